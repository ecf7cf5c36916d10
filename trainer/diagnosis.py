"""The rerun is the diagnosis: data, device or transient.

After a rollback the suspect step runs again, with the data-parallel replicas'
micro-batches rotated by one (`DataLoader.swap_at`): replica d trains on what
replica d+1 trained on the first time. The global batch, and so the step's math,
is the same; only the suspect samples now sit on another device. Each rank then
reports its own view of the probe step (`ProbeRow`: its finite flags and its
replica's loss), gathered across the world once, and every rank computes the same
`Verdict` from the same rows:

- the anomaly moved with the samples to the rank that now holds them: **data**
  (skip those samples, never show them again);
- it stayed on the rank that had it, although that rank now holds other samples:
  **device** (isolate its node);
- it did not come back at all: **transient** (count it against the node; the
  probe was a clean step and is kept as the real one).

With one replica (dp = 1) nothing can move: a reproduction then counts as data,
and the evidence says so. A loss spike of a whole poisoned global batch shows on
every replica whatever the swap: it reproduces, so it is data too.

Pure: no torch, no I/O. `trainer/control.py` plans the probe, the engine gathers
the rows (`TrainEngine.train_step(probe=...)`), this module judges them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

NAN_KINDS = frozenset({"nan"})
LOSS_KINDS = frozenset({"loss_spike", "grad_spike"})
ROW_FIELDS = ("finite_fwd", "finite_bwd", "local_loss", "dp_rank", "stage")


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """What a rollback asks the rerun to find out (from the command's arguments)."""

    incident_id: int | None
    kind: str  # the incident's kind: nan, loss_spike, grad_spike
    step: int  # the suspect step (the incident's first step)
    rank: int | None  # the rank the incident named, if any
    shift: int  # replica d trains on replica (d + shift) % dp's samples at the probe
    loss_above: float | None = None  # a loss spike reproduces above this (the collector's threshold)
    grad_norm_above: float | None = None  # a grad spike reproduces above this
    skip_batches: int = 0  # on a data verdict, global batches skipped after the suspect one


@dataclass(frozen=True, slots=True)
class ProbeRow:
    """One rank's view of the probe step."""

    rank: int
    finite_fwd: bool
    finite_bwd: bool
    local_loss: float  # its replica's token-mean loss
    dp_rank: int
    stage: int  # pp_rank * tp + tp_rank: the ranks of one stage coordinate hold the same shard

    @classmethod
    def from_values(cls, rank: int, values: list[float]) -> "ProbeRow":
        fwd, bwd, loss, dp_rank, stage = values
        return cls(rank=rank, finite_fwd=fwd > 0.5, finite_bwd=bwd > 0.5, local_loss=loss, dp_rank=int(dp_rank),
                   stage=int(stage))


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict: str  # data | device | transient
    reproduced: bool
    anomalous: tuple[int, ...]  # ranks whose probe view was anomalous
    rank: int | None  # the rank blamed: the device's, or the one now holding the bad samples
    evidence: str
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def apply_step(self) -> bool:
        """Keep the probe as the real step: it was clean (transient), or it fails on a
        device whatever we do (device: the step is skipped as non-finite anyway)."""
        return self.verdict != "data"


def _anomalous(plan: ProbePlan, row: ProbeRow, loss: float, grad_norm: float) -> bool:
    if plan.kind in NAN_KINDS:
        return not (row.finite_fwd and row.finite_bwd and math.isfinite(row.local_loss))
    if plan.kind == "loss_spike":
        return plan.loss_above is not None and not row.local_loss <= plan.loss_above  # NaN counts as above
    if plan.kind == "grad_spike":
        return plan.grad_norm_above is not None and not grad_norm <= plan.grad_norm_above
    return not math.isfinite(loss)


def judge(plan: ProbePlan, rows: list[ProbeRow], *, loss: float, grad_norm: float, dp: int) -> Verdict:
    """The verdict of the probe step from every rank's row (the same on every rank)."""
    bad = tuple(r.rank for r in rows if _anomalous(plan, r, loss, grad_norm))
    by_rank = {r.rank: r for r in rows}
    detail: dict[str, Any] = {"kind": plan.kind, "step": plan.step, "dp": dp, "shift": plan.shift,
                              "incident_rank": plan.rank, "anomalous_ranks": list(bad), "loss": loss,
                              "grad_norm": grad_norm}
    if not bad:
        return Verdict("transient", False, bad, plan.rank,
                       f"the rerun of step {plan.step} was clean on every rank: the fault did not come back", detail)
    if dp == 1 or plan.shift % dp == 0:
        return Verdict("data", True, bad, plan.rank,
                       f"step {plan.step} reproduced on rank(s) {list(bad)}; with a single replica the samples "
                       "cannot move to another device, so a reproduction is taken as data", detail)
    if plan.kind not in NAN_KINDS:
        # a spike is judged on the loss every replica sees: the swap cannot tell a device from data
        return Verdict("data", True, bad, plan.rank,
                       f"step {plan.step} reproduced ({plan.kind}) with the same samples on other devices", detail)
    culprit = by_rank.get(plan.rank) if plan.rank is not None else None
    if culprit is None:
        return Verdict("data", True, bad, bad[0],
                       f"step {plan.step} reproduced on rank(s) {list(bad)}; the incident named no rank to compare",
                       detail)
    # the replica that now holds the culprit's samples: d trains on (d + shift)'s, so the
    # culprit replica's samples went to replica culprit - shift, same stage coordinate
    holder_dp = (culprit.dp_rank - plan.shift) % dp
    holder = next((r for r in rows if r.dp_rank == holder_dp and r.stage == culprit.stage), None)
    detail["holder_rank"] = holder.rank if holder is not None else None
    stayed = culprit.rank in bad
    moved = holder is not None and holder.rank in bad
    if stayed and not moved:
        return Verdict("device", True, bad, culprit.rank,
                       f"step {plan.step} failed again on rank {culprit.rank} with other samples, while rank "
                       f"{detail['holder_rank']} trained the original samples cleanly: the device", detail)
    if moved and not stayed:
        return Verdict("data", True, bad, holder.rank,
                       f"the fault followed the samples of step {plan.step} from rank {culprit.rank} to rank "
                       f"{holder.rank}, and rank {culprit.rank} was clean with other samples: the data", detail)
    if stayed and moved:
        return Verdict("device", True, bad, culprit.rank,
                       f"step {plan.step} failed on rank {culprit.rank} and on rank {holder.rank}, which now holds "
                       "its samples: the device fails whatever its data (its samples may be bad too)", detail)
    return Verdict("transient", False, bad, plan.rank,
                   f"step {plan.step} failed on rank(s) {list(bad)} in the rerun, neither the incident's rank nor "
                   "the one holding its samples: not a reproduction", detail)
