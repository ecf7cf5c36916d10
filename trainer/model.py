"""The GPT, built for one pipeline stage of one tensor-parallel rank.

    ids -> vocab-parallel token embedding + learned positions
        -> N pre-LN blocks (causal attention, GELU MLP)
        -> final LayerNorm -> logits with the token embedding as weight (tied)

Stage p holds a contiguous slice of the layers (`pipeline.stage_layers`); the
first stage holds the embeddings, the last the final LN and head. With pp > 1
the last stage keeps its own copy of the vocab-sharded embedding for the tied
head (Megatron's scheme): it is initialised identically and its grad is summed
with the first stage's over `Axis.EMBED` by the engine.

Deterministic init is what makes every layout equivalent to the single-process
model: each parameter is generated at its FULL shape on CPU by a generator
seeded from `(seed, crc32(name))`, then this rank's TP slice is kept. Names use
GLOBAL layer indices (`layers.7.attn.qkv.weight`), so they do not depend on the
layout. Cost: each rank materialises every one of its parameters at full size
once, on CPU, at start.

Activations are `[seq, batch, hidden]`; under SP the residual stream holds only
this rank's `seq / tp` rows.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from trainer.comm import Comm
from trainer.config import ModelConfig
from trainer.parallel_dims import Axis
from trainer.pipeline import stage_layers
from trainer.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_tp_region,
    leave_tp_region,
    make_param,
    vocab_parallel_cross_entropy,
)


class LayerNorm(nn.Module):
    """LayerNorm whose (replicated) params are tagged `seq_partial` for SP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = make_param(dim, tp_dim=None, init="ones", seq_partial=True)
        self.bias = make_param(dim, tp_dim=None, init="zeros", seq_partial=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, eps=1e-5)


class Attention(nn.Module):
    """Causal self-attention with this rank's `heads / tp` heads.

    The QKV projection's output dim is laid out `[heads, 3, head_dim]`, so a
    contiguous column shard holds whole heads with their q, k and v together.
    Samples are right-padded and padded positions carry target IGNORE_INDEX, so
    the causal mask alone keeps padding out of every loss-bearing position: a
    valid token only attends to earlier, valid tokens. No padding mask needed,
    which keeps SDPA on its fused `is_causal` path."""

    def __init__(self, cfg: ModelConfig, *, comm: Comm, sp: bool) -> None:
        super().__init__()
        self.local_heads = cfg.heads // comm.size(Axis.TP)
        self.head_dim = cfg.d_model // cfg.heads
        self.dropout = cfg.dropout
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, comm=comm, sp=sp)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, comm=comm, sp=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [L, b, local_heads * 3 * head_dim]
        seq, batch = qkv.shape[:2]
        q, k, v = qkv.view(seq, batch, self.local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.permute(2, 0, 1, 3).reshape(seq, batch, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, comm: Comm, sp: bool) -> None:
        super().__init__()
        hidden = cfg.d_model * cfg.mlp_ratio
        self.fc = ColumnParallelLinear(cfg.d_model, hidden, comm=comm, sp=sp)
        self.proj = RowParallelLinear(hidden, cfg.d_model, comm=comm, sp=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, comm: Comm, sp: bool) -> None:
        super().__init__()
        self.dropout = cfg.dropout
        self.ln1 = LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, comm=comm, sp=sp)
        self.ln2 = LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, comm=comm, sp=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class GPTStage(nn.Module):
    """This rank's part of the GPT. Build on CPU (init happens here), then `.to(device)`.

    `forward(x, targets)`: x is token ids `[b, L]` on the first stage, else the
    previous stage's hidden state `[L / (tp if sp else 1), b, d]`. Returns the
    hidden state for the next stage, or on the last stage the per-token loss
    `[b, L]` (fp32, 0 where the target is ignored), or the vocab-sharded logits
    `[b, L, V / tp]` when `targets` is None.
    """

    def __init__(self, cfg: ModelConfig, *, comm: Comm, sp: bool, seed: int) -> None:
        super().__init__()
        dims = comm.dims
        self.comm, self.sp, self.dropout = comm, sp, cfg.dropout
        self.is_first, self.is_last = dims.is_first_stage, dims.is_last_stage
        self.layer_ids = stage_layers(cfg.layers, dims.pp)[dims.pp_rank]
        if self.is_first or self.is_last:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, comm=comm)
            self.embed.weight.tied_copy = self.is_last and not self.is_first
        if self.is_first:
            self.pos_embed = make_param(cfg.seq_len, cfg.d_model, tp_dim=None, init="normal", seq_partial=True)
        self.layers = nn.ModuleDict({str(i): Block(cfg, comm=comm, sp=sp) for i in self.layer_ids})
        if self.is_last:
            self.final_ln = LayerNorm(cfg.d_model)
        init_parameters(self, seed=seed, std=cfg.init_std, num_layers=cfg.layers, tp_rank=dims.tp_rank, tp=comm.size(Axis.TP))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.pos_embed.shape[0]:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than seq_len {self.pos_embed.shape[0]}")
        h = leave_tp_region(self.embed(ids.t()), self.comm, self.sp)  # [L or L/tp, b, d]
        start = self.comm.dims.tp_rank * h.shape[0] if self.sp else 0
        h = h + self.pos_embed[start:start + h.shape[0]].unsqueeze(1)
        return F.dropout(h, self.dropout, self.training)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, *, poison: bool = False) -> torch.Tensor:
        h = self.embed_tokens(x) if self.is_first else x
        for block in self.layers.values():
            h = block(h)
        if poison:  # fault injection: a NaN that really flows through loss and grads
            h = h * float("nan")
        if not self.is_last:
            return h
        logits = F.linear(enter_tp_region(self.final_ln(h), self.comm, self.sp), self.embed.weight)  # [L, b, V/tp]
        if targets is None:
            return logits.transpose(0, 1)
        return vocab_parallel_cross_entropy(logits, targets.t(), self.comm, self.embed.vocab_start).t()


def param_seed(seed: int, name: str) -> int:
    """Generator seed of one parameter: depends on the run seed and its name only.
    The CPU generator (mt19937) keeps only 32 bits of a seed, so the two are folded
    into one 32-bit value: `crc32(name)` continued from `crc32(seed)`."""
    return zlib.crc32(name.encode(), zlib.crc32(str(seed).encode()))


def full_init(name: str, shape: list[int], kind: str, *, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The parameter `name` at its full (unsharded) shape, on CPU, fp32."""
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    # GPT-2 / Megatron: projections into the residual stream shrink with depth
    scale = std / math.sqrt(2 * num_layers) if kind == "proj" else std
    return torch.empty(shape).normal_(0.0, scale, generator=gen)


@torch.no_grad()
def init_parameters(module: nn.Module, *, seed: int, std: float, num_layers: int, tp_rank: int, tp: int) -> None:
    for name, param in module.named_parameters():
        shape = list(param.shape)
        if param.tp_dim is not None:
            shape[param.tp_dim] *= tp
        full = full_init(name, shape, param.init, seed=seed, std=std, num_layers=num_layers)
        if param.tp_dim is not None:
            local = param.shape[param.tp_dim]
            full = full.narrow(param.tp_dim, tp_rank * local, local)
        param.copy_(full)
