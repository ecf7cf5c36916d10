"""Replica integrity: a bit-exact checksum of a parameter shard, the bit flip that
corrupts one (fault injection), and the repair that copies a healthy replica over it.

Data-parallel replicas hold bit-identical parameters after every step (the same
initial weights, the same all-reduced gradients, the same optimizer). A memory
bit flip in one replica breaks that silently: nothing goes non-finite, the loss
barely moves, and the replica's gradients leak into every other through the DP
all-reduce. `shard_checksum` makes it visible: the sum of the shard's elements
read as integers (their bit patterns), in int64, kept to its low 52 bits so the
value is exact in a float64 (the telemetry's scalar column). Integer addition is
exact and order-free, so replicas holding identical bits give identical sums on
any device and any reduction order, and one flipped bit changes the sum by
±2^k (k < 52): never 0 modulo 2^52, so a single flip is always seen. It is a few
device reductions, no host sync: the trainer reads it at the step's one sync.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_CHECKSUM_MASK = (1 << 52) - 1  # exact in a float64
# the integer view of each float width, and the bit a flip sets or clears: the
# highest mantissa bit (a value changes by a factor in [2/3, 3/2], never to inf
# or NaN, whatever its exponent: noticeable, finite, and training goes on)
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
FLIP_BIT = {torch.float32: 22, torch.float64: 51, torch.bfloat16: 6, torch.float16: 9}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as signed integers of the same width (a view, no copy)."""
    return t.detach().reshape(-1).view(_INT_VIEW[t.element_size()])


def shard_checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-d float64 tensor on the tensors' device: the sum of every element's bit
    pattern, modulo 2^52. Device ops only (no sync)."""
    sums = [_bits(t).sum(dtype=torch.int64) for t in tensors if t.numel()]
    if not sums:
        return torch.zeros((), dtype=torch.float64)
    total = torch.stack(sums).sum() if len(sums) > 1 else sums[0]
    return torch.bitwise_and(total, _CHECKSUM_MASK).to(torch.float64)


def flip_bit(t: torch.Tensor, index: int, bit: int | None = None) -> tuple[int, int, int]:
    """Flip one bit of element `index` (flat) of `t`, in place on its device (default:
    the dtype's top mantissa bit, FLIP_BIT). Returns (bit, bits before, bits after)."""
    bit = FLIP_BIT.get(t.dtype, 8 * t.element_size() - 2) if bit is None else bit
    if not 0 <= bit < 8 * t.element_size():
        raise ValueError(f"bit {bit} outside a {t.element_size()}-byte element")
    if not t.is_contiguous():
        raise ValueError("flip_bit needs a contiguous tensor (parameters and optimizer state are)")
    width = 8 * t.element_size()
    mask = (1 << bit) if bit < width - 1 else -(1 << bit)  # the sign bit of a signed view
    cell = _bits(t)[index:index + 1]
    before = int(cell.item())  # fault injection only: a sync is fine here
    cell.bitwise_xor_(mask)
    return bit, before, int(cell.item())


def state_tensors(engine) -> list[torch.Tensor]:
    """Every tensor that makes a replica: parameters, then the optimizer's state (in
    parameter order, keys sorted), all in the same order on every replica."""
    params = list(engine.model.parameters())
    out = list(params)
    for p in params:
        st = engine.optimizer.state.get(p, {})
        out.extend(v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor))
    return out


def broadcast_replica(engine, comm, axis, src_group_rank: int) -> int:
    """Copy replica `src_group_rank`'s parameters and optimizer state to every replica
    of this rank's `axis` (DP) group: one flat broadcast per dtype. Every rank of the
    group calls it. Returns the bytes broadcast."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in state_tensors(engine):
        by_dtype.setdefault(t.dtype, []).append(t)
    nbytes = 0
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            comm.broadcast(flat, axis, src_group_rank=src_group_rank)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            nbytes += flat.numel() * flat.element_size()
    return nbytes


def named_tensors(engine, target: str) -> list[tuple[str, torch.Tensor]]:
    """What a `bitflip` may hit: the parameters (`param`) or the optimizer's moment
    tensors (`optim`; its step counters are not memory a flip is drawn from)."""
    named = list(engine.model.named_parameters())
    if target == "param":
        return [(n, p.data) for n, p in named]
    return [(f"{n}.{k}", v) for n, p in named for k, v in sorted(engine.optimizer.state.get(p, {}).items())
            if isinstance(v, torch.Tensor) and k != "step" and v.is_floating_point()]
