"""The trainer's control layer: commands from the collector, agreed by every rank,
carried out by handlers registered by name.

Agreement (`CommandChannel`). Every rank's agent receives a run-wide command;
rank 0 decides, one per step boundary, oldest first (the others wait their turn:
a rollback and an isolation decided together both happen). At the end of step s
it encodes the command it picked, id, kind
and arguments as JSON, into a fixed-size byte tensor and starts an async
broadcast over the world; every rank waits for it at the end of step s+1 and
acts on the same command with the same arguments at the same step boundary. The
broadcast travels while step s+1 computes, so the agreement costs no step time;
the price is one step of latency. Arguments are bounded (`MAX_COMMAND_BYTES`):
a command whose arguments do not fit is refused by rank 0, never cut.

The end of a run (`await_end`). A run that finished its steps does not leave at
once: a spike in its last steps would otherwise end it before the rollback lands,
and the final weights are the product. The ranks go on agreeing boundaries
without steps until rank 0's agent says the collector has judged the last step
(its `judged_through`), a command comes (a rollback: training goes on from the
checkpoint) or the collector's `end_wait_s` has passed; rank 0 then broadcasts
the end (`END_KIND`).

Handlers (`Handler`). `run()` is the public entry and owns what every command
shares: the guards (`check`, which refuses with a reason), the acknowledgement
(each rank acks for itself, so the collector sees the command settle only when
every rank did it) and the events. Subclasses do the work in `act()` through a
`RunContext`: the loader, the engine, the checkpointer, the loop state (step,
attempt, data position) and the agent. Whatever a handler decides must be the
same on every rank: it reads only the agreed arguments and state every rank
shares, and the collectives it runs (a checkpoint load) are run by all.

Built in: `checkpoint`, `stop`, `rollback` (restore the newest verified
checkpoint before the incident, continue as attempt + 1, and plan the rerun that
diagnoses it: trainer/diagnosis.py) and `isolate` (checkpoint, record the node in
the run's membership file, trainer/membership.py, exit with `EXIT_RESTART` so that the supervisor
restarts the job without that node) and `repair` (copy a healthy dp replica's
parameters and optimizer state over a corrupted one, in place: trainer/integrity.py) and
`rebalance` (move micro-batches from a slow dp replica to the others, in place, the
global batch unchanged: trainer/data.py `DataLoader.rebalance`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed

from trainer.data import balanced_shares
from trainer.diagnosis import ProbePlan
from trainer.membership import EXIT_RESTART, record_isolation, under_elastic_agent
from trainer.parallel_dims import Axis

MAX_COMMAND_BYTES = 4096
END_KIND = "__end__"  # rank 0's word, at the end of a run, that the wait for the last verdicts is over
END_POLL_S = 0.1  # the end of a run's boundaries without steps: one per this long
_HEADER = struct.Struct("<I")  # payload length, then the JSON bytes


@dataclass(frozen=True, slots=True)
class AgreedCommand:
    id: str
    kind: str
    args: dict[str, Any]


@dataclass(slots=True)
class Outcome:
    """What the loop does after a command: go on, stop, or exit for a restart."""

    detail: str = ""
    stop: bool = False
    exit_code: int = 0


class Refused(Exception):
    """A guard said no (acked `rejected`, with this reason)."""


class Failed(Exception):
    """The handler tried and could not (acked `failed`, with this reason)."""


@dataclass(slots=True)
class Recovery:
    """A rollback in progress: done when a step past `past_step` completes."""

    incident_id: int | None
    command_id: str
    attempt: int
    past_step: int  # the last step the abandoned lineage completed
    started_ts: float


@dataclass(slots=True)
class RunContext:
    """What handlers act on. The loop owns these; a handler changes them in place."""

    cfg: Any  # JobConfig
    dims: Any  # ParallelDims
    comm: Any  # Comm
    engine: Any  # TrainEngine
    ckpt: Any  # Checkpointer | None
    agent: Any
    state: Any  # train.LoopState: step, attempt, position
    bad_batches: Any  # trainer.badbatches.BadBatchList
    log: Callable[[str], None]
    save: Callable[[int], None]  # checkpoint this step (the loop's own save: meta, events)
    restore: Callable[[Any], None]  # load a LoadedCheckpoint into engine, RNG and state
    note_attempt: Callable[[], None]  # after state.attempt changed: the agent's rows and the run dir follow
    node_names: tuple[str, ...] = ()  # this layout's nodes (after a restart, the ones left)
    node: str | None = None  # this rank's own node
    loader: Any = None  # the DataLoader in use (set by the loop)
    probe: ProbePlan | None = None  # the rerun diagnosis planned by a rollback
    recovery: Recovery | None = None
    run_dir: Path | None = None
    checksum_next: bool = False  # take the parameter checksums at the next step (after a repair)


class Handler:
    """One command kind. Subclasses set `kind` and implement `act`; they may add guards
    in `check` (raise Refused)."""

    kind: ClassVar[str] = ""

    def check(self, ctx: RunContext, cmd: AgreedCommand) -> None:
        """Raise Refused(reason) when this command cannot be carried out here."""

    def act(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        raise NotImplementedError

    def run(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        """Guards, the work, the ack and the events: the same on every rank."""
        try:
            self.check(ctx, cmd)
        except Refused as e:
            ctx.agent.ack(cmd.id, "rejected", str(e))
            return Outcome()
        ctx.agent.event("command_started", step=step, command_id=cmd.id, command_kind=cmd.kind)  # `kind` is the event's
        try:
            outcome = self.act(ctx, cmd, step)
        except Failed as e:
            ctx.agent.ack(cmd.id, "failed", str(e))
            ctx.log(f"{cmd.kind} command {cmd.id} failed at step {step}: {e}")
            return Outcome()
        ctx.agent.ack(cmd.id, "done", outcome.detail or f"at step {step}")
        return outcome


def _int_arg(args: dict, key: str, *, default: int | None = None, minimum: int | None = None) -> int | None:
    value = args.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise Refused(f"argument {key!r} must be an integer{f' >= {minimum}' if minimum is not None else ''}")
    return value


def _float_arg(args: dict, key: str) -> float | None:
    value = args.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise Refused(f"argument {key!r} must be a finite number")
    return float(value)


class CheckpointHandler(Handler):
    kind = "checkpoint"

    def check(self, ctx: RunContext, cmd: AgreedCommand) -> None:
        if ctx.ckpt is None:
            raise Refused("the run has no --ckpt-dir")

    def act(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        ctx.save(step)
        return Outcome(f"checkpoint of step {step} queued")


class StopHandler(Handler):
    kind = "stop"

    def act(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        if ctx.ckpt is not None:
            ctx.save(step)
        ctx.log(f"stop requested by the collector at step {step}")
        ctx.state.stopped = True
        return Outcome(f"stopped at step {step}", stop=True)


class RollbackHandler(Handler):
    """Restore the newest verified checkpoint before the suspect step and go on as
    attempt + 1; the suspect step's rerun (replicas swapped) is the diagnosis.

    Arguments: `step` (the incident's first step, required), `incident_id`, `kind`
    (nan, loss_spike, grad_spike), `rank` (the rank the incident named),
    `loss_above` / `grad_norm_above` (what counts as a reproduced spike),
    `skip_batches` (global batches to skip after the suspect one on a data verdict;
    default 0), `diagnose` (default true), `known_good_step` (the collector's
    clean-through watermark when it decided: the checkpoint restored is the newest
    at or below it, else, when none is left, the newest before the suspect step)."""

    kind = "rollback"

    def check(self, ctx: RunContext, cmd: AgreedCommand) -> None:
        if ctx.ckpt is None:
            raise Refused("the run has no --ckpt-dir: there is nothing to roll back to")
        step = _int_arg(cmd.args, "step", minimum=1)
        if step is None:
            raise Refused("rollback needs the suspect 'step'")
        if step > ctx.state.step:
            raise Refused(f"step {step} has not run yet (the run is at step {ctx.state.step})")
        for key in ("incident_id", "rank", "known_good_step"):
            _int_arg(cmd.args, key, minimum=0)
        _int_arg(cmd.args, "skip_batches", default=0, minimum=0)
        _float_arg(cmd.args, "loss_above")
        _float_arg(cmd.args, "grad_norm_above")
        if not isinstance(cmd.args.get("diagnose", True), bool):
            raise Refused("argument 'diagnose' must be true or false")

    def act(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        args = cmd.args
        suspect = int(args["step"])
        known_good = _agreed_known_good(ctx, args.get("known_good_step"), suspect)
        before = suspect if known_good is None else known_good + 1
        loaded = ctx.ckpt.load_latest(before_step=before)  # collective: every rank, same answer
        if loaded is None and before < suspect:
            ctx.log(f"rollback: no verified checkpoint at or below the known-good step {known_good}; "
                    f"taking the newest before step {suspect}")
            loaded = ctx.ckpt.load_latest(before_step=suspect)
        if loaded is None:
            raise Failed(f"no verified checkpoint before step {suspect}")
        past = ctx.state.step
        old_attempt = ctx.state.attempt
        ctx.restore(loaded)
        ctx.state.attempt = max(old_attempt, int(loaded.meta.get("attempt", 0))) + 1
        ctx.note_attempt()
        shift = 1 if ctx.dims.dp > 1 else 0
        kind = str(args.get("kind") or "nan")
        ctx.probe = None
        if args.get("diagnose", True):
            ctx.probe = ProbePlan(incident_id=args.get("incident_id"), kind=kind, step=suspect,
                                  rank=args.get("rank"), shift=shift, loss_above=_float_arg(args, "loss_above"),
                                  grad_norm_above=_float_arg(args, "grad_norm_above"),
                                  skip_batches=int(args.get("skip_batches") or 0))  # null: the default
        ctx.loader.seek(ctx.state.position, ctx.state.step + 1)
        if ctx.probe is not None and shift:
            ctx.loader.swap_at(suspect, shift)
        ctx.recovery = Recovery(incident_id=args.get("incident_id"), command_id=cmd.id, attempt=ctx.state.attempt,
                                past_step=past, started_ts=time.time())
        ctx.agent.event("rollback_started", step=ctx.state.step, command_id=cmd.id,
                        incident_id=args.get("incident_id"), from_step=past, to_step=loaded.step,
                        suspect_step=suspect, attempt=ctx.state.attempt, checkpoint=str(loaded.path),
                        diagnose=ctx.probe is not None, swap_shift=shift)
        rerun = "" if ctx.probe is None else f"; rerun of step {suspect}" + (
            " with the replicas swapped" if shift else " (one replica: its samples cannot move)")
        ctx.log(f"rollback: step {past} -> checkpoint of step {loaded.step}, attempt {ctx.state.attempt}{rerun}")
        return Outcome(f"restored step {loaded.step} as attempt {ctx.state.attempt}")


def _agreed_known_good(ctx: RunContext, decided: int | None, suspect: int) -> int | None:
    """The newest step every rank holds known-good now, below the suspect step; None: none.

    The command carries the collector's watermark when it decided; by the time the ranks
    act (a second or more later, dozens of tiny steps) the watermark has often moved on,
    and each rank's agent has its own newest answer. Each rank offers the newer of the
    two, and one all-reduce MIN (the rank that heard least) makes it the same on every
    rank, as `load_latest`, a collective, needs. Every rank runs this."""
    heard = ctx.agent.clean_through()
    mine = max(-1 if decided is None else int(decided), -1 if heard is None else int(heard))
    mine = min(mine, suspect - 1)
    vote = torch.tensor([mine], dtype=torch.int64, device=ctx.comm.device)
    ctx.comm.all_reduce(vote, Axis.WORLD, op=torch.distributed.ReduceOp.MIN)
    agreed = int(vote.item())  # host sync: once per rollback
    if agreed < 0:  # no watermark in the command, and a rank has none either
        return None
    if decided is not None and agreed > int(decided):
        ctx.log(f"rollback: the known-good watermark moved from step {decided} to {agreed} since the decision")
    return agreed


class RepairHandler(Handler):
    """Repair a corrupted replica in place (silent data corruption, `replica_divergence`):
    every dp group broadcasts the parameters and optimizer state of a healthy replica,
    dp index `src_dp`, to its other replicas (trainer/integrity.py), with no rollback.
    The step's checksums are taken again at the next step, which shows the replicas
    agree. Every rank runs it (a broadcast per dp group; the healthy groups' copy is a
    no-op on their bits).

    Arguments: `src_dp` (required: a dp index whose replica holds the majority's
    checksum), `ranks` (the corrupted ones, for the record), `incident_id`, `step`."""

    kind = "repair"

    def check(self, ctx: RunContext, cmd: AgreedCommand) -> None:
        if ctx.dims.dp < 2:
            raise Refused("a repair needs dp >= 2: there is no other replica to copy")
        src = _int_arg(cmd.args, "src_dp", minimum=0)
        if src is None or src >= ctx.dims.dp:
            raise Refused(f"argument 'src_dp' must name a dp replica (0..{ctx.dims.dp - 1})")
        _int_arg(cmd.args, "incident_id", minimum=0)
        ranks = cmd.args.get("ranks", [])
        if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise Refused("argument 'ranks' must be a list of ranks")
        d = ctx.dims  # the same answer on every rank: a refusal on some would leave the others waiting
        if any((r // d.tp) % d.dp == src for r in ranks):
            raise Refused(f"replica dp {src} holds a corrupted rank: it cannot be the source")

    def act(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        from trainer.integrity import broadcast_replica

        src = int(cmd.args["src_dp"])
        nbytes = broadcast_replica(ctx.engine, ctx.comm, Axis.DP, src)
        ctx.checksum_next = True
        ctx.agent.event("replica_repaired", step=step, command_id=cmd.id, incident_id=cmd.args.get("incident_id"),
                        src_dp=src, ranks=list(cmd.args.get("ranks", [])), bytes=nbytes)
        ctx.log(f"repair: replica dp {src} copied to the others at step {step} ({nbytes} bytes per rank)")
        return Outcome(f"replica dp {src} broadcast at step {step}")


class IsolateHandler(Handler):
    """Checkpoint, record the node as isolated in the run's membership file, and exit
    every rank with EXIT_RESTART: the supervisor restarts the job on the other nodes
    (fewer dp replicas, the same global batch) from that checkpoint.

    Arguments: `node` (required), `reason`, `incident_id`."""

    kind = "isolate"

    def check(self, ctx: RunContext, cmd: AgreedCommand) -> None:
        node = cmd.args.get("node")
        if not isinstance(node, str) or not node:
            raise Refused("isolate needs the 'node' to leave out")
        if ctx.run_dir is None:
            raise Refused("the run has no run dir for its membership file")
        if ctx.node_names and node not in ctx.node_names:
            raise Refused(f"{node} is not a node of this job (it runs on {', '.join(ctx.node_names)})")

    def act(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        node = cmd.args["node"]
        if ctx.ckpt is not None and step > 0:  # at step 0 (pre-flight) nothing is trained: the restart starts fresh
            ctx.save(step)
            ctx.ckpt.wait()  # the restart resumes from it: it must be finalized before we exit
        if ctx.dims.rank == 0:
            record_isolation(ctx.run_dir, node=node, reason=str(cmd.args.get("reason") or ""),
                             incident_id=cmd.args.get("incident_id"), step=step, command_id=cmd.id)
        ctx.comm.barrier(Axis.WORLD)  # the file is written before any rank exits
        ctx.log(f"isolate {node}: " + (f"checkpointed step {step}" if step > 0 else "before step 1")
                + "; the job restarts without it")
        if ctx.node == node and under_elastic_agent():
            # Under torchrun the isolated node's elastic agent must leave, not restart its
            # workers: told to stop, it does not rejoin (and does not close the rendezvous),
            # so the other agents re-rendezvous without it (--nnodes MIN:MAX).
            os.kill(os.getppid(), signal.SIGTERM)
        return Outcome(f"{node} isolated at step {step}; restarting without it", stop=True, exit_code=EXIT_RESTART)


MAX_SLOWNESS = 1000.0  # a rebalance's ratio above this is refused: a rank that slow is the isolation's


class RebalanceHandler(Handler):
    """Move micro-batches from a slow data-parallel replica to the others, from the next
    step on, with no restart: replica d takes `shares[d]` of the global batch's
    `dp x micro_batches` micro-batches, chosen so that the slowest replica finishes
    soonest (trainer/data.py `balanced_shares`, each replica at least one). The global
    batch, its order and the loss are unchanged (each micro-batch's loss is divided by
    the global token count, and the DP all-reduce is a sum), so the run trains as before;
    only its step time changes. Every rank computes the same shares from the same
    arguments.

    Arguments: `rank` (the slow rank: its replica takes fewer), `ratio` (its compute over
    a healthy replica's, per micro-batch; 1 or none: undo, back to the job's own split),
    `incident_id`."""

    kind = "rebalance"

    def check(self, ctx: RunContext, cmd: AgreedCommand) -> None:
        ratio = _float_arg(cmd.args, "ratio")
        if ratio is not None and not 1.0 <= ratio <= MAX_SLOWNESS:
            raise Refused(f"argument 'ratio' must lie in [1, {MAX_SLOWNESS:g}]")
        _int_arg(cmd.args, "incident_id", minimum=0)
        if ratio is None or ratio == 1.0:
            return  # an undo: whatever the layout now, back to its own split
        if ctx.dims.dp < 2:
            raise Refused("a rebalance needs dp >= 2: there is no other replica to take micro-batches")
        rank = _int_arg(cmd.args, "rank", minimum=0)
        if rank is None or rank >= ctx.dims.world_size:
            raise Refused(f"argument 'rank' must name a rank of this job (0..{ctx.dims.world_size - 1})")

    def act(self, ctx: RunContext, cmd: AgreedCommand, step: int) -> Outcome:
        d, loader = ctx.dims, ctx.loader
        ratio = _float_arg(cmd.args, "ratio") or 1.0
        before = loader.shares
        if ratio == 1.0:
            shares, slow_dp = ctx.cfg.parallel.shares, None  # None: micro_batches each
        else:
            slow_dp = (int(cmd.args["rank"]) // d.tp) % d.dp  # the replica of that rank (its dp coordinate)
            slowness = [ratio if i == slow_dp else 1.0 for i in range(d.dp)]
            shares = balanced_shares(sum(before), slowness)
        after = loader.rebalance(shares)
        ctx.agent.event("rebalanced", step=step, command_id=cmd.id, incident_id=cmd.args.get("incident_id"),
                        rank=cmd.args.get("rank"), dp=slow_dp, ratio=ratio, shares=list(after),
                        previous=list(before))
        split = "/".join(map(str, after))
        ctx.log(f"rebalance at step {step}: micro-batches per replica {'/'.join(map(str, before))} -> {split}"
                + (f" (replica dp {slow_dp} {ratio:.2f}x slower)" if slow_dp is not None else " (undone)"))
        return Outcome(f"micro-batches per replica {split} from step {step + 1}")


def default_handlers() -> dict[str, Handler]:
    return {h.kind: h for h in (CheckpointHandler(), StopHandler(), RollbackHandler(), IsolateHandler(),
                                RepairHandler(), RebalanceHandler())}


def encode_command(cmd: AgreedCommand | None) -> bytes:
    """The broadcast payload of `cmd` (None: no command), `MAX_COMMAND_BYTES` long."""
    body = b"" if cmd is None else json.dumps({"id": cmd.id, "kind": cmd.kind, "args": cmd.args},
                                              separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_COMMAND_BYTES - _HEADER.size:
        raise ValueError(f"command {cmd.id if cmd else ''} is {len(body)} bytes encoded, over {MAX_COMMAND_BYTES}")
    return (_HEADER.pack(len(body)) + body).ljust(MAX_COMMAND_BYTES, b"\0")


def decode_command(payload: bytes) -> AgreedCommand | None:
    (n,) = _HEADER.unpack_from(payload)
    if n == 0:
        return None
    d = json.loads(payload[_HEADER.size:_HEADER.size + n])
    return AgreedCommand(id=str(d["id"]), kind=str(d["kind"]), args=dict(d["args"]))


class CommandChannel:
    """The one-step, overlapped agreement on at most one command per step."""

    def __init__(self, comm, agent, *, rank: int, device: torch.device, handlers: dict[str, Handler]) -> None:
        self.comm = comm
        self.agent = agent
        self.rank = rank
        self.device = device
        self.handlers = handlers
        self._in_flight: tuple[Any, torch.Tensor] | None = None
        self._waiting: deque[AgreedCommand] = deque()  # rank 0: received, not yet broadcast
        # ids this rank ran a handler for: its agent can hear of a command after the
        # broadcast carried it (rank 0's agent got it first); it is not refused then
        self._carried: set[str] = set()

    def take(self) -> AgreedCommand | None:
        """The command agreed at the previous step boundary (waits for its broadcast)."""
        if self._in_flight is None:
            return None
        handle, buf = self._in_flight
        self._in_flight = None
        handle.wait()
        return decode_command(buf.cpu().numpy().tobytes())  # host sync on one small buffer, telemetry on only

    def post(self, *, end: bool = False) -> None:
        """Pick this boundary's command (rank 0) and start its broadcast (every rank); with
        none to send and `end` (rank 0, waiting at the end of the run), the end of the wait."""
        chosen = self._choose(self.agent.commands())
        if chosen is None and end and self.rank == 0:
            chosen = AgreedCommand(id="", kind=END_KIND, args={})
        payload = encode_command(chosen) if self.rank == 0 else bytes(MAX_COMMAND_BYTES)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self._in_flight = (self.comm.broadcast(buf, Axis.WORLD, async_op=True), buf)

    def finish(self) -> None:
        """Complete the last broadcast (every rank posted it); the command in it, and any
        received since, are refused: the collector must not wait for them. One this rank
        already carried out (its agent heard of it after the broadcast) is left as acked."""
        cmd = self.take()
        if cmd is not None and cmd.kind != END_KIND:
            self.agent.ack(cmd.id, "rejected", "the run ended before it could act")
        for late in [*self._waiting, *self.agent.commands()]:
            if str(late.id) not in self._carried:
                self.agent.ack(late.id, "rejected", "the run ended before it could act")
        self._waiting.clear()

    def _choose(self, received: Iterable[Any]) -> AgreedCommand | None:
        """Rank 0: the oldest command waiting (one per boundary; the others wait their
        turn, in order). Other ranks only refuse kinds nobody here can carry out."""
        for cmd in received:
            if cmd.kind not in self.handlers:
                self.agent.ack(cmd.id, "rejected", f"the trainer has no {cmd.kind!r} handler "
                                                   f"(it handles {', '.join(sorted(self.handlers))})")
                continue
            if self.rank != 0:
                continue  # rank 0 decides; this rank acts on what the broadcast brings
            candidate = AgreedCommand(id=str(cmd.id), kind=cmd.kind, args=dict(cmd.args or {}))
            try:
                encode_command(candidate)
            except (ValueError, TypeError) as e:
                self.agent.ack(cmd.id, "rejected", f"arguments not carried: {e}")
                continue
            self._waiting.append(candidate)
        return self._waiting.popleft() if self._waiting else None

    def await_end(self, ctx: RunContext, step: int, *, ready: Callable[[], bool], wait_s: float,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> Outcome | None:
        """After the run's last step: boundaries without steps, every `END_POLL_S`, until rank 0
        finds `ready()` (the collector has judged the last step) or `wait_s` has passed, or a
        command is agreed (a rollback of the last steps: the run goes on from its checkpoint).
        Returns that command's outcome, or None when the run may end. Every rank calls it
        after the same last `step_boundary`; only rank 0's `ready` and clock decide."""
        until = clock() + wait_s
        while True:
            cmd = self.take()
            if cmd is not None and cmd.kind == END_KIND:
                return None
            if cmd is not None:
                self._carried.add(cmd.id)
                return self.handlers[cmd.kind].run(ctx, cmd, step)
            over = self.rank == 0 and (ready() or clock() >= until)
            self.post(end=over)
            if not over:
                sleep(END_POLL_S)

    def step_boundary(self, ctx: RunContext, step: int) -> Outcome | None:
        """The loop's one call per step boundary: take the agreed command, run its
        handler, post the next (unless the run ends here). None: no command."""
        cmd = self.take()
        outcome = None
        if cmd is not None:
            self._carried.add(cmd.id)
            outcome = self.handlers[cmd.kind].run(ctx, cmd, step)
        if outcome is None or not (outcome.stop or outcome.exit_code):
            self.post()
        return outcome
