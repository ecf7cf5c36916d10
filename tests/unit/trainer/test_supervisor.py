"""The supervisor: rounds of the job on the nodes that are left, fake processes and
a fake clock (the watch loop's sleeps advance it, so no test waits)."""

from __future__ import annotations

import signal
import stat
from pathlib import Path

import pytest

from tests.unit.trainer.fakes import FakeClock, FakeProc
from trainer import supervisor as sup
from trainer.config import AlertReceivers, CheckpointConfig, HealingConfig, JobConfig, ParallelConfig, TelemetryConfig
from trainer.membership import EXIT_RESTART, record_isolation
from trainer.supervisor import (
    ATTEMPT_FLOOR_ENV,
    HW_RANK_ENV,
    NODE_NAMES_ENV,
    ORIG_WORLD_ENV,
    RESTART_ROUND_ENV,
    SPARES_ENV,
    Layout,
    Supervisor,
    attempt_high_water,
    first_layout,
    layout_config,
    shrink,
    write_attempt,
)


class FakeWatch:
    """The collector's isolations as NodeWatch reports them."""

    def __init__(self, isolated: dict[str, str] | None = None, *, on_poll: dict[str, str] | None = None,
                 decided: bool = False) -> None:
        self._isolated = dict(isolated or {})
        self.on_poll = on_poll  # what a poll finds (the crash decision polls)
        self.decided = decided  # whether the policy has recorded its answer to the crash
        self.num_polls = 0

    def decided_since(self, ts: float, taken=frozenset()) -> set[int]:
        return {1} - set(taken) if self.decided else set()

    def stopped_since(self, ts: float, taken=frozenset()):
        return None

    def isolated(self) -> dict[str, str]:
        return dict(self._isolated)

    def poll_once(self) -> None:
        self.num_polls += 1
        if self.on_poll:
            self._isolated.update(self.on_poll)


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(sup, "time", c)
    return c


def job(tmp_path: Path, *, nodes: int = 3, dp: int = 3, tp: int = 1, pp: int = 1, micro_batches: int = 2,
        ckpt: bool = True, telemetry: bool = True, **healing) -> JobConfig:
    return JobConfig(parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, nodes=nodes, micro_batches=micro_batches),
                     ckpt=CheckpointConfig(dir=str(tmp_path / "ckpt") if ckpt else None), run_id="run-1",
                     telemetry=TelemetryConfig(enabled=telemetry),
                     healing=HealingConfig(**{"policy": "auto", **healing}))


class Rounds:
    """A spawn that hands out one list of FakeProcs per round and records what it was given."""

    def __init__(self, *rounds, before=None) -> None:
        self.rounds = list(rounds)
        self.before = before or {}  # round -> a callable run at its spawn (what the ranks write)
        self.seen: list[tuple[JobConfig, Layout, int, list[dict]]] = []
        self.supervisor: Supervisor | None = None

    def __call__(self, cfg, layout, round_):
        envs = [self.supervisor.rank_env(layout, r, round_) for r in range(layout.world_size)]
        self.seen.append((cfg, layout, round_, envs))
        if round_ in self.before:
            self.before[round_]()
        procs = self.rounds[round_]
        return procs() if callable(procs) else procs


def supervise(cfg, tmp_path, rounds: Rounds, **kw) -> tuple[Supervisor, list[str]]:
    logs: list[str] = []
    s = Supervisor(cfg, tmp_path, spawn=rounds, log=logs.append, **kw)
    rounds.supervisor = s
    return s, logs


def procs(n, code, polls=1):
    return lambda: [FakeProc(code, polls) for _ in range(n)]


# -- layouts -------------------------------------------------------------------------

