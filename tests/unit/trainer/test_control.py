"""The control layer: one command per step boundary agreed by every rank (rank 0
decides, a broadcast carries it), and the handlers' guards, acks and work, run
against fakes of the comm, the agent, the checkpointer and the loader."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from agent.agent import Command
from trainer.control import (
    MAX_COMMAND_BYTES,
    AgreedCommand,
    CommandChannel,
    Failed,
    Handler,
    IsolateHandler,
    Outcome,
    RollbackHandler,
    RunContext,
    decode_command,
    default_handlers,
    encode_command,
)
from trainer.diagnosis import ProbePlan
from trainer.membership import EXIT_RESTART, MEMBERSHIP_FILE, read_membership, record_isolation
from trainer.parallel_dims import Axis

# -- fakes -----------------------------------------------------------------------

class Wire:
    """The world's broadcasts, matched by order as collectives are: the n-th broadcast
    of rank 0 lands in every other rank's n-th buffer at wait()."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []  # rank 0's buffers, in order
        self.num_broadcasts = 0
        self.peers: list[list[int]] = []  # what the other ranks offer to an all-reduce (MIN), one list each


class FakeComm:
    def __init__(self, wire: Wire, rank: int, calls: list | None = None) -> None:
        self.wire, self.rank, self.calls = wire, rank, calls if calls is not None else []
        self.num_posted = 0

    def broadcast(self, buf, axis, async_op=False):
        assert axis is Axis.WORLD and async_op
        self.wire.num_broadcasts += 1
        seq, self.num_posted = self.num_posted, self.num_posted + 1
        if self.rank == 0:
            self.wire.sent.append(buf)
        wire, me = self.wire, buf

        class Handle:
            def wait(self):
                if me is not wire.sent[seq]:
                    me.copy_(wire.sent[seq])
        return Handle()

    device = torch.device("cpu")

    def barrier(self, axis):
        self.calls.append(("barrier", axis))

    def all_reduce(self, tensor, axis, *, op):
        assert axis is Axis.WORLD and op == torch.distributed.ReduceOp.MIN
        self.calls.append(("all_reduce", tensor.tolist()))
        for offer in self.wire.peers:
            torch.minimum(tensor, torch.tensor(offer, dtype=tensor.dtype), out=tensor)


class FakeAgent:
    def __init__(self) -> None:
        self.mailbox: list[Command] = []
        self.acks: list[tuple[str, str, str]] = []
        self.events: list[tuple[str, dict]] = []
        self.watermark: int | None = None  # clean_through(): None, no collector's answer

    def clean_through(self):
        return self.watermark

    def commands(self) -> list[Command]:
        out, self.mailbox = self.mailbox, []
        return out

    def ack(self, command_id, status, detail=""):
        self.acks.append((command_id, status, detail))

    def event(self, kind, step=-1, **data):
        self.events.append((kind, {"step": step, **data}))


def two_ranks(handlers=None):
    wire = Wire()
    agents = [FakeAgent(), FakeAgent()]
    chans = [CommandChannel(FakeComm(wire, r), agents[r], rank=r, device=torch.device("cpu"),
                            handlers=handlers or default_handlers()) for r in (0, 1)]
    return wire, agents, chans


def deliver(agents, *cmds):
    for a in agents:
        a.mailbox.extend(Command(c.id, c.kind, dict(c.args)) for c in cmds)


def post_both(chans):
    chans[0].post()  # rank 0 posts first, then rank 1; both take after
    chans[1].post()


# -- the payload -------------------------------------------------------------------

def test_a_command_round_trips_through_its_payload():
    cmd = AgreedCommand(id="c1", kind="rollback", args={"step": 40, "rank": 2, "loss_above": 3.5, "x": [1, "a"]})
    payload = encode_command(cmd)
    assert len(payload) == MAX_COMMAND_BYTES
    assert decode_command(payload) == cmd


def test_no_command_is_an_empty_payload():
    payload = encode_command(None)
    assert payload == bytes(MAX_COMMAND_BYTES)
    assert decode_command(payload) is None


