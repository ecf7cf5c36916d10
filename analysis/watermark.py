"""The clean-through watermark: the newest step whose weights every detector vouches for.

A checkpoint of step s holds the parameters after step s's update. It is
*known-good* once the analysis has judged every step up to s and nothing it found
there can have spoiled the weights. `clean_through(state)` is the highest such s
for the run's newest attempt (the lineage a rollback or restart continues), or
None while nothing of that attempt is judged (a `Watermark`: its `step`, and
`judged`, the same without the checksum bound, which the end of a run waits for:
no checksum comes after the last step to vouch for its update):

- judged: every step of the newest attempt up to s was released whole (every
  rank's row, or its timeout: analysis/assembly.py), so every detector saw it;
  before its first step is released, the step the attempt resumed from (its
  checkpoint was judged in the lineage before it);
- clean: no open incident of a kind that taints the weights (`TAINTS_WEIGHTS` in
  analysis/kinds.py: nan, loss and grad spikes, replica divergence) at or before
  s; an open one caps s at its first step - 1;
- checked for silent corruption: when the replicas' checksums are reported, s is
  below the newest step every shard agreed at (a checksum is taken as its step
  begins: it vouches for the update before it). Corruption is found only at a
  checksum, so a step after the last agreeing one is not vouched for yet.

The collector (collector/live) lowers it further for incidents its policy has
not acted on yet, and sends it back to the ranks with every ingest answer; the
trainer never prunes the newest known-good checkpoint nor any after it, and a
rollback restores the newest known-good checkpoint before its incident.

Monotone within an attempt: a detector judges a step when it is released, and
an incident it opens there caps the watermark before the step is counted. A new
attempt starts its own, from the checkpoint it resumed.
"""

from __future__ import annotations

from typing import NamedTuple

from analysis.kinds import TAINTS_WEIGHTS


class Watermark(NamedTuple):
    attempt: int
    step: int  # known-good: judged, clean, and checked for silent corruption
    judged: int  # judged and clean (>= step)


def clean_through(state) -> Watermark | None:
    """The run's watermark (analysis/state.py RunState), or None."""
    asm = state.assembler
    if asm.newest is None:
        return None
    attempt = asm.newest[0]
    open_steps = [s for a, s in asm.open_keys() if a == attempt]
    if open_steps:
        step = min(open_steps) - 1
    else:
        step = asm.newest[1]
    for key in state.book.open_keys():
        f = state.book.get(key)
        if f is not None and f.kind in TAINTS_WEIGHTS and f.step_from is not None:
            step = min(step, int(f.step_from) - 1)
    judged = step
    agreed = _checksums_agreed(state)
    if agreed is not None:
        step = min(step, agreed - 1)
    return Watermark(int(attempt), int(step), int(judged)) if step >= 0 else None


def _checksums_agreed(state) -> int | None:
    """The newest step every shard's replicas agreed at (None: no checksums reported)."""
    st = state.detectors.get("replica_divergence")
    last = getattr(st, "last_agree", None)
    if not last:
        return None
    return min(step for _, step in last.values())
