"""End to end: real ranks with injected faults -> collector -> policy -> commands -> the ranks heal.

Each scenario lets a run end by itself and then reads what it left: the `actions`,
`nodes`, `bad_batches`, `steps` and `events` tables of its DuckDB file and the run
dir (`bad_batches.jsonl`, `config.round<N>.json`). Commands take about a second of
wall time here, dozens of tiny steps: checkpoints every 5 steps with a deep keep, so
that one before the incident still exists when the rollback lands, and enough steps
that the run does not end before the action does. Runs are module-scoped; faults
that cannot interfere share a run (a data NaN and a crash under `--policy shadow`).

Every run but the shadow one gets `QUIET` rules: this tiny model's grad norm has
genuine lone excursions (3-8x, z 8-12, at steps that depend on the lr schedule and
on earlier rollbacks). The policy does not roll those back by default, but their
incidents and alerts are not the subject here: the lone grad-spike bar is raised out
of reach (a grad spike at a loss spike's step still folds into it).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path

import pytest

from collector.offline.archive import archive
from tests.e2e.runs import Healed, run_healing
from tests.fleet_runs import runs_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DP = ("--dp", "2", "--nodes", "2", "--micro-batches", "2")  # node0: rank 0; node1: rank 1; 8 samples a step
GLOBAL_SAMPLES = 2 * 2 * 2  # dp x micro-batches x micro-batch size
BIGGER = ("--d-model", "128", "--seq-len", "64")  # the straggler's steps: long enough to measure (test_detection)
QUIET = "[grad_spike]\nalone_z_threshold = 1000.0\n"
# two actions of one kind in a run: the second past the cooldown without hundreds of steps between, even on
# a fast host (at 2.0 s a fast CI host reached step 150 inside the cooldown, and the held-back rollback
# landed at step 249, past the 100 steps of checkpoints kept)
SHORT_COOLDOWN = "[policy]\ncooldown_s = 0.5\n"
# a straggler's node isolated after 2 s of its cost, not the default 4 s (the same decision, sooner)
SHORT_PERSIST = "[policy]\nstraggler_persist_s = 2.0\n"
# the isolation scenarios: a rebalance in place (its own scenario) would otherwise be the cheaper candidate for
# an 8x straggler here (its replica keeps 1 of the 4 micro-batches, 8 healthy ones' time, but no restart)
ISOLATION_ONLY = SHORT_PERSIST + "rebalance = false\n"
LEMON_STEPS = 200  # the fleet-memory scenario's run (~8 s): its isolation lands within ~2 s (the ranks' flush grid)


def ckpt(run_dir: Path, every: int = 5, keep: int = 20) -> tuple[str, ...]:
    return ("--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", str(every), "--ckpt-keep", str(keep))


def rules(path: Path, extra: str = "") -> tuple[str, ...]:
    path.write_text(QUIET + extra)
    return ("--rules", str(path))


def overlaps(row: dict, window: dict) -> bool:
    """A steps row's replica window [sample_from, sample_to) meets the bad window of its epoch."""
    return (row["sample_epoch"] == window["epoch"] and row["sample_from"] < window["sample_to"]
            and window["sample_from"] < row["sample_to"])


def last_attempt(o: Healed) -> list[dict]:
    (a,) = o.query("SELECT max(attempt) AS a FROM steps")
    return o.query("SELECT * FROM steps WHERE attempt = ? ORDER BY step, rank", a["a"])


def round_config(o: Healed, n: int) -> dict:
    path = o.run.run_dir / f"config.round{n}.json"
    assert path.exists(), f"no {path.name}: {sorted(p.name for p in o.run.run_dir.iterdir())}\n{o.report()}"
    return json.loads(path.read_text())


def samples_per_step(rows: list[dict]) -> set[int]:
    """The global batch of each step, in samples: its replicas' windows added up."""
    per: dict[tuple[int, int], int] = {}
    for r in rows:
        key = (r["attempt"], r["step"])
        per[key] = per.get(key, 0) + r["sample_to"] - r["sample_from"]
    return set(per.values())


def assert_isolated(o: Healed, node: str, incident: dict, reason: str) -> dict:
    """`node` was isolated for `incident`: one isolate action, done; the node `isolated` with the reason."""
    isolates = o.actions_of("isolate")
    assert [(a["node"], a["status"], a["incident_id"]) for a in isolates] == [(node, "done", incident["id"])], \
        o.report()
    (a,) = isolates
    # a command carries it out; a crashed node's ranks are down, the supervisor leaves it out
    assert a["mode"] == "auto" and (a["command_id"] is not None or incident["kind"] == "crash"), o.report()
    assert reason in a["detail"]["reason"], o.report()
    assert o.nodes[node]["status"] == "isolated" and reason in o.nodes[node]["reason"], o.report()
    assert all(r["status"] != "isolated" for n, r in o.nodes.items() if n != node), o.report()
    return a


def assert_finished_without(o: Healed, node: str, steps: int) -> None:
    """The job ended by itself on the other nodes: rc 0, the run completed, and the last
    attempt's steps, up to the last one, came only from ranks not on `node`."""
    assert o.run.returncode == 0, o.report()
    (run,) = o.query("SELECT status, world_size FROM runs")
    assert run["status"] == "completed", o.report()
    rows = last_attempt(o)
    assert rows and max(r["step"] for r in rows) == steps, o.report()
    nodes = {r["node"] for r in rows}
    assert node not in nodes and nodes == {"node0"}, o.report()
    assert run["world_size"] == 1 and {r["rank"] for r in rows} == {0}, o.report()


# -- the runs ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_nan(tmp_path_factory):
    d = tmp_path_factory.mktemp("data") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml"), "--steps", "150", *ckpt(d, keep=0),
                       "--inject", "nan@step=30,rank=1,mode=data")


@pytest.fixture(scope="module")
def data_nan_resumed(data_nan):
    """The same run dir again with `--resume`, from the checkpoint the rollback restored (before
    the bad window: a restore from an older tier would start there) up to more steps than the
    first run's: the second invocation must not serve the window either."""
    o = data_nan
    (started,) = [e for e in o.events("rollback_started") if e["rank"] == 0]
    old = Path(started["data"]["checkpoint"])
    resume_dir = o.run.run_dir / "ckpt-resume"
    resume_dir.mkdir()
    shutil.copytree(old, resume_dir / old.name)
    t0 = time.time()
    again = run_healing(o.run.run_dir, *DP, *rules(o.run.run_dir.parent / "rules.toml"), "--steps", "160",
                        "--ckpt-dir", str(resume_dir), "--ckpt-every", "5", "--resume",
                        "--inject", "nan@step=30,rank=1,mode=data")
    return again, t0, started["data"]["to_step"]