def test_a_command_over_the_limit_is_refused_not_cut():
    overhead = len(json.dumps({"id": "c", "kind": "k", "args": {"b": ""}}, separators=(",", ":")))
    room = MAX_COMMAND_BYTES - 4 - overhead  # 4: the length header
    fits = AgreedCommand("c", "k", {"b": "x" * room})
    assert decode_command(encode_command(fits)) == fits
    with pytest.raises(ValueError, match="over 4096"):
        encode_command(AgreedCommand("c", "k", {"b": "x" * (room + 1)}))
    with pytest.raises(ValueError):
        encode_command(AgreedCommand("c", "k", {"v": float("nan")}))  # JSON has no NaN


# -- agreement ---------------------------------------------------------------------

def test_every_rank_takes_the_command_rank_0_picked():
    wire, agents, chans = two_ranks()
    deliver(agents, Command("c1", "checkpoint", {"why": "test"}))
    post_both(chans)
    got = [ch.take() for ch in chans]
    assert got == [AgreedCommand("c1", "checkpoint", {"why": "test"})] * 2
    assert wire.num_broadcasts == 2
    assert [ch.take() for ch in chans] == [None, None]  # taken once
    assert agents[0].acks == agents[1].acks == []


def test_no_command_posts_an_empty_broadcast():
    _, _, chans = two_ranks()
    post_both(chans)
    assert [ch.take() for ch in chans] == [None, None]


def test_an_unknown_kind_is_rejected_on_every_rank():
    _, agents, chans = two_ranks()
    deliver(agents, Command("c9", "frobnicate"))
    post_both(chans)
    assert [ch.take() for ch in chans] == [None, None]
    for a in agents:
        [(cid, status, detail)] = a.acks
        assert (cid, status) == ("c9", "rejected")
        assert "no 'frobnicate' handler" in detail and "checkpoint, isolate, rebalance, repair, rollback, stop" in detail


def test_only_rank_0_picks_and_a_second_command_waits_for_the_next_boundary():
    _, agents, chans = two_ranks()
    deliver(agents, Command("c1", "checkpoint"), Command("c2", "stop"))
    post_both(chans)
    assert [ch.take().id for ch in chans] == ["c1", "c1"]
    post_both(chans)  # the next step boundary: the one that waited
    assert [ch.take().id for ch in chans] == ["c2", "c2"]
    assert agents[0].acks == [] and agents[1].acks == []  # nothing refused: both are carried out


def test_rank_1_follows_the_broadcast_not_its_own_mailbox():
    _, agents, chans = two_ranks()
    agents[0].mailbox.append(Command("c1", "checkpoint"))
    agents[1].mailbox.append(Command("c7", "stop"))  # arrived on rank 1 only (or in another order)
    post_both(chans)
    assert [ch.take().id for ch in chans] == ["c1", "c1"]


def test_arguments_too_big_are_rejected_by_rank_0_and_the_next_command_goes():
    _, agents, chans = two_ranks()
    deliver(agents, Command("big", "checkpoint", {"blob": "x" * MAX_COMMAND_BYTES}),
            Command("nan", "checkpoint", {"v": float("nan")}),
            Command("odd", "checkpoint", {"v": object()}),
            Command("ok", "checkpoint"))
    post_both(chans)
    assert [ch.take().id for ch in chans] == ["ok", "ok"]
    assert [(cid, status) for cid, status, _ in agents[0].acks] == [("big", "rejected"), ("nan", "rejected"),
                                                                     ("odd", "rejected")]
    assert all(d.startswith("arguments not carried") for _, _, d in agents[0].acks)
    assert agents[1].acks == []


def test_finish_rejects_a_command_the_run_could_not_act_on():
    _, agents, chans = two_ranks()
    deliver(agents, Command("late", "checkpoint"))
    post_both(chans)
    for ch in chans:
        ch.finish()
    for a in agents:
        assert a.acks == [("late", "rejected", "the run ended before it could act")]
    for ch in chans:
        ch.finish()  # nothing in flight: nothing more
    assert all(len(a.acks) == 1 for a in agents)


