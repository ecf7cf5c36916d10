"""`trainer --telemetry` end to end: ranks -> agents -> embedded collector -> DuckDB file."""

import json

import duckdb
import pytest

from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 8


@pytest.fixture(scope="module")
def telemetry_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tel")
    r = run_trainer(d / "run", "--telemetry", "--steps", str(STEPS), "--dp", "2", "--tp", "2", "--nodes", "2",
                    "--micro-batches", "2", "--eval-every", "4", "--ckpt-dir", str(d / "ckpt"), "--ckpt-every", "4",
                    "--inject", "straggler@rank=1,from=3,factor=4")
    assert r.returncode == 0, r.stderr[-3000:]
    con = duckdb.connect(str(r.run_dir / "telemetry.duckdb"), read_only=True)
    yield r, con
    con.close()


def q(con, sql, *params):
    return con.execute(sql, list(params)).fetchall()


def test_launcher_prints_the_collector(telemetry_run):
    r, _ = telemetry_run
    assert "telemetry: collector http://127.0.0.1:" in r.stdout


def test_every_step_of_every_rank_exactly_once(telemetry_run):
    r, con = telemetry_run
    assert q(con, "SELECT count(*), count(DISTINCT (attempt, step, rank)) FROM steps WHERE run_id = ?",
             r.run_dir.name) == [(STEPS * 4, STEPS * 4)]
    (lo, hi, ranks), = q(con, "SELECT min(step), max(step), count(DISTINCT rank) FROM steps_effective")
    assert (lo, hi, ranks) == (1, STEPS, 4)
    # the values are the trainer's own: rank 0's losses equal metrics.jsonl
    losses = dict(q(con, "SELECT step, loss FROM steps WHERE rank = 0"))
    assert losses == {m["step"]: m["loss"] for m in r.metrics()}
    (bad,), = q(con, "SELECT count(*) FROM steps WHERE NOT (step_s > 0 AND fwd_s > 0 AND bwd_s > 0 AND tokens > 0"
                     " AND mem_bytes > 0 AND lr > 0)")
    assert bad == 0


def test_collectives_cover_every_axis(telemetry_run):
    _, con = telemetry_run
    rows = dict(q(con, "SELECT op || '/' || axis, count(*) FROM collectives GROUP BY ALL"))
    assert rows.get("all_reduce/tp", 0) > 0 and rows.get("all_reduce/dp", 0) > 0
    # one collective matched across its group: same group_seq on both tp ranks
    (n,), = q(con, """SELECT count(*) FROM (SELECT step, group_id, group_seq, count(*) AS k FROM collectives
                      WHERE axis = 'tp' AND op = 'all_reduce' GROUP BY ALL) WHERE k <> 2""")
    assert n == 0


def test_run_metadata_heartbeats_events_checkpoints(telemetry_run):
    r, con = telemetry_run
    (config, mesh, code, data, world), = q(con, "SELECT config, mesh, code_version, data_version, world_size FROM runs")
    assert json.loads(mesh)["tp"] == 2 and world == 4 and code and data
    assert json.loads(config)["parallel"]["dp"] == 2
    assert dict(q(con, "SELECT rank, node FROM ranks ORDER BY rank")) == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    (hb,), = q(con, "SELECT count(DISTINCT rank) FROM heartbeats")
    assert hb == 4
    ckpts = q(con, "SELECT step, num_shards, bytes > 0 FROM checkpoints ORDER BY step")
    assert [c[0] for c in ckpts] == [4, 8] and all(c[2] for c in ckpts)
    names = {n for (n,) in q(con, "SELECT DISTINCT name FROM scalars")}
    assert {"eval/code_loss", "eval/math_loss"} <= names
    kinds = {k for (k,) in q(con, "SELECT DISTINCT kind FROM events")}
    assert {"run_started", "run_finished", "checkpoint_saved"} <= kinds


def test_straggler_compute_really_slower(telemetry_run):
    _, con = telemetry_run
    # fwd_s and bwd_s are compute only: the time blocked in communication is comm_exposed_s
    rows = dict(q(con, """SELECT rank, median(fwd_s + bwd_s) FROM steps WHERE step >= 3 GROUP BY rank"""))
    peers = sorted(v for k, v in rows.items() if k != 1)
    assert rows[1] >= 3.0 * peers[len(peers) // 2], rows
    # ... and its peers' waiting for it shows as exposed communication, not compute
    waits = dict(q(con, "SELECT rank, median(comm_exposed_s) FROM steps WHERE step >= 3 GROUP BY rank"))
    assert waits[0] > waits[1] and waits[2] > waits[1], waits