@pytest.fixture(scope="module")
def transients(tmp_path_factory):
    # the second one ~120 steps after the first rollback: past cooldown_s (SHORT_COOLDOWN) on any host we know;
    # and should a very fast one still hold it back, every checkpoint of the run is kept, so the rollback
    # finds one before step 150 whenever it lands
    d = tmp_path_factory.mktemp("transient") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml", SHORT_COOLDOWN), "--steps", "250",
                       *ckpt(d, keep=60),
                       "--inject", "nan@step=30,rank=1,mode=transient",
                       "--inject", "nan@step=150,rank=1,mode=transient")


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    base = tmp_path_factory.mktemp("device")
    d, hook, calls = base / "run", base / "on_isolate.sh", base / "on_isolate.txt"
    hook.write_text(f'#!/bin/sh\necho "$LLMWATCH_RUN_ID $LLMWATCH_NODE $LLMWATCH_REASON" >> "{calls}"\n')
    hook.chmod(0o755)
    o = run_healing(d, *DP, *rules(base / "rules.toml"), "--steps", "150", *ckpt(d),
                    "--inject", "nan@step=30,rank=1,mode=device", "--on-isolate", str(hook))
    return o, calls


@pytest.fixture(scope="module")
def spike(tmp_path_factory):
    # checkpoints every 4 steps and the default keep of 3: 12 steps of history, while the rollback lands a
    # second or more (dozens of steps) after the spike; the known-good watermark keeps the one it needs
    d = tmp_path_factory.mktemp("spike") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml"), "--steps", "150", "--ckpt-dir", str(d / "ckpt"),
                       "--ckpt-every", "4", "--inject", "spike@step=40")


@pytest.fixture(scope="module")
def late_spike(tmp_path_factory):
    # a spike 16 steps before the end: the run waits for the verdict on its last steps, then rolls back
    d = tmp_path_factory.mktemp("late") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml"), "--steps", "100", "--ckpt-dir", str(d / "ckpt"),
                       "--ckpt-every", "5", "--inject", "spike@step=84")


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    # detected ~1 s after its onset, weighed SHORT_PERSIST of cost later (around step 90-130 here): 220 steps.
    # 8x: on 2 nodes the cost model takes the node out only when waiting for it costs more than the other
    # node doing both halves and the restart (a 1.5x one is kept: test_policy, test_costmodel); at 6x the
    # predicted gain was 33% of the time left, at 8x it is past half: no margin call
    d = tmp_path_factory.mktemp("straggler") / "run"
    return run_healing(d, *DP, *BIGGER, *rules(d.parent / "rules.toml", ISOLATION_ONLY), "--steps", "220",
                       *ckpt(d, every=10),
                       "--inject", "straggler@rank=1,from=52,factor=8")


@pytest.fixture(scope="module")
def spare(tmp_path_factory):
    # the straggler scenario with a standby node: replacing costs the restart and nothing per step, shrinking
    # 2 nodes to 1 doubles every step after it: the cost model takes the spare
    d = tmp_path_factory.mktemp("spare") / "run"
    return run_healing(d, *DP, *BIGGER, *rules(d.parent / "rules.toml", ISOLATION_ONLY), "--steps", "220",
                       *ckpt(d, every=10), "--spare-nodes", "1",
                       "--inject", "straggler@rank=1,from=52,factor=8")


@pytest.fixture(scope="module")
def lemon(tmp_path_factory):
    # node1 failed in two runs this week (a straggler, then a hang that isolated it), archived by
    # `collector archive`: this run starts on node0 and node1 with node2 standing by
    d = tmp_path_factory.mktemp("lemon") / "run"
    now = time.time()
    earlier = runs_file(d.parent / "earlier.duckdb", [
        ("monday", now - 4 * 86400, {"node0": [], "node1": ["straggler"]}),
        ("tuesday", now - 3 * 86400, {"node0": [], "node1": ["hang"]}, ("node1",))])
    archive(earlier, d.parent / "archive")
    # steps long enough (BIGGER) that the isolation, issued as the run starts and carried by the ranks'
    # next flush (~1-2 s), lands well inside the run: 60 tiny steps took 1.1-1.4 s, and it landed after them
    return run_healing(d, *DP, *BIGGER, *rules(d.parent / "rules.toml"), "--steps", str(LEMON_STEPS),
                       *ckpt(d, every=10), "--spare-nodes", "1", "--archive", str(d.parent / "archive"))


@pytest.fixture(scope="module")
def preflight(tmp_path_factory):
    # four nodes and a spare; node2's link is 16x slow from the start: the pre-flight checks find it.
    # Simulated nodes on one host time their pairs in turns, and a turn can fall in the embedded
    # dashboard's start-up: in one CI run node0-node1 read 33.6 ms and the 8x pair 62.2 ms (1.85x,
    # under the 2x bar). Each pair now takes two turns and keeps the faster (the burst is the unit
    # test's); the fault stays twice as large, so a burst over both turns fails nothing either
    d = tmp_path_factory.mktemp("preflight") / "run"
    return run_healing(d, "--dp", "4", "--nodes", "4", "--micro-batches", "1", *rules(d.parent / "rules.toml"),
                       "--steps", "40", *ckpt(d, every=10), "--spare-nodes", "1", "--preflight",
                       "--inject", "slowlink@rank=2,axis=dp,from=0,factor=16")


@pytest.fixture(scope="module")
def preflight_silent(tmp_path_factory):
    # the same fleet; rank 2 (node2) stops answering the pre-flight checks after its matmuls
    d = tmp_path_factory.mktemp("preflightsilent") / "run"
    return run_healing(d, "--dp", "4", "--nodes", "4", "--micro-batches", "1", *rules(d.parent / "rules.toml"),
                       "--steps", "30", *ckpt(d, every=10), "--spare-nodes", "1", "--preflight",
                       "--preflight-timeout-s", "3", "--inject", "hang@rank=2,step=0")


