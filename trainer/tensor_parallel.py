"""Megatron-style tensor (and sequence) parallelism over the instrumented `Comm`.

Activations are laid out `[seq, batch, hidden]` (Megatron's order) everywhere in
the model, so the sequence dim is dim 0: `Comm.all_gather` / `Comm.reduce_scatter`
work on dim 0, and a sequence-parallel shard is a contiguous slice of it.

The communication ops are explicit autograd functions, each the conjugate of the
other in backward:

    copy_to_tp             identity     | all-reduce
    reduce_from_tp         all-reduce   | identity
    gather_from_sp         all-gather   | reduce-scatter   (seq dim)
    reduce_scatter_to_sp   reduce-scatter | all-gather     (seq dim)
    scatter_to_sp          slice        | all-gather       (seq dim)

Every one is free when the TP group has one member. Parameters carry three
attributes the rest of the engine reads instead of guessing from names:

    tp_dim       dim along which the FULL tensor is split over tp (None: replicated)
    seq_partial  replicated, but under SP each rank's grad covers only its
                 sequence shard, so the grads are all-reduced over TP after backward
    init         how the full tensor is initialised ("normal", "proj", "ones", "zeros")
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.batch import IGNORE_INDEX
from trainer.comm import Comm
from trainer.parallel_dims import Axis


def make_param(*shape: int, tp_dim: int | None, init: str, seq_partial: bool = False) -> nn.Parameter:
    """An uninitialised parameter of this rank's LOCAL shape, tagged for init and grad sync."""
    param = nn.Parameter(torch.empty(*shape))
    param.tp_dim = tp_dim
    param.seq_partial = seq_partial
    param.init = init
    return param


def _tp_size(comm: Comm) -> int:
    return comm.size(Axis.TP)


# -- mappings ------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # never reduce into a buffer autograd may share
        ctx.comm.all_reduce(grad, Axis.TP)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        x = x.contiguous().clone()
        comm.all_reduce(x, Axis.TP)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * _tp_size(comm), *x.shape[1:]))
    comm.all_gather(out, x, Axis.TP)
    return out


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = x.contiguous()
    tp = _tp_size(comm)
    if x.shape[0] % tp:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp {tp}")
    out = x.new_empty((x.shape[0] // tp, *x.shape[1:]))
    comm.reduce_scatter(out, x, Axis.TP)
    return out


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comm), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        tp = _tp_size(comm)
        chunk = x.shape[0] // tp
        return x.narrow(0, comm.dims.tp_rank * chunk, chunk).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if _tp_size(comm) == 1 else _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if _tp_size(comm) == 1 else _ReduceFromTP.apply(x, comm)


def gather_from_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if _tp_size(comm) == 1 else _GatherFromSP.apply(x, comm)


def reduce_scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if _tp_size(comm) == 1 else _ReduceScatterToSP.apply(x, comm)


def scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if _tp_size(comm) == 1 else _ScatterToSP.apply(x, comm)


def enter_tp_region(x: torch.Tensor, comm: Comm, sp: bool) -> torch.Tensor:
    """Input of a column-parallel op: the full sequence, grads summed over tp in backward.

    Under autocast the SP all-gather moves the activation already in the low
    precision the matmul would cast it to anyway: half the bytes, same result."""
    if not sp:
        return copy_to_tp(x, comm)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    return gather_from_sp(x, comm)


def leave_tp_region(x: torch.Tensor, comm: Comm, sp: bool) -> torch.Tensor:
    """Output of a row-parallel op (partial sums): reduced, and split on seq under SP."""
    return reduce_scatter_to_sp(x, comm) if sp else reduce_from_tp(x, comm)


# -- layers --------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split on its output dim; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, *, comm: Comm, sp: bool, init: str = "normal") -> None:
        super().__init__()
        tp = _tp_size(comm)
        if out_features % tp:
            raise ValueError(f"output features {out_features} not divisible by tp {tp}")
        self.comm, self.sp = comm, sp
        self.weight = make_param(out_features // tp, in_features, tp_dim=0, init=init)
        self.bias = make_param(out_features // tp, tp_dim=0, init="zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(enter_tp_region(x, self.comm, self.sp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split on its input dim; the partial sums are reduced
    (reduce-scattered on seq under SP) and the replicated bias added after."""

    def __init__(self, in_features: int, out_features: int, *, comm: Comm, sp: bool, init: str = "proj") -> None:
        super().__init__()
        tp = _tp_size(comm)
        if in_features % tp:
            raise ValueError(f"input features {in_features} not divisible by tp {tp}")
        self.comm, self.sp = comm, sp
        self.weight = make_param(out_features, in_features // tp, tp_dim=1, init=init)
        self.bias = make_param(out_features, tp_dim=None, init="zeros", seq_partial=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _tp_size(self.comm) == 1:  # nothing to reduce: the bias in the matmul (addmm), as nn.Linear
            return F.linear(x, self.weight, self.bias)
        return leave_tp_region(F.linear(x, self.weight), self.comm, self.sp) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over tp. `forward` returns
    the PARTIAL lookup (zeros for ids owned by other ranks); the caller reduces it
    with `leave_tp_region`, which under SP also splits the sequence."""

    def __init__(self, vocab_size: int, dim: int, *, comm: Comm) -> None:
        super().__init__()
        tp = _tp_size(comm)
        if vocab_size % tp:
            raise ValueError(f"vocab size {vocab_size} not divisible by tp {tp}")
        self.comm = comm
        self.vocab_per_rank = vocab_size // tp
        self.vocab_start = comm.dims.tp_rank * self.vocab_per_rank
        self.weight = make_param(self.vocab_per_rank, dim, tp_dim=0, init="normal")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if _tp_size(self.comm) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


# -- cross entropy -------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over vocab-sharded logits, in fp32.

    Two collectives: the max (for stability) and one stacked all-reduce of
    (sum of exp, target logit). Ignored targets get loss 0 and grad 0."""

    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start):
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.amax(dim=-1)
        comm.all_reduce(logits_max, Axis.TP, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        local_t = targets - vocab_start
        outside = (local_t < 0) | (local_t >= vocab_local)
        local_t = local_t.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # `shifted` is ours: reuse its memory for exp
        stats = torch.stack([exp.sum(dim=-1), target_logit])
        comm.all_reduce(stats, Axis.TP)
        sum_exp, target_logit = stats[0], stats[1]
        ignored = targets == IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, outside | ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, no_target_here, ignored = ctx.saved_tensors
        grad = softmax  # saved tensors are not reused after backward: update in place
        hit = (~no_target_here).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm, vocab_start: int) -> torch.Tensor:
    """Per-token loss (fp32, same shape as `targets`) for logits sharded on the last dim."""
    if _tp_size(comm) == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="none").view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, comm, vocab_start)