def test_shrinking_keeps_the_global_batch_where_it_divides(tmp_path):
    cfg = job(tmp_path)
    first = first_layout(cfg)
    assert (first.nodes, first.hw_index, first.per_node, first.dp, first.micro_batches) == (
        ("node0", "node1", "node2"), (0, 1, 2), 1, 3, 2)
    new = shrink(cfg, first, {"node1"})
    assert (new.nodes, new.hw_index, new.dp, new.micro_batches, new.note) == (("node0", "node2"), (0, 2), 2, 3, "")
    assert new.dp * new.micro_batches == first.dp * first.micro_batches  # 24 samples of 4 either way
    assert [new.hw_rank(r) for r in range(new.world_size)] == [0, 2]
    assert [new.node_of(r) for r in range(new.world_size)] == ["node0", "node2"]


def test_shrinking_keeps_the_micro_batches_and_says_so_when_it_does_not_divide(tmp_path):
    cfg = job(tmp_path, nodes=4, dp=4, micro_batches=1)  # 16 samples do not split over 3 replicas of 4
    new = shrink(cfg, first_layout(cfg), {"node3"})
    assert (new.dp, new.micro_batches) == (3, 1)
    assert "does not split over dp=3" in new.note and "12 samples per step" in new.note


def test_shrinking_keeps_tp_and_maps_each_kept_rank_to_its_hardware(tmp_path):
    cfg = job(tmp_path, nodes=3, dp=3, tp=2)  # 2 ranks per node: one tp group each
    first = first_layout(cfg)
    assert first.per_node == 2 and first.world_size == 6
    new = shrink(cfg, first, {"node0"})
    assert (new.nodes, new.hw_index, new.dp, new.world_size) == (("node1", "node2"), (1, 2), 2, 4)
    assert [new.hw_rank(r) for r in range(4)] == [2, 3, 4, 5]
    again = shrink(cfg, new, {"node2"})  # the hardware identity survives a second shrink
    assert (again.nodes, [again.hw_rank(r) for r in range(2)], again.dp, again.micro_batches) == (
        ("node1",), [2, 3], 1, 6)


def test_no_layout_fits_a_model_that_no_longer_divides_the_ranks(tmp_path):
    cfg = job(tmp_path, nodes=6, dp=3, pp=2)  # a pipeline across nodes: 5 ranks cannot hold whole replicas
    with pytest.raises(ValueError, match="cannot hold whole tp x pp = 2"):
        shrink(cfg, first_layout(cfg), {"node5"})
    with pytest.raises(ValueError, match="no node is left"):
        shrink(cfg, first_layout(cfg), {f"node{i}" for i in range(6)})


def test_a_round_config_is_a_copy_on_the_layout(tmp_path):
    cfg = job(tmp_path)
    cfg.telemetry.alerts = AlertReceivers(webhooks=("https://hook",))
    new_layout = shrink(cfg, first_layout(cfg), {"node1"})
    new = layout_config(cfg, new_layout)
    assert (new.parallel.dp, new.parallel.nodes, new.parallel.micro_batches, new.parallel.tp) == (2, 2, 3, 1)
    assert new.parallel.world_size == new_layout.world_size
    assert new.telemetry.alerts.webhooks == ("https://hook",)  # kept, though never serialised
    assert (new.run_id, new.ckpt.dir, new.healing.policy) == (cfg.run_id, cfg.ckpt.dir, "auto")
    assert (cfg.parallel.dp, cfg.parallel.nodes, cfg.parallel.micro_batches) == (3, 3, 2)  # untouched


def test_the_attempt_high_water_only_rises(tmp_path):
    assert attempt_high_water(tmp_path) == 0
    write_attempt(tmp_path, 3)
    write_attempt(tmp_path, 2)
    assert attempt_high_water(tmp_path) == 3
    write_attempt(tmp_path, 5)
    assert attempt_high_water(tmp_path) == 5
    for text in ("{", "[]", '{"attempt": "x"}', "{}", '{"attempt": null}'):
        (tmp_path / sup.ATTEMPT_FILE).write_text(text)
        assert attempt_high_water(tmp_path) == 0


# -- one round (the launcher's reports) ------------------------------------------------