@pytest.fixture(scope="module")
def place_loop(tmp_path_factory):
    # the spare scenario, but the slowness is rank 1's place (its data, its stage), not node1's hardware:
    # the spare that takes rank 1 is as slow there
    d = tmp_path_factory.mktemp("placeloop") / "run"
    return run_healing(d, *DP, *BIGGER, *rules(d.parent / "rules.toml", ISOLATION_ONLY), "--steps", "220",
                       *ckpt(d, every=10), "--spare-nodes", "1",
                       "--inject", "straggler@rank=1,from=52,factor=8,on=place")


@pytest.fixture(scope="module")
def rebalance(tmp_path_factory):
    # a 1.7x straggler from step 40 on 2 nodes of dp 2 with 3 micro-batches each: shrinking would put all 6 on
    # one node (6 healthy micro-batches' time a step, and a restart), keeping it costs 5.1; moving one micro-batch
    # off its replica (2 to it, 4 to the other: the split for any ratio from 1.34 to 2) costs 4, in place. From step 130 it is 5x: under that split 10,
    # split again for 5x (1 and 5) 5, shrunk 6 and a restart: split again. It recovers at 180: the split is undone.
    # 50 steps a phase: each split's realized gain is measured over 20 steps after it, within its phase
    d = tmp_path_factory.mktemp("rebalance") / "run"
    return run_healing(d, "--dp", "2", "--nodes", "2", "--micro-batches", "3", *BIGGER,
                       *rules(d.parent / "rules.toml", SHORT_PERSIST), "--steps", "300", *ckpt(d, every=10),
                       "--inject", "straggler@rank=1,from=40,factor=1.7,to=130",
                       "--inject", "straggler@rank=1,from=130,factor=5,to=180")


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    d = tmp_path_factory.mktemp("crash") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml"), "--steps", "150", *ckpt(d),
                       "--inject", "crash@rank=1,step=30", "--inject", "crash@rank=1,step=60")


@pytest.fixture(scope="module")
def crash_loop(tmp_path_factory):
    # a crash at step 30 in every attempt (a software bug): no node is ever isolated for it
    # (crashes_to_isolate 9), and --max-restarts leaves room for more restarts than the policy allows
    d = tmp_path_factory.mktemp("crashloop") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml", "[policy]\ncrashes_to_isolate = 9\n"),
                       "--steps", "150", *ckpt(d), "--max-restarts", "6",
                       "--inject", "crash@rank=1,step=30,mode=every")


@pytest.fixture(scope="module")
def hang(tmp_path_factory):
    d = tmp_path_factory.mktemp("hang") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml"), "--steps", "150", *ckpt(d),
                       "--inject", "hang@rank=1,step=40")


@pytest.fixture(scope="module")
def shadow(tmp_path_factory):
    d = tmp_path_factory.mktemp("shadow") / "run"
    return run_healing(d, *DP, "--policy", "shadow", "--steps", "150", *ckpt(d),
                       "--inject", "nan@step=30,rank=1,mode=data", "--inject", "crash@rank=1,step=100")


@pytest.fixture(scope="module")
def rollback_cap(tmp_path_factory):
    d = tmp_path_factory.mktemp("cap") / "run"
    # the second NaN well past the first rollback's cooldown_s: a new incident, not the rerun's echo
    cap = rules(d.parent / "rules.toml", SHORT_COOLDOWN + "max_rollbacks = 1\n")
    return run_healing(d, *DP, *cap, "--steps", "300", *ckpt(d),
                       "--inject", "nan@step=30,rank=1,mode=data", "--inject", "nan@step=150,rank=0,mode=data")


@pytest.fixture(scope="module")
def recurring(tmp_path_factory):
    # a spike of the optimizer's, not the data's (mode=step): at 40 and 43 in every attempt, whatever the batch.
    # 300 steps: the stop reaches the ranks ~2 s after the spike came back (detection, then an ingest
    # answer), 90 steps at this host's 50 steps/s; a faster host must not finish the run first
    d = tmp_path_factory.mktemp("recurring") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml"), "--steps", "300", *ckpt(d, every=4),
                       "--inject", "spike@step=40,mode=step", "--inject", "spike@step=43,mode=step")


@pytest.fixture(scope="module")
def min_nodes(tmp_path_factory):
    d = tmp_path_factory.mktemp("min_nodes") / "run"
    return run_healing(d, *DP, *rules(d.parent / "rules.toml"), "--min-nodes", "2", "--steps", "150", *ckpt(d),
                       "--inject", "nan@step=30,rank=1,mode=device")


# -- 1. a NaN in the data -----------------------------------------------------------------------------------


def test_a_data_nan_is_rolled_back_diagnosed_as_data_and_its_batch_skipped(data_nan):
    o = data_nan
    assert o.run.returncode == 0, o.report()
    nan = o.only("nan")
    assert (nan["step_from"], nan["rank"], nan["node"]) == (30, 1, "node1"), o.report()
    assert nan["root_cause"].startswith("data: "), o.report()
    (verdict,) = [e["data"] for e in o.events("rerun_verdict")]
    assert (verdict["verdict"], verdict["incident_id"]) == ("data", nan["id"]), verdict

    (rb,) = o.actions
    assert (rb["kind"], rb["status"], rb["mode"], rb["incident_id"]) == ("rollback", "done", "auto", nan["id"]), \
        o.report()
    assert rb["recovery_s"] is not None and 0 < rb["recovery_s"] < 5, o.report()
    assert rb["attempt"] >= 1 and rb["command_id"] is not None, o.report()

    # the skipped window: one row, the same as the run dir's list, and the global batch step 30 served
    (bad,) = o.bad_batches
    (line,) = [json.loads(x) for x in (o.run.run_dir / "bad_batches.jsonl").read_text().splitlines()]
    keys = ("epoch", "sample_from", "sample_to", "step", "incident_id", "verdict")
    assert {k: bad[k] for k in keys} == {k: line[k] for k in keys}, (bad, line)
    assert (bad["step"], bad["incident_id"], bad["verdict"]) == (30, nan["id"], "data"), bad
    served = o.query("SELECT sample_epoch, min(sample_from) AS lo, max(sample_to) AS hi FROM steps "
                     "WHERE attempt = 0 AND step = 30 GROUP BY sample_epoch")
    assert served == [{"sample_epoch": bad["epoch"], "lo": bad["sample_from"], "hi": bad["sample_to"]}], served
    skipped = [(e["data"]["epoch"], e["data"]["sample_from"], e["data"]["sample_to"])
               for e in o.events("batch_skipped")]
    assert skipped and set(skipped) == {(bad["epoch"], bad["sample_from"], bad["sample_to"])}, (skipped, o.report())

    # after the verdict: never served again, and step 30 redone on the next clean batch
    later = o.query("SELECT * FROM steps WHERE attempt > 0 ORDER BY attempt, step, rank")
    assert later and not [r for r in later if overlaps(r, bad)], o.report()
    redone = [r for r in later if r["step"] == 30]
    assert len(redone) == 2 and min(r["sample_from"] for r in redone) == bad["sample_to"], redone
    assert all(math.isfinite(r["loss"]) for r in redone), redone

    metrics = o.run.metrics()
    assert metrics[-1]["step"] == 150 and math.isfinite(metrics[-1]["loss"]), metrics[-1]
    (run,) = o.query("SELECT status FROM runs")
    assert run["status"] == "completed", o.report()