def test_finish_leaves_a_command_carried_out_before_the_agent_heard_of_it():
    """Rank 0's agent got the stop first; rank 1 stopped with the broadcast, and its agent
    received the stop after: the end of the run must not refuse what rank 1 just did."""
    wire, agents, chans = two_ranks()
    hs = [make_ctx(None, rank=r, agent=agents[r], ckpt=False) for r in (0, 1)]
    deliver(agents[:1], Command("s", "stop"))
    post_both(chans)
    assert all(ch.step_boundary(h.ctx, 9).stop for ch, h in zip(chans, hs))
    deliver(agents[1:], Command("s", "stop"), Command("late", "checkpoint"))
    for ch in chans:
        ch.finish()
    assert [(c, s) for c, s, _ in agents[0].acks] == [("s", "done")]
    assert [(c, s) for c, s, _ in agents[1].acks] == [("s", "done"), ("late", "rejected")]


# -- the end of a run -------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def end_both(chans, hs, *, ready, wait_s=30.0):
    """Every rank after the same last boundary: rank 0 decides (it never blocks: the fake wire
    hands its broadcasts on in order), then rank 1 follows the same broadcasts."""
    clocks = [Clock() for _ in chans]  # each rank's own; rank 0's is returned
    for ch, h in zip(chans, hs):
        ch.step_boundary(h.ctx, 9)
    return [ch.await_end(h.ctx, 9, ready=ready, wait_s=wait_s, clock=c, sleep=c.sleep)
            for ch, h, c in zip(chans, hs, clocks)], clocks[0]


def test_the_end_waits_for_the_verdict_on_the_last_step():
    _, agents, chans = two_ranks()
    hs = [make_ctx(None, rank=r, agent=agents[r]) for r in (0, 1)]
    polls = []
    outs, clock = end_both(chans, hs, ready=lambda: polls.append(1) or len(polls) >= 3)
    assert outs == [None, None] and len(polls) == 3  # rank 0 alone asked, until the collector had judged it
    assert 0.15 <= clock.now <= 0.25
    assert all(a.acks == [] for a in agents)
    for ch in chans:
        ch.finish()  # the end's own broadcast is nobody's command
    assert all(a.acks == [] for a in agents)


def test_a_command_while_waiting_is_carried_out_by_every_rank_and_the_run_goes_on():
    _, agents, chans = two_ranks()
    hs = [make_ctx(None, rank=r, agent=agents[r]) for r in (0, 1)]
    polls = []

    def ready():
        polls.append(1)
        if len(polls) == 2:  # the collector's answer: the last steps spiked, roll back
            deliver(agents, Command("c", "checkpoint"))
        return False

    outs, _ = end_both(chans, hs, ready=ready)
    assert [o.detail for o in outs] == ["checkpoint of step 9 queued"] * 2
    assert all(a.acks == [("c", "done", "checkpoint of step 9 queued")] for a in agents)


def test_without_a_verdict_the_end_waits_no_longer_than_its_bound():
    _, agents, chans = two_ranks()
    hs = [make_ctx(None, rank=r, agent=agents[r]) for r in (0, 1)]
    outs, clock = end_both(chans, hs, ready=lambda: False, wait_s=2.0)
    assert outs == [None, None] and 2.0 <= clock.now <= 2.2
    _, agents, chans = two_ranks()
    hs = [make_ctx(None, rank=r, agent=agents[r]) for r in (0, 1)]
    outs, clock = end_both(chans, hs, ready=lambda: False, wait_s=0.0)
    assert outs == [None, None] and clock.now == 0.0  # a collector whose policy would not act: no wait


# -- the step boundary -----------------------------------------------------------

@dataclass
class State:
    step: int = 10
    attempt: int = 0
    position: Any = "pos@10"
    stopped: bool = False


class FakeLoader:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def seek(self, position, step):
        self.calls.append(("seek", position, step))

    def swap_at(self, step, shift):
        self.calls.append(("swap_at", step, shift))

    shares = (2, 2)

    def rebalance(self, shares):
        self.calls.append(("rebalance", shares))
        self.shares = tuple(shares) if shares is not None else (2, 2)
        return self.shares


@dataclass
class Loaded:
    step: int
    path: Path
    meta: dict


class FakeCkpt:
    def __init__(self, calls: list, loaded: Loaded | None) -> None:
        self.calls, self.loaded = calls, loaded

    def load_latest(self, before_step=None):
        self.calls.append(("load_latest", before_step))
        return self.loaded

    def wait(self, timeout=None):
        self.calls.append(("wait",))
        return True


@dataclass
class Harness:
    ctx: RunContext
    calls: list = field(default_factory=list)
    logs: list = field(default_factory=list)


