"""PolicyRunner following a rollback across a restart: a command the old round's ranks
received but left without carrying out (an isolation restarted the job first) is not
done at the new round's first step (the commands book delivers it again to the new
round: tests/unit/collector/test_commands.py); it is done at the first step of the
attempt it made, once a rank acked it."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from analysis.policy import Decision, Policy
from analysis.rules import load_rules
from collector.live.policy import PolicyRunner
from collector.live.watermark import Watermarks

RUN = "r1"


class FakeWatch:
    on_change = None

    def open_rows(self) -> list:
        return []


class FakeStorage:
    """What the runner calls, recorded; each issued command gets the next id."""

    def __init__(self) -> None:
        self.issued: list[tuple[str, dict]] = []
        self.updates: list[tuple[int, dict[str, Any]]] = []
        self.next_id = 10
        self.watermarks = Watermarks(hold_for_policy=True)

    def read(self, fn, run_id):
        if fn.__name__ == "_run_layout":
            return {"world_size": 2, "node_map": {0: "node0", 1: "node0"}, "reached": {}}
        return {"all": ["node0", "node1"], "isolated": ["node1"], "finished": False}

    def issue_command(self, run_id, kind, args, ranks, *, done):
        self.issued.append((kind, args))
        self.next_id += 1
        done({"id": self.next_id}, None)

    def update_action(self, action_id, **fields):
        self.updates.append((action_id, fields))


def events(*rows: dict) -> pa.Table:
    return pa.Table.from_pylist([{"run_id": RUN, "ts": 1.0, "step": 0, "attempt": 0, **r} for r in rows])


def steps(attempt: int, *numbers: int) -> pa.Table:
    return pa.Table.from_pylist([{"run_id": RUN, "attempt": attempt, "step": s, "ts": 100.0 + s} for s in numbers])


def test_a_rollback_the_restart_swallowed_is_done_only_at_the_attempt_it_made():
    storage = FakeStorage()
    runner = PolicyRunner(storage, Policy(load_rules()), subscription=None, watch=FakeWatch())
    d = Decision(kind="rollback", run_id=RUN, reason="loss_spike at step 70", incident_id=2,
                 args={"step": 70, "incident_id": 2, "kind": "loss_spike"})
    runner._follow(d, 5, 90.0, 0)(1, None)  # action 1, command 5, issued during attempt 0
    runner._refresh_run(RUN)

    # the isolation's restart: a new round at attempt 1; command 5 was never carried out
    runner._commit({"events": events({"rank": 0, "kind": "run_started",
                                      "data": '{"restart": 1, "attempt_floor": 1}'})})
    runner._commit({"steps": steps(1, 72, 73)})  # the restart's own attempt: not the rollback's
    assert storage.issued == []  # nothing issued twice: the same command goes to the new round
    assert not any(f.get("status") == "done" for _, f in storage.updates)

    runner._commit({"events": events({"rank": 0, "kind": "command_ack", "data": '{"command_id": 5, "status": "done"}'},
                                     {"rank": 1, "kind": "command_ack", "data": '{"command_id": 5, "status": "done"}'}),
                    "steps": steps(2, 61, 62)})
    done = [f for _, f in storage.updates if f.get("status") == "done"]
    assert len(done) == 1 and done[0]["attempt"] == 2 and done[0]["detail"]["first_step"] == 61
    assert done[0]["recovery_s"] == 100.0 + 61 - 90.0


def test_a_rollback_carried_out_before_any_restart_is_done_at_its_attempt():
    storage = FakeStorage()
    runner = PolicyRunner(storage, Policy(load_rules()), subscription=None, watch=FakeWatch())
    d = Decision(kind="rollback", run_id=RUN, reason="nan", incident_id=3, args={"step": 40})
    runner._follow(d, 7, 50.0, 0)(4, None)
    runner._refresh_run(RUN)
    runner._commit({"events": events({"rank": 0, "kind": "command_ack", "data": '{"command_id": 7, "status": "done"}'}),
                    "steps": steps(1, 31)})
    assert storage.issued == []
    done = [f for _, f in storage.updates if f.get("status") == "done"]
    assert len(done) == 1 and done[0]["attempt"] == 1


class ActingStorage(FakeStorage):
    """FakeStorage that also records actions (each gets the next id), for decisions carried out."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[tuple[str, str, dict]] = []

    def record_action(self, run_id, kind, status, *, done=None, **fields):
        self.actions.append((kind, status, fields))
        if done is not None:
            done(len(self.actions), None)