def test_every_exit_is_reported_once_in_the_order_seen(tmp_path):
    seen = []
    cfg = job(tmp_path, nodes=1, dp=3)
    s, _ = supervise(cfg, tmp_path, Rounds([FakeProc(0, polls=p) for p in (1, 3, 2)]),
                     on_exit=lambda r, c, cause: seen.append((r, c, cause)))
    assert s.run() == 0
    assert seen == [(0, 0, "exited"), (2, 0, "exited"), (1, 0, "exited")]


def test_an_interrupt_stops_the_ranks_and_ends_the_job(tmp_path):
    class Interrupting(FakeProc):
        interrupted = False

        def poll(self):
            if not self.interrupted:  # Ctrl-C lands once, while the supervisor polls
                self.interrupted = True
                raise KeyboardInterrupt
            return super().poll()

    ranks = [FakeProc(None), Interrupting(None)]
    s, _ = supervise(job(tmp_path, nodes=1, dp=2), tmp_path, Rounds(ranks))
    assert s.run() == 130
    assert all(p.signals == [signal.SIGTERM] for p in ranks)


# -- restarts ---------------------------------------------------------------------

def test_ranks_that_leave_for_an_isolation_restart_without_the_node(tmp_path):
    def ranks_isolate_node1():  # what rank 0 writes before every rank exits 75
        write_attempt(tmp_path, 4)
        record_isolation(tmp_path, node="node1", reason="device: the fault stayed", incident_id=9, step=30,
                         command_id="c1")

    rounds = Rounds(procs(3, EXIT_RESTART), procs(2, 0), before={0: ranks_isolate_node1})
    s, logs = supervise(job(tmp_path), tmp_path, rounds)
    assert s.run() == 0
    assert [r for _, _, r, _ in rounds.seen] == [0, 1]
    cfg1, layout1, _, envs1 = rounds.seen[1]
    assert (layout1.nodes, layout1.dp, layout1.micro_batches) == (("node0", "node2"), 2, 3)
    assert (cfg1.parallel.nodes, cfg1.parallel.dp, cfg1.parallel.micro_batches) == (2, 2, 3)
    assert [e[HW_RANK_ENV] for e in envs1] == ["0", "2"]
    assert {e[NODE_NAMES_ENV] for e in envs1} == {"node0,node2"}
    assert {e[ATTEMPT_FLOOR_ENV] for e in envs1} == {"5"}  # above every attempt run so far
    assert {(e[ORIG_WORLD_ENV], e[RESTART_ROUND_ENV]) for e in envs1} == {("3", "1")}
    envs0 = rounds.seen[0][3]
    assert [e[HW_RANK_ENV] for e in envs0] == ["0", "1", "2"] and {e[ATTEMPT_FLOOR_ENV] for e in envs0} == {"0"}
    assert s.restarts == 0  # the ranks left by themselves: not a restart
    assert any("restarting without node1" in m and "dp 3 -> 2" in m for m in logs)


def test_a_crash_restarts_on_the_same_nodes_up_to_max_restarts(tmp_path):
    crash = lambda: [FakeProc(None), FakeProc(1), FakeProc(None)]  # noqa: E731
    rounds = Rounds(crash, crash, crash)
    ends = []
    s, logs = supervise(job(tmp_path, max_restarts=2), tmp_path, rounds, on_end=lambda *a: ends.append(a))
    assert s.run() == 1
    assert len(rounds.seen) == 3 and s.restarts == 2
    assert {layout.nodes for _, layout, _, _ in rounds.seen} == {("node0", "node1", "node2")}
    assert "giving up" in logs[-1]
    assert ends == [("failed", "2 restart(s) done (--max-restarts 2): giving up")]


def test_a_crash_then_a_clean_round_is_a_success(tmp_path):
    write_attempt(tmp_path, 2)
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(-signal.SIGSEGV, polls=3), FakeProc(None)], procs(3, 0))
    s, logs = supervise(job(tmp_path), tmp_path, rounds)
    assert s.run() == 0
    assert s.restarts == 1
    assert {e[ATTEMPT_FLOOR_ENV] for e in rounds.seen[1][3]} == {"3"}
    assert any("rank 1 exited with signal SIGSEGV" in m for m in logs)
    assert any("restarting on the same 3 node(s)" in m for m in logs)