def make_ctx(tmp_path: Path | None, *, dp: int = 2, rank: int = 0, ckpt: bool = True, step: int = 10,
             attempt: int = 0, loaded_attempt: int = 2, loaded: bool = True, agent=None, comm=None) -> Harness:
    calls: list = []
    logs: list = []
    state = State(step=step, attempt=attempt)
    ck_loaded = Loaded(step=4, path=Path("/ck/step_4"),
                       meta={"attempt": loaded_attempt, "data_position": "pos@4", "step": 4}) if loaded else None

    def restore(ld):
        calls.append(("restore", ld.step))
        state.step = int(ld.meta["step"])
        state.position = ld.meta["data_position"]

    ctx = RunContext(cfg=None, dims=SimpleNamespace(dp=dp, rank=rank), comm=comm or FakeComm(Wire(), rank, calls),
                     engine=None, ckpt=FakeCkpt(calls, ck_loaded) if ckpt else None, agent=agent or FakeAgent(),
                     state=state, bad_batches=None, log=logs.append, save=lambda s: calls.append(("save", s)),
                     restore=restore, note_attempt=lambda: calls.append(("note_attempt", state.attempt)),
                     loader=FakeLoader(calls), run_dir=tmp_path)
    return Harness(ctx, calls, logs)


def test_the_step_boundary_runs_the_agreed_command_and_posts_the_next():
    wire, agents, chans = two_ranks()
    hs = [make_ctx(None, rank=r, agent=agents[r]) for r in (0, 1)]
    assert [ch.step_boundary(h.ctx, 5) for ch, h in zip(chans, hs)] == [None, None]  # nothing agreed yet: post
    deliver(agents, Command("c1", "checkpoint"))
    outs = [ch.step_boundary(h.ctx, 6) for ch, h in zip(chans, hs)]  # c1 is read now, broadcast travels
    assert outs == [None, None] and wire.num_broadcasts == 4
    outs = [ch.step_boundary(h.ctx, 7) for ch, h in zip(chans, hs)]  # and acted on here, by both
    assert [o.detail for o in outs] == ["checkpoint of step 7 queued"] * 2
    for a, h in zip(agents, hs):
        assert a.acks == [("c1", "done", "checkpoint of step 7 queued")]
        assert ("save", 7) in h.calls
    assert wire.num_broadcasts == 6  # a plain outcome: the next is posted


def test_the_step_boundary_does_not_post_after_a_stop():
    wire, agents, chans = two_ranks()
    hs = [make_ctx(None, rank=r, agent=agents[r], ckpt=False) for r in (0, 1)]
    deliver(agents, Command("s", "stop"))
    post_both(chans)
    n = wire.num_broadcasts
    outs = [ch.step_boundary(h.ctx, 9) for ch, h in zip(chans, hs)]
    assert all(o.stop and o.exit_code == 0 for o in outs)
    assert all(h.ctx.state.stopped for h in hs)
    assert wire.num_broadcasts == n  # nothing posted: the run ends here
    assert [ch.take() for ch in chans] == [None, None]


def test_the_step_boundary_does_not_post_after_an_exit(tmp_path):
    wire, agents, chans = two_ranks()
    hs = [make_ctx(tmp_path, rank=r, agent=agents[r]) for r in (0, 1)]
    deliver(agents, Command("i", "isolate", {"node": "node1"}))
    post_both(chans)
    n = wire.num_broadcasts
    outs = [ch.step_boundary(h.ctx, 9) for ch, h in zip(chans, hs)]
    assert all(o.exit_code == EXIT_RESTART for o in outs)
    assert wire.num_broadcasts == n


# -- the handlers' guards and acks ---------------------------------------------------

def run(handler: Handler, h: Harness, kind: str, args: dict, step: int = 10, cid: str = "c1") -> Outcome:
    return handler.run(h.ctx, AgreedCommand(cid, kind, args), step)


def test_a_checkpoint_without_a_ckpt_dir_is_rejected():
    h = make_ctx(None, ckpt=False)
    out = run(default_handlers()["checkpoint"], h, "checkpoint", {})
    assert out == Outcome()
    assert h.ctx.agent.acks == [("c1", "rejected", "the run has no --ckpt-dir")]
    assert h.ctx.agent.events == [] and h.calls == []  # not started


