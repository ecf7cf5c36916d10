"""Retention (collector/offline/retention.py): rolling old collectives up keeps every total the
comm views and collective_summary show, drops the raw rows, is idempotent, refuses a
young age, and runs on a live collector's writer thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from agent import wire
from collector.ingest.decode import decode
from collector.offline import retention
from collector.read import queries, views
from collector.settings import RetentionSettings, Settings, WriterSettings
from collector.storage import Storage, connect
from collector.store.schema import MIGRATIONS
from tests.polling import wait_until
from tests.unit.collector.collector_batches import columns, make_batch

RANKS = 4
OPS = (("all_reduce", "tp", 1 << 20), ("all_reduce", "dp", 8 << 20), ("all_gather", "dp", 4 << 20))
DICTS = {"op": ["all_reduce", "all_gather"], "axis": ["dp", "tp"], "phase": ["forward"], "name": ["eval_loss"]}
DAY0 = 86400.0 * 19000  # 2022-01-08 00:00 UTC: the run crosses into the next day halfway


def _order(num_steps: int, rollback_at: int | None) -> list[tuple[int, int]]:
    """(attempt, step) in execution order: attempt 0, then attempt 1 from the rollback."""
    if rollback_at is None:
        return [(0, k) for k in range(num_steps)]
    return [(0, k) for k in range(rollback_at + 10)] + [(1, k) for k in range(rollback_at, num_steps)]


def fill_run(storage: Storage, run_id: str = "done1", *, num_steps: int = 40, rollback_at: int | None = 20,
             t0: float = DAY0 - 20.0, finished: bool = True) -> None:
    """A 4-rank run (tp 2 x dp 2) with three collectives a step whose group_seq and
    entry times agree across each group, rank 3 a straggler, a rollback from step 30
    to 20 (attempt 1), eval scalars, heartbeats, checkpoints and a straggler incident;
    `finished`: rank 0's run_finished event ends it."""
    order = _order(num_steps, rollback_at)
    rng = np.random.default_rng(abs(hash(run_id)) % 2**32)
    E = len(order)
    att = np.array([a for a, _ in order], np.int32)
    stp = np.array([k for _, k in order], np.int64)
    step_start = t0 + np.arange(E) * 1.0
    slow = np.array([1.0, 1.0, 1.0, 1.3])
    compute = 0.5 * slow[None, :] * (1 + 0.05 * rng.random((E, RANKS)))  # (E, R)
    J = len(OPS)
    entry = np.zeros((E, RANKS, J))
    dur = np.zeros((E, RANKS, J))
    for j, (_, axis, _) in enumerate(OPS):
        entry[:, :, j] = step_start[:, None] + compute * (j + 1) / (J + 1)
        for members in ([0, 1], [2, 3]) if axis == "tp" else ([0, 2], [1, 3]):
            last = entry[:, members, j].max(axis=1, keepdims=True)
            dur[:, members, j] = last - entry[:, members, j] + 0.01 * (1 + rng.random((E, 1)))
    wait = dur * 0.8
    bodies = []
    for r in range(RANKS):
        tp_id, dp_id = r % 2, r // 2
        e = np.arange(E)
        group_id = np.array([dp_id * 2 if a == "tp" else tp_id for _, a, _ in OPS], np.int32)
        is_tp = np.array([a == "tp" for _, a, _ in OPS])
        gseq = np.where(is_tp, e[:, None] * is_tp.sum() + np.cumsum(is_tp) - 1,
                        e[:, None] * (~is_tp).sum() + np.cumsum(~is_tp) - 1)
        st = columns(wire.STEP, E, step=stp, attempt=att, ts=step_start + compute[:, r] + 0.05,
                     loss=2 + 3 / np.sqrt(1 + stp), step_s=compute[:, r] + wait[:, r].sum(axis=1),
                     fwd_s=compute[:, r] / 3, bwd_s=compute[:, r] / 2, opt_s=compute[:, r] / 6,
                     comm_exposed_s=wait[:, r].sum(axis=1), tokens=1024, skipped=0, finite_fwd=1, finite_bwd=1,
                     local_loss_valid=1)
        co = columns(wire.COLLECTIVE, E * J, step=np.repeat(stp, J), attempt=np.repeat(att, J),
                     seq=np.arange(E * J), group_seq=gseq.reshape(-1),
                     op=np.tile([DICTS["op"].index(o) for o, _, _ in OPS], E),
                     axis=np.tile([DICTS["axis"].index(a) for _, a, _ in OPS], E), group_id=np.tile(group_id, E),
                     peer=-1, bytes=np.tile([b for _, _, b in OPS], E), start_ts=entry[:, r].reshape(-1),
                     duration_s=dur[:, r].reshape(-1), wait_s=wait[:, r].reshape(-1))
        evals = np.flatnonzero(stp % 10 == 9)
        sc = columns(wire.SCALAR, len(evals), step=stp[evals], attempt=att[evals], ts=step_start[evals] + 0.9,
                     name=0, value=2.5 + 0.01 * evals)
        hb = columns(wire.HEARTBEAT, E, ts=step_start + 0.5, step=stp, phase=0, last_seq=np.arange(E) * J,
                     last_op=0, last_axis=1, last_group_id=0, last_group_seq=np.arange(E))
        events = [{"ts": float(step_start[i]) + 0.95, "step": int(stp[i]), "attempt": int(att[i]),
                   "kind": "checkpoint_saved", "data": {"step": int(stp[i]), "path": f"/ckpt/{stp[i]}",
                                                        "num_shards": 1, "bytes": 1000, "write_s": 0.2,
                                                        "verified": True}}
                  for i in range(E) if stp[i] % 10 == 0 and stp[i] > 0]
        if finished and r == 0:
            events.append({"ts": float(step_start[-1]) + 1.0, "step": int(stp[-1]), "attempt": int(att[-1]),
                           "kind": "run_finished", "data": {"status": "finished"}})
        run = {"run_id": run_id, "world_size": RANKS, "mesh": {"dp": 2, "tp": 2, "pp": 1},
               "node_map": {str(k): f"node{k // 2}" for k in range(RANKS)}, "started_ts": t0} if r == 0 else None
        body = make_batch(run_id, r, 0, incarnation=f"inc{r}", dicts=DICTS, events=events, run=run,
                          coords={"dp": r // 2, "tp": r % 2, "pp": 0},
                          sections={wire.STEP: (E, st), wire.COLLECTIVE: (E * J, co), wire.SCALAR: (len(evals), sc),
                                    wire.HEARTBEAT: (E, hb)})
        bodies.append(body)
    with ThreadPoolExecutor(len(bodies)) as pool:  # concurrently: one group commit, not one per rank
        list(pool.map(lambda b: storage.ingest_blocking(decode(b)), bodies))
    storage.open_incident(run_id, "straggler", "warning", rank=3, node="node1", step_from=5, step_to=30,
                          evidence={"slowdown": 1.3}).result(timeout=30)


def comm_answers(cur, run_id: str = "done1") -> dict:
    """What the dashboard's comm views and collective_summary answer over the whole run."""
    whole = {"step_from": 0, "step_to": 10_000}
    return {"ops": views.comm_ops(cur, run_id, **whole), "waits": views.comm_waits(cur, run_id, **whole),
            "latency": views.comm_latency(cur, run_id, **whole),
            "last": views.comm_ops(cur, run_id),  # the default window: the last steps
            "summary": queries.collectives(cur, run_id, step_from=0, step_to=10_000)}


def assert_rows_close(a: list[dict], b: list[dict], *, keys: tuple[str, ...], skip: tuple[str, ...] = (),
                      rel: float = 1e-9) -> None:
    def key(r):
        return tuple(r[k] for k in keys)

    a, b = sorted(a, key=key), sorted(b, key=key)
    assert [key(r) for r in a] == [key(r) for r in b]
    for x, y in zip(a, b):
        for col in x:
            if col in skip:
                continue
            if isinstance(x[col], float):
                assert y[col] == pytest.approx(x[col], rel=rel, abs=1e-12), (key(x), col)
            else:
                assert x[col] == y[col], (key(x), col)


_KEYS = {"ops": ("axis", "op"), "last": ("axis", "op"), "waits": ("waiter", "waited_for"),
         "summary": ("step", "axis", "op"), "latency": ("axis", "group_id", "op")}


def assert_answers_close(a: dict, b: dict) -> None:
    """Two comm_answers equal, floats to 1e-9 (DuckDB sums doubles in parallel, in no fixed order)."""
    for name, keys in _KEYS.items():
        assert_rows_close(a[name], b[name], keys=keys)


def _counts(cur) -> dict[str, int]:
    return {t: cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("collectives", "collectives_rollup", "collective_waits_rollup")}


NOW = DAY0 + 30 * 86400.0  # a month after the run


@pytest.fixture
def filled(storage) -> Storage:
    fill_run(storage)
    return storage


def test_rollup_keeps_the_totals_and_the_comm_views(filled):
    with filled.cursor() as cur:
        totals_sql = """SELECT rank, op, axis, sum(n)::BIGINT, sum(b)::BIGINT, sum(d), sum(w) FROM (
                            SELECT rank, op, axis, 1 AS n, bytes AS b, duration_s AS d, wait_s AS w FROM collectives
                            UNION ALL SELECT rank, op, axis, num_ops, bytes, duration_s, wait_s FROM collectives_rollup)
                        GROUP BY ALL ORDER BY ALL"""
        totals = cur.execute(totals_sql).fetchall()
        before = comm_answers(cur)
        counts = _counts(cur)
    assert counts["collectives"] == RANKS * 3 * 50 and counts["collectives_rollup"] == 0
    assert before["waits"] and before["waits"][0]["waited_for"] == 3  # the straggler

    result = filled.write(lambda ctx: [retention.rollup_chunk(ctx.con, c) for c in
                                       retention.plan(ctx.con, NOW - retention.DAY_S)]).result(timeout=60)
    assert sum(r.raw_rows for r in result) == counts["collectives"]
    with filled.cursor() as cur:
        after_totals = cur.execute(totals_sql).fetchall()
        after = comm_answers(cur)
        counts_after = _counts(cur)
    assert counts_after["collectives"] == 0
    # one row per (rank, step, op, group) of each attempt: 3 ops, all of a distinct (axis, op)
    assert counts_after["collectives_rollup"] == RANKS * 3 * 50
    assert 0 < counts_after["collective_waits_rollup"]
    assert [t[:5] for t in after_totals] == [t[:5] for t in totals]
    for x, y in zip(totals, after_totals):
        assert y[5] == pytest.approx(x[5], rel=1e-9) and y[6] == pytest.approx(x[6], rel=1e-9)

    assert_rows_close(before["ops"], after["ops"], keys=("axis", "op"))
    assert_rows_close(before["last"], after["last"], keys=("axis", "op"))
    assert_rows_close(before["waits"], after["waits"], keys=("waiter", "waited_for"))
    assert_rows_close(before["summary"], after["summary"], keys=("step", "axis", "op"))
    # latency: counts, totals and maxima exact; the quantiles become per-rank-step ones
    assert_rows_close(before["latency"], after["latency"], keys=("axis", "group_id", "op"),
                      skip=("p5_s", "p25_s", "p50_s", "p75_s", "p99_s"))


def test_who_waited_for_whom_reads_the_agents_summaries(filled):
    """A large job's agents ship summaries, not op rows, and no wait pairs: comm_waits matches
    each summary's mean op across its group as the detectors do, and gives what the op rows
    gave (one op per summary here, so exactly; before, summarized steps gave no pairs)."""
    with filled.cursor() as cur:
        before = views.comm_waits(cur, "done1", step_from=0, step_to=10_000)

    def as_agent_summaries(ctx):
        for chunk in retention.plan(ctx.con, NOW - retention.DAY_S):
            retention.rollup_chunk(ctx.con, chunk)
        ctx.con.execute("DELETE FROM collective_waits_rollup")  # the agents write none

    filled.write(as_agent_summaries).result(timeout=60)
    with filled.cursor() as cur:
        assert _counts(cur)["collectives"] == 0 and _counts(cur)["collective_waits_rollup"] == 0
        after = views.comm_waits(cur, "done1", step_from=0, step_to=10_000)
    assert before and after[0]["waited_for"] == 3  # the straggler
    assert_rows_close(before, after, keys=("waiter", "waited_for"))


def test_a_summary_of_several_ops_waits_for_its_groups_last_member_num_ops_times(storage):
    """Two ranks, three all-reduces a step in one summary row each: rank 1 enters every one
    0.1 s after rank 0, which waits for it (0.1 s blocked each, measured 0.12: the transfer
    counts only up to the last entry). 0.3 s a step, from one row of each."""
    rows = []
    for step in range(4):
        t = 100.0 + step
        for rank, entries in ((0, [t, t + 1 / 3, t + 2 / 3]), (1, [t + 0.1, t + 0.1 + 1 / 3, t + 0.1 + 2 / 3])):
            rows.append({"run_id": "big", "attempt": 0, "step": step, "rank": rank, "axis": "dp",
                         "op": "all_reduce", "group_id": 0, "peer": -1, "num_ops": 3, "bytes": 3 << 20,
                         "duration_s": 0.36 if rank == 0 else 0.06, "wait_s": 0.36 if rank == 0 else 0.0,
                         "start_ts": entries[0], "mean_start_ts": float(np.mean(entries)),
                         "max_group_seq": 3 * step + 2, "max_seq": 3 * step + 2})

    def insert(ctx):
        for r in rows:
            ctx.con.execute(f"INSERT INTO collectives_rollup ({', '.join(r)}) VALUES ({', '.join('?' * len(r))})",
                            list(r.values()))

    storage.write(insert).result(timeout=30)
    with storage.cursor() as cur:
        waits = views.comm_waits(cur, "big", step_from=0, step_to=3)
    assert [(w["waiter"], w["waited_for"], w["num_ops"]) for w in waits] == [(0, 1, 12)]
    assert waits[0]["wait_s"] == pytest.approx(0.3)


def test_members_entering_at_the_same_instant_are_waited_for_as_the_highest_rank(storage):
    """Four ranks enter every all-reduce of a step at two instants, ranks 1 and 3 together
    last: the pairs name rank 3 (ties go to the highest rank), the same on every read
    (arg_max alone picked among equal start_ts by thread order), and the rollup writes the
    same pairs."""
    rows = [("tie", 0, step, rank, step * 4 + k, k, "all_reduce", "dp", 0, -1, 1 << 20,
             100.0 + step + k * 0.2 + (0.05 if rank % 2 else 0.0), 0.06, 0.05 if rank % 2 == 0 else 0.0)
            for step in range(200) for rank in range(4) for k in range(4)]

    def insert(ctx):
        ctx.con.executemany("INSERT INTO collectives (run_id, attempt, step, rank, seq, group_seq, op, axis, group_id,"
                            f" peer, bytes, start_ts, duration_s, wait_s) VALUES ({', '.join('?' * 14)})", rows)

    storage.write(insert).result(timeout=30)
    whole = {"step_from": 0, "step_to": 1_000}
    with storage.cursor() as cur:
        reads = [views.comm_waits(cur, "tie", **whole) for _ in range(8)]
    # the same pairs in the same order; the sums to rounding (DuckDB's threads add in any order)
    assert all([(w["waiter"], w["waited_for"], w["num_ops"]) for w in r]
               == [(w["waiter"], w["waited_for"], w["num_ops"]) for w in reads[0]]
               and [w["wait_s"] for w in r] == pytest.approx([w["wait_s"] for w in reads[0]], abs=1e-12)
               for r in reads)
    assert [(w["waiter"], w["waited_for"], w["num_ops"]) for w in reads[0]] == [
        (0, 3, 800), (2, 3, 800), (1, 3, 800)]  # 0 and 2 waited 0.05 s an op, rank 1 not at all
    assert reads[0][0]["wait_s"] == pytest.approx(0.2) and reads[0][2]["wait_s"] == 0.0

    def roll_up(ctx):
        for chunk in retention.plan(ctx.con, NOW):
            retention.rollup_chunk(ctx.con, chunk)

    storage.write(roll_up).result(timeout=60)
    with storage.cursor() as cur:
        assert _counts(cur)["collectives"] == 0
        assert_rows_close(reads[0], views.comm_waits(cur, "tie", **whole), keys=("waiter", "waited_for"))


def test_only_steps_older_than_the_age_are_rolled_up_and_rerun_is_idempotent(filled, tmp_path):
    fill_run(filled, "recent", num_steps=10, rollback_at=None, t0=NOW - 3600.0)
    filled.close()
    con = connect(filled.settings.db_path)
    try:
        before = _counts(con)
        first = retention.rollup(con, older_than_s=retention.DAY_S, now=NOW)
        mid = _counts(con)
        recent_raw = con.execute("SELECT count(*) FROM collectives WHERE run_id = 'recent'").fetchone()[0]
        answers = comm_answers(con)
        second = retention.rollup(con, older_than_s=retention.DAY_S, now=NOW)
        assert _counts(con) == mid
        assert_answers_close(comm_answers(con), answers)
    finally:
        con.close()
    assert first.raw_rows == before["collectives"] - RANKS * 3 * 10 and first.num_steps == 50
    assert recent_raw == RANKS * 3 * 10 == mid["collectives"]  # an hour old: kept raw
    assert second.raw_rows == 0 and second.num_chunks == 0


def test_chunks_cut_at_max_rows_and_never_split_a_step(filled):
    with filled.cursor() as cur:
        chunks = retention.plan(cur, NOW, max_rows=100)
    # attempt 0: steps 0-29 (360 rows), attempt 1: steps 20-39 (240 rows); 12 rows a step
    # a chunk starts a step once the rows before it in its attempt pass a multiple of max_rows
    assert [(c.attempt, c.step_from, c.step_to) for c in chunks][:2] == [(0, 0, 8), (0, 9, 16)]
    assert all(c.num_rows == 12 * (c.step_to - c.step_from + 1) <= 100 + 12 for c in chunks)
    assert sum(c.num_rows for c in chunks) == RANKS * 3 * 50
    assert {c.attempt for c in chunks} == {0, 1}


@pytest.mark.parametrize("age", ["1h", "23h", "600", "0"])
def test_the_minimum_age_is_enforced(filled, age):
    with pytest.raises(ValueError, match="minimum"):
        retention.check_age(retention.parse_age(age))
    with filled.cursor() as cur:
        with pytest.raises(ValueError, match="minimum"):
            retention.rollup(cur, older_than_s=retention.parse_age(age), now=NOW)
        assert _counts(cur)["collectives_rollup"] == 0


def test_parse_age():
    assert retention.parse_age("7d") == 7 * 86400
    assert retention.parse_age("36h") == 36 * 3600
    assert retention.parse_age("90m") == 5400
    assert retention.parse_age("2w") == 14 * 86400
    assert retention.parse_age("3600") == retention.parse_age("3600s") == 3600
    with pytest.raises(ValueError):
        retention.parse_age("7 days")


def test_storage_refuses_a_young_rollup_age(tmp_path):
    with pytest.raises(ValueError, match="minimum"):
        Storage(Settings(db_path=tmp_path / "t.duckdb", token="tok",
                         retention=RetentionSettings(rollup_after_s=3600.0)))
    assert not (tmp_path / "t.duckdb").exists()


def test_serve_rolls_up_on_the_writer_thread(tmp_path):
    """Storage with rollup_after_s: the job's chunks run as writer jobs (beside ingest),
    and the rows of a run a month old become summaries without a restart."""
    s = Storage(Settings(db_path=tmp_path / "t.duckdb", token="tok", writer=WriterSettings(linger_s=0.0),
                         retention=RetentionSettings(rollup_after_s=retention.DAY_S, rollup_every_s=1.0,
                                                     rollup_chunk_rows=100)),
                clock=lambda: NOW)
    try:
        assert s.rollup is not None and s.health() == (True, "")
        fill_run(s)
        assert wait_until(lambda: s.read(_counts)["collectives"] == 0, timeout_s=30.0, interval_s=0.05)
        assert s.read(_counts)["collectives_rollup"] == RANKS * 3 * 50
        assert s.read(views.comm_ops, "done1", step_from=0, step_to=100)[0]["num_ops"] > 0
    finally:
        s.close()
    assert not s.rollup.alive()


def test_compact_shrinks_a_rolled_up_file_and_keeps_every_row(filled, tmp_path):
    fill_run(filled, "more", num_steps=400, rollback_at=None)
    filled.close()
    path = filled.settings.db_path
    con = connect(path)
    try:
        retention.rollup(con, older_than_s=retention.DAY_S, now=NOW)
        rows = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("steps", "collectives_rollup")}
        answers = comm_answers(con, "more")
    finally:
        con.close()
    before = retention.file_bytes(path)
    result = retention.compact(path)
    assert result.bytes_after == retention.file_bytes(path) < before
    con = connect(path, read_only=True)
    try:
        assert {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in rows} == rows
        assert_answers_close(comm_answers(con, "more"), answers)
        assert con.execute("SELECT max(version) FROM schema_version").fetchone()[0] == MIGRATIONS[-1][0]
    finally:
        con.close()
