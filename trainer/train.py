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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainer.batch import DataPosition
from trainer.comm import Comm
from trainer.config import JobConfig
from trainer.faults import FaultInjector
from trainer.parallel_dims import Axis, ParallelDims

# Control commands the loop understands. Rollback/isolate arrive with the healing issue;
# until then they are acknowledged as rejected, so the collector knows they were seen.
CMD_NONE, CMD_CHECKPOINT, CMD_STOP = 0, 1, 2
_CMD_CODES = {"checkpoint": CMD_CHECKPOINT, "stop": CMD_STOP}


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


class Trainer:
    def __init__(self, cfg: JobConfig, *, dims: ParallelDims, comm: Comm, engine, loader_factory: Callable,
                 eval_sets: dict, checkpointer, agent, injector: FaultInjector, device: torch.device,
                 poison: Callable, progress: bool = False) -> None:
        self.cfg = cfg
        self.dims = dims
        self.comm = comm
        self.engine = engine
        self.loader_factory = loader_factory
        self.eval_sets = eval_sets
        self.ckpt = checkpointer
        self.agent = agent
        self.injector = injector
        self.device = device
        self.poison = poison
        self.is_logger = dims.rank == 0
        self.state = LoopState()
        self.telemetry = cfg.telemetry.enabled  # also enables the control channel
        self._ctrl = None  # (handle, [kind, command id] tensor) of the broadcast in flight
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
        self.engine.load_state_dict({"model": loaded.model_state, "optim": loaded.optim_state,
                                     **loaded.meta.get("engine", {})})
        if loaded.rank_state is not None and "rng" in loaded.rank_state:
            set_rng_state(loaded.rank_state["rng"])
        meta = loaded.meta
        self.state.step = int(meta["step"])
        self.state.attempt = int(meta.get("attempt", 0))
        self.state.position = DataPosition.from_dict(meta["data_position"])
        self._log(f"resume: step {self.state.step} from {loaded.path} (data position "
                  f"epoch {self.state.position.epoch}, sample {self.state.position.index})")
        self.agent.event("checkpoint_loaded", step=self.state.step, path=str(loaded.path))

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
        self._open_outputs()
        cfg = self.cfg
        loader = self.loader_factory(self.state.position, self.state.step + 1)
        try:
            while self.state.step < cfg.steps:
                step = self.state.step + 1
                self.injector.before_step(step, self.state.attempt)
                t_start = time.perf_counter()
                self.agent.set_phase("data", step)
                batch = loader.next()
                data_s = loader.wait_s
                # the samples of this step's global batch (the loader's step_window): data-tied faults follow them
                faults = self.injector.step_faults(step, self.state.attempt, batch.meta["window"])
                if faults.spike:
                    batch = self.poison(batch, cfg.seed)
                self.agent.set_phase("train", step)
                result = self.engine.train_step(step, batch.micro_batches, batch.global_num_tokens, faults)
                comm_stats = self.comm.end_step()
                step_s = time.perf_counter() - t_start
                self.state.step = step
                self.state.position = batch.next_position
                self.state.num_skipped += int(result.skipped)
                self._report(step, batch.global_num_tokens, sum(mb.num_tokens for mb in batch.micro_batches),
                             result, step_s, data_s, comm_stats.wait_s, batch.meta["replica_window"])
                if cfg.eval_every and step % cfg.eval_every == 0:
                    self._evaluate(step)
                if self.ckpt is not None and cfg.ckpt.every and step % cfg.ckpt.every == 0:
                    self._save(step)
                if self._control(step):
                    break
                self.agent.set_phase("idle", step)
            self._finish_control()
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
        self.agent.record_step(step, r.loss, r.grad_norm, r.loss_scale, r.lr, replica_tokens, step_s, r.fwd_s, r.bwd_s,
                               r.opt_s, data_s, comm_wait_s, memory_bytes(self.device) if self.telemetry else 0,
                               bool(r.skipped), local_loss=r.local_loss, finite_fwd=r.finite_fwd,
                               finite_bwd=r.finite_bwd, sample_epoch=epoch, sample_from=sample_from,
                               sample_to=sample_to)
        if not self.is_logger:
            return
        tokens_per_s = tokens / step_s if step_s > 0 else 0.0
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({
                "step": step, "loss": r.loss, "grad_norm": r.grad_norm, "loss_scale": r.loss_scale, "lr": r.lr,
                "tokens_per_s": tokens_per_s, "skipped": bool(r.skipped), "attempt": self.state.attempt,
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
        self.ckpt.save(step, model_state=sd["model"], optim_state=sd["optim"], rank_state={"rng": rng_state()},
                       meta=meta)
        self._checkpoint_events()

    def _checkpoint_events(self) -> None:
        for rec in self.ckpt.poll():
            self.agent.event("checkpoint_saved", step=rec.step, path=str(rec.path), num_shards=rec.num_shards,
                             bytes=rec.bytes, write_s=rec.write_s, checksums=rec.checksums, verified=True,
                             attempt=self.state.attempt)

    # -- control channel -----------------------------------------------------
    def _control(self, step: int) -> bool:
        """Agree on at most one command per step; True means stop.

        Every rank's agent receives a run-wide command; rank 0 decides. It puts
        (kind, id) of the command it picked into an async broadcast at the end of
        step s; every rank waits for it at the end of step s+1, acts, and acks the
        command for itself. The broadcast travels while step s+1 computes, so the
        agreement costs no step time; the price is one step of latency."""
        if not self.telemetry:
            return False
        stop = False
        if self._ctrl is not None:
            handle, code = self._ctrl
            self._ctrl = None
            handle.wait()
            kind, command_id = code.tolist()  # host sync on two ints, telemetry on only
            stop = self._act(kind, str(command_id), step)
        if stop:
            return True
        code = torch.tensor([CMD_NONE, -1], dtype=torch.int64, device=self.device)
        chosen = False
        for cmd in self.agent.commands():
            if cmd.kind not in _CMD_CODES:
                self.agent.ack(cmd.id, "rejected", f"the trainer does not handle {cmd.kind!r} here")
            elif self.dims.rank == 0 and not chosen and cmd.id.isdigit():
                code[0], code[1] = _CMD_CODES[cmd.kind], int(cmd.id)
                chosen = True
            elif self.dims.rank == 0:
                self.agent.ack(cmd.id, "rejected", "another command is being carried out")
        self._ctrl = (self.comm.broadcast(code, Axis.WORLD, async_op=True), code)
        return False

    def _finish_control(self) -> None:
        """Complete the last broadcast (every rank posted it); a command in it is refused."""
        if self._ctrl is None:
            return
        handle, code = self._ctrl
        self._ctrl = None
        handle.wait()
        kind, command_id = code.tolist()
        if kind != CMD_NONE:
            self.agent.ack(str(command_id), "rejected", "the run ended before it could act")

    def _act(self, kind: int, command_id: str, step: int) -> bool:
        if kind == CMD_NONE:
            return False
        if kind == CMD_CHECKPOINT and self.ckpt is None:
            self.agent.ack(command_id, "rejected", "the run has no --ckpt-dir")
            return False
        if self.ckpt is not None:
            self._save(step)
        self.agent.ack(command_id, "done", f"at step {step}")
        if kind == CMD_STOP:
            self._log(f"stop requested by the collector at step {step}")
            self.state.stopped = True
            return True
        return False