@pytest.mark.parametrize("args, reason", [
    ({}, "needs the suspect 'step'"),
    ({"step": 11}, "step 11 has not run yet (the run is at step 10)"),
    ({"step": "5"}, "'step' must be an integer >= 1"),
    ({"step": 0}, "'step' must be an integer >= 1"),
    ({"step": True}, "'step' must be an integer"),
    ({"step": 5.0}, "'step' must be an integer"),
    ({"step": 5, "rank": -1}, "'rank' must be an integer >= 0"),
    ({"step": 5, "incident_id": "x"}, "'incident_id' must be an integer"),
    ({"step": 5, "skip_batches": -2}, "'skip_batches' must be an integer >= 0"),
    ({"step": 5, "loss_above": "big"}, "'loss_above' must be a finite number"),
    ({"step": 5, "loss_above": float("inf")}, "'loss_above' must be a finite number"),
    ({"step": 5, "grad_norm_above": True}, "'grad_norm_above' must be a finite number"),
    ({"step": 5, "diagnose": "yes"}, "'diagnose' must be true or false"),
])
def test_rollback_arguments_are_checked(args, reason):
    h = make_ctx(None)
    out = run(RollbackHandler(), h, "rollback", args)
    assert out == Outcome()
    [(cid, status, detail)] = h.ctx.agent.acks
    assert (cid, status) == ("c1", "rejected") and reason in detail
    assert h.calls == [] and h.ctx.agent.events == []  # nothing loaded, nothing started


def test_a_rollback_without_a_ckpt_dir_is_rejected():
    h = make_ctx(None, ckpt=False)
    run(RollbackHandler(), h, "rollback", {"step": 5})
    assert h.ctx.agent.acks == [("c1", "rejected", "the run has no --ckpt-dir: there is nothing to roll back to")]


def test_a_handler_that_fails_is_acked_failed_and_the_run_goes_on():
    class Broken(Handler):
        kind = "broken"

        def act(self, ctx, cmd, step):
            raise Failed("the disk is full")

    h = make_ctx(None)
    out = run(Broken(), h, "broken", {}, step=8)
    assert out == Outcome()
    assert h.ctx.agent.acks == [("c1", "failed", "the disk is full")]
    assert [k for k, _ in h.ctx.agent.events] == ["command_started"]
    assert h.logs == ["broken command c1 failed at step 8: the disk is full"]


def test_a_handler_that_is_done_acks_done_after_a_started_event():
    class Fine(Handler):
        kind = "fine"

        def act(self, ctx, cmd, step):
            return Outcome()

    h = make_ctx(None)
    run(Fine(), h, "fine", {}, step=8, cid="c5")
    assert h.ctx.agent.events == [("command_started", {"step": 8, "command_id": "c5", "command_kind": "fine"})]
    assert h.ctx.agent.acks == [("c5", "done", "at step 8")]  # no detail: the step


# -- rollback --------------------------------------------------------------------

ROLLBACK_ARGS = {"step": 7, "incident_id": 3, "kind": "loss_spike", "rank": 1, "loss_above": 4.5,
                 "skip_batches": 2}


def test_a_rollback_restores_the_checkpoint_before_the_suspect_step():
    h = make_ctx(None, step=10, attempt=0, loaded_attempt=2)
    out = run(RollbackHandler(), h, "rollback", ROLLBACK_ARGS, step=10, cid="rb")
    assert h.calls == [("all_reduce", [-1]), ("load_latest", 7), ("restore", 4), ("note_attempt", 3),
                       ("seek", "pos@4", 5), ("swap_at", 7, 1)]
    st = h.ctx.state
    assert (st.step, st.attempt, st.position) == (4, 3, "pos@4")  # attempt: max(0, 2) + 1
    assert h.ctx.probe == ProbePlan(incident_id=3, kind="loss_spike", step=7, rank=1, shift=1, loss_above=4.5,
                                    grad_norm_above=None, skip_batches=2)
    rec = h.ctx.recovery
    assert (rec.incident_id, rec.command_id, rec.attempt, rec.past_step) == (3, "rb", 3, 10)
    assert (out.stop, out.exit_code, out.detail) == (False, 0, "restored step 4 as attempt 3")
    assert h.ctx.agent.acks == [("rb", "done", "restored step 4 as attempt 3")]
    started = dict(h.ctx.agent.events)["rollback_started"]
    assert started == {"step": 4, "command_id": "rb", "incident_id": 3, "from_step": 10, "to_step": 4,
                       "suspect_step": 7, "attempt": 3, "checkpoint": "/ck/step_4", "diagnose": True,
                       "swap_shift": 1}
    assert "rerun of step 7 with the replicas swapped" in h.logs[-1]


