"""What the framework callbacks share: the agent from arguments or the environment,
one step's values, and the collector's commands at a step boundary.

A callback (agent/integrations/hf.py, lightning.py) only maps its framework's hooks
onto `Telemetry`: `begin_fit` when a fit starts (a resumed one honours a pending
rollback), `record` once per optimizer step, `boundary` after it (a command to act
on), `end_fit` when the fit ends.

Commands (collector/store/commands.py; the kinds the policy issues, collector/live/policy.py):

- `stop`: the callback stops the fit (`Decision.stop`), acked `done`.
- `rollback` (args `step`, the incident's first step): the fit stops and
  `resume_from` names the newest checkpoint of a step before `step` (as the
  trainer's rollback: a checkpoint of the suspect step holds its update). The user's
  script resumes from it; the next `begin_fit` that starts at that checkpoint's
  step records the new rows as the next attempt and acks `done`; one that starts
  elsewhere acks `failed`. No checkpoint before `step`: acked `rejected`.
- `checkpoint`: saved where the framework can (`Decision.save`), else `rejected`.
- `isolate`, and any other kind: acked `rejected` with the reason (leaving a node
  out needs a launcher that restarts the job without it).

Every rank acts on the same command at the same step: with more than one rank,
torch.distributed's rank 0 (`dist.get_rank()`, whatever rank the framework reports)
picks it; each step it broadcasts a one-element int flag (one small blocking
collective), and the command itself (`broadcast_object_list`) only on a step that
has one. Each rank acks for itself, as the collector expects. Without an
initialized torch.distributed (say XLA) each rank acts on its own copy, maybe at
another step: a warning says so.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from agent.agent import Agent, AgentConfig, Command
from agent.noop import NoopAgent
from agent.secrets import read_token_file

log = logging.getLogger("llmwatch.agent")

URL_ENV, TOKEN_ENV, TOKEN_FILE_ENV, RUN_ID_ENV = "LLMWATCH_URL", "LLMWATCH_TOKEN", "LLMWATCH_TOKEN_FILE", "LLMWATCH_RUN_ID"
_STEP_IN_NAME = re.compile(r"(?:^|[^a-z])step[=_-]?(\d+)")


def env_rank_world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when it is initialized, else RANK/WORLD_SIZE."""
    if _dist_initialized():
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def make_agent(*, run_id: str | None, rank: int, world_size: int, node: str | None = None, url: str | None = None,
               token: str | None = None, token_file: str | None = None, config: AgentConfig | None = None,
               run_info: dict | None = None) -> Agent | NoopAgent:
    """A started Agent for this rank. `url`/`token`/`token_file`/`run_id` default to
    $LLMWATCH_URL, $LLMWATCH_TOKEN, $LLMWATCH_TOKEN_FILE, $LLMWATCH_RUN_ID; no URL
    (and no `config` with one): a NoopAgent, and a warning. The token is read here and
    goes only into the agent's Authorization header."""
    url = url or (config.url if config is not None else None) or os.environ.get(URL_ENV)
    if not url:
        log.warning("llmwatch: no collector URL (argument or $%s): telemetry is off", URL_ENV)
        return NoopAgent()
    token_file = token_file or os.environ.get(TOKEN_FILE_ENV)
    token = token or (read_token_file(token_file) if token_file else None) or os.environ.get(TOKEN_ENV)
    if config is None:
        config = AgentConfig(url=url, token=token)
    else:
        config.url, config.token = url, token or config.token
    run_id = run_id or os.environ.get(RUN_ID_ENV) or f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    info = {"run_id": run_id, "world_size": world_size, "mesh": {"dp": world_size, "tp": 1, "pp": 1},
            "started_ts": time.time(), **(run_info or {})}
    agent = Agent(config, run_id=run_id, rank=rank, node=node or socket.gethostname(), world_size=world_size,
                  coords={"dp": rank, "tp": 0, "pp": 0}, run_info=info)
    agent.start()
    return agent


def newest_before(candidates: Iterable[tuple[int, str]], step: int) -> tuple[int, str] | None:
    """The (step, path) of the newest candidate of a step before `step`, or None."""
    older = [c for c in candidates if c[0] < step]
    return max(older, key=lambda c: c[0]) if older else None


def step_of_name(name: str) -> int | None:
    """N of a checkpoint named `...step=N...` (Lightning) or `checkpoint-N` (Hugging Face)."""
    m = _STEP_IN_NAME.search(name.lower()) or re.fullmatch(r"checkpoint-(\d+)", name)
    return int(m.group(1)) if m else None


@dataclass(slots=True)
class Decision:
    """What the framework does at this step boundary."""

    stop: bool = False
    save: bool = False


@dataclass(slots=True)
class _Rollback:
    command_id: str
    suspect_step: int
    from_step: int
    to_step: int
    path: str