def _divergence(iid: int, opened_ts: float, **ev) -> dict:
    evidence = {"shard": "pp00-tp00", "majority": True, "src_dp": 0, "divergent_ranks": [1],
                "caught_within_steps": 10, "checksum_every": 10, "suspect_nodes": ["node0"],
                "first_disagreeing_step": 30, **ev}
    return {"id": iid, "run_id": RUN, "kind": "replica_divergence", "status": "open", "rank": 1, "node": "node0",
            "step_from": 20, "step_to": 30, "opened_ts": opened_ts, "evidence": evidence}


def test_a_repair_held_back_by_the_cooldown_is_asked_again_on_the_tick():
    now = [100.0]
    storage = ActingStorage()
    runner = PolicyRunner(storage, Policy(load_rules()), subscription=None, watch=FakeWatch(), clock=lambda: now[0])
    cooldown = runner.policy.cfg.cooldown_s
    runner._incident(_divergence(1, 100.0))  # repaired at once
    assert [k for k, _ in storage.issued] == ["repair"]
    now[0] = 101.0
    second = _divergence(2, 101.0, shard="pp00-tp01")  # another replica corrupted: within the cooldown
    runner._incident(second)
    assert [k for k, _ in storage.issued] == ["repair"] and 2 in runner._deferred
    now[0] = 100.0 + cooldown / 2
    runner._tick()
    assert [k for k, _ in storage.issued] == ["repair"]  # still cooling: waits
    now[0] = 100.0 + cooldown + 0.1
    runner._tick()
    assert [k for k, _ in storage.issued] == ["repair", "repair"]
    assert storage.issued[1][1]["incident_id"] == 2 and 2 not in runner._deferred
    now[0] += 60.0
    runner._tick()  # decided once
    assert len(storage.issued) == 2
    # each counted against node0: the second reaches transient_limit, and its isolation is
    # refused here (node1 is isolated already: min_nodes)
    assert [(k, s, f["detail"].get("faults")) for k, s, f in storage.actions] == [
        ("repair", "issued", {"node0": 1}), ("repair", "issued", {"node0": 2}), ("isolate", "refused", None)]


def test_a_deferred_divergence_that_closed_is_dropped():
    now = [100.0]
    storage = ActingStorage()
    runner = PolicyRunner(storage, Policy(load_rules()), subscription=None, watch=FakeWatch(), clock=lambda: now[0])
    runner._incident(_divergence(1, 100.0, majority=False, src_dp=None, suspect_nodes=["node0", "node1"]))
    assert [k for k, _ in storage.issued] == ["rollback"]
    now[0] = 101.0
    runner._incident(_divergence(2, 101.0, shard="pp00-tp01", majority=False, src_dp=None))
    assert 2 in runner._deferred  # a rollback waiting out the cooldown
    runner._incident({**_divergence(2, 101.0, shard="pp00-tp01"), "status": "closed"})
    assert 2 not in runner._deferred
    now[0] = 200.0
    runner._tick()
    assert [k for k, _ in storage.issued] == ["rollback"]


def test_a_taint_holds_the_watermark_until_its_rollback_is_done_and_a_shadow_one_not_at_all():
    """A spike closes in the analysis once the loss is back, maybe before the policy acted:
    its hold (placed by the detection runner) keeps the known-good watermark below it
    until the rollback's new attempt runs; a decision to do nothing releases it at once."""
    storage = ActingStorage()
    marks = storage.watermarks
    runner = PolicyRunner(storage, Policy(load_rules()), subscription=None, watch=FakeWatch())
    runner._refresh_run(RUN)
    marks.set(RUN, (0, 80, 80))
    marks.hold(RUN, "loss_spike#1", 70)
    spike = {"id": 3, "run_id": RUN, "kind": "loss_spike", "status": "closed", "rank": None, "node": None,
             "step_from": 70, "step_to": 70, "opened_ts": 100.0, "cause_key": "loss_spike#1",
             "evidence": {"peak": {"step": 70, "value": 11.0, "baseline": 2.8}}}
    runner._incident(spike)
    assert [k for k, _ in storage.issued] == ["rollback"]
    assert storage.issued[0][1]["known_good_step"] == 69  # the checkpoint it restores: at or below it
    assert marks.get(RUN) == {"attempt": 0, "step": 69, "judged": 69}  # held while the rollback is under way
    runner._incident(spike)  # an update of the same row: still under way
    assert marks.get(RUN) == {"attempt": 0, "step": 69, "judged": 69}
    command_id = storage.next_id
    runner._commit({"events": events(*({"rank": r, "kind": "command_ack",
                                        "data": f'{{"command_id": {command_id}, "status": "done"}}'} for r in (0, 1))),
                    "steps": steps(1, 61)})
    assert marks.held(RUN) == {}  # the rollback's attempt runs: its own watermark from here
    marks.set(RUN, (1, 60, 60))
    assert marks.get(RUN) == {"attempt": 1, "step": 60, "judged": 60}

    shadow = ActingStorage()
    runner = PolicyRunner(shadow, Policy(load_rules(), mode="shadow"), subscription=None, watch=FakeWatch())
    runner._refresh_run(RUN)
    shadow.watermarks.set(RUN, (0, 80, 80))
    shadow.watermarks.hold(RUN, "loss_spike#1", 70)
    runner._incident(spike)
    assert [(k, st) for k, st, _ in shadow.actions] == [("rollback", "shadow")]
    assert shadow.watermarks.get(RUN) == {"attempt": 0, "step": 80, "judged": 80}