def test_the_new_attempt_is_above_the_one_that_ran_and_the_checkpoints():
    h = make_ctx(None, attempt=5, loaded_attempt=2)
    run(RollbackHandler(), h, "rollback", {"step": 7})
    assert h.ctx.state.attempt == 6
    h = make_ctx(None, attempt=0, loaded_attempt=0)
    h.ctx.ckpt.loaded.meta.pop("attempt")  # an older checkpoint without one
    run(RollbackHandler(), h, "rollback", {"step": 7})
    assert h.ctx.state.attempt == 1


def test_one_replica_reruns_without_a_swap():
    h = make_ctx(None, dp=1)
    run(RollbackHandler(), h, "rollback", {"step": 7})
    assert not any(c[0] == "swap_at" for c in h.calls)
    assert h.ctx.probe.shift == 0 and h.ctx.probe.kind == "nan"  # the default kind
    assert dict(h.ctx.agent.events)["rollback_started"]["swap_shift"] == 0
    assert "rerun of step 7 (one replica: its samples cannot move)" in h.logs[-1]


def test_a_rollback_without_diagnosis_plans_no_probe_and_no_swap():
    h = make_ctx(None)
    h.ctx.probe = ProbePlan(incident_id=1, kind="nan", step=2, rank=None, shift=1)  # a stale plan
    run(RollbackHandler(), h, "rollback", {"step": 7, "diagnose": False})
    assert h.ctx.probe is None
    assert ("seek", "pos@4", 5) in h.calls and not any(c[0] == "swap_at" for c in h.calls)
    assert dict(h.ctx.agent.events)["rollback_started"]["diagnose"] is False


def test_explicit_nulls_mean_the_defaults():
    h = make_ctx(None)
    run(RollbackHandler(), h, "rollback", {"step": 7, "kind": None, "rank": None, "incident_id": None,
                                           "skip_batches": None, "loss_above": None})
    assert h.ctx.agent.acks[-1][1] == "done"
    assert h.ctx.probe == ProbePlan(incident_id=None, kind="nan", step=7, rank=None, shift=1)


def test_the_rollback_restores_the_newest_known_good_checkpoint_else_the_newest_before_the_incident():
    h = make_ctx(None)
    run(RollbackHandler(), h, "rollback", {"step": 7, "known_good_step": 4})
    assert [c for c in h.calls if c[0] == "load_latest"] == [("load_latest", 5)]
    assert h.ctx.agent.acks[-1][1] == "done"
    h = make_ctx(None)
    h.ctx.ckpt.load_latest = lambda before_step=None: (h.calls.append(("load_latest", before_step)),
                                                       None if before_step < 7 else h.ctx.ckpt.loaded)[1]
    run(RollbackHandler(), h, "rollback", {"step": 7, "known_good_step": 2})
    assert [c for c in h.calls if c[0] == "load_latest"] == [("load_latest", 3), ("load_latest", 7)]
    assert any("no verified checkpoint at or below the known-good step 2" in m for m in h.logs)
    assert h.ctx.agent.acks[-1][1] == "done"
    h = make_ctx(None)
    run(RollbackHandler(), h, "rollback", {"step": 7, "known_good_step": -1})
    assert h.ctx.agent.acks[-1][1] == "rejected"


