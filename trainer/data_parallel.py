"""Data parallelism: flat gradient buckets all-reduced from backward hooks.

Every parameter's `.grad` is a view into one flat fp32 buffer per bucket
(DDP's `gradient_as_bucket_view`): autograd accumulates the micro-batches into
it in place, a bucket is one collective, and the optimizer, clipping and the
norm can work on a few flat tensors. Buckets are filled in reverse
registration order (roughly the order backward produces grads) up to
`bucket_mb` each.

During the LAST micro-batch's backward, `register_post_accumulate_grad_hook`
counts the parameters of each bucket as their grads land; a complete bucket is
all-reduced over `Axis.DP` at once with `async_op=True`, so the transfer runs
while backward computes the earlier layers. Buckets are launched strictly in
bucket order (a finished later bucket waits for the earlier ones), so every DP
rank issues the same collectives in the same order. `finish()` launches what is
left and waits for all of them.

`local_finite()` says whether this rank's own gradients were all finite: each
bucket is checked on the device right before its all-reduce (one reduction per
bucket, `all_finite`, no sync), so a NaN a peer contributed does not count.

`sync_s` counts the host seconds (the compute thread's CPU time on a CPU device)
spent in that bookkeeping inside backward: the engine books it as grad sync
(`opt_s`), not backward compute. It is a fixed cost per step, and in `bwd_s` it
made a replica of one micro-batch look 1.3x slower per micro-batch than one of
five (a rebalance's split, judged per micro-batch: analysis/frames.py).

The reduction is a SUM: each micro-batch loss is already divided by the global
token count. With dp == 1 no hook is registered and nothing is launched: the
buffers cost only the memory the grads take anyway.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from trainer.comm import Comm, Handle
from trainer.optim import all_finite
from trainer.parallel_dims import Axis

FP32_BYTES = 4


class GradBuckets:
    def __init__(self, params: list[nn.Parameter], comm: Comm, *, bucket_mb: float, device: torch.device) -> None:
        self.comm = comm
        self.overlap = comm.size(Axis.DP) > 1
        cap_elems = max(1, int(bucket_mb * 2**20) // FP32_BYTES)
        groups: list[list[nn.Parameter]] = []
        size = cap_elems
        for param in reversed(params):
            if size + param.numel() > cap_elems and (not groups or groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(param)
            size += param.numel()
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._bucket_of: dict[int, int] = {}
        self._sizes = [len(group) for group in groups]
        for index, group in enumerate(groups):
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=torch.float32, device=device)
            offset = 0
            for param in group:
                view = buffer[offset:offset + param.numel()].view_as(param)
                param.grad = view
                self._views.append((param, view))
                self._bucket_of[id(param)] = index
                offset += param.numel()
            self.buffers.append(buffer)
        self._armed = False
        self._pending: list[int] = []
        self._seen: set[int] = set()
        self._next_launch = 0
        self._handles: list[Handle] = []
        self._finite: list[torch.Tensor] = []  # per launched bucket: all_finite(...) before the reduction
        self._clock = time.thread_time if device.type == "cpu" else time.perf_counter
        self.sync_s = 0.0  # seconds in the bookkeeping of the armed backward (the module doc), all steps
        if self.overlap:
            for param, _ in self._views:
                param.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def num_buckets(self) -> int:
        return len(self.buffers)

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()
        for param, view in self._views:  # someone may have set .grad = None
            if param.grad is not view:
                param.grad = view

    def arm(self) -> None:
        """Call right before the step's last backward: from now on complete buckets launch."""
        if not self.overlap:
            return
        self._armed = True
        self._pending = list(self._sizes)
        self._seen.clear()
        self._next_launch = 0
        self._handles = []
        self._finite = []

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._armed or id(param) in self._seen:
            return
        self._seen.add(id(param))
        self._pending[self._bucket_of[id(param)]] -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        t0 = None  # the clock is read only around launches: this runs for every parameter's grad
        while self._next_launch < len(self.buffers) and (force or self._pending[self._next_launch] == 0):
            t0 = self._clock() if t0 is None else t0
            self._finite.append(all_finite(self.buffers[self._next_launch]))
            self._handles.append(self.comm.all_reduce(self.buffers[self._next_launch], Axis.DP, async_op=True))
            self._next_launch += 1
        if t0 is not None:
            self.sync_s += self._clock() - t0

    def finish(self) -> None:
        """Launch the buckets whose params got no grad in the last backward, then wait for all."""
        if not self._armed:
            return
        self._launch_ready(force=True)
        for handle in self._handles:
            handle.wait()
        self._handles = []
        self._armed = False

    def local_finite(self) -> torch.Tensor:
        """A bool tensor on the device: this rank's gradients of the step were all finite
        before any DP reduction. Call after `finish()`. No host sync."""
        if self.overlap and len(self._finite) == len(self.buffers):
            flags = self._finite
        else:  # dp == 1 (nothing is reduced), or finish() was not reached: the buffers as they are
            flags = [all_finite(buffer) for buffer in self.buffers]
        if not flags:
            return torch.ones((), dtype=torch.bool, device=self.comm.device)
        if len(flags) == 1:
            return flags[0]
        return torch.stack(flags).all()