def test_a_resume_from_before_the_bad_window_never_serves_it_again(data_nan, data_nan_resumed):
    again, t0, from_step = data_nan_resumed
    (bad,) = data_nan.bad_batches
    assert again.run.returncode == 0, again.report()
    assert f"resume: step {from_step} " in again.run.stdout, again.report()
    assert from_step < bad["step"]
    rows = again.query("SELECT * FROM steps WHERE ts >= ? ORDER BY step, rank", t0)
    assert rows and min(r["step"] for r in rows) == from_step + 1 and max(r["step"] for r in rows) == 160, \
        again.report()
    assert not [r for r in rows if overlaps(r, bad)], [r for r in rows if overlaps(r, bad)]
    assert all(math.isfinite(r["loss"]) for r in rows), again.report()
    assert not [i for i in again.of("nan") if i["opened_ts"] >= t0], again.report()
    assert again.bad_batches == data_nan.bad_batches


# -- 2. transient faults, twice on one node ------------------------------------------------------------------


def test_two_transient_nans_on_one_node_isolate_it(transients):
    o = transients
    nans = o.of("nan")
    assert [(i["step_from"], i["node"]) for i in nans] == [(30, "node1"), (150, "node1")], o.report()
    assert all(i["root_cause"].startswith("transient: ") for i in nans), o.report()
    verdicts = [e["data"] for e in o.events("rerun_verdict")]
    assert [(v["verdict"], v["incident_id"]) for v in verdicts] == [("transient", i["id"]) for i in nans], verdicts
    rollbacks = o.actions_of("rollback")
    assert [(a["incident_id"], a["status"]) for a in rollbacks] == [(i["id"], "done") for i in nans], o.report()
    assert o.bad_batches == [], o.report()  # a transient's samples were fine: nothing skipped

    iso = assert_isolated(o, "node1", nans[1], "transient")
    assert iso["requested_ts"] > rollbacks[1]["requested_ts"], o.report()
    assert round_config(o, 1)["parallel"]["dp"] == 1
    assert_finished_without(o, "node1", 250)


# -- 3. a broken device (and --on-isolate, 10.) ----------------------------------------------------------------


def test_a_device_nan_isolates_its_node_and_the_job_finishes_on_the_other(device):
    o, _ = device
    nans = o.of("nan")
    assert nans and (nans[0]["step_from"], nans[0]["rank"], nans[0]["node"]) == (30, 1, "node1"), o.report()
    assert nans[0]["root_cause"].startswith("device: "), o.report()
    verdicts = [e["data"] for e in o.events("rerun_verdict")]
    assert len(verdicts) == 1, (verdicts, o.report())
    assert (verdicts[0]["verdict"], verdicts[0]["rank"]) == ("device", 1), verdicts
    assert o.bad_batches == [], o.report()  # the samples were fine
    assert_isolated(o, "node1", nans[0], "device: ")
    assert_finished_without(o, "node1", 150)

    first = json.loads((o.run.run_dir / "config.json").read_text())["parallel"]
    rounds = sorted(int(p.name[len("config.round"):-len(".json")]) for p in o.run.run_dir.glob("config.round*.json"))
    new = round_config(o, rounds[-1])["parallel"]  # the isolation's round, the last
    assert (first["dp"], first["micro_batches"]) == (2, 2)
    assert (new["dp"], new["micro_batches"], new["nodes"]) == (1, 4, 1), new  # the same global batch
    # one round per restart the policy recorded: the isolation's (and, once in a CI run, a crash's restart
    # first: rank 0 exited 1 on start-up, before its agent reported, and the job came back on both nodes)
    restarts = [a for a in o.actions if a["kind"] in ("isolate", "restart") and a["status"] == "done"]
    assert rounds == list(range(1, len(restarts) + 1)) and restarts[-1]["kind"] == "isolate", o.report()


def test_on_isolate_runs_once_with_the_isolated_node(device):
    o, calls = device
    assert calls.exists(), o.report()
    lines = calls.read_text().splitlines()
    assert lines == [f"{o.run.run_dir.name} node1 {o.nodes['node1']['reason']}"], (lines, o.report())
    assert lines[0].split(" ", 2)[2].startswith("device: ")


# -- 4. a loss spike from a poisoned global batch ---------------------------------------------------------------


def test_a_loss_spike_is_rolled_back_and_its_global_batch_skipped(spike):
    o = spike
    assert o.run.returncode == 0, o.report()
    inc = o.only("loss_spike")
    assert inc["step_from"] == 40 and inc["root_cause"].startswith("data: "), o.report()
    (rb,) = o.actions_of("rollback")
    assert (rb["status"], rb["incident_id"]) == ("done", inc["id"]), o.report()
    (started,) = [e["data"] for e in o.events("rollback_started") if e["rank"] == 0]
    to_step, from_step = started["to_step"], started["from_step"]
    assert to_step < 40 <= from_step and started["suspect_step"] == 40, started
    # the newest known-good checkpoint before the spike, kept by pruning though 3 x 4 steps had passed
    assert to_step == 36 and from_step - to_step > 3 * 4, started
    # the watermark it was decided at (it trails the ranks by the collector's latency): before the spike
    assert rb["detail"]["args"]["known_good_step"] < 40, rb["detail"]

    # both lineages are stored for the steps in between
    attempts = o.query("SELECT step, list(DISTINCT attempt ORDER BY attempt) AS a FROM steps "
                       "WHERE step > ? AND step <= ? GROUP BY step ORDER BY step", to_step, from_step)
    assert len(attempts) == from_step - to_step and all(r["a"] == [0, 1] for r in attempts), attempts

    # the verdict: the whole global batch was poisoned; that batch is skipped, and only it
    (verdict,) = [e["data"] for e in o.events("rerun_verdict")]
    assert verdict["verdict"] == "data", verdict
    (bad,) = o.bad_batches
    samples = inc["evidence"]["samples"]
    assert (bad["epoch"], bad["sample_from"], bad["sample_to"]) == (samples["epoch"], samples["from"], samples["to"])
    assert (bad["step"], bad["verdict"], bad["sample_to"] - bad["sample_from"]) == (40, "data", GLOBAL_SAMPLES), bad

    # the effective curve: the spike is gone from it and the loss goes on below its pre-spike level
    loss = {r["step"]: r["loss"] for r in o.query("SELECT step, loss FROM steps_effective WHERE rank = 0")}
    (peak,) = o.query("SELECT loss FROM steps WHERE attempt = 0 AND step = 40 AND rank = 0")
    before = statistics.median(loss[s] for s in range(30, 40))
    after = statistics.median(loss[s] for s in range(141, 151))
    assert max(loss[s] for s in range(40, 151)) < peak["loss"], (peak, loss)
    assert after < before, (before, after)