def test_the_rollback_takes_the_watermark_the_ranks_agree_on_when_they_act_not_the_one_it_was_decided_on():
    """A spike at 40 detected late: the policy decided with the watermark at 29, and by the time
    the ranks acted checkpoint 36 was known-good; restoring 28 redid 8 steps for nothing (CI,
    tests/e2e/test_healing.py). Each rank offers its agent's newer watermark; the least wins."""
    h = make_ctx(None, step=50)
    h.ctx.agent.watermark = 37
    h.ctx.comm.wire.peers = [[36]]  # the other rank heard one answer fewer
    run(RollbackHandler(), h, "rollback", {"step": 40, "known_good_step": 29})
    assert [c for c in h.calls if c[0] in ("all_reduce", "load_latest")] == [("all_reduce", [37]),
                                                                            ("load_latest", 37)]
    assert any("watermark moved from step 29 to 36" in m for m in h.logs)
    # a watermark past the suspect step (its incident is not the watermark's concern) stops below it
    h = make_ctx(None, step=50)
    h.ctx.agent.watermark, h.ctx.comm.wire.peers = 45, [[60]]
    run(RollbackHandler(), h, "rollback", {"step": 40, "known_good_step": 29})
    assert [c for c in h.calls if c[0] in ("all_reduce", "load_latest")] == [("all_reduce", [39]),
                                                                            ("load_latest", 40)]
    # a rank whose agent has heard nothing newer offers the command's
    h = make_ctx(None, step=50)
    h.ctx.agent.watermark, h.ctx.comm.wire.peers = 37, [[29]]
    run(RollbackHandler(), h, "rollback", {"step": 40, "known_good_step": 29})
    assert ("load_latest", 30) in h.calls and not any("moved" in m for m in h.logs)
    # no watermark anywhere (no detection): the newest checkpoint before the suspect step
    h = make_ctx(None, step=50)
    h.ctx.comm.wire.peers = [[12]]
    run(RollbackHandler(), h, "rollback", {"step": 40})
    assert [c for c in h.calls if c[0] in ("all_reduce", "load_latest")] == [("all_reduce", [-1]),
                                                                            ("load_latest", 40)]
    assert h.ctx.agent.acks[-1][1] == "done"


def test_no_checkpoint_before_the_suspect_step_fails_the_rollback():
    h = make_ctx(None, loaded=False)
    out = run(RollbackHandler(), h, "rollback", {"step": 7})
    assert out == Outcome()
    assert h.ctx.agent.acks == [("c1", "failed", "no verified checkpoint before step 7")]
    assert h.calls == [("all_reduce", [-1]), ("load_latest", 7)]  # nothing restored
    assert (h.ctx.state.step, h.ctx.state.attempt, h.ctx.probe, h.ctx.recovery) == (10, 0, None, None)


# -- isolate -----------------------------------------------------------------------

def test_isolate_checkpoints_records_the_node_and_exits_for_a_restart(tmp_path):
    h = make_ctx(tmp_path, rank=0)
    out = run(IsolateHandler(), h, "isolate", {"node": "node1", "reason": "device", "incident_id": 4}, step=12,
              cid="iso")
    assert (out.stop, out.exit_code) == (True, EXIT_RESTART)
    assert h.calls == [("save", 12), ("wait",), ("barrier", Axis.WORLD)]
    [row] = read_membership(tmp_path)["isolated"]
    assert {k: row[k] for k in ("node", "reason", "incident_id", "step", "command_id")} == {
        "node": "node1", "reason": "device", "incident_id": 4, "step": 12, "command_id": "iso"}
    assert h.ctx.agent.acks == [("iso", "done", "node1 isolated at step 12; restarting without it")]


def test_only_rank_0_writes_the_membership_file(tmp_path):
    h = make_ctx(tmp_path, rank=1, ckpt=False)
    out = run(IsolateHandler(), h, "isolate", {"node": "node1"})
    assert out.exit_code == EXIT_RESTART
    assert h.calls == [("barrier", Axis.WORLD)]  # no checkpointer: no save; the barrier all the same
    assert not (tmp_path / MEMBERSHIP_FILE).exists()


@pytest.mark.parametrize("args, run_dir, reason", [
    ({}, True, "needs the 'node'"),
    ({"node": ""}, True, "needs the 'node'"),
    ({"node": 3}, True, "needs the 'node'"),
    ({"node": "node1"}, False, "no run dir"),
])
def test_isolate_guards(tmp_path, args, run_dir, reason):
    h = make_ctx(tmp_path if run_dir else None)
    assert run(IsolateHandler(), h, "isolate", args) == Outcome()
    [(_, status, detail)] = h.ctx.agent.acks
    assert status == "rejected" and reason in detail
    assert h.calls == []