def test_a_crashed_node_the_policy_isolates_is_left_out(tmp_path):
    watch = FakeWatch(on_poll={"node1": "crash #2 on node1"})
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1), FakeProc(None)], procs(2, 0))
    s, _ = supervise(job(tmp_path), tmp_path, rounds, watch=watch)
    assert s.run() == 0
    assert rounds.seen[1][1].nodes == ("node0", "node2")
    assert watch.num_polls == 1


def test_no_isolation_decision_within_the_wait_restarts_on_the_same_nodes(tmp_path, clock):
    watch = FakeWatch(on_poll={"node0": "an isolation of another node"})  # node0 did not crash
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1), FakeProc(None)], procs(3, 0))
    s, _ = supervise(job(tmp_path), tmp_path, rounds, watch=watch)
    assert s.run() == 0
    assert rounds.seen[1][1].nodes == ("node0", "node1", "node2")
    assert clock.slept == pytest.approx(sup.CRASH_DECISION_S, abs=0.25) and watch.num_polls > 1


@pytest.mark.parametrize("policy", ["shadow", "off"])
def test_without_healing_a_failed_rank_ends_the_job(tmp_path, policy):
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1)])
    s, _ = supervise(job(tmp_path, nodes=2, dp=2, policy=policy), tmp_path, rounds,
                     watch=FakeWatch({"node1": "ignored without healing"}))
    assert s.run() == 1
    assert len(rounds.seen) == 1


def test_without_telemetry_there_is_no_policy_and_a_failed_rank_ends_the_job(tmp_path):
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1)])
    s, _ = supervise(job(tmp_path, nodes=2, dp=2, telemetry=False), tmp_path, rounds)
    assert s.run() == 1
    assert len(rounds.seen) == 1


def test_without_healing_the_collector_isolations_are_not_watched(tmp_path):
    rounds = Rounds(procs(2, 0, polls=3))
    s, _ = supervise(job(tmp_path, nodes=2, dp=2, policy="shadow", isolate_grace_s=0.0), tmp_path, rounds,
                     watch=FakeWatch({"node1": "hang"}))
    assert s.run() == 0


def test_a_restart_without_a_ckpt_dir_is_refused(tmp_path):
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1)])
    s, logs = supervise(job(tmp_path, nodes=2, dp=2, ckpt=False), tmp_path, rounds)
    assert s.run() == 1
    assert len(rounds.seen) == 1 and "without --ckpt-dir" in logs[-1]


def test_a_spare_takes_the_isolated_nodes_place_and_the_next_isolation_shrinks(tmp_path):
    """--spare-nodes 1 on 3 nodes: node3 stands by. node1 is isolated: node3 takes its ranks, dp
    and the batch stay, its hardware is new (hw ranks 3.., which no injection names), and the
    ranks are told no spare is left. node0 is isolated next: no spare, the job shrinks."""
    def isolate(node):
        return lambda: record_isolation(tmp_path, node=node, reason="straggler", incident_id=1, step=5,
                                        command_id=f"c-{node}")

    rounds = Rounds(procs(3, EXIT_RESTART), procs(3, EXIT_RESTART), procs(2, 0),
                    before={0: isolate("node1"), 1: isolate("node0")})
    s, logs = supervise(job(tmp_path, min_nodes=2, spare_nodes=1), tmp_path, rounds)
    assert s.run() == 0
    (_, first, _, envs0), (cfg1, second, _, envs1), (_, third, _, _) = rounds.seen
    assert {e[SPARES_ENV] for e in envs0} == {"node3"}
    assert (second.nodes, second.dp, second.micro_batches) == (("node0", "node3", "node2"), 3, 2)
    assert (cfg1.parallel.nodes, cfg1.parallel.dp) == (3, 3)
    assert [e[HW_RANK_ENV] for e in envs1] == ["0", "3", "2"] and {e[SPARES_ENV] for e in envs1} == {""}
    assert {e[NODE_NAMES_ENV] for e in envs1} == {"node0,node3,node2"}
    assert any("spare node3 takes node1's place" in m and "dp 3 kept" in m for m in logs)
    assert (third.nodes, third.dp) == (("node3", "node2"), 2)  # no spare left: shrunk
    assert any("restarting without node0" in m for m in logs)


