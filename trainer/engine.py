"""`TrainEngine`: one rank's model shard, schedule, gradient sync and optimizer.

A step, in order (the same order on every rank, so collectives on different
groups can never wait on each other in a cycle):

1. the 1F1B schedule over the step's micro-batches (TP collectives inside
   forward/backward, p2p between stages); in the last backward the DP buckets
   launch their async all-reduces;
2. wait for the DP buckets; all-reduce over TP the grads that SP left partial;
   sum the tied embedding's grads over `Axis.EMBED`;
3. grad norm: squares over TP, then one PP all-reduce that also carries the loss
   (summed over DP on the last stage before) and the replica's own loss (the same
   sum taken before the DP all-reduce); fp16 adds one WORLD max of found_inf;
4. ONE host sync fetches loss, norm, local loss, found_inf and this rank's two
   finite flags; then the step is skipped (any non-finite norm, in every
   precision) or grads are unscaled, clipped and applied.

The finite flags are the rank's own view, taken on the device before anything
crosses ranks (analysis/frames.py): `finite_fwd`, every forward output of this
stage (on the last stage: the hidden state entering the loss head, before its TP
reductions) was finite; `finite_bwd`, its gradients were, before the DP
all-reduce (`GradBuckets.local_finite`). A NaN is then named where it first
appears: forward before backward, an earlier stage before a later one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.batch import IGNORE_INDEX, MicroBatch
from trainer.comm import Comm
from trainer.config import JobConfig
from trainer.data_parallel import GradBuckets
from trainer.faults import NO_FAULTS, StepFaults
from trainer.integrity import shard_checksum
from trainer.model import GPTStage
from trainer.optim import (
    DynamicLossScaler,
    all_finite,
    build_adamw,
    clip_coef,
    counts_in_norm,
    global_grad_sq_norm,
    lr_at,
)
from trainer.parallel_dims import Axis, ParallelDims
from trainer.pipeline import Pipeline

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (every rank's [finite_fwd, finite_bwd, local loss, dp rank, stage], loss, grad_norm) -> apply the update?
Probe = Callable[[list[list[float]], float, float], bool]


@dataclass(slots=True)
class StepResult:
    loss: float  # token-mean loss over the whole global batch, identical on every rank
    grad_norm: float  # global, before clipping (unscaled)
    loss_scale: float  # the scale after this step's update (what the next step uses)
    lr: float
    skipped: bool
    # Phase times are compute only: host seconds in the phase minus the time blocked on
    # communication inside it (that time is the step's exposed comm, counted once, in
    # the comm layer). A straggler's extra time shows here; its peers' waiting does not.
    fwd_s: float
    bwd_s: float
    opt_s: float  # grad sync bookkeeping (the DP buckets' checks and launches in backward too), norm, clipping, optimizer
    bwd_end_ts: float  # unix time at which this rank's last backward finished
    num_micro_batches: int
    # This rank's local signals (analysis/frames.py), read at the same host sync:
    local_loss: float = math.nan  # token-mean loss of this DP replica's micro-batches, before the DP average
    finite_fwd: int = 1  # 1: every forward output of this stage (pre-head on the last) was finite
    finite_bwd: int = 1  # 1: this rank's local gradients (before the DP all-reduce) were finite
    # trainer/integrity.py: the shard's parameter checksum as the step began (after the
    # previous update), on the steps asked for (`train_step(checksum=True)`); None else
    checksum: float | None = None


class TrainEngine:
    def __init__(self, cfg: JobConfig, dims: ParallelDims, comm: Comm, device: torch.device) -> None:
        self.cfg, self.dims, self.comm, self.device = cfg, dims, comm, device
        self.tp = comm.size(Axis.TP)
        self.sp = cfg.parallel.sp and self.tp > 1
        # Dropout masks come from the global RNG: every TP rank of a stage draws the
        # same stream, so replicated regions agree across the TP group.
        torch.manual_seed(cfg.seed + 1_000_003 * dims.pp_rank + 7_919 * dims.dp_rank)
        self.model = GPTStage(cfg.model, comm=comm, sp=self.sp, seed=cfg.seed).to(device)
        self.model.train()
        named = list(self.model.named_parameters())
        self.param_names = [name for name, _ in named]
        params = [p for _, p in named]
        self.grads = GradBuckets(params, comm, bucket_mb=cfg.parallel.bucket_mb, device=device)
        self._seq_partial = [p for p in params if p.seq_partial] if self.sp else []
        self._tied = self.model.embed.weight if dims.pp > 1 and (dims.is_first_stage or dims.is_last_stage) else None
        self._norm_params = [p for p in params if counts_in_norm(p, dims.tp_rank)]
        self.optimizer = build_adamw(named, cfg.optim)
        precision = cfg.precision.precision
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)
        self._stalled_s = 0.0  # injected straggler/jitter sleep, all steps (counts as compute)
        self._checksum: float | None = None  # read at the last step's host sync (train_step(checksum=True))
        self.scaler = DynamicLossScaler(cfg.precision, enabled=precision == "fp16")
        self.pipeline = Pipeline(comm, device=device)
        # AND of all_finite over the step's forward outputs, on the device; None outside train_step
        self._fwd_ok: torch.Tensor | None = None
        if dims.is_last_stage:  # the hidden state entering the loss head, before its TP reductions
            self.model.final_ln.register_forward_pre_hook(self._check_head_input)

    def _check_head_input(self, _module, args) -> None:
        self._note_finite(args[0])

    def _note_finite(self, x: torch.Tensor) -> None:
        """Fold "x is all finite" into the step's forward flag (device ops, no sync)."""
        if self._fwd_ok is not None:
            self._fwd_ok = self._fwd_ok & all_finite(x.detach())

    @property
    def shard_key(self) -> str:
        return f"pp{self.dims.pp_rank:02d}-tp{self.dims.tp_rank:02d}"

    # -- inputs ------------------------------------------------------------
    def _prepare(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Move to the device; under SP right-pad the sequence to a multiple of tp
        (padding carries IGNORE_INDEX targets, and causal attention keeps it out of
        the valid positions, so the loss is unchanged)."""
        inputs, targets = mb.inputs, mb.targets
        pad = (-inputs.shape[1]) % self.tp if self.sp else 0
        if pad:
            inputs = F.pad(inputs, (0, pad), value=0)
            targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def _act_shape(self, inputs: torch.Tensor) -> tuple[int, int, int]:
        batch, seq = inputs.shape
        return (seq // self.tp if self.sp else seq, batch, self.cfg.model.d_model)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _mark(self) -> tuple[float, float, float, float, float]:
        """Where a compute window starts: wall, blocked, thread CPU, blocked CPU, stalled."""
        c = self.comm
        return time.perf_counter(), c.blocked_s, time.thread_time(), c.blocked_cpu_s, self._stalled_s

    def _compute_s(self, m: tuple[float, float, float, float, float]) -> float:
        """Compute seconds since the mark `m`, net of communication.

        On CUDA: host wall time minus the time blocked on communication (what the
        host saw; the device's own times are the CUDA events of the comm layer).
        On CPU the CPU is the device, and this rank's device time is the CPU time
        its compute thread used, net of what it used inside communication ops,
        plus any injected stall (a slow device): wall time on an oversubscribed
        host also counts the time the scheduler gave this rank's core to another
        rank, which no real device loses, and made every rank of a 2-core run look
        like a straggler now and then. (One intra-op thread per rank, as the
        launcher sets it, puts all compute on this thread.)"""
        c = self.comm
        if self.device.type == "cuda":
            return (time.perf_counter() - m[0]) - (c.blocked_s - m[1])
        cpu = (time.thread_time() - m[2]) - (c.blocked_cpu_s - m[3])
        return max(cpu, 0.0) + (self._stalled_s - m[4])

    def _stall(self, faults: StepFaults, m: tuple[float, float, float, float, float]) -> None:
        """Straggler fault: stretch the compute just measured to `slowdown` x (a slow
        device: the rank really takes that long)."""
        if faults.slowdown <= 1.0:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # only with an injected straggler
        extra = (faults.slowdown - 1.0) * self._compute_s(m)
        time.sleep(extra)
        self._stalled_s += extra

    # -- training ------------------------------------------------------------
    def train_step(self, step: int, micro_batches: list[MicroBatch], global_num_tokens: int,
                   faults: StepFaults = NO_FAULTS, probe: Probe | None = None, checksum: bool = False) -> StepResult:
        """One optimizer step over this dp rank's micro-batches. `step` counts from 1
        (the loop's numbering; it sets the LR). `global_num_tokens` is the number of
        loss tokens in the whole global batch, the loss's denominator.

        `probe` (a rollback's rerun of the suspect step, trainer/diagnosis.py): after
        the host sync every rank's (finite_fwd, finite_bwd, local loss, dp rank, stage)
        is gathered over the world, one small all-gather, and `probe(rows, loss,
        grad_norm)` decides whether the update is applied (False: skipped, the scaler
        untouched). Every rank calls it with the same rows.

        `checksum`: also take the shard's parameter checksum (trainer/integrity.py) as
        the step begins, on the device, and read it at the step's one host sync."""
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        self.comm.begin_step(step, faults.slow_links)
        model, dims = self.model, self.dims
        batches = [self._prepare(mb) for mb in micro_batches]
        num_mb = len(batches)
        scale = self.scaler.scale
        inv_tokens = 1.0 / max(1, global_num_tokens)
        loss_sum = torch.zeros((), device=self.device)
        timing = {"fwd_s": 0.0, "bwd_s": 0.0, "bwd_end_ts": 0.0, "sync_s": 0.0}
        self.grads.zero_grad()
        cks = shard_checksum(self.model.parameters()) if checksum else None  # device ops: no sync
        self._fwd_ok = torch.ones((), dtype=torch.bool, device=self.device)
        local_tokens = sum(mb.num_tokens for mb in micro_batches)

        def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            nonlocal loss_sum
            m = self._mark()
            inputs, targets = batches[i]
            with self._autocast():
                out = model(inputs if dims.is_first_stage else x, targets if dims.is_last_stage else None,
                            poison=faults.nan and i == 0)
            if dims.is_last_stage:
                mb_loss = out.sum() * inv_tokens
                loss_sum = loss_sum + mb_loss.detach()
                out = mb_loss * scale if scale != 1.0 else mb_loss
            else:  # the activations this stage sends on
                self._note_finite(out)
            self._stall(faults, m)
            timing["fwd_s"] += self._compute_s(m)
            return out

        def backward_step(i: int, y: torch.Tensor, dy: torch.Tensor | None) -> None:
            if i == num_mb - 1:
                self.grads.arm()
            m = self._mark()
            synced = self.grads.sync_s
            if faults.overflow and i == num_mb - 1:  # injected overflow: this rank's gradients go infinite
                y, dy = (y * math.inf, None) if dy is None else (y, dy * math.inf)
            torch.autograd.backward(y, grad_tensors=dy)
            self._stall(faults, m)
            sync = self.grads.sync_s - synced  # the DP buckets' bookkeeping in it: grad sync, booked in opt_s
            timing["bwd_s"] += max(0.0, self._compute_s(m) - sync)
            timing["sync_s"] += sync
            timing["bwd_end_ts"] = time.time()

        self.pipeline.train_1f1b(num_mb, lambda i: self._act_shape(batches[i][0]), forward_step, backward_step)

        m_opt = self._mark()
        fwd_ok, self._fwd_ok = self._fwd_ok, None
        to_local = max(1, global_num_tokens) / max(1, local_tokens)  # the replica's loss sum -> its token mean
        veto = self._gathered(probe, to_local) if probe is not None else None
        loss, grad_norm, skipped, lr, local_sum, finite_fwd, finite_bwd = self._update(step, loss_sum, scale, fwd_ok,
                                                                                       veto, cks)
        return StepResult(loss=loss, grad_norm=grad_norm, loss_scale=self.scaler.scale, lr=lr, skipped=skipped,
                          fwd_s=timing["fwd_s"], bwd_s=timing["bwd_s"],
                          opt_s=self._compute_s(m_opt) + timing["sync_s"],
                          bwd_end_ts=timing["bwd_end_ts"], num_micro_batches=num_mb,
                          local_loss=local_sum * to_local, finite_fwd=finite_fwd, finite_bwd=finite_bwd,
                          checksum=self._checksum)

    def _gathered(self, probe: Probe, to_local: float) -> Callable[[float, float, float, int, int], bool]:
        """The probe as `_update` calls it: this rank's view in, every rank's out."""
        def veto(loss: float, grad_norm: float, local_sum: float, finite_fwd: int, finite_bwd: int) -> bool:
            d = self.dims
            mine = torch.tensor([finite_fwd, finite_bwd, local_sum * to_local, d.dp_rank, d.pp_rank * d.tp + d.tp_rank],
                                dtype=torch.float64, device=self.device)
            rows = torch.empty(d.world_size * mine.numel(), dtype=torch.float64, device=self.device)
            self.comm.all_gather(rows, mine, Axis.WORLD)
            return probe(rows.view(d.world_size, -1).tolist(), loss, grad_norm)
        return veto

    def _update(self, step: int, loss_sum: torch.Tensor, scale: float, fwd_ok: torch.Tensor,
                veto: Callable[..., bool] | None = None,
                cks: torch.Tensor | None = None) -> tuple[float, float, bool, float, float, int, int]:
        """Gradient sync, norm, skip decision, optimizer. Returns (loss, grad_norm, skipped,
        lr, the replica's own loss sum over the global token count, finite_fwd, finite_bwd)."""
        self.grads.finish()
        bwd_ok = self.grads.local_finite()  # each bucket was checked before its DP all-reduce
        self._sync_replicated_grads()
        sq = global_grad_sq_norm(self._norm_params, self.comm)
        local_sum = loss_sum.clone()  # this replica's, before the DP sum (0 off the last stage)
        if self.dims.is_last_stage:
            self.comm.all_reduce(loss_sum, Axis.DP)
        # one PP all-reduce carries the loss, the norm and the replica's loss to every stage
        packed = torch.stack([loss_sum, sq, local_sum])  # the losses are 0 off the last stage
        self.comm.all_reduce(packed, Axis.PP)
        found_inf = torch.zeros((), device=self.device)
        if self.scaler.enabled:
            found_inf = (~torch.isfinite(packed[1])).float()
            self.comm.all_reduce(found_inf, Axis.WORLD, op=torch.distributed.ReduceOp.MAX)
        # The step's one host sync: the skip decision and the clip factor need these on the host;
        # this rank's finite flags ride along (never reduced: they are its own).
        flags = torch.stack([found_inf, fwd_ok.float(), bwd_ok.float()])
        host = torch.cat([packed, flags])
        if cks is not None:  # exact in float64 (< 2^52); the float32 values widen exactly
            host = torch.cat([host.double(), cks.reshape(1)])
        values = host.tolist()
        loss, grad_sq, local, inf, finite_fwd, finite_bwd = values[:6]
        self._checksum = values[6] if cks is not None else None
        grad_norm = math.sqrt(grad_sq) / scale if grad_sq >= 0 else float("nan")
        skipped = inf > 0 or not math.isfinite(grad_norm)
        self.scaler.update(found_inf=skipped)
        if veto is not None and not veto(loss, grad_norm, local, int(finite_fwd), int(finite_bwd)):
            skipped = True  # the rerun found the batch bad: no update, and no scaler backoff for it
        lr = lr_at(step, self.cfg.optim, self.cfg.steps)
        if not skipped:
            coef = clip_coef(grad_norm, self.cfg.optim.grad_clip) / scale
            if coef != 1.0:
                torch._foreach_mul_(self.grads.buffers, coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        return loss, grad_norm, skipped, lr, local, int(finite_fwd), int(finite_bwd)

    def _sync_replicated_grads(self) -> None:
        """SP leaves replicated params with per-shard grads: sum them over TP. The
        tied embedding's two copies each hold part of its grad: sum over EMBED."""
        if self._seq_partial:
            flat = torch.cat([p.grad.reshape(-1) for p in self._seq_partial])
            self.comm.all_reduce(flat, Axis.TP)
            offset = 0
            for p in self._seq_partial:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if self._tied is not None:
            self.comm.all_reduce(self._tied.grad, Axis.EMBED)

    # -- evaluation ------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch]) -> tuple[float, int]:
        """(sum of token losses, number of loss tokens) over these micro-batches,
        identical on every rank of the replica. One host sync."""
        model, dims = self.model, self.dims
        batches = [self._prepare(mb) for mb in micro_batches]
        total = torch.zeros((), device=self.device)

        def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            nonlocal total
            inputs, targets = batches[i]
            with self._autocast():
                out = model(inputs if dims.is_first_stage else x, targets if dims.is_last_stage else None)
            if dims.is_last_stage:
                total = total + out.sum()
            return out

        model.eval()
        try:
            self.pipeline.forward_only(len(batches), lambda i: self._act_shape(batches[i][0]), forward_step)
        finally:
            model.train()
        self.comm.all_reduce(total, Axis.PP)
        return float(total.item()), sum(mb.num_tokens for mb in micro_batches)

    # -- checkpoint state ------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: fp32 params by stable name, AdamW state, loss scaler.
        Identical on every dp rank (no optimizer sharding), so any one can be saved.
        The tensors are the live ones, not copies: copy them before the next step."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.scaler.load_state_dict(state["scaler"])
        self.grads.zero_grad()
