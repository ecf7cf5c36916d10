"""An agent that summarizes its collectives (agent/summary.py): one row per (step, op, axis,
group, peer) with the ops' exact totals, op rows only for the sampled steps and while the
collector asks, a step summarized whole, nothing lost at close."""

from __future__ import annotations

import random

import pytest

from agent import Agent, AgentConfig, summary, wire
from tests.unit.agent.spooled import closed_port, spooled_batches

OPS = [("all_reduce", "dp", 0, -1), ("all_gather", "tp", 2, -1), ("send", "pp", 0, 1), ("recv", "pp", 0, 1)]
OP_NAMES, AXES = ["all_reduce", "all_gather", "send", "recv"], ["dp", "tp", "pp"]  # the agent's dictionary codes


def _ops(steps, per_step: int, seed: int = 0, null_waits: bool = False) -> list[tuple]:
    """Op rows in wire.RECORDED[COLLECTIVE] order (op and axis as their dictionary codes): several
    kinds a step, with their seq counters."""
    rng = random.Random(seed)
    rows, seq, gseq = [], 0, {}
    for step in steps:
        t = 1000.0 + step
        for _ in range(per_step):
            op, axis, gid, peer = rng.choice(OPS)
            g = gseq[(axis, gid)] = gseq.get((axis, gid), -1) + 1
            dur = rng.uniform(1e-4, 5e-3)
            wait = wire.NULL_F64 if null_waits else rng.uniform(0, dur)
            rows.append((step, 0, seq, g, OP_NAMES.index(op), AXES.index(axis), gid, peer, rng.randrange(1, 1 << 20),
                         t, dur, wait))
            seq, t = seq + 1, t + dur + rng.uniform(0, 1e-3)
    return rows


def _reference(rows) -> dict[tuple, dict]:
    out: dict[tuple, dict] = {}
    for step, attempt, seq, g, op, axis, gid, peer, nbytes, start, dur, wait in rows:
        r = out.setdefault((step, attempt, op, axis, gid, peer), {"ops": []})
        r["ops"].append((seq, g, nbytes, start, dur, wait))
    for r in out.values():
        ops = r.pop("ops")
        last = max(ops)
        r.update(num_ops=len(ops), bytes=sum(o[2] for o in ops), duration_s=sum(o[4] for o in ops),
                 max_duration_s=max(o[4] for o in ops), start_ts=min(o[3] for o in ops),
                 end_ts=max(o[3] + o[4] for o in ops), mean_start_ts=sum(o[3] for o in ops) / len(ops),
                 mean_end_ts=sum(o[3] + o[4] for o in ops) / len(ops), max_seq=last[0],
                 max_group_seq=max(o[1] for o in ops),
                 wait_s=None if any(o[5] != o[5] for o in ops) else sum(o[5] for o in ops),
                 max_wait_s=None if any(o[5] != o[5] for o in ops) else max(o[5] for o in ops))
    return out


def _as_dicts(cols: dict, n: int, ops_codes=None) -> dict[tuple, dict]:
    names = [c.name for c in wire.SCHEMA[wire.COLLECTIVE_SUMMARY]]
    out = {}
    for i in range(n):
        row = {k: cols[k][i] for k in names}
        for k in ("duration_s", "max_duration_s", "wait_s", "max_wait_s"):
            if row[k] != row[k]:
                row[k] = None
        key = tuple(row.pop(k) for k in ("step", "attempt", "op", "axis", "group_id", "peer"))
        out[key] = row
    return out


def test_a_summary_row_holds_its_ops_totals_maxima_span_and_means():
    rows = _ops(range(1, 9), 25, seed=3)
    raw, cols, n, held, plain = summary.summarize(rows, raw_step=lambda s: s == 4, hold_after=7)
    assert [r[0] for r in raw] == [4] * 25 and [r[0] for r in held] == [8] * 25  # sampled step; not finished
    assert plain == []
    want = _reference([r for r in rows if r[0] not in (4, 8)])
    got = _as_dicts(cols, n)
    assert got.keys() == want.keys() and n == len(want)
    for key, w in want.items():
        for col, value in w.items():
            assert got[key][col] == pytest.approx(value, rel=1e-12, abs=1e-15) if value is not None \
                else got[key][col] is None, (key, col)


def test_ops_without_a_measured_wait_go_out_as_they_are():
    """A Flight Recorder's ops (agent/flight.py) have no wait: who waited for whom is inferred from
    their arrivals op by op, which their summary's means cannot give. They are shipped unflagged,
    whatever the step, and never held."""
    rows = _ops(range(1, 5), 10, seed=3, null_waits=True)
    raw, cols, n, held, plain = summary.summarize(rows, raw_step=lambda s: s == 2, hold_after=3)
    assert (raw, n, held, plain) == ([], 0, [], rows)


def test_op_rows_go_out_flagged_sampled_but_the_plain_ones():
    rows = _ops([5], 4)
    cols = summary.op_section(rows, plain=1)
    assert list(cols["sampled"]) == [1, 1, 1, -1]  # -1: NULL
    assert [tuple(cols[c.name][i] for c in wire.RECORDED[wire.COLLECTIVE]) for i in range(4)] == rows


def test_auto_summarizes_from_the_rank_threshold_and_the_mode_is_checked(monkeypatch):
    assert not summary.summarizes("auto", 255, 256) and summary.summarizes("auto", 256, 256)
    assert summary.summarizes("summary", 1, 256) and not summary.summarizes("ops", 10**6, 256)
    with pytest.raises(ValueError, match="collectives must be one of"):
        AgentConfig(collectives="some")
    monkeypatch.setenv("LLMWATCH_COLLECTIVES", "summary")
    assert AgentConfig().collectives == "summary"