def test_a_spike_in_the_last_steps_is_rolled_back_before_the_run_ends(late_spike):
    """The final weights are the product: a finished run waits for the collector's verdict on
    its last steps (it used to end first: "the run ended before it could act")."""
    o = late_spike
    assert o.run.returncode == 0, o.report()
    inc = o.only("loss_spike")
    (rb,) = o.actions_of("rollback")
    assert inc["step_from"] == 84 and (rb["status"], rb["incident_id"]) == ("done", inc["id"]), o.report()
    (run,) = o.query("SELECT status FROM runs")
    assert run["status"] == "completed", o.report()
    rows = last_attempt(o)
    assert rows[0]["attempt"] >= 1 and max(r["step"] for r in rows) == 100, o.report()  # the rerun finished it
    loss = {r["step"]: r["loss"] for r in o.query("SELECT step, loss FROM steps_effective WHERE rank = 0")}
    (peak,) = o.query("SELECT loss FROM steps WHERE attempt = 0 AND step = 84 AND rank = 0")
    assert max(loss[s] for s in range(84, 101)) < peak["loss"], (peak, loss)


# -- 5. a straggler ----------------------------------------------------------------------------------------------


def test_a_straggling_node_is_isolated_and_the_job_keeps_its_global_batch(straggler):
    o = straggler
    s = o.only("straggler")
    assert (s["rank"], s["node"]) == (1, "node1"), o.report()
    iso = assert_isolated(o, "node1", s, "straggler")
    assert_finished_without(o, "node1", 220)
    # the cost model's prediction, and what came of it once the job caught up
    predicted, realized = iso["detail"]["predicted"], iso["detail"].get("realized")
    assert predicted["best"] == "shrink" and predicted["gain_s"] > 0, o.report()
    assert predicted["inputs"]["nodes"] == 2 and predicted["inputs"]["steps_left"] == 220 - predicted["at_step"]
    assert predicted["seconds"]["shrink"] < predicted["seconds"]["keep"], o.report()
    assert realized is not None and realized["step_s_after"] < realized["step_s_before"], o.report()
    assert realized["recovery_s"] > 0 and isinstance(realized["gain_s"], float), o.report()
    new = round_config(o, 1)["parallel"]
    assert (new["dp"], new["micro_batches"]) == (1, 4), new

    before = o.query("SELECT * FROM steps WHERE attempt = 0")
    after = last_attempt(o)
    assert samples_per_step(before) == samples_per_step(after) == {GLOBAL_SAMPLES}, o.report()
    # tokens per step as well (their samples differ in length: compared on average; half would mean dp halved)
    tokens = {a: statistics.mean(r["tokens"] for r in o.query(
        "SELECT tokens FROM step_summary WHERE attempt = ?", a)) for a in (0, after[0]["attempt"])}
    assert 0.8 < tokens[after[0]["attempt"]] / tokens[0] < 1.25, tokens


def test_a_spare_takes_the_straggling_nodes_place_and_the_job_keeps_its_size(spare):
    """--spare-nodes 1: node2 stands by (a `spare` node without ranks) until the policy isolates
    node1 for its straggler; the cost model chose `replace`, node2 takes rank 1, dp stays 2 and
    the slowness, which was node1's hardware, does not follow."""
    o = spare
    stragglers = o.of("straggler")
    assert stragglers, o.report()
    s = stragglers[0]  # the injected straggler's
    assert (s["rank"], s["node"]) == (1, "node1"), o.report()
    iso = assert_isolated(o, "node1", s, "straggler")
    # and nothing else until its node was replaced: after that the job is a clean dp2 job on two shared
    # cores, where a short swing is named now and then (the clean-run tests judge that; CI once saw a
    # second straggler incident here)
    assert all(i["opened_ts"] > iso["requested_ts"] for i in stragglers[1:]), o.report()
    predicted, realized = iso["detail"]["predicted"], iso["detail"].get("realized")
    assert predicted["best"] == "replace" and predicted["inputs"]["spares"] == 1, o.report()
    assert predicted["seconds"]["replace"] < predicted["seconds"]["shrink"], o.report()
    assert "with a spare in its node's place" in iso["detail"]["reason"], o.report()
    assert realized is not None and realized["step_s_after"] < realized["step_s_before"], o.report()
    assert o.run.returncode == 0 and o.query("SELECT status, world_size FROM runs") == [
        {"status": "completed", "world_size": 2}], o.report()
    assert (o.nodes["node2"]["status"], json.loads(o.nodes["node2"]["ranks"])) == ("healthy", [1]), o.report()
    after = last_attempt(o)
    assert max(r["step"] for r in after) == 220 and {(r["rank"], r["node"]) for r in after} == {
        (0, "node0"), (1, "node2")}, o.report()
    new = round_config(o, 1)["parallel"]
    assert (new["dp"], new["nodes"], new["micro_batches"]) == (2, 2, 2), new
    assert samples_per_step(after) == {GLOBAL_SAMPLES}, o.report()
    assert "spare node2 takes node1's place" in o.run.stderr + o.run.stdout, o.report()


