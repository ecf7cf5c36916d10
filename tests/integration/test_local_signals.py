"""The per-rank local signals, end to end: real ranks (dp 2 x pp 2) -> agents ->
embedded collector -> DuckDB; and the launcher's exit reports and incident lines.

Two runs: a NaN injected in one rank's forward (the run goes on and finishes), and
a crash (the launcher stops the other ranks)."""

from __future__ import annotations

import json
import math

import duckdb
import pytest

from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAN_STEP, NAN_RANK = 6, 3  # rank 3: pp stage 1 (the last), dp replica 1
MICRO_BATCHES, MBS = 2, 2  # MBS: trainer_run.TINY's --micro-batch-size
LAYOUT = ["--telemetry", "--policy", "off", "--dp", "2", "--pp", "2", "--micro-batches", str(MICRO_BATCHES)]


def _open(run):
    return duckdb.connect(str(run.run_dir / "telemetry.duckdb"), read_only=True)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    # 150 steps, >= 3 s on a fast host: heartbeats (every 1 s) land while the ranks are in their
    # collectives (12 steps ran in 0.28 s, before any heartbeat after the first: the test failed)
    r = run_trainer(tmp_path_factory.mktemp("sig") / "nan", *LAYOUT, "--steps", "150",
                    "--inject", f"nan@step={NAN_STEP},rank={NAN_RANK},mode=transient", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    con = _open(r)
    yield r, con
    con.close()


@pytest.fixture(scope="module")
def crash_run(tmp_path_factory):
    r = run_trainer(tmp_path_factory.mktemp("sig") / "crash", *LAYOUT, "--steps", "40",
                    "--inject", "crash@rank=1,step=10", timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    con = _open(r)
    yield r, con
    con.close()


def q(con, sql, *params):
    return con.execute(sql, list(params)).fetchall()


def coords(con) -> dict[int, tuple[int, int]]:
    return {rank: (dp, pp) for rank, dp, pp in q(con, "SELECT rank, dp, pp FROM ranks")}


def test_the_nan_is_first_non_finite_in_the_forward_of_its_origin_rank(nan_run):
    _, con = nan_run
    mesh = coords(con)
    assert sorted(mesh) == [0, 1, 2, 3] and mesh[NAN_RANK] == (1, 1)
    assert q(con, "SELECT min(step) FROM steps WHERE finite_fwd = 0 OR finite_bwd = 0") == [(NAN_STEP,)]
    at = {rank: (fwd, bwd) for rank, fwd, bwd in q(con, "SELECT rank, finite_fwd, finite_bwd FROM steps WHERE step = ?",
                                                  NAN_STEP)}
    assert [r for r, (fwd, _) in at.items() if fwd == 0] == [NAN_RANK]
    # the origin's earlier stage saw finite activations; its replica's gradients went bad through backward
    assert all(at[r][0] == 1 for r in at if mesh[r][1] < mesh[NAN_RANK][1])
    assert {r for r, (_, bwd) in at.items() if bwd == 0} == {r for r in mesh if mesh[r][0] == mesh[NAN_RANK][0]}
    assert q(con, "SELECT count(*) FROM steps WHERE step <> ? AND (finite_fwd <> 1 OR finite_bwd <> 1)",
             NAN_STEP) == [(0,)]
    (skipped,), = q(con, "SELECT bool_and(skipped) FROM steps WHERE step = ?", NAN_STEP)
    assert skipped


def test_local_losses_are_per_replica(nan_run):
    _, con = nan_run
    mesh = coords(con)
    rows = q(con, "SELECT step, rank, loss, local_loss FROM steps ORDER BY step, rank")
    by_step: dict[int, dict[int, tuple[float, float]]] = {}
    for step, rank, loss, local in rows:
        by_step.setdefault(step, {})[rank] = (loss, local)
    for step, ranks in by_step.items():
        per_replica: dict[int, set] = {}
        for rank, (_, local) in ranks.items():
            per_replica.setdefault(mesh[rank][0], set()).add("nan" if math.isnan(local) else round(local, 9))
        assert all(len(v) == 1 for v in per_replica.values()), (step, per_replica)  # the same on the replica's stages
        if step == NAN_STEP:
            assert per_replica[mesh[NAN_RANK][0]] == {"nan"} and per_replica[1 - mesh[NAN_RANK][0]] != {"nan"}
        else:
            (a,), (b,) = per_replica[0], per_replica[1]
            assert a != b
            loss = ranks[0][0]
            assert min(a, b) < loss < max(a, b) or math.isclose(a, b)  # the global loss lies between them


def test_sample_windows_are_the_replicas_disjoint_shares_of_the_global_batch(nan_run):
    _, con = nan_run
    mesh = coords(con)
    share = MICRO_BATCHES * MBS
    for step, rank, epoch, lo, hi in q(con, "SELECT step, rank, sample_epoch, sample_from, sample_to FROM steps"):
        dp = mesh[rank][0]
        assert epoch == 0 and hi - lo == share
        assert lo == (step - 1) * 2 * share + dp * share  # data.py: lo + dp_rank * micro_batches * mbs


def test_heartbeats_name_the_collective_last_entered(nan_run):
    _, con = nan_run
    rows = q(con, "SELECT last_seq, last_op, last_axis, last_group_id, last_group_seq FROM heartbeats")
    named = [r for r in rows if r[0] >= 0]
    assert named and all(op is not None and axis in ("dp", "tp", "pp", "embed", "world") and gid is not None
                         and gseq is not None for _, op, axis, gid, gseq in named)
    assert all(r[1:] == (None, None, None, None) for r in rows if r[0] < 0)
    ops = {op for _, op, _, _, _ in named}
    assert ops <= {"all_reduce", "broadcast", "send", "recv", "barrier", "all_gather", "reduce_scatter"}
    # and say their agent's heartbeat interval (the trainer's default), which silence is read against
    assert q(con, "SELECT DISTINCT interval_s FROM heartbeats") == [(1.0,)]


def test_every_agent_closed_and_the_launcher_reported_every_clean_exit(nan_run):
    r, con = nan_run
    closed = q(con, "SELECT list(DISTINCT rank ORDER BY rank) FROM events WHERE kind = 'agent_closed'")
    assert closed == [([0, 1, 2, 3],)]
    exits = [json.loads(d) for d, in q(con, "SELECT data FROM events WHERE kind = 'rank_exited' AND rank = -1")]
    assert sorted((e["rank"], e["exit_code"], e["signal"], e["cause"]) for e in exits) == [
        (rank, 0, None, "exited") for rank in range(4)]
    assert q(con, "SELECT count(*) FROM ranks WHERE rank < 0") == [(0,)]
    assert f"incident: nan step {NAN_STEP}" in r.stdout
    listed = r.stdout[r.stdout.index("incidents:"):]
    assert f"nan step {NAN_STEP} rank {NAN_RANK} node node0" in listed, r.stdout


def test_a_crash_is_reported_by_the_launcher_and_the_others_as_stopped(crash_run):
    r, con = crash_run
    exits = {e["rank"]: e for e in (json.loads(d) for d, in q(
        con, "SELECT data FROM events WHERE kind = 'rank_exited' AND rank = -1 ORDER BY ts"))}
    assert exits[1]["cause"] == "exited" and exits[1]["exit_code"] == 17 and exits[1]["signal"] is None
    assert sorted(exits) == [0, 1, 2, 3]
    assert {exits[k]["cause"] for k in (0, 2, 3)} == {"stopped"}
    (first,), = q(con, "SELECT data FROM events WHERE kind = 'rank_exited' ORDER BY ts LIMIT 1")
    assert json.loads(first)["rank"] == 1  # named before the ranks it brought down
    assert "incident: crash" in r.stdout and "rank 1 exited with exit code 17" in r.stdout, r.stdout
    assert q(con, "SELECT count(*) FROM ranks WHERE rank < 0") == [(0,)]
