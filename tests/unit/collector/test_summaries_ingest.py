"""A summarizing agent's batches in a real Storage (agent/summary.py): its summaries land in
`collectives_rollup`, its sampled op rows in `collectives` flagged, and the SQL views give the
numbers they give for an agent that ships every op. While an incident whose evidence is the
collectives is open on a run, the collector asks that run's agents for op rows."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent import Agent, AgentConfig, wire
from analysis.policy import Policy
from analysis.rules import load_rules
from collector.ingest.decode import decode
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from tests.unit.agent.spooled import closed_port, spooled_payloads
from tests.unit.agent.test_summary import AXES, OP_NAMES, _ops

STEPS, PER_STEP = 12, 20


def _payloads(tmp_path, mode: str, rank: int) -> list[bytes]:
    """One rank's batches of the same ops and steps, through a real Agent that spools them."""
    spool_dir = tmp_path / f"{mode}{rank}"
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(spool_dir), timeout_s=0.5,
                      collectives=mode, raw_every_steps=5, device_health=False)
    a = Agent(cfg, run_id="run1", rank=rank, node=f"node{rank}", world_size=2)
    for step, attempt, seq, g, op, axis, gid, peer, nbytes, start, dur, wait in _ops(range(1, STEPS + 1), PER_STEP,
                                                                                      seed=rank):
        a.collective(step, seq, g, OP_NAMES[op], AXES[axis], gid, peer, nbytes, start, dur, wait)
        if seq % PER_STEP == PER_STEP - 1:
            a.record_step(step, loss=1.0)
            if step % 4 == 0:
                a.flush(1.0)
    a.close()
    return spooled_payloads(spool_dir)


def _store(tmp_path, name: str, payloads: list[bytes]) -> Storage:
    s = Storage(Settings(db_path=tmp_path / f"{name}.duckdb", token="tok", writer=WriterSettings(linger_s=0.0)))
    for p in payloads:
        s.ingest_blocking(decode(p))
    return s


def test_summaries_are_stored_and_the_views_agree_with_every_op(tmp_path):
    summ = _store(tmp_path, "summary", _payloads(tmp_path, "summary", 0) + _payloads(tmp_path, "summary", 1))
    ops = _store(tmp_path, "ops", _payloads(tmp_path, "ops", 0) + _payloads(tmp_path, "ops", 1))
    try:
        with summ.cursor() as cur:
            raw = cur.execute("SELECT DISTINCT step, sampled FROM collectives ORDER BY step").fetchall()
            assert raw == [(5, 1), (10, 1)]  # the sampled steps, flagged
            rolled = cur.execute("SELECT count(DISTINCT step), sum(num_ops), count(*) FROM collectives_rollup "
                                 "WHERE peer IS NOT NULL AND mean_start_ts IS NOT NULL").fetchone()
            assert rolled[0] == STEPS - 2 and rolled[1] == 2 * PER_STEP * (STEPS - 2) and rolled[2] < rolled[1] / 4
        with ops.cursor() as cur:
            assert cur.execute("SELECT count(*), count(sampled) FROM collectives").fetchone() == (2 * STEPS * PER_STEP, 0)
            assert cur.execute("SELECT count(*) FROM collectives_rollup").fetchone() == (0,)
        view = """SELECT step, op, axis, num_ops, bytes, round(mean_duration_s, 12), round(max_duration_s, 12),
                         round(total_wait_s, 12), round(max_wait_s, 12)
                  FROM collective_summary ORDER BY step, op, axis"""
        with summ.cursor() as a, ops.cursor() as b:
            assert a.execute(view).fetchall() == b.execute(view).fetchall()
    finally:
        summ.close()
        ops.close()


@pytest.fixture
def watched(tmp_path):
    s = Storage(Settings(db_path=tmp_path / "w.duckdb", token="tok", writer=WriterSettings(linger_s=0.0)),
                policy=Policy(load_rules()))
    yield s
    s.close()


@pytest.mark.parametrize("kind, asks", [("straggler", True), ("slow_link", True), ("hang", True), ("nan", False)])
def test_an_open_incident_on_the_collectives_asks_for_op_rows_until_it_closes(watched, kind, asks):
    assert not watched.wants_ops("run1")
    iid = watched.open_incident("run1", kind, "warning", rank=1, step_from=10).result(5.0)
    assert watched.wants_ops("run1") is asks and not watched.wants_ops("run2")
    watched.update_incident(iid, status="resolved").result(5.0)
    assert not watched.wants_ops("run1")


def _post(endpoint, body: bytes) -> dict:
    """POST /v1/ingest through the ASGI callable (the gate in front is not part of this test)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/ingest",
             "headers": [(b"content-type", wire.CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]}
    asyncio.run(endpoint(scope, receive, send))
    assert sent[0]["status"] == 200, sent
    return json.loads(sent[1]["body"])


def test_the_ingest_answer_carries_raw_ops_s_to_every_rank_while_it_asks(watched):
    from collector.http.routes.ingest import RAW_OPS_S, IngestEndpoint

    endpoint = IngestEndpoint(watched)

    def batch(rank: int, seq: int) -> bytes:
        return wire.encode_batch({"run_id": "run1", "rank": rank, "incarnation": "i", "batch_seq": seq, "node": "n",
                                  "pid": 1, "sent_ts": 1.0, "dicts": {}, "events": [], "run": None,
                                  "stats": {"dropped": {}}}, {})

    assert "raw_ops_s" not in _post(endpoint, batch(3, 0))
    iid = watched.open_incident("run1", "straggler", "warning", rank=1, step_from=10).result(5.0)
    assert _post(endpoint, batch(3, 1))["raw_ops_s"] == RAW_OPS_S == _post(endpoint, batch(0, 0))["raw_ops_s"]
    watched.update_incident(iid, status="resolved").result(5.0)
    assert "raw_ops_s" not in _post(endpoint, batch(3, 2))