def test_a_node_whose_link_fails_the_preflight_checks_is_replaced_before_it_costs_the_run(preflight):
    """--preflight: before the first step the nodes time their links in pairs; node2's pair is slow
    in the first round, and again paired with a healthy node in the second (its first partner,
    node3, is cleared). A critical preflight incident names it at step 0, the policy isolates it,
    and the spare takes its place: the run completes at dp 4 without it."""
    o = preflight
    flag = o.only("preflight")
    assert (flag["rank"], flag["node"], flag["step_from"], flag["severity"]) == (2, "node2", 0, "critical"), o.report()
    ev = flag["evidence"]
    assert ev["verdict"] == "slow_link" and ev["rounds"] == 2 and ev["link_ratio"] >= 2.0, ev
    assert "preflight: 4 node(s), 2 link round(s)" in o.run.stdout, o.report()
    assert_isolated(o, "node2", flag, "failed its pre-flight checks (slow_link)")
    assert o.run.returncode == 0 and o.query("SELECT status, world_size FROM runs") == [
        {"status": "completed", "world_size": 4}], o.report()
    after = last_attempt(o)
    assert max(r["step"] for r in after) == 40 and {r["node"] for r in after} == {"node0", "node1", "node3",
                                                                                 "node4"}, o.report()
    assert (o.nodes["node4"]["status"], json.loads(o.nodes["node4"]["ranks"])) == ("healthy", [2]), o.report()
    # isolated before step 1: the ranks waited at step 0 for the verdict; node2 never ran a step
    assert "isolate node2: before step 1" in o.run.stdout + o.run.stderr, o.report()
    assert o.query("SELECT count(*) AS n FROM steps WHERE node = 'node2'") == [{"n": 0}], o.report()


def test_a_node_that_never_answers_the_preflight_checks_is_named_and_replaced(preflight_silent):
    """A peer that never answers: rank 2 goes silent after its matmuls. node3, its partner, waits the
    3 s timeout and is re-paired; the report names node2 `no_answer` (not the process group's timeout,
    minutes later), the policy isolates it, the supervisor stops the silent rank with the others, and
    the spare takes its place: the run completes at dp 4, and node2 never ran a step."""
    o = preflight_silent
    flag = o.only("preflight")
    assert (flag["rank"], flag["node"], flag["step_from"], flag["severity"]) == (2, "node2", 0, "critical"), o.report()
    ev = flag["evidence"]
    assert ev["verdict"] == "no_answer" and ev["silent_ranks"] == [2] and ev["timeout_s"] == 3.0, ev
    assert "node2        no_answer" in o.run.stdout, o.report()
    assert_isolated(o, "node2", flag, "failed its pre-flight checks (no_answer)")
    assert o.run.returncode == 0 and o.query("SELECT status, world_size FROM runs") == [
        {"status": "completed", "world_size": 4}], o.report()
    assert o.query("SELECT count(*) AS n FROM steps WHERE node = 'node2'") == [{"n": 0}], o.report()
    after = last_attempt(o)
    assert max(r["step"] for r in after) == 30 and {r["node"] for r in after} == {"node0", "node1", "node3",
                                                                                 "node4"}, o.report()


def test_a_node_that_failed_in_two_runs_this_week_is_replaced_by_the_spare_at_the_start(lemon):
    """Fleet memory: the archive says node1 failed in two runs this week. The run opens a
    node_history incident for it at step 0, with its record, and the policy hands its place to
    the spare before it costs anything: node2 takes rank 1 and the run completes at dp 2."""
    o = lemon
    flag = o.only("node_history")
    assert (flag["rank"], flag["node"], flag["step_from"]) == (1, "node1", 0), o.report()
    ev = flag["evidence"]
    assert (ev["runs"], ev["fault_runs"], ev["by_kind"]) == (2, 2, {"hang": 1, "isolated": 1, "straggler": 1}), ev
    assert [x["run_id"] for x in ev["latest_faults"]][:1] == ["tuesday"], ev
    iso = assert_isolated(o, "node1", flag, "node_history")
    assert "a spare takes its place" in iso["detail"]["reason"], o.report()
    assert o.run.returncode == 0 and o.query("SELECT status, world_size FROM runs") == [
        {"status": "completed", "world_size": 2}], o.report()
    assert (o.nodes["node2"]["status"], json.loads(o.nodes["node2"]["ranks"])) == ("healthy", [1]), o.report()
    after = last_attempt(o)
    assert max(r["step"] for r in after) == LEMON_STEPS and {(r["rank"], r["node"]) for r in after} == {
        (0, "node0"), (1, "node2")}, o.report()
    # early in the run: node1 ran the first steps only (the command's one flush and one step of agreement)
    assert o.query("SELECT max(step) AS s FROM steps WHERE node = 'node1'")[0]["s"] < LEMON_STEPS // 2, o.report()
    assert not [i for i in o.incidents if i["kind"] != "node_history"], o.report()


def test_a_spare_as_slow_in_the_same_place_stops_the_run_instead_of_replacing_again(place_loop):
    """The straggler belongs to rank 1's place: the policy replaces node1 with the spare, node2 takes rank
    1 and is as slow there. The second straggler incident names the same rank on the node that replaced
    it: another replacement (or a shrink) would chase the place around the job, so the run is stopped,
    with the reason, and pages; nothing else is isolated."""
    o = place_loop
    first, second = o.of("straggler")
    assert (first["rank"], first["node"], second["rank"], second["node"]) == (1, "node1", 1, "node2"), o.report()
    iso = assert_isolated(o, "node1", first, "straggler")
    assert iso["detail"]["predicted"]["best"] == "replace", o.report()
    stop = o.actions[-1]
    assert (stop["kind"], stop["status"], stop["incident_id"]) == ("stop", "done", second["id"]), o.report()
    assert "node2 took node1's place and is as slow there" in stop["detail"]["reason"], o.report()
    assert "another replacement would loop" in stop["detail"]["reason"], o.report()
    (run,) = o.query("SELECT status FROM runs")
    assert run["status"] == "stopped", o.report()
    assert o.nodes["node2"]["status"] == "healthy", o.report()  # not isolated in its turn
    assert max(r["step"] for r in o.query("SELECT step FROM steps")) < 220, o.report()  # it did not run on
    # the ground truth: one row per node that held the slow place
    assert [(t["rank"], t["node"]) for t in o.truths("straggler")] == [(1, 1), (1, 2)], o.report()