def test_an_isolation_below_min_nodes_stops_the_job(tmp_path):
    marker = tmp_path / "isolated.txt"
    rounds = Rounds(procs(2, EXIT_RESTART), before={0: lambda: record_isolation(
        tmp_path, node="node1", reason="device", incident_id=1, step=5, command_id="c")})
    s, logs = supervise(job(tmp_path, nodes=2, dp=2, min_nodes=2, on_isolate=f"touch {marker}"), tmp_path, rounds)
    assert s.run() == 1
    assert len(rounds.seen) == 1 and "fewer than --min-nodes 2" in logs[-1]
    assert not marker.exists()  # nothing isolated, nothing announced


def test_a_layout_that_no_longer_fits_stops_the_job(tmp_path):
    rounds = Rounds(procs(6, EXIT_RESTART), before={0: lambda: record_isolation(
        tmp_path, node="node5", reason="device", incident_id=1, step=5, command_id="c")})
    s, logs = supervise(job(tmp_path, nodes=6, dp=3, pp=2), tmp_path, rounds)
    assert s.run() == 1
    assert "cannot restart without node5" in logs[-1]


# -- the collector's isolations ---------------------------------------------------

def test_a_node_the_collector_isolates_is_stopped_after_the_grace_and_left_out(tmp_path):
    stuck = [FakeProc(None) for _ in range(3)]  # hung: they never leave by themselves
    seen = []
    watch = FakeWatch({"node1": "hang: rank 1 stopped entering collectives", "node7": "another layout's"})
    rounds = Rounds(stuck, procs(2, 0))
    s, logs = supervise(job(tmp_path, isolate_grace_s=0.0), tmp_path, rounds, watch=watch,
                        on_exit=lambda r, c, cause: seen.append((r, c, cause)))
    assert s.run() == 0
    assert all(p.signals == [signal.SIGTERM] for p in stuck)
    assert seen[:3] == [(0, 143, "stopped"), (1, 143, "stopped"), (2, 143, "stopped")]
    assert rounds.seen[1][1].nodes == ("node0", "node2")
    assert any("the collector isolated node1" in m for m in logs)


def test_ranks_that_fail_during_the_grace_are_not_a_crash(tmp_path, clock):
    # node1 is isolated; rank 1 dies on its own within the grace, rank 0 waits for it forever
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1, polls=3)], procs(1, 0))
    s, _ = supervise(job(tmp_path, nodes=2, dp=2, isolate_grace_s=1.0), tmp_path, rounds,
                     watch=FakeWatch({"node1": "straggler"}))
    assert s.run() == 0
    assert rounds.seen[1][1].nodes == ("node0",)
    assert clock.slept == pytest.approx(1.0, abs=0.15)  # the fake clock: the grace ran out, then the stop


def test_on_isolate_runs_the_command_with_the_node_and_the_reason(tmp_path):
    out = tmp_path / "isolations.txt"
    script = tmp_path / "on_isolate.sh"
    script.write_text(f'#!/bin/sh\necho "$LLMWATCH_NODE|$LLMWATCH_REASON|$LLMWATCH_RUN_ID" >> "{out}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    rounds = Rounds(procs(3, EXIT_RESTART), procs(2, 0), before={0: lambda: record_isolation(
        tmp_path, node="node2", reason="device: rank 2", incident_id=1, step=5, command_id="c")})
    s, _ = supervise(job(tmp_path, on_isolate=f"sh {script}"), tmp_path, rounds)
    assert s.run() == 0
    assert out.read_text().splitlines() == ["node2|device: rank 2|run-1"]