class Telemetry:
    """One rank's agent and command handling, framework-free (the callbacks drive it).

    `agent`: an Agent to use (the caller owns it and closes it); else one is made by
    `make_agent` at the first `begin_fit` with the framework's rank and world size,
    kept across fits (a resume after a rollback records into it as the next attempt)
    and closed by `close()` or the first `end_fit` with no rollback pending."""

    def __init__(self, *, framework: str, agent: Agent | NoopAgent | None = None, run_id: str | None = None,
                 node: str | None = None, url: str | None = None, token: str | None = None,
                 token_file: str | None = None, config: AgentConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.framework = framework
        self.agent = agent
        self._owns_agent = agent is None
        self._make = dict(run_id=run_id, node=node, url=url, token=token, token_file=token_file, config=config)
        self.rank, self.world_size = 0, 1
        self.resume_from: str | None = None  # the checkpoint a rollback asks the next fit to resume from
        self.stopped = False  # a stop command ended the fit
        self._rollback: _Rollback | None = None
        self._waiting: list[Command] = []  # rank 0: received, not yet acted on (one per boundary)
        self._clock = clock
        self._last_end: float | None = None
        self._flag = None  # the broadcast flag tensor, on the default group's device (made at the first boundary)
        self.probe = None  # agent.watch.Watch(record=False): phases, local signals, collectives

    # -- the fit ---------------------------------------------------------------
    def begin_fit(self, *, rank: int, world_size: int, step: int, config: dict | None = None) -> None:
        """A fit starts at `step` (the steps done so far: 0, or a resumed checkpoint's)."""
        self.rank, self.world_size = rank, world_size
        if world_size > 1 and not _dist_initialized():
            log.warning("llmwatch: %d ranks but torch.distributed is not initialized: each rank acts on its own "
                        "commands, perhaps at different steps", world_size)
        if self.agent is None or (self._owns_agent and getattr(self.agent, "_closed", False)):
            self.agent = make_agent(rank=rank, world_size=world_size,
                                    run_info={"config": {"framework": self.framework, **(config or {})}},
                                    **self._make)
            self._owns_agent = True
        self.stopped = False
        self._last_end = None
        self._flag = None  # a new fit may run in a new process group
        pending, self._rollback = self._rollback, None
        self.resume_from = None
        if pending is None:
            return
        agent = self.agent
        if step != pending.to_step:
            agent.ack(pending.command_id, "failed", f"the next fit started at step {step}, not from {pending.path}")
            return
        agent.set_attempt(agent.attempt + 1)
        agent.event("rollback_started", step=step, command_id=pending.command_id, from_step=pending.from_step,
                    to_step=pending.to_step, suspect_step=pending.suspect_step, attempt=agent.attempt,
                    checkpoint=pending.path, diagnose=False)
        agent.ack(pending.command_id, "done", f"resumed from {pending.path} (step {step}) as attempt {agent.attempt}")

    def attach(self, model, optimizer, *, step: int) -> None:
        """Watch the fit's model and optimizer (agent/watch.py, as a probe): each step's
        row gains fwd/bwd/opt/data seconds, the local loss and finiteness, and every
        collective comes from torch's Flight Recorder. Call after `begin_fit`. A model or
        optimizer that cannot be hooked leaves the rows as they were (a warning)."""
        self.detach()
        if self.agent is None or isinstance(self.agent, NoopAgent):
            return
        import torch

        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps the torch one
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
        try:
            from agent.watch import Watch

            self.probe = Watch(self.agent, model, [optimizer] if optimizer is not None else [], record=False,
                               start_step=step)
        except Exception as e:  # noqa: BLE001 - the callback's own rows go on
            log.warning("llmwatch: cannot watch the %s model and optimizer (%r): rows without phases and "
                        "collectives", self.framework, e)

    def detach(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None

    def step_started(self) -> None:
        """The first step of a fit begins (its step time counts from here)."""
        if self._last_end is None:
            self._last_end = self._clock()

    def step_time(self) -> float | None:
        """Seconds since the previous step ended (the first: since `step_started`)."""
        now = self._clock()
        last, self._last_end = self._last_end, now
        return None if last is None else now - last

    def record(self, step: int, **values: Any) -> None:
        """One optimizer step (agent.record_step's keywords; None: not measured), with what
        the probe measured of it (the callback's own values win)."""
        if self.probe is not None:
            measured = self.probe.take(step)
            values = {**measured, **{k: v for k, v in values.items() if v is not None or k not in measured}}
        self.agent.record_step(step, **values)

    def end_fit(self, step: int) -> None:
        """A fit ended at `step`. With a rollback pending the agent stays open for the
        resumed fit (flushed now); otherwise rank 0 reports the run finished and an
        agent made here is closed."""
        if self.agent is None:
            return
        self.detach()
        if self._rollback is not None:
            self.agent.flush(timeout_s=5.0)
            return
        if self.rank == 0:
            self.agent.event("run_finished", step=step, status="stopped" if self.stopped else "completed")
        if self._owns_agent:
            self.agent.close()
        else:
            self.agent.flush(timeout_s=5.0)

    def close(self) -> None:
        """Close an agent made here (a rollback never resumed is then refused)."""
        if self._rollback is not None and self.agent is not None:
            self.agent.ack(self._rollback.command_id, "rejected", "the fit was not resumed from the checkpoint")
            self._rollback = None
        if self._owns_agent and self.agent is not None:
            self.agent.close()

    # -- commands --------------------------------------------------------------
    def boundary(self, step: int, *, checkpoints: Callable[[], Iterable[tuple[int, str]]],
                 can_save: bool = False) -> Decision:
        """After step `step`: the command every rank agreed on, carried out or refused.
        `checkpoints()`: the (step, path) a rollback may resume from; `can_save`: the
        framework saves a checkpoint when asked (`Decision.save`)."""
        cmd = self._agreed(self.agent.commands())
        if cmd is None:
            return Decision()
        agent, kind = self.agent, cmd.kind
        if kind == "stop":
            agent.event("command_started", step=step, command_id=cmd.id, command_kind=kind)
            self.stopped = True
            agent.ack(cmd.id, "done", f"stopped at step {step}")
            return Decision(stop=True, save=can_save)
        if kind == "checkpoint":
            if not can_save:
                agent.ack(cmd.id, "rejected", f"this {self.framework} fit saves no checkpoints")
                return Decision()
            agent.ack(cmd.id, "done", f"checkpoint of step {step} requested")
            return Decision(save=True)
        if kind == "rollback":
            return self._rollback_to(cmd, step, checkpoints)
        if kind == "isolate":
            reason = (f"isolate needs a launcher that restarts the job without the node (the llmwatch trainer's "
                      f"supervisor, or torchrun --nnodes MIN:MAX); a {self.framework} callback cannot")
        else:
            reason = f"the {self.framework} callback has no {kind!r} handler (it handles stop, rollback, checkpoint)"
        agent.ack(cmd.id, "rejected", reason)
        return Decision()

    def _rollback_to(self, cmd: Command, step: int, checkpoints) -> Decision:
        target = cmd.args.get("step")
        if not isinstance(target, int) or isinstance(target, bool) or target < 1:
            self.agent.ack(cmd.id, "rejected", "rollback needs the suspect 'step' (an integer >= 1)")
            return Decision()
        if target > step:
            self.agent.ack(cmd.id, "rejected", f"step {target} has not run yet (the fit is at step {step})")
            return Decision()
        found = newest_before(checkpoints(), target)
        if found is None:
            self.agent.ack(cmd.id, "rejected", f"no checkpoint before step {target} to resume from")
            return Decision()
        self.agent.event("command_started", step=step, command_id=cmd.id, command_kind=cmd.kind)
        self._rollback = _Rollback(cmd.id, target, step, found[0], found[1])
        self.resume_from = found[1]
        log.warning("llmwatch: rollback to %s (step %d) requested at step %d: the fit stops; resume it from "
                    "`resume_from`", found[1], found[0], step)
        return Decision(stop=True)

    def _agreed(self, received: list[Command]) -> Command | None:
        """The command of this boundary, the same on every rank: torch.distributed rank
        0's oldest (the other ranks' own copies are dropped: they act on the broadcast)."""
        if self.world_size <= 1 or _dist_world() <= 1:
            self._waiting.extend(received)
            return self._waiting.pop(0) if self._waiting else None
        import torch.distributed as dist

        lead = dist.get_rank() == 0  # the broadcast's source (the framework's rank may be another numbering)
        if lead:
            self._waiting.extend(received)
        if self._flag is None:
            self._flag = _flag_tensor()
        flag = self._flag
        flag.fill_(1 if lead and self._waiting else 0)
        dist.broadcast(flag, src=0)  # blocking, one int per step
        if not int(flag.item()):
            return None
        box = [self._waiting.pop(0) if lead else None]
        dist.broadcast_object_list(box, src=0)  # only on a step with a command
        return box[0]


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def _dist_world() -> int:
    """torch.distributed's world size; 0 when it is not initialized."""
    if not _dist_initialized():
        return 0
    import torch.distributed as dist

    return dist.get_world_size()


def _flag_tensor():
    """A one-element int64 tensor on the device the default group broadcasts from: the
    CPU where it has gloo or mpi (also "cuda:nccl,cpu:gloo", as accelerate sets up: no
    device sync), else the current accelerator (nccl, xccl)."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend())
    device = torch.device("cpu")
    if "gloo" not in backend and "mpi" not in backend:
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            device = torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.zeros(1, dtype=torch.int64, device=device)


class TelemetryCallback:
    """What both framework callbacks expose of their `Telemetry` (`self.telemetry`)."""

    telemetry: Telemetry

    @property
    def resume_from(self) -> str | None:
        """The checkpoint a rollback asks the next fit to resume from (None: no rollback pending)."""
        return self.telemetry.resume_from

    @property
    def agent(self):
        return self.telemetry.agent
