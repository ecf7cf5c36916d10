"""`TrainEngine`: one rank's model shard, schedule, gradient sync and optimizer.

A step, in order (the same order on every rank, so collectives on different
groups can never wait on each other in a cycle):

1. the 1F1B schedule over the step's micro-batches (TP collectives inside
   forward/backward, p2p between stages); in the last backward the DP buckets
   launch their async all-reduces;
2. wait for the DP buckets; all-reduce over TP the grads that SP left partial;
   sum the tied embedding's grads over `Axis.EMBED`;
3. grad norm: squares over TP, then one PP all-reduce that also carries the loss
   (summed over DP on the last stage before); fp16 adds one WORLD max of found_inf;
4. ONE host sync fetches loss, norm and found_inf; then the step is skipped (any
   non-finite norm, in every precision) or grads are unscaled, clipped and applied.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.batch import IGNORE_INDEX, MicroBatch
from trainer.comm import Comm
from trainer.config import JobConfig
from trainer.data_parallel import GradBuckets
from trainer.faults import NO_FAULTS, StepFaults
from trainer.model import GPTStage
from trainer.optim import DynamicLossScaler, build_adamw, clip_coef, counts_in_norm, global_grad_sq_norm, lr_at
from trainer.parallel_dims import Axis, ParallelDims
from trainer.pipeline import Pipeline

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    opt_s: float  # grad sync bookkeeping, norm, clipping, optimizer
    bwd_end_ts: float  # unix time at which this rank's last backward finished
    num_micro_batches: int


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
        self.scaler = DynamicLossScaler(cfg.precision, enabled=precision == "fp16")
        self.pipeline = Pipeline(comm, device=device)

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

    def _compute_s(self, t0: float, blocked0: float) -> float:
        """Seconds since t0 that were not spent blocked on communication."""
        return (time.perf_counter() - t0) - (self.comm.blocked_s - blocked0)

    def _stall(self, faults: StepFaults, t0: float, blocked0: float) -> None:
        """Straggler fault: stretch the compute just measured to `slowdown` x."""
        if faults.slowdown <= 1.0:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # only with an injected straggler
        time.sleep((faults.slowdown - 1.0) * self._compute_s(t0, blocked0))

    # -- training ------------------------------------------------------------
    def train_step(self, step: int, micro_batches: list[MicroBatch], global_num_tokens: int,
                   faults: StepFaults = NO_FAULTS) -> StepResult:
        """One optimizer step over this dp rank's micro-batches. `step` counts from 1
        (the loop's numbering; it sets the LR). `global_num_tokens` is the number of
        loss tokens in the whole global batch, the loss's denominator."""
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        self.comm.begin_step(step)
        model, dims = self.model, self.dims
        batches = [self._prepare(mb) for mb in micro_batches]
        num_mb = len(batches)
        scale = self.scaler.scale
        inv_tokens = 1.0 / max(1, global_num_tokens)
        loss_sum = torch.zeros((), device=self.device)
        timing = {"fwd_s": 0.0, "bwd_s": 0.0, "bwd_end_ts": 0.0}
        self.grads.zero_grad()

        def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            nonlocal loss_sum
            t0, blocked0 = time.perf_counter(), self.comm.blocked_s
            inputs, targets = batches[i]
            with self._autocast():
                out = model(inputs if dims.is_first_stage else x, targets if dims.is_last_stage else None,
                            poison=faults.nan and i == 0)
            if dims.is_last_stage:
                mb_loss = out.sum() * inv_tokens
                loss_sum = loss_sum + mb_loss.detach()
                out = mb_loss * scale if scale != 1.0 else mb_loss
            self._stall(faults, t0, blocked0)
            timing["fwd_s"] += self._compute_s(t0, blocked0)
            return out

        def backward_step(i: int, y: torch.Tensor, dy: torch.Tensor | None) -> None:
            if i == num_mb - 1:
                self.grads.arm()
            t0, blocked0 = time.perf_counter(), self.comm.blocked_s
            torch.autograd.backward(y, grad_tensors=dy)
            self._stall(faults, t0, blocked0)
            timing["bwd_s"] += self._compute_s(t0, blocked0)
            timing["bwd_end_ts"] = time.time()

        self.pipeline.train_1f1b(num_mb, lambda i: self._act_shape(batches[i][0]), forward_step, backward_step)

        t_opt, blocked_opt = time.perf_counter(), self.comm.blocked_s
        loss, grad_norm, skipped, lr = self._update(step, loss_sum, scale)
        return StepResult(loss=loss, grad_norm=grad_norm, loss_scale=self.scaler.scale, lr=lr, skipped=skipped,
                          fwd_s=timing["fwd_s"], bwd_s=timing["bwd_s"], opt_s=self._compute_s(t_opt, blocked_opt),
                          bwd_end_ts=timing["bwd_end_ts"], num_micro_batches=num_mb)

    def _update(self, step: int, loss_sum: torch.Tensor, scale: float) -> tuple[float, float, bool, float]:
        """Gradient sync, norm, skip decision, optimizer. Returns (loss, grad_norm, skipped, lr)."""
        self.grads.finish()
        self._sync_replicated_grads()
        sq = global_grad_sq_norm(self._norm_params, self.comm)
        if self.dims.is_last_stage:
            self.comm.all_reduce(loss_sum, Axis.DP)
        packed = torch.stack([loss_sum, sq])  # loss_sum is 0 off the last stage
        self.comm.all_reduce(packed, Axis.PP)
        found_inf = torch.zeros((), device=self.device)
        if self.scaler.enabled:
            found_inf = (~torch.isfinite(packed[1])).float()
            self.comm.all_reduce(found_inf, Axis.WORLD, op=torch.distributed.ReduceOp.MAX)
        # The step's one host sync: the skip decision and the clip factor need these on the host.
        loss, grad_sq, inf = torch.cat([packed, found_inf.view(1)]).tolist()
        grad_norm = math.sqrt(grad_sq) / scale if grad_sq >= 0 else float("nan")
        skipped = inf > 0 or not math.isfinite(grad_norm)
        self.scaler.update(found_inf=skipped)
        lr = lr_at(step, self.cfg.optim, self.cfg.steps)
        if not skipped:
            coef = clip_coef(grad_norm, self.cfg.optim.grad_clip) / scale
            if coef != 1.0:
                torch._foreach_mul_(self.grads.buffers, coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        return loss, grad_norm, skipped, lr

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