def test_a_detection_that_starts_over_keeps_the_policys_holds():
    """After a gap the analysis starts over and knows nothing of the spike it had found: the
    policy's rollback for it is still under way, so its hold stays until the policy releases it."""
    marks = Watermarks(hold_for_policy=True)
    marks.set(RUN, (0, 80, 80))
    marks.hold(RUN, "loss_spike#1", 70)
    marks.forget(RUN)
    assert marks.get(RUN) is None  # unknown until the next pass
    marks.set(RUN, (0, 95, 95))  # the fresh analysis' own view
    assert marks.get(RUN) == {"attempt": 0, "step": 69, "judged": 69}
    marks.release(RUN, "loss_spike#1")
    assert marks.get(RUN) == {"attempt": 0, "step": 95, "judged": 95}


def test_a_verdict_read_after_the_spike_came_back_still_makes_it_a_recurrence():
    """Seen in CI: the collector opened the spike that came back (at 102.5) before it read the
    verdict that had skipped its forerunner's batch (reached at 102.0, read at 103.0). The
    verdict counts from when the trainer reached it: the spike is a recurrence and stops the run."""
    import json

    now = [100.0]
    storage = ActingStorage()
    storage.update_incident = lambda *a, **k: None
    runner = PolicyRunner(storage, Policy(load_rules()), subscription=None, watch=FakeWatch(), clock=lambda: now[0])
    spike = {"id": 1, "run_id": RUN, "kind": "loss_spike", "status": "open", "rank": None, "node": None,
             "step_from": 40, "step_to": 40, "opened_ts": 100.0, "evidence": {}}
    runner._incident(spike)
    now[0] = 102.5
    runner._incident({**spike, "id": 2, "step_from": 43, "step_to": 43, "opened_ts": 102.5})  # waits: cooldown
    now[0] = 103.0
    verdict = {"incident_id": 1, "incident_kind": "loss_spike", "verdict": "data", "rank": None,
               "probe": {"kind": "loss_spike", "step": 40}, "evidence": "reproduced"}
    runner._commit({"events": events({"rank": 0, "ts": 102.0, "kind": "rerun_verdict", "data": json.dumps(verdict)})})
    runner._tick()
    assert [(k, s) for k, s, _ in storage.actions] == [("rollback", "issued"), ("rollback", "refused"),
                                                       ("stop", "issued")]


def test_a_crash_restart_whose_job_went_on_is_not_pending_for_the_next_real_restart():
    """Ranks that stalled long enough to look dead (heartbeats silent) came back: the crash's restart
    never happened, and the job went on in the same attempt. After 8 new steps the restart is no longer
    pending (`failed`, not needed); the next real restart is not taken for it."""
    storage = FakeStorage()
    runner = PolicyRunner(storage, Policy(load_rules()), subscription=None, watch=FakeWatch(), clock=lambda: 1195.0)
    d = Decision(kind="restart", run_id=RUN, reason="crash on node1", incident_id=5, node="node1")
    runner._follow(d, None, 1190.0, 0)(6, None)  # action 6, decided during attempt 0 (steps ts = 100 + step)
    runner._refresh_run(RUN)
    runner._commit({"steps": steps(0, *range(1096, 1100))})  # four steps on: not yet
    assert storage.updates == []
    runner._commit({"steps": steps(0, *range(1100, 1106))})
    [(action, fields)] = storage.updates
    assert action == 6 and fields["status"] == "failed" and "not needed: no rank exited" in fields["detail"]["outcome"]
    runner._commit({"events": events({"rank": 0, "kind": "run_started", "data": '{"restart": 1, "attempt_floor": 1}'}),
                    "steps": steps(1, 1486, 1487)})  # a later, real crash's restart
    assert len(storage.updates) == 1  # the earlier restart is not done by it