def test_a_straggling_replica_hands_micro_batches_to_the_other_in_place_until_it_recovers(rebalance):
    """No node is worth taking out of a 2-node job for a 1.7x straggler, but one of its replica's
    micro-batches is worth moving: the cost model chose `rebalance`, every rank carried it out at one step
    boundary, no restart; the global batch stayed whole at every step while rank 1 took fewer of its
    samples. When the rank got 5x slower under that split, the split was weighed again and made for the
    new ratio (2 of 6 micro-batches, then 1), and the step got faster; once the straggler was over it was
    undone.
    The incident stayed one incident: judged per micro-batch, the rebalanced rank was still the straggler,
    and rank 0 (more micro-batches a step) was not named while it lasted, nor once the rank recovered under
    the split (it carries more than an even share: judged against its like only, and it has none;
    analysis/detectors/straggler.py); nor was rank 1 named anew between its incident's close and the undo
    (it carried less than an even share)."""
    o = rebalance
    first, second, back = [e for e in o.events("rebalanced") if e["rank"] == 0]
    # the injected straggler's (40 to 180), and nothing else from its start to the undo. After the undo the job
    # is a clean dp2 job on two shared cores, where a 30-step swing of 1.2x on one rank is named now and then
    # (a run here: rank 1 at 1.15-1.26x for steps 236-264, idle host, no fault): the clean-run tests judge that
    stragglers = [i for i in o.of("straggler") if i["step_from"] <= back["step"]]
    assert len(stragglers) == 1, o.report()
    (s,) = stragglers
    assert (s["rank"], s["node"], s["status"]) == (1, "node1", "closed"), o.report()
    assert o.actions_of("isolate") == [] and o.query("SELECT max(attempt) AS a FROM steps") == [{"a": 0}], o.report()
    moved, again, undone = o.actions_of("rebalance")
    assert [(a["status"], a["mode"], a["incident_id"]) for a in (moved, again, undone)] == [
        ("done", "auto", s["id"])] * 3, o.report()
    predicted, realized = moved["detail"]["predicted"], moved["detail"].get("realized")
    assert predicted["best"] == "rebalance" and predicted["seconds"]["rebalance"] < predicted["seconds"]["shrink"]
    assert (predicted["inputs"]["dp"], predicted["inputs"]["micro_batches"]) == (2, 6), o.report()
    assert moved["detail"]["args"]["rank"] == 1 and moved["detail"]["args"]["ratio"] > 1.2, o.report()
    # measured, whatever its sign: a 1.7x split saves ~20% of a step, within this host's step-to-step noise
    # (CI: 0.077 -> 0.092 s, locally 0.116 -> 0.111)
    assert realized is not None and realized["recovery_s"] > 0, o.report()
    # the second split: weighed against going on under the first, for a ratio 1.5x the first's or more
    worse, gained = again["detail"]["predicted"], again["detail"].get("realized")
    assert gained is not None and gained["step_s_after"] < gained["step_s_before"], o.report()  # 5x: ~half a step
    assert again["detail"]["args"]["ratio"] >= 1.5 * moved["detail"]["args"]["ratio"], o.report()
    assert worse["best"] == "rebalance" and worse["rebalanced_from"] == moved["detail"]["args"]["ratio"], o.report()
    assert "got slower under its rebalance" in again["detail"]["reason"], o.report()
    assert undone["detail"]["args"]["ratio"] == 1.0 and "the rebalance undone" in undone["detail"]["reason"]

    assert first["data"]["shares"] == [4, 2] and second["data"]["shares"] == [5, 1], o.report()
    assert back["data"]["shares"] == [3, 3], o.report()
    assert 40 < first["step"] < 130 < second["step"] < 180 < back["step"], o.report()
    rows = o.query("SELECT * FROM steps ORDER BY step, rank")
    assert samples_per_step(rows) == {2 * 3 * 2}, o.report()  # the global batch, whole at every step
    share_of = {(r["step"], r["rank"]): (r["sample_to"] - r["sample_from"]) // 2 for r in rows}
    for ev, (mine, other) in ((first, (2, 4)), (second, (1, 5)), (back, (3, 3))):
        assert (share_of[(ev["step"] + 1, 1)], share_of[(ev["step"] + 1, 0)]) == (mine, other), o.report()
    assert share_of[(first["step"], 1)] == 3, o.report()
    assert o.run.returncode == 0 and o.query("SELECT status, world_size FROM runs") == [
        {"status": "completed", "world_size": 2}], o.report()
    assert "rebalance at step" in o.run.stderr + o.run.stdout, o.report()


# -- 6. a node that crashes twice --------------------------------------------------------------------------------


def test_a_crash_restarts_the_job_and_a_second_one_on_that_node_isolates_it(crashes):
    o = crashes
    c = o.of("crash")
    assert [(i["rank"], i["node"]) for i in c] == [(1, "node1"), (1, "node1")], o.report()
    kinds = [(a["kind"], a["node"], a["status"], a["incident_id"]) for a in o.actions]
    assert kinds == [("restart", "node1", "done", c[0]["id"]), ("isolate", "node1", "done", c[1]["id"])], o.report()
    iso = assert_isolated(o, "node1", c[1], "crash")
    assert round_config(o, 1)["parallel"]["nodes"] == 2  # the first crash: the same nodes
    # the second: without node1, at once (no round of the job runs node1 after it was isolated)
    new = round_config(o, 2)["parallel"]
    assert (new["nodes"], new["dp"], new["micro_batches"]) == (1, 1, 4), (new, o.report())
    later = [e["data"]["node"] for e in o.events("run_started") if e["ts"] > iso["requested_ts"]]
    assert later == ["node0"], (later, o.report())
    assert not (o.run.run_dir / "config.round3.json").exists(), o.report()
    assert_finished_without(o, "node1", 150)


def test_restarts_that_make_no_progress_stop_the_run(crash_loop):
    """The job crashes at step 30 in every attempt. Restarted from its checkpoint at 25 it crashes
    there again, never past step 29: after restarts_without_progress (2) restarts in a row that got
    it no further, the third crash's restart is refused and the run stopped with that reason, well
    before --max-restarts."""
    o = crash_loop
    assert o.run.returncode == 1, o.report()
    crashes = o.of("crash")
    assert len(crashes) == 3, o.report()
    kinds = [(a["kind"], a["status"]) for a in o.actions]
    assert kinds[-2:] == [("restart", "refused"), ("stop", "done")], o.report()  # the launcher carried it out
    assert kinds[:-2] == [("restart", "done")] * (len(crashes) - 1), o.report()
    stop = o.actions[-1]
    assert stop["incident_id"] == crashes[-1]["id"], o.report()
    assert "2 restart(s) in a row made no progress: the run got no further than step 29" in stop["detail"]["reason"]
    assert "the collector's policy stopped the run instead of restarting it" in o.run.stderr, o.report()
    (run,) = o.query("SELECT status FROM runs")
    assert run["status"] == "stopped", o.report()  # the launcher's run_finished: no rank was left to send it
    (end,) = o.events("run_finished")
    assert end["rank"] == -1 and "made no progress" in end["data"]["reason"], end
    round_config(o, 2)  # the second restart's round ran; none after the stop
    assert not (o.run.run_dir / "config.round3.json").exists(), o.report()
    assert max(r["step"] for r in o.query("SELECT step FROM steps")) < 30, o.report()


# -- 7. a hang ---------------------------------------------------------------------------------------------------


def test_a_hung_rank_has_its_node_isolated_and_the_job_finishes(hang):
    o = hang
    h = o.only("hang")
    assert (h["rank"], h["node"], h["step_from"]) == (1, "node1", 40), o.report()
    assert_isolated(o, "node1", h, "hang")
    assert_finished_without(o, "node1", 150)


# -- 8. shadow mode ------------------------------------------------------------------------------------------------


def test_shadow_mode_records_what_it_would_do_and_does_nothing(shadow):
    o = shadow
    assert o.run.returncode != 0, o.report()  # the crash ends the job, as without this tool
    assert {i["kind"] for i in o.incidents} >= {"nan", "crash"}, o.report()
    assert o.actions and all((a["status"], a["mode"], a["command_id"]) == ("shadow", "shadow", None)
                             for a in o.actions), o.report()
    assert {a["kind"] for a in o.actions} >= {"rollback", "restart"}, o.report()
    for kind in ("rollback_started", "rerun_verdict", "batch_skipped", "command_ack"):
        assert o.events(kind) == [], (kind, o.report())
    assert o.bad_batches == [] and not (o.run.run_dir / "bad_batches.jsonl").exists(), o.report()
    assert o.query("SELECT * FROM commands") == [], o.report()
    assert [r["attempt"] for r in o.query("SELECT DISTINCT attempt FROM steps")] == [0], o.report()
    assert all(r["status"] == "healthy" for r in o.nodes.values()), o.report()
    assert [e["data"]["restart"] for e in o.events("run_started")] == [0, 0], o.report()
    assert not (o.run.run_dir / "config.round1.json").exists()


# -- 9. guard rails ------------------------------------------------------------------------------------------------


def test_past_max_rollbacks_the_next_incident_stops_the_run(rollback_cap):
    o = rollback_cap
    nans = o.of("nan")
    assert [(i["step_from"], i["rank"]) for i in nans] == [(30, 1), (150, 0)], o.report()
    kinds = [(a["kind"], a["status"], a["incident_id"]) for a in o.actions]
    assert kinds[0] == ("rollback", "done", nans[0]["id"]), o.report()
    assert kinds[1:] == [("rollback", "refused", nans[1]["id"]), ("stop", "done", nans[1]["id"])], o.report()
    assert "max_rollbacks 1" in o.actions[1]["detail"]["refused"], o.report()
    (run,) = o.query("SELECT status FROM runs")
    assert run["status"] == "stopped", o.report()
    (finished,) = o.events("run_finished")
    assert finished["data"]["status"] == "stopped" and 150 <= finished["step"] < 300, finished
    assert o.run.metrics()[-1]["step"] < 300
    assert [b["incident_id"] for b in o.bad_batches] == [nans[0]["id"]], o.report()  # the refused one: no skip


def test_a_spike_that_comes_back_after_its_skip_stops_the_run_at_once(recurring):
    """Rolled back and its batch skipped (a data verdict: the rerun reproduced it), the spike comes
    back 3 steps later with other samples: not the data. The next rollback is refused and the run
    stopped with that reason, without waiting out the cooldown or reaching max_rollbacks."""
    o = recurring
    spikes = o.of("loss_spike")
    assert [i["step_from"] for i in spikes][:2] == [40, 43], o.report()
    (verdict,) = [e["data"] for e in o.events("rerun_verdict")]
    assert (verdict["verdict"], verdict["incident_id"]) == ("data", spikes[0]["id"]), verdict
    kinds = [(a["kind"], a["status"], a["incident_id"]) for a in o.actions]
    assert kinds == [("rollback", "done", spikes[0]["id"]), ("rollback", "refused", spikes[1]["id"]),
                     ("stop", "done", spikes[1]["id"])], o.report()
    why = o.actions[1]["detail"]["refused"]
    assert why.startswith("loss_spike at step 43 came back 3 step(s) after the samples of step 40 were skipped"), why
    (run,) = o.query("SELECT status FROM runs")
    assert run["status"] == "stopped", o.report()
    assert o.run.metrics()[-1]["step"] < 300
    assert [b["incident_id"] for b in o.bad_batches] == [spikes[0]["id"]], o.report()


def test_an_isolation_below_min_nodes_is_refused_and_the_run_is_stopped(min_nodes):
    """The device fails every step from 30 and its node cannot be removed (--min-nodes 2): the
    isolation is refused, and the run is stopped with that reason rather than rolled back into
    the device again and again (it did so until max_rollbacks before)."""
    o = min_nodes
    assert o.run.returncode == 0, o.report()
    nan = o.of("nan")[0]
    assert nan["root_cause"].startswith("device: "), o.report()
    kinds = [(a["kind"], a["status"], a["node"], a["incident_id"]) for a in o.actions]
    assert kinds == [("rollback", "done", "node1", nan["id"]), ("isolate", "refused", "node1", nan["id"]),
                     ("stop", "done", "node1", nan["id"])], o.report()
    assert o.actions[1]["detail"]["refused"].startswith("min_nodes: "), o.report()
    assert "its isolation was refused (min_nodes: " in o.actions[2]["detail"]["reason"], o.report()
    (run,) = o.query("SELECT status FROM runs")
    assert run["status"] == "stopped", o.report()
    assert o.run.metrics()[-1]["step"] < 150
    assert all(r["status"] == "healthy" for r in o.nodes.values()), o.report()
    assert "isolate" not in {c["kind"] for c in o.query("SELECT kind FROM commands")}, o.report()
    assert [e["data"]["restart"] for e in o.events("run_started")] == [0, 0], o.report()
    assert not (o.run.run_dir / "config.round1.json").exists(), o.report()
    assert {r["node"] for r in last_attempt(o)} == {"node0", "node1"}, o.report()
