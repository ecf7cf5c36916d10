"""Jobs we did not write, fully diagnosed: a plain DDP loop and an FSDP2 loop under
`llmwatch-instrument` (zero code), the DDP loop with one `watch()` call, a Hugging Face
Trainer and a Lightning fit with their one-line callbacks. Two gloo ranks under torchrun,
faults injected by the harness (loops/faults.py), detection by the collector alone:

- a clean run opens no incident;
- a rank made ~1.5x slower is named a straggler, with its cost;
- a rank that hangs before a forward is named, with the collective it never entered,
  within 10 s of the hang;
- a noisy batch on one replica is a loss spike at its step naming that rank, and a NaN in
  one rank's loss names that rank as the origin.

One run per (loop, scenario), shared by the assertions that read it; the runs share a
collector per policy (each its own run id).
"""

from __future__ import annotations

import pytest

from tests.integration.foreign_run import Collectors, ForeignRun, hang_seen, run_loop

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

LOOPS = ["ddp", "fsdp2", "hf", "lightning"]
# the straggler's extra forward time: about half a step of each loop on two idle cores
SLOW_MS = {"ddp": 30, "fsdp2": 30, "hf": 40, "lightning": 25}
STRAGGLER_FROM, HANG_AT, NOISE_AT, NAN_AT = 40, 30, 30, 45
# a straggler verdict on inferred waits waits for the ranks' drift to be measured (~64 steps on
# two ranks): a clean run long past that, a straggler run long enough to be caught after it
CLEAN_STEPS, STRAGGLER_STEPS = 160, 120
BEAT_STEPS = 1000  # ~20 ms a step on two idle cores: a run of ~20 s, past a 12 s heartbeat and a 4 s flush


def scenario(loop: str, name: str) -> dict:
    return {
        "clean": dict(steps=CLEAN_STEPS),
        "straggler": dict(steps=STRAGGLER_STEPS, faults=f"straggler:rank=1,step={STRAGGLER_FROM},ms={SLOW_MS[loop]}"),
        "hang": dict(steps=400, faults=f"hang:rank=1,step={HANG_AT}", stop_when=hang_seen(1, HANG_AT - 1)),
        "data": dict(steps=55, faults=f"noise:rank=0,step={NOISE_AT};nan:rank=1,step={NAN_AT}",
                     collector_args=("--policy", "auto")),
    }[name]


@pytest.fixture(scope="module")
def collectors(tmp_path_factory):
    started = Collectors(tmp_path_factory.mktemp("collectors"))
    yield started
    started.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, collectors):
    done: dict[tuple[str, str], ForeignRun] = {}

    def get(loop: str, name: str) -> ForeignRun:
        if (loop, name) not in done:
            done[loop, name] = run_loop(tmp_path_factory.mktemp(f"{loop}-{name}"), loop, collectors=collectors,
                                        **scenario(loop, name))
        return done[loop, name]

    return get


def _finished(run: ForeignRun, steps: int, nproc: int = 2) -> None:
    assert run.returncode == 0, run.output[-3000:]
    assert run.num_steps_rows == steps * nproc, f"{run.num_steps_rows} step rows\n{run.output[-2000:]}"
    assert run.num_collectives > steps * nproc, "the collectives come from the Flight Recorder"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_clean_run_opens_no_incident(runs, loop):
    run = runs(loop, "clean")
    _finished(run, CLEAN_STEPS)
    assert run.incidents == [], run.summary()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_slow_rank_is_named_a_straggler_with_its_cost(runs, loop):
    run = runs(loop, "straggler")
    _finished(run, STRAGGLER_STEPS)
    found = run.of("straggler")
    assert found, run.summary()
    inc = found[0]
    assert inc["rank"] == 1, run.summary()
    # the onset is a change point of noisy ratios on shared cores: a few steps either way
    assert STRAGGLER_FROM - 10 <= inc["step_from"] <= STRAGGLER_FROM + 20, run.summary()
    cost = inc["evidence"].get("cost_s_per_step")  # what the policy weighs: present, and of the fault's size
    assert cost is not None and cost > 0.3 * SLOW_MS[loop] / 1e3, inc["evidence"]
    assert {i["kind"] for i in run.incidents} <= {"straggler"}, run.summary()