def test_the_membership_file_appends_each_node_once(tmp_path):
    record_isolation(tmp_path, node="node1", reason="a", incident_id=1, step=3, command_id="x")
    record_isolation(tmp_path, node="node1", reason="b", incident_id=2, step=4, command_id="y")
    record_isolation(tmp_path, node="node2", reason="c", incident_id=None, step=5, command_id="z")
    rows = read_membership(tmp_path)["isolated"]
    assert [(r["node"], r["reason"]) for r in rows] == [("node1", "a"), ("node2", "c")]
    assert not (tmp_path / "membership.tmp").exists()


@pytest.mark.parametrize("text", [None, "{", "[]", '{"isolated": 3}', '"x"'])
def test_a_missing_or_corrupt_membership_file_reads_as_empty(tmp_path, text):
    if text is not None:
        (tmp_path / MEMBERSHIP_FILE).write_text(text)
    assert read_membership(tmp_path) == {"isolated": []}


def test_a_handler_runs_against_the_real_agent_signature():
    # Agent.event(kind, step=-1, **data): the event's data must not reuse the name `kind`
    from agent.noop import NoopAgent

    h = make_ctx(None, agent=NoopAgent())
    out = run(default_handlers()["checkpoint"], h, "checkpoint", {}, step=3)
    assert out.detail == "checkpoint of step 3 queued" and h.calls == [("save", 3)]


# -- rebalance ---------------------------------------------------------------------------


def rebalance_ctx(*, dp: int = 2, tp: int = 1, pp: int = 1, agent=None, shares=None) -> Harness:
    h = make_ctx(None, dp=dp, agent=agent)
    h.ctx.dims = SimpleNamespace(dp=dp, tp=tp, pp=pp, rank=0, world_size=dp * tp * pp)
    h.ctx.cfg = SimpleNamespace(parallel=SimpleNamespace(shares=shares))
    return h


def test_a_rebalance_gives_the_slow_rank_replica_fewer_micro_batches_and_an_undo_the_jobs_own_split():
    """dp 2 x tp 2: rank 3 is in replica dp 1; 3x slower per micro-batch, it takes 1 of the 4 and its
    peer 3. Every rank derives the same split from the same arguments; ratio 1 undoes it."""
    agent = FakeAgent()
    h = rebalance_ctx(tp=2, agent=agent)
    out = run(default_handlers()["rebalance"], h, "rebalance", {"rank": 3, "ratio": 3.0, "incident_id": 4}, step=20)
    assert out.detail == "micro-batches per replica 3/1 from step 21" and not (out.stop or out.exit_code)
    assert h.calls == [("rebalance", (3, 1))]
    assert agent.acks == [("c1", "done", out.detail)]
    (ev,) = [e for e in agent.events if e[0] == "rebalanced"]
    assert (ev[1]["shares"], ev[1]["previous"], ev[1]["dp"], ev[1]["step"]) == ([3, 1], [2, 2], 1, 20)
    undo = run(default_handlers()["rebalance"], h, "rebalance", {"rank": 3, "ratio": 1.0}, step=40, cid="c2")
    assert h.calls[-1] == ("rebalance", None) and undo.detail == "micro-batches per replica 2/2 from step 41"


@pytest.mark.parametrize("args, dp, reason", [
    ({"rank": 1, "ratio": 2.0}, 1, "needs dp >= 2"),
    ({"rank": 9, "ratio": 2.0}, 2, "must name a rank"),
    ({"ratio": 2.0}, 2, "must name a rank"),
    ({"rank": 1, "ratio": 0.5}, 2, "must lie in"),
    ({"rank": 1, "ratio": "fast"}, 2, "finite number"),
])
def test_rebalance_arguments_are_checked(args, dp, reason):
    agent = FakeAgent()
    h = rebalance_ctx(dp=dp, agent=agent)
    assert run(default_handlers()["rebalance"], h, "rebalance", args) == Outcome()
    (ack,) = agent.acks
    assert ack[1] == "rejected" and reason in ack[2], ack
    assert h.calls == []


def test_an_undo_on_one_replica_is_carried_out_not_refused():
    """After a shrink to dp 1 the undo of an earlier rebalance still arrives: nothing to split, done."""
    h = rebalance_ctx(dp=1)
    out = run(default_handlers()["rebalance"], h, "rebalance", {"rank": 3, "ratio": 1.0})
    assert h.calls == [("rebalance", None)] and "from step 11" in out.detail
