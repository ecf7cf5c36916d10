"""What the data pipeline hands the engine: micro-batches, steps and positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100  # target value that carries no loss (padding)


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Exact position in the sample stream: `index` samples of `epoch` consumed.

    Saved in checkpoints; a resume or a rollback restarts exactly here, and a
    rollback that skips a bad window moves `index` forward."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(epoch=int(d["epoch"]), index=int(d["index"]))


@dataclass(slots=True)
class MicroBatch:
    inputs: torch.Tensor  # int64 [micro_batch_size, L]
    targets: torch.Tensor  # int64 [micro_batch_size, L]; IGNORE_INDEX where there is no loss
    num_tokens: int  # targets != IGNORE_INDEX
    sample_ids: tuple[int, ...] = ()

    @property
    def seq_len(self) -> int:
        return int(self.inputs.shape[1])


@dataclass(slots=True)
class StepBatch:
    """One optimizer step's data for one data-parallel rank."""

    step: int
    micro_batches: list[MicroBatch]  # this dp rank's share, in order
    global_num_tokens: int  # loss-bearing tokens in the whole global batch (all dp ranks)
    position: DataPosition  # before this step
    next_position: DataPosition  # after this step
    meta: dict = field(default_factory=dict)
