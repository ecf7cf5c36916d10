"""Device health end to end: a `devhealth` injection rides the agent's real device-health samples (a
simulated device: this CPU host has no GPU columns, the injector supplies them) to the embedded
collector, whose `device_health` detector names the rank and its node by cause, and the policy acts:
ECC errors isolate the node, memory pressure checkpoints at once.

Two nodes of one rank each (node0: rank 0, node1: rank 1), ~45 tiny steps a second here. Samples
come once per heartbeat (1 s), so the rules shorten the memory window to 2 s. The tiny model's lone
grad spikes are not the subject and stay out of it (the bar raised out of reach, as in
tests/e2e/test_healing.py), and so are stragglers: on 2 shared cores a dp2 run's two ranks drift
apart by 1.15-1.5x for stretches, and over 300-400 steps the straggler detector, whose own tests
cover it, named one now and then (a CI run failed on it). Any other incident (a crash when the
isolated job restarts, a stall) fails the test."""

import pytest

from analysis.scoring import WINDOWS
from tests.e2e.runs import Healed, read_healed
from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

DP = ("--telemetry", "--policy", "auto", "--dp", "2", "--nodes", "2", "--micro-batches", "2")
RULES = "[device_health]\nmemory_window_s = 2.0\n[grad_spike]\nalone_z_threshold = 1000.0\n[straggler]\nenabled = false\n"
ONSET = 40


def run(tmp_path, what: str, steps: int) -> Healed:
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    return read_healed(run_trainer(tmp_path / what, *DP, "--rules", str(rules), "--steps", str(steps),
                                   "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "100",
                                   "--inject", f"devhealth@rank=1,from={ONSET},what={what}", timeout=150))


def the_incident(o: Healed, cause: str) -> dict:
    """The run's one incident: a device_health of `cause` on rank 1, node1, from a sample after onset."""
    assert [(i["kind"], i["evidence"].get("cause")) for i in o.incidents] == [("device_health", cause)], o.report()
    (inc,) = o.incidents
    assert (inc["rank"], inc["node"]) == (1, "node1"), o.report()
    # the first faulty sample: never before onset, and within the scoring's window
    assert ONSET <= inc["step_from"] <= ONSET + WINDOWS["devhealth"][1], o.report()
    return inc


def test_ecc_errors_isolate_the_node_and_the_job_finishes_on_the_other(tmp_path):
    o = run(tmp_path, "ecc", steps=300)
    assert o.run.returncode == 0, o.report()
    (truth,) = o.run.injections()
    assert (truth["kind"], truth["rank"], truth["node"], truth["step"], truth["what"]) == (
        "devhealth", 1, 1, ONSET, "ecc")
    inc = the_incident(o, "ecc")
    assert (inc["severity"], inc["evidence"]["new_errors"], inc["evidence"]["ecc_at_start"]) == ("critical", 2, 0)

    (iso,) = o.actions
    assert (iso["kind"], iso["status"], iso["mode"], iso["node"], iso["incident_id"]) == (
        "isolate", "done", "auto", "node1", inc["id"]), o.report()
    assert iso["command_id"] is not None and iso["detail"]["reason"].startswith("ecc: rank 1's GPU"), o.report()
    assert o.nodes["node1"]["status"] == "isolated" and o.nodes["node1"]["reason"].startswith("ecc: "), o.report()
    assert o.nodes["node0"]["status"] != "isolated", o.report()
    # the job went on without it: the last attempt's steps, up to the last one, are rank 0's on node0
    (run_row,) = o.query("SELECT status, world_size FROM runs")
    assert (run_row["status"], run_row["world_size"]) == ("completed", 1), o.report()
    last = o.query("SELECT max(step) AS step, list(DISTINCT node) AS nodes FROM steps "
                   "WHERE attempt = (SELECT max(attempt) FROM steps)")
    assert last == [{"step": 300, "nodes": ["node0"]}], o.report()


def test_memory_pressure_checkpoints_at_once(tmp_path):
    o = run(tmp_path, "memory", steps=400)
    assert o.run.returncode == 0, o.report()
    (truth,) = o.run.injections()
    assert (truth["kind"], truth["rank"], truth["step"], truth["what"]) == ("devhealth", 1, ONSET, "memory")
    inc = the_incident(o, "memory_pressure")
    assert inc["evidence"]["mem_available_share"] == pytest.approx(0.01, abs=1e-4), o.report()

    (ck,) = o.actions
    assert (ck["kind"], ck["status"], ck["mode"], ck["node"], ck["incident_id"]) == (
        "checkpoint", "done", "auto", "node1", inc["id"]), o.report()
    assert ck["command_id"] is not None and "checkpoint before an OOM kill" in ck["detail"]["reason"], o.report()
    assert ck["detail"]["outcome"] == "every rank carried out the checkpoint", o.report()  # not the run's end
    # every rank carried it out at one step after the incident opened: acked, and that step's checkpoint saved
    of_it = [e for kind in ("command_started", "command_ack") for e in o.events(kind)
             if e["data"]["command_id"] == str(ck["command_id"])]
    assert sorted((e["kind"], e["rank"], e["data"].get("status")) for e in of_it) == [
        ("command_ack", 0, "done"), ("command_ack", 1, "done"), ("command_started", 0, None),
        ("command_started", 1, None)], o.report()
    (step,) = {e["step"] for e in of_it if e["kind"] == "command_started"}
    assert step > inc["step_from"], (step, o.report())
    saved = o.query("SELECT step, num_ranks FROM checkpoints WHERE step = ?", step)
    assert saved == [{"step": step, "num_ranks": 2}], (saved, o.report())
    assert o.nodes["node1"]["status"] != "isolated", o.report()