def test_a_failing_on_isolate_is_logged_and_the_job_goes_on(tmp_path):
    rounds = Rounds(procs(3, EXIT_RESTART), procs(2, 0), before={0: lambda: record_isolation(
        tmp_path, node="node2", reason="device", incident_id=1, step=5, command_id="c")})
    s, logs = supervise(job(tmp_path, on_isolate="echo nope >&2; exit 3"), tmp_path, rounds)
    assert s.run() == 0
    assert any("--on-isolate exited with 3 for node2" in m and "nope" in m for m in logs)


def test_an_elastic_restart_under_torchrun_fits_dp_to_the_ranks_and_keeps_the_global_batch():
    from trainer.supervisor import fit_world

    cfg = JobConfig()
    cfg.parallel.dp, cfg.parallel.micro_batches, cfg.parallel.micro_batch_size = 3, 2, 2
    assert fit_world(cfg, 3) == "" and (cfg.parallel.dp, cfg.parallel.micro_batches) == (3, 2)
    assert "the same global batch" in fit_world(cfg, 2)
    assert (cfg.parallel.dp, cfg.parallel.micro_batches) == (2, 3)
    cfg.parallel.tp = 2
    with pytest.raises(ValueError, match="tp x pp"):
        fit_world(cfg, 3)


def test_the_hardware_rank_comes_from_the_supervisor_or_the_node_index():
    from trainer.worker import hardware_rank

    assert hardware_rank({"LLMWATCH_HW_RANK": "5"}, 1, 2) == 5
    assert hardware_rank({"LLMWATCH_NODE_INDEX": "2", "LOCAL_RANK": "1"}, 0, 2) == 5
    assert hardware_rank({}, 3, 2) == 3


def test_the_spares_reported_are_the_standbys_that_hold_no_ranks_and_were_not_isolated(tmp_path):
    from trainer.worker import spares_left

    env = {"LLMWATCH_SPARE_NODES": "node2,node3,node2"}
    assert spares_left(env, ["node0", "node1"], tmp_path) == ["node2", "node3"]
    # node2 took node1's place (torchrun's standby joined the round), then was isolated in turn
    assert spares_left(env, ["node0", "node2"], tmp_path) == ["node3"]
    record_isolation(tmp_path, node="node2", reason="straggler", incident_id=4, step=90, command_id="c4")
    assert spares_left(env, ["node0", "node3"], tmp_path) == []
    assert spares_left({}, ["node0"], tmp_path) == [] and spares_left(env, ["node0"], None) == ["node2", "node3"]


class DictStore:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value.encode()

    def get(self, key):
        return self.kv[key]


def test_ranks_agree_on_the_restart_round_through_a_fresh_store(monkeypatch):
    from trainer.worker import agree_restart

    store = DictStore()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    store.set("llmwatch/restart_count/1", "0")  # the standby agent's rank: its agent never restarted
    assert agree_restart(store, rank=0, world=2, own=1) == 1
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the agents' shared store: counts agree already
    assert agree_restart(DictStore(), rank=0, world=2, own=3) == 3


def test_a_run_that_finishes_during_the_isolation_grace_is_done(tmp_path):
    watch = FakeWatch({"node1": "straggler"})
    rounds = Rounds(procs(3, 0, polls=3))  # every rank exits 0 while the grace runs
    s, _ = supervise(job(tmp_path, isolate_grace_s=60.0), tmp_path, rounds, watch=watch)
    assert s.run() == 0
    assert len(rounds.seen) == 1  # no empty round restarted for nothing


def test_a_crash_answer_counts_only_if_decided_after_this_crash(tmp_path, clock):
    class Answers(FakeWatch):
        def decided_since(self, ts: float, taken=frozenset()) -> set[int]:
            self.asked.append(ts)
            return set()

    watch = Answers()
    watch.asked = []
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1), FakeProc(None)], procs(3, 0))
    s, _ = supervise(job(tmp_path), tmp_path, rounds, watch=watch)
    assert s.run() == 0
    # rank 1 failed at the first poll, at the fake clock's start: an answer must be newer than
    # that (less a second), not any of the last seconds' (a first crash's restart action)
    assert watch.asked and set(watch.asked) == {1.7e9 + 1000.0 - 1.0}


