"""The training loop: data -> engine -> telemetry, checkpoints, eval, control.

`Trainer.fit()` reads top to bottom. Everything it drives is built elsewhere
(`trainer.worker`) and handed in, so the loop holds no setup code and every
collaborator can be replaced in a test.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainer.badbatches import BadBatchList
from trainer.batch import DataPosition
from trainer.comm import Comm
from trainer.config import JobConfig
from trainer.control import CommandChannel, RunContext, default_handlers
from trainer.diagnosis import ProbeRow, Verdict, judge
from trainer.faults import FaultInjector
from trainer.integrity import named_tensors
from trainer.parallel_dims import ParallelDims
from trainer.supervisor import write_attempt


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# the end of a run waits for the collector's verdict on its last steps as long as the collector says
# (rules: policy.end_of_run_wait_s; 0 when its policy would not act), never longer than this
END_WAIT_MAX_S = 600.0


def memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory, or the process's resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(slots=True)
class LoopState:
    step: int = 0  # last completed optimizer step
    attempt: int = 0  # lineage: +1 after every rollback
    position: DataPosition = DataPosition()
    num_skipped: int = 0
    stopped: bool = False  # ended early by a stop command
    exit_code: int = 0  # non-zero: the run ends for a restart (membership.EXIT_RESTART)


class Trainer:
    def __init__(self, cfg: JobConfig, *, dims: ParallelDims, comm: Comm, engine, loader_factory: Callable,
                 eval_sets: dict, checkpointer, agent, injector: FaultInjector, device: torch.device,
                 poison: Callable, progress: bool = False, attempt_floor: int = 0,
                 node_names: tuple[str, ...] = (), node: str | None = None) -> None:
        """`attempt_floor`: a restarted job's first attempt (the supervisor's: above
        every attempt an earlier round ran, so no (step, attempt) row is written twice)."""
        self.cfg = cfg
        self.dims = dims
        self.comm = comm
        self.engine = engine
        self.loader_factory = loader_factory
        self.eval_sets = eval_sets
        self.ckpt = checkpointer
        self._saves_queued: deque[tuple[int, int]] = deque()  # (step, attempt) of saves not reported yet
        self.agent = agent
        self.injector = injector
        self.device = device
        self.poison = poison
        self.is_logger = dims.rank == 0
        self.attempt_floor = attempt_floor
        self.preflight_failed = False  # a node failed the pre-flight checks: the collector's verdict before step 1
        self.state = LoopState()
        self.telemetry = cfg.telemetry.enabled  # also enables the control channel
        run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        # samples a rollback skipped: a resume and every later rollback honour them
        self.bad_batches = BadBatchList.load(run_dir) if run_dir is not None else BadBatchList(None)
        self.ctx = RunContext(cfg=cfg, dims=dims, comm=comm, engine=engine, ckpt=checkpointer, agent=agent,
                              state=self.state, bad_batches=self.bad_batches, log=self._log, save=self._save,
                              restore=self._restore, run_dir=run_dir, note_attempt=self.note_attempt,
                              node_names=tuple(node_names), node=node)
        self.channel = (CommandChannel(comm, agent, rank=dims.rank, device=device, handlers=default_handlers())
                        if self.telemetry else None)
        self._jsonl = None
        self._bar = None
        self._progress = progress and self.is_logger

    # -- setup -------------------------------------------------------------
    def _resume(self) -> None:
        if not (self.ckpt is not None and self.cfg.ckpt.resume):
            return
        loaded = self.ckpt.load_latest()
        if loaded is None:
            self._log("resume: no verified checkpoint found, starting fresh")
            return
        self._restore(loaded)
        self.state.attempt = int(loaded.meta.get("attempt", 0))
        self._log(f"resume: step {self.state.step} from {loaded.path} (data position "
                  f"epoch {self.state.position.epoch}, sample {self.state.position.index})")
        self.agent.event("checkpoint_loaded", step=self.state.step, path=str(loaded.path))

    def note_attempt(self) -> None:
        """Tell the agent the attempt its rows belong to; rank 0 also records it in the
        run dir, where a supervisor's restart reads the floor of its next attempt."""
        self.agent.set_attempt(self.state.attempt)
        if self.is_logger and self.cfg.run_dir:
            write_attempt(Path(self.cfg.run_dir), self.state.attempt)

    def _restore(self, loaded) -> None:
        """Model, optimizer, loss scaler, RNG, step and data position from a checkpoint
        (the attempt is the caller's: a resume keeps it, a rollback raises it)."""
        self.engine.load_state_dict({"model": loaded.model_state, "optim": loaded.optim_state,
                                     **loaded.meta.get("engine", {})})
        if loaded.rank_state is not None and "rng" in loaded.rank_state:
            set_rng_state(loaded.rank_state["rng"])
        self.state.step = int(loaded.meta["step"])
        self.state.position = DataPosition.from_dict(loaded.meta["data_position"])

    def _open_outputs(self) -> None:
        if self.is_logger and self.cfg.metrics_jsonl:
            Path(self.cfg.metrics_jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.cfg.metrics_jsonl, "a", buffering=1)
        if self._progress:
            from tqdm import tqdm

            self._bar = tqdm(total=self.cfg.steps, initial=self.state.step, unit="step", dynamic_ncols=True)

    def _log(self, msg: str) -> None:
        if not self.is_logger:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    # -- the loop ------------------------------------------------------------
    def fit(self) -> LoopState:
        self._resume()
        self.state.attempt = max(self.state.attempt, self.attempt_floor)
        self.note_attempt()
        self._open_outputs()
        cfg = self.cfg
        loader = self.loader_factory(self.state.position, self.state.step + 1,
                                     bad_windows=self.bad_batches.windows)
        self.ctx.loader = loader
        try:
            if self.preflight_failed and self._preflight_verdict():
                return self.state  # an isolation before step 1: every rank leaves for the restart
            while True:  # the steps, then the wait for the verdict on the last ones (a rollback goes on)
                while self.state.step < cfg.steps:
                    step = self.state.step + 1
                    self.injector.before_step(step, self.state.attempt)
                    t_start = time.perf_counter()
                    self.agent.set_phase("data", step)
                    batch = loader.next()
                    data_s = loader.wait_s
                    # a rollback's rerun of its suspect step (trainer/diagnosis.py): the probe judges it
                    probe = self.ctx.probe if self.ctx.probe is not None and self.ctx.probe.step == step else None
                    self.injector.probing = probe is not None
                    # the samples of this step's global batch (the loader's step_window): data-tied faults follow them
                    faults = self.injector.step_faults(step, self.state.attempt, batch.meta["window"],
                                                       replica_window=batch.meta["replica_window"])
                    if faults.spike:
                        batch = self.poison(batch, cfg.seed)
                    self.agent.set_phase("train", step)
                    verdict: list[Verdict] = []
                    result = self.engine.train_step(step, batch.micro_batches, batch.global_num_tokens, faults,
                                                    probe=self._prober(probe, verdict) if probe is not None else None,
                                                    checksum=self._checksum_due(step))
                    comm_stats = self.comm.end_step()
                    if self.injector:  # a bitflip after this step's update (silent data corruption)
                        self.injector.after_update(step, self.state.attempt, partial(named_tensors, self.engine))
                    if probe is not None:
                        self.ctx.probe = None
                        if not self._diagnosed(step, batch, probe, verdict[0]):
                            continue  # the batch was bad: the same step number runs again on the next clean one
                    step_s = time.perf_counter() - t_start
                    self.state.step = step
                    self.state.position = batch.next_position
                    self.state.num_skipped += int(result.skipped)
                    if self.ckpt is not None:  # saves written by now are reported before this step's row,
                        self._checkpoint_events()  # so a save not reported was still being written then
                    self._report(step, batch.global_num_tokens, sum(mb.num_tokens for mb in batch.micro_batches),
                                 result, step_s, data_s, comm_stats.wait_s, batch.meta["replica_window"])
                    self._recovered(step)
                    if cfg.eval_every and step % cfg.eval_every == 0:
                        self._evaluate(step)
                    if self.ckpt is not None and cfg.ckpt.every and step % cfg.ckpt.every == 0:
                        self._save(step)
                    if self._control(step):
                        break
                    self.agent.set_phase("idle", step)
                if not self._judged_end():
                    break
            if self.channel is not None and not self.state.exit_code:
                self.channel.finish()
                if self.ckpt is not None:  # every rank's last saves reported before rank 0 says the run finished
                    self.ckpt.wait()
                    self._checkpoint_events()
                    self.comm.barrier()
        finally:
            loader.close()
            if self.ckpt is not None:
                self.agent.set_phase("checkpoint", self.state.step)
                self.ckpt.wait()
                self._checkpoint_events()
            if self._bar is not None:
                self._bar.close()
            if self._jsonl is not None:
                self._jsonl.close()
        return self.state

    def _report(self, step: int, tokens: int, replica_tokens: int, r, step_s: float, data_s: float,
                comm_wait_s: float, window: tuple[int, int, int]) -> None:
        # r's values are host numbers from the engine's one sync: recording forces no other.
        # steps.tokens is what this rank's replica processed (docs/schema.md): the same on
        # its tp x pp ranks, so the collector counts each replica once; `tokens` (the
        # global batch) is what the progress line and metrics.jsonl show.
        epoch, sample_from, sample_to = window
        self.agent.record_step(step, loss=r.loss, grad_norm=r.grad_norm, loss_scale=r.loss_scale, lr=r.lr,
                               tokens=replica_tokens, step_s=step_s, fwd_s=r.fwd_s, bwd_s=r.bwd_s, opt_s=r.opt_s,
                               data_s=data_s, comm_exposed_s=comm_wait_s,
                               mem_bytes=memory_bytes(self.device) if self.telemetry else None,
                               skipped=bool(r.skipped), local_loss=r.local_loss, finite_fwd=r.finite_fwd,
                               finite_bwd=r.finite_bwd, sample_epoch=epoch, sample_from=sample_from,
                               sample_to=sample_to)
        if r.checksum is not None:  # the shard's parameters as the step began (trainer/integrity.py)
            self.agent.record_scalar(step, f"checksum/{self.engine.shard_key}", r.checksum)
        if not self.is_logger:
            return
        tokens_per_s = tokens / step_s if step_s > 0 else 0.0
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({
                "step": step, "loss": r.loss, "grad_norm": r.grad_norm, "loss_scale": r.loss_scale, "lr": r.lr,
                "tokens_per_s": tokens_per_s, "step_s": step_s, "skipped": bool(r.skipped),
                "attempt": self.state.attempt,
            }) + "\n")
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{r.loss:.4f}", gnorm=f"{r.grad_norm:.3g}", tok_s=f"{tokens_per_s:,.0f}",
                                  refresh=False)
            self._bar.update(1)
        elif self.cfg.log_every and step % self.cfg.log_every == 0 and os.environ.get("LLMWATCH_PROGRESS") == "1":
            print(f"step {step:>6}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3g}  lr {r.lr:.2e}  "
                  f"tok/s {tokens_per_s:,.0f}{'  SKIPPED' if r.skipped else ''}", flush=True)

    def _evaluate(self, step: int) -> None:
        self.agent.set_phase("eval", step)
        parts = []
        for domain, batches in self.eval_sets.items():
            loss_sum, num_tokens = self.engine.eval_loss(batches)
            loss = loss_sum / max(num_tokens, 1)
            self.agent.record_scalar(step, f"eval/{domain}_loss", loss)
            parts.append(f"{domain} {loss:.4f}")
        self._log(f"eval @ step {step}: " + ", ".join(parts))

    def _save(self, step: int) -> None:
        self.agent.set_phase("checkpoint", step)
        sd = self.engine.state_dict()
        meta = {
            "step": step, "attempt": self.state.attempt, "data_position": self.state.position.to_dict(),
            "run_id": self.cfg.run_id, "mesh": {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp,
                                                "sp": self.dims.sp},
            "engine": {k: v for k, v in sd.items() if k not in ("model", "optim")},
        }
        queued = self.ckpt.save(step, model_state=sd["model"], optim_state=sd["optim"],
                                rank_state={"rng": rng_state()}, meta=meta)
        if queued is not None:  # the write starts now, in the background (checkpoint_slow's lower bound)
            self._saves_queued.append((step, self.state.attempt))
            self.agent.event("checkpoint_queued", step=step, num_shards=queued.num_shards, bytes=queued.bytes,
                             stall_s=queued.stall_s, attempt=self.state.attempt)

    def _checkpoint_events(self) -> None:
        for rec in self.ckpt.poll():
            attempt = self._save_attempt(rec.step)
            self.agent.event("checkpoint_saved", step=rec.step, path=str(rec.path), num_shards=rec.num_shards,
                             bytes=rec.bytes, write_s=rec.write_s, checksums=rec.checksums, verified=True,
                             attempt=attempt, of_attempt=attempt)

    def _save_attempt(self, step: int) -> int:
        """The attempt a save of `step` was queued in (its report may come after a rollback):
        the writer finishes saves in the order they were queued."""
        while self._saves_queued:
            s, attempt = self._saves_queued.popleft()
            if s == step:
                return attempt
        return self.state.attempt

    def _checksum_due(self, step: int) -> bool:
        """Every `telemetry.checksum_every` steps, and the step after a repair (which
        shows the replicas agree again): the same answer on every rank."""
        every = self.cfg.telemetry.checksum_every if self.telemetry else 0
        if not every:
            return False
        due = step % every == 0 or self.ctx.checksum_next
        self.ctx.checksum_next = False
        return due

    def _judged_end(self) -> bool:
        """The steps are done: wait for the collector's verdict on the last ones
        (trainer/control.py `await_end`), at most its `end_wait_s` (0 while it is away,
        or when it never answered: no verdict can come). True: a command sent the run on
        (a rollback of its last steps)."""
        if self.channel is None or self.state.exit_code or self.state.stopped or self.state.step < self.cfg.steps:
            return False
        last = self.state.step
        said, wait_s = self._verdict_wait()
        t0 = time.monotonic()

        def ready() -> bool:
            judged = self.agent.judged_through()
            return judged is not None and judged >= last

        self.agent.set_phase("idle", last)
        outcome = self.channel.await_end(self.ctx, last, ready=ready, wait_s=wait_s)
        waited = time.monotonic() - t0
        if outcome is None:
            if self.is_logger and not ready() and (said is None or said > 0):
                why = (f"it gave none within {wait_s:g} s" if wait_s > 0 else
                       "it is unreachable" if said is not None else "it never answered")
                self._log(f"end of run: no verdict from the collector on step {last} ({why}); ending without it")
            elif self.is_logger and waited >= 1.0:
                self._log(f"end of run: the collector judged the last step {waited:.1f} s after it")
            return False
        if outcome.exit_code:
            self.state.exit_code = outcome.exit_code
        return not (outcome.stop or outcome.exit_code)

    def _verdict_wait(self) -> tuple[float | None, float]:
        """(what the collector said, the wait): how long boundaries without steps may wait for
        its verdict. Rank 0 decides alone; 0 while it is away or never answered."""
        said = self.agent.end_wait_s() if self.is_logger else None
        return said, 0.0 if said is None else min(said, END_WAIT_MAX_S)

    def _preflight_verdict(self) -> bool:
        """A node failed the pre-flight checks (trainer/preflight.py): before step 1, wait for
        the collector's policy to act on it, in boundaries without steps (trainer/control.py
        `await_end`) at most its `end_wait_s` (0 while it is away, or when its policy would
        not act). True: the command agreed ends the loop here (an isolation: the node is
        replaced or left out before it cost a step)."""
        if self.channel is None or self.state.step > 0:
            return False
        _, wait_s = self._verdict_wait()
        t0 = time.monotonic()
        outcome = self.channel.await_end(self.ctx, self.state.step, ready=lambda: False, wait_s=wait_s)
        if outcome is None:
            if self.is_logger:
                self._log(f"preflight: the collector took no action within {time.monotonic() - t0:.1f} s; "
                          "training on every node")
            return False
        if outcome.exit_code:
            self.state.exit_code = outcome.exit_code
        return outcome.stop or bool(outcome.exit_code)

    # -- control channel -----------------------------------------------------
    def _control(self, step: int) -> bool:
        """At most one command per step boundary, agreed by every rank (trainer/control.py);
        True means the loop ends here (a stop, or an exit for a restart)."""
        if self.channel is None:
            return False
        outcome = self.channel.step_boundary(self.ctx, step)
        if outcome is None:
            return False
        if outcome.exit_code:
            self.state.exit_code = outcome.exit_code
        return outcome.stop or bool(outcome.exit_code)

    # -- the rerun diagnosis ---------------------------------------------------
    def _prober(self, plan, out: list[Verdict]):
        """The engine's probe callback at the suspect step: judge every rank's row (the
        same rows, so the same verdict, on every rank); True keeps the step's update."""
        def probe(rows: list[list[float]], loss: float, grad_norm: float) -> bool:
            verdict = judge(plan, [ProbeRow.from_values(r, v) for r, v in enumerate(rows)], loss=loss,
                            grad_norm=grad_norm, dp=self.dims.dp)
            out.append(verdict)
            return verdict.apply_step
        return probe

    def _diagnosed(self, step: int, batch, plan, verdict: Verdict) -> bool:
        """Record the verdict (rank 0 speaks for all: every rank computed the same one);
        on data, skip the batch, and `plan.skip_batches` more, for good. Returns whether
        the probe counts as the step (False: the step runs again on the next clean batch)."""
        epoch, lo, hi = batch.meta["window"]
        if self.dims.rank == 0:
            self.agent.event("rerun_verdict", step=step, incident_id=plan.incident_id, incident_kind=plan.kind,
                             verdict=verdict.verdict, reproduced=verdict.reproduced, rank=verdict.rank,
                             anomalous_ranks=list(verdict.anomalous), evidence=verdict.evidence,
                             samples=[epoch, lo, hi], probe=verdict.detail)
        self._log(f"rerun of step {step}: {verdict.verdict}: {verdict.evidence}")
        if verdict.verdict != "data":
            return True
        window = (epoch, lo, hi + plan.skip_batches * (hi - lo))
        self.bad_batches.add(window, step=step, incident_id=plan.incident_id, verdict="data",
                             write=self.dims.rank == 0)
        if self.dims.rank == 0:
            self.agent.event("batch_skipped", step=step, epoch=window[0], sample_from=window[1], sample_to=window[2],
                             incident_id=plan.incident_id, verdict="data")
        loader = self.ctx.loader
        loader.add_bad_window(window)
        loader.seek(batch.position, step)
        return False

    def _recovered(self, step: int) -> None:
        """The first step past where the abandoned lineage stopped: the rollback is over."""
        rec = self.ctx.recovery
        if rec is None or step <= rec.past_step:
            return
        self.ctx.recovery = None
        self.agent.event("recovered", step=step, command_id=rec.command_id, incident_id=rec.incident_id,
                         attempt=rec.attempt, past_step=rec.past_step,
                         rollback_s=round(time.time() - rec.started_ts, 6))