@pytest.mark.parametrize("loop", ["ddp", "fsdp2"])
def test_a_summarizing_agent_ships_the_flight_recorders_ops_and_the_slow_rank_is_named(tmp_path, collectors, loop):
    """The agent of a job of 256 ranks or more summarizes its collectives per step (agent/summary.py);
    on two ranks `LLMWATCH_COLLECTIVES=summary` makes it. The Flight Recorder's ops have no wait: who
    waited for whom is inferred from their arrivals op by op, which a summary's means cannot give (a
    DDP loop's straggler went unnamed from them), so they go out as they are, and the slow rank is
    named as in test_a_slow_rank_is_named_a_straggler_with_its_cost."""
    run = run_loop(tmp_path / loop, loop, collectors=collectors, env={"LLMWATCH_COLLECTIVES": "summary"},
                   **scenario(loop, "straggler"))
    _finished(run, STRAGGLER_STEPS)
    assert run.num_summarized_ops == 0, run.num_summarized_ops
    found = run.of("straggler")
    assert found and found[0]["rank"] == 1, run.summary()
    assert STRAGGLER_FROM - 10 <= found[0]["step_from"] <= STRAGGLER_FROM + 20, run.summary()
    assert {i["kind"] for i in run.incidents} <= {"straggler"}, run.summary()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_hung_rank_is_named_with_its_collective_within_10_s(runs, loop):
    run = runs(loop, "hang")
    found = run.of("hang")
    assert found, f"{run.summary()}\n{run.output[-2000:]}"
    inc = found[0]
    assert inc["rank"] == 1, run.summary()
    collective = inc["evidence"]["collective"]
    assert collective and collective["axis"] == "dp" and collective["group_seq"] > 0, inc["evidence"]
    assert HANG_AT - 1 in run.steps, f"step {HANG_AT - 1} never stored: {sorted(run.steps)[-5:]}\n{run.output[-2000:]}"
    hang_started = run.steps[HANG_AT - 1]  # the hung rank's last step ended then
    assert inc["opened_ts"] - hang_started <= 10.0, (inc["opened_ts"] - hang_started, run.summary())
    assert {i["kind"] for i in run.incidents} == {"hang"}, run.summary()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_noisy_batch_and_a_nan_name_their_rank_and_step(runs, loop):
    run = runs(loop, "data")
    spikes = run.of("loss_spike")
    assert spikes, run.summary()
    assert spikes[0]["step_from"] == NOISE_AT and spikes[0]["rank"] == 0, run.summary()
    nans = run.of("nan")
    assert nans, run.summary()
    assert nans[0]["step_from"] == NAN_AT and nans[0]["rank"] == 1, run.summary()
    assert "rank 1" in nans[0]["root_cause"], nans[0]["root_cause"]


def test_zero_code_runs_ask_for_shadow_and_every_decision_is_still_recorded(runs):
    run = runs("ddp", "data")
    assert run.config.get("source") == "instrument" and run.config.get("policy") == "shadow", run.config
    assert run.actions, "the policy decided something about the NaN"
    assert {a["status"] for a in run.actions} == {"shadow"}, run.actions


def test_one_watch_call_in_the_loop_gets_the_same_diagnosis(tmp_path, collectors):
    run = run_loop(tmp_path, "ddp_watch", steps=55, faults=f"noise:rank=0,step={NOISE_AT};nan:rank=1,step={NAN_AT}",
                   collectors=collectors)
    _finished(run, 55)
    assert run.config.get("source") == "watch", run.config
    assert sorted((i["kind"], i["rank"], i["step_from"]) for i in run.incidents) == [
        ("loss_spike", 0, NOISE_AT), ("nan", 1, NAN_AT)], run.summary()


def test_agents_set_to_beat_every_12_s_say_so_and_their_quiet_is_no_crash(tmp_path, collectors):
    """$LLMWATCH_FLUSH_S / $LLMWATCH_HEARTBEAT_S (a job too large to beat every second, at a size
    that runs here): the DDP loop's agents flush every 4 s and beat every 12 s, each heartbeat says
    so, and the crash detector waits 3 beats. By its fixed times alone, both ranks quiet for 10 s
    (`run_silence_s`) between beats read as a job that died."""
    run = run_loop(tmp_path / "beats", "ddp", collectors=collectors, steps=BEAT_STEPS,
                   env={"LLMWATCH_FLUSH_S": "4", "LLMWATCH_HEARTBEAT_S": "12"})
    _finished(run, BEAT_STEPS)
    span_s = max(run.steps.values()) - min(run.steps.values())
    assert span_s > 12.0 + 4.0, f"the run took {span_s:.1f} s: it must outlast a beat and a flush"
    assert run.incidents == [], run.summary()
    col = collectors.get(("--policy", "off"))
    beats = col.sql(f"SELECT rank, min(interval_s), max(interval_s) FROM heartbeats "
                    f"WHERE run_id = '{run.run_id}' GROUP BY rank ORDER BY rank")
    assert beats == [[0, 12.0, 12.0], [1, 12.0, 12.0]], beats