def test_a_second_crash_does_not_take_the_first_ones_restart_for_its_answer(tmp_path, clock):
    """Seen in CI: node1 crashed twice 0.9 s apart. The first crash's restart action was recorded
    within the second's "less a second" margin, the supervisor took it for the second crash's
    answer, and restarted on node1 before the policy's isolation came. An action is one crash's
    answer only."""
    class Actions(FakeWatch):
        def __init__(self):
            super().__init__()
            self.actions = {1: "restart"}  # the first crash's answer, already recorded

        def decided_since(self, ts, taken=frozenset()):
            return set(self.actions) - set(taken)

        def poll_once(self):
            super().poll_once()
            if self.num_polls >= 6:  # the second crash's answer: an isolation, a little later
                self.actions[2] = "isolate"
                self._isolated["node1"] = "crash #2 on node1"

    watch = Actions()
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1)], lambda: [FakeProc(None), FakeProc(1)], procs(1, 0))
    s, _ = supervise(job(tmp_path, nodes=2, dp=2), tmp_path, rounds, watch=watch)
    assert s.run() == 0
    # the same nodes after the first crash, without node1 after the second
    assert [r[1].nodes for r in rounds.seen] == [("node0", "node1"), ("node0", "node1"), ("node0",)]
    assert s.answers == {1, 2}


def test_the_launcher_imports_no_torch():
    """`python -m trainer` starts, supervises and restarts the ranks: torch is theirs. In the
    launcher its import and teardown (~1.5 s of CPU) would delay every start and end of a job."""
    import subprocess
    import sys

    code = ("import sys, trainer.cli, trainer.launch, trainer.embedded, trainer.embedded_dashboard, "
            "trainer.incident_feed; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_stop_answering_a_crash_ends_the_job_with_the_policys_reason(tmp_path, clock):
    """Restarts that made no progress: the policy answers the crash with a stop (and a refused
    restart, which is no answer), and the job ends instead of restarting into the same crash."""
    class Stopping(FakeWatch):
        def stopped_since(self, ts, taken=frozenset()):
            return None if self.num_polls < 3 else (7, "2 restart(s) in a row made no progress")

    logs, ends = [], []
    rounds = Rounds(lambda: [FakeProc(None), FakeProc(1)], procs(2, 0))
    s, _ = supervise(job(tmp_path, nodes=2, dp=2), tmp_path, rounds, watch=Stopping(),
                     on_end=lambda *a: ends.append(a))
    s.log = logs.append
    assert s.run() == 1
    assert len(rounds.seen) == 1  # no second round
    assert s.stopped == "2 restart(s) in a row made no progress" and 7 in s.answers
    assert any("stopped the run instead of restarting it: 2 restart(s)" in m for m in logs), logs
    # reported, as no rank is left to: the run is not left `running`
    assert ends == [("stopped", "the collector's policy stopped the run instead of restarting it: "
                                "2 restart(s) in a row made no progress")]


def test_the_node_watch_takes_neither_a_refused_nor_a_shadow_action_for_an_answer():
    from trainer.supervisor import NodeWatch

    rows = [{"id": 1, "kind": "restart", "status": "refused", "requested_ts": 10.0},
            {"id": 2, "kind": "restart", "status": "shadow", "requested_ts": 10.0},
            {"id": 3, "kind": "stop", "status": "issued", "requested_ts": 10.0,
             "detail": '{"reason": "no progress", "args": {}}'},
            {"id": 4, "kind": "isolate", "status": "issued", "requested_ts": 10.0},
            {"id": 5, "kind": "restart", "status": "issued", "requested_ts": 5.0}]  # before the crash
    watch = NodeWatch.__new__(NodeWatch)
    watch._actions_path = "/actions"

    class Api:
        def get_json(self, path):
            return rows

    watch._api = Api()
    assert watch.decided_since(9.0) == {4}
    assert watch.stopped_since(9.0) == (3, "no progress")
    assert watch.stopped_since(9.0, {3}) is None
