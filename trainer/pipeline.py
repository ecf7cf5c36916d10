"""Pipeline parallelism: the layer split and the 1F1B / forward-only schedules.

The schedule is Megatron's non-interleaved 1F1B. Stage `p` of `P` runs
`min(P - p - 1, M)` warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. Every transfer goes through
`Comm.batch_p2p`, and the paired transfers of the steady phase
(send activation + receive gradient, send gradient + receive activation) are
posted together, so the order in which neighbours post can never deadlock, for
any `P` and any `M >= 1` (also `M < P`). In-flight activations are bounded by
`P - p` micro-batches per stage instead of `M` (GPipe).

Every stage of a replica gets the same micro-batches, so the receive buffers'
shapes are known up front (`shape_of(i)`); nothing about shapes is exchanged.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from trainer.comm import Comm, wait_all

ForwardStep = Callable[[int, "torch.Tensor | None"], torch.Tensor]
BackwardStep = Callable[[int, torch.Tensor, "torch.Tensor | None"], None]
ShapeOf = Callable[[int], tuple[int, ...]]


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous global layer indices per stage, as even as possible (earlier
    stages take the remainder: the last stage also carries the head and loss)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp} stages")
    base, extra = divmod(num_layers, pp)
    bounds = [0]
    for stage in range(pp):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


class Pipeline:
    """Runs one stage's side of a schedule. Stage compute is given as callbacks:

    - `forward_step(i, x)` -> the stage output for micro-batch i (`x` is None on
      the first stage); on the last stage the (scaled) loss to backpropagate;
    - `backward_step(i, y, dy)` runs backward from output `y` with grad `dy`
      (None on the last stage).

    The gradient sent upstream is the received activation's `.grad`.
    """

    def __init__(self, comm: Comm, *, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        dims = comm.dims
        self.comm, self.device, self.dtype = comm, device, dtype
        self.num_stages, self.stage = dims.pp, dims.pp_rank
        self.prev_rank = None if dims.is_first_stage else dims.rank_at(pp=dims.pp_rank - 1)
        self.next_rank = None if dims.is_last_stage else dims.rank_at(pp=dims.pp_rank + 1)

    # -- transfers: each posts its sends and receives together and waits for all --
    def _exchange(self, send: torch.Tensor | None, send_to: int | None,
                  recv_shape: tuple[int, ...] | None, recv_from: int | None) -> torch.Tensor | None:
        sends = [] if send is None or send_to is None else [(send.detach().to(self.dtype).contiguous(), send_to)]
        buf = None
        recvs = []
        if recv_shape is not None and recv_from is not None:
            buf = torch.empty(recv_shape, dtype=self.dtype, device=self.device)
            recvs.append((buf, recv_from))
        wait_all(self.comm.batch_p2p(sends, recvs))
        return buf

    def _recv_forward(self, shape: tuple[int, ...], *, grad: bool) -> torch.Tensor | None:
        x = self._exchange(None, None, shape, self.prev_rank)
        return x.requires_grad_() if x is not None and grad else x

    # -- schedules ---------------------------------------------------------
    def train_1f1b(self, num_micro_batches: int, shape_of: ShapeOf,
                   forward_step: ForwardStep, backward_step: BackwardStep) -> None:
        num_mb = num_micro_batches
        num_warmup = min(self.num_stages - self.stage - 1, num_mb)
        num_steady = num_mb - num_warmup
        inputs: deque[torch.Tensor | None] = deque()
        outputs: deque[torch.Tensor] = deque()

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            y = forward_step(i, x)
            inputs.append(x)
            outputs.append(y)
            return y

        def backward(i: int, dy: torch.Tensor | None) -> torch.Tensor | None:
            x, y = inputs.popleft(), outputs.popleft()
            backward_step(i, y, dy)
            return None if x is None else x.grad

        for i in range(num_warmup):
            y = forward(i, self._recv_forward(shape_of(i), grad=True))
            self._exchange(y, self.next_rank, None, None)

        x = self._recv_forward(shape_of(num_warmup), grad=True) if num_steady else None
        for k in range(num_steady):
            i = num_warmup + k  # forward index; k is the backward index
            y = forward(i, x)
            dy = self._exchange(y, self.next_rank, shape_of(k), self.next_rank)
            dx = backward(k, dy)
            if k == num_steady - 1:
                self._exchange(dx, self.prev_rank, None, None)
            else:
                x = self._exchange(dx, self.prev_rank, shape_of(i + 1), self.prev_rank)
                if x is not None:
                    x.requires_grad_()

        for k in range(num_steady, num_mb):
            dy = self._exchange(None, None, shape_of(k), self.next_rank)
            dx = backward(k, dy)
            self._exchange(dx, self.prev_rank, None, None)

    def forward_only(self, num_micro_batches: int, shape_of: ShapeOf, forward_step: ForwardStep) -> None:
        """Evaluation: each micro-batch flows through the stages; nothing flows back."""
        for i in range(num_micro_batches):
            y = forward_step(i, self._recv_forward(shape_of(i), grad=False))
            self._exchange(y, self.next_rank, None, None)