@pytest.fixture
def agent(tmp_path):
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=4096,
                      timeout_s=0.5, collectives="summary", raw_every_steps=5, device_health=False)
    a = Agent(cfg, run_id="r1", rank=2, node="node1", world_size=4)

    def batches():
        a.close()
        return spooled_batches(tmp_path)

    return a, batches


def _record(a: Agent, rows) -> None:
    for step, attempt, seq, g, op, axis, gid, peer, nbytes, start, dur, wait in rows:
        a.collective(step, seq, g, OP_NAMES[op], AXES[axis], gid, peer, nbytes, start, dur, wait)


def _steps_in(batch, kind: str) -> list[int]:
    cols = batch.columns.get(kind)
    return sorted(set(cols["step"].tolist())) if cols else []


def test_the_agent_ships_summaries_op_rows_for_sampled_steps_and_holds_the_unfinished_step(agent):
    a, batches = agent
    rows = _ops(range(1, 13), 6)
    a.collective(0, -1, -1, "all_reduce", "dp", 0, -1, 0, 999.0, 0.0, 0.0)  # the codes in OP_NAMES, AXES order
    a.collective(0, -1, -1, "all_gather", "tp", 0, -1, 0, 999.0, 0.0, 0.0)
    a.collective(0, -1, -1, "send", "pp", 0, -1, 0, 999.0, 0.0, 0.0)
    a.collective(0, -1, -1, "recv", "pp", 0, -1, 0, 999.0, 0.0, 0.0)
    _record(a, [r for r in rows if r[0] <= 11])
    for step in range(1, 11):
        a.record_step(step, loss=1.0)
    a.flush(1.0)  # steps 1-10 finished: 11's ops wait
    _record(a, [r for r in rows if r[0] == 12])
    a.record_step(11, loss=1.0)
    a.flush(1.0)  # 11 finished, 12 not
    first, second, closing = batches()  # the last one at close: step 12, never finished, shipped all the same
    assert _steps_in(first, wire.COLLECTIVE) == [0, 5, 10]  # step 0: a sampled step (0 % 5)
    assert list(first.columns[wire.COLLECTIVE]["sampled"]) == [1] * 16
    assert _steps_in(first, wire.COLLECTIVE_SUMMARY) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert first.header["dicts"]["op"] == OP_NAMES and first.header["dicts"]["axis"] == AXES
    assert _steps_in(second, wire.COLLECTIVE_SUMMARY) == [11] and _steps_in(second, wire.COLLECTIVE) == []
    assert _steps_in(closing, wire.COLLECTIVE_SUMMARY) == [12]
    # every op is in exactly one row: as an op row, or counted in a summary
    shipped = sum(len(b.columns[wire.COLLECTIVE]["step"]) for b in (first, second, closing) if wire.COLLECTIVE in b.columns)
    summed = sum(sum(b.columns[wire.COLLECTIVE_SUMMARY]["num_ops"]) for b in (first, second, closing)
                 if wire.COLLECTIVE_SUMMARY in b.columns)
    assert shipped + summed == len(rows) + 4 == 76
    assert a.stats()["recorded"]["collective_summary"] == sum(
        len(b.columns[wire.COLLECTIVE_SUMMARY]["step"]) for b in (first, second, closing)
        if wire.COLLECTIVE_SUMMARY in b.columns)


def test_while_the_collector_asks_every_step_goes_out_as_op_rows(agent):
    a, batches = agent
    a._on_response({"raw_ops_s": 5.0})
    rows = _ops(range(1, 4), 5)
    _record(a, rows)
    for step in range(1, 4):
        a.record_step(step, loss=1.0)
    a.flush(1.0)
    (batch,) = [b for b in batches() if wire.COLLECTIVE in b.columns]
    assert _steps_in(batch, wire.COLLECTIVE) == [1, 2, 3] and wire.COLLECTIVE_SUMMARY not in batch.columns


def test_a_job_below_the_threshold_ships_every_op(tmp_path):
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), timeout_s=0.5,
                      collectives="auto", device_health=False)
    a = Agent(cfg, run_id="r1", rank=0, world_size=8)
    _record(a, _ops(range(1, 4), 5))
    a.record_step(3, loss=1.0)
    a.close()
    batch = spooled_batches(tmp_path)[0]
    assert len(batch.columns[wire.COLLECTIVE]["step"]) == 15 and wire.COLLECTIVE_SUMMARY not in batch.columns
    assert "sampled" not in batch.columns[wire.COLLECTIVE]  # NULL in the table: an agent that ships every op


def test_after_a_rollback_the_step_in_progress_is_held_again(agent):
    """The steps run again from the checkpoint: what is held is what comes after the step recorded
    last, not after the highest step ever recorded."""
    a, batches = agent
    rows = _ops(range(1, 11), 4)
    _record(a, rows)
    for step in range(1, 11):
        a.record_step(step, loss=1.0)
    a.flush(1.0)
    a.set_attempt(1)  # rolled back to the checkpoint at 5: steps 6 and 7 again, 7 not finished
    again = _ops(range(6, 8), 4, seed=9)
    _record(a, again)
    a.record_step(6, loss=1.0)
    a.flush(1.0)
    first, second, closing = batches()
    assert _steps_in(second, wire.COLLECTIVE_SUMMARY) == [6] and _steps_in(closing, wire.COLLECTIVE_SUMMARY) == [7]
    assert set(second.columns[wire.COLLECTIVE_SUMMARY]["attempt"].tolist()) == {1}
