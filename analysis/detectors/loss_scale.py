"""`loss_scale_collapse` (fp16): the dynamic loss scale keeps backing off, or sits at its floor.

A backoff is a step whose scale is below the previous step's. One now and then
is the scaler doing its job (it grows every `growth_interval` good steps and
halves on an overflow); `max_backoffs` within `window_steps` means the gradients
overflow at every scale it tries, and a scale pinned at `floor_scale` for
`pinned_steps` means it has nothing left to give: every step is skipped or
underflows. Backoffs during the first `warmup_steps` of a run are its
calibration (from a too-high initial scale) and are not counted. A backoff at a
step whose loss is non-finite is the nan detector's, not counted here either.

Off under bf16/fp32: a scale that never rose above 1 is no scaler at all.
Judged at first sight of each step (the scale is global). Where the agent sends
`finite_bwd` (a rank's own gradients, before the data-parallel reduction spread
an overflow), the complete rows of the backoff steps name the rank whose
gradients overflowed: the one non-finite at the most of them; on a tie the one
in the latest pipeline stage (backward runs from the last stage, so an overflow
there makes its upstream peer's gradients non-finite too). A tie within one
stage (tensor-parallel partners: the tp all-reduce in backward hands the
overflow to every partner at the same step) names no single rank: the suspects
are in the evidence (`overflow_suspects`), and the node when they share one.
The per-rank counts are in the evidence.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import numpy as np

from analysis.findings import Finding, json_number
from analysis.frames import has, ints
from analysis.registry import register

_MAX_COUNTED_RANKS = 64  # ranks listed per backoff step


class _State:
    __slots__ = ("last", "backoffs", "pinned", "peak", "key", "first_step", "quiet", "start_step", "max_seen",
                 "overflows", "finding")

    def __init__(self) -> None:
        self.last: tuple[int, int, float] | None = None  # attempt, step, scale
        self.backoffs: deque[int] = deque()  # steps of the recent backoffs
        self.pinned = 0
        self.peak = 0.0
        self.key: str | None = None
        self.first_step = 0
        self.quiet = 0
        self.start_step: int | None = None
        self.max_seen = 0.0
        self.overflows: dict[int, set[int]] = {}  # backoff step in the window -> ranks whose own grads overflowed
        self.finding: Finding | None = None  # the open incident's last report

    def footprint(self) -> dict[str, int]:
        return {"backoffs": len(self.backoffs), "overflow_steps": len(self.overflows)}


@register
class LossScaleDetector:
    name = "loss_scale_collapse"
    kinds = ("loss_scale_collapse",)

    def __init__(self, rules) -> None:
        self.cfg = rules.loss_scale_collapse

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        for sight in p.first_sight:
            scale = sight.loss_scale
            if scale is None or not math.isfinite(scale):
                continue
            self._judge(p, st, sight.attempt, sight.step, scale, sight.loss)
        self._origin(p, st)

    def _origin(self, p, st: _State) -> None:
        """Count, per rank, the backoff steps of the window at which its own gradients were non-finite."""
        rel = p.released
        if rel is None or not rel.height or not has(rel, "finite_bwd") or not st.backoffs:
            return
        steps = ints(rel["step"])
        bad = np.isin(steps, np.fromiter(st.backoffs, np.int64)) & (ints(rel["finite_bwd"], 1) == 0)
        if not bad.any():
            return
        for step, r in zip(steps[bad].tolist(), ints(rel["rank"])[bad].tolist()):
            ranks = st.overflows.setdefault(step, set())
            if len(ranks) < _MAX_COUNTED_RANKS:
                ranks.add(r)
        live = set(st.backoffs)
        st.overflows = {k: v for k, v in st.overflows.items() if k in live}
        if st.finding is not None:
            self._emit(p, st, st.finding)

    @staticmethod
    def _counts(st: _State) -> dict[int, int]:
        counts: dict[int, int] = {}
        for ranks in st.overflows.values():
            for r in ranks:
                counts[r] = counts.get(r, 0) + 1
        return counts

    def _emit(self, p, st: _State, f: Finding) -> None:
        counts = self._counts(st)
        if counts:
            # an overflow spreads backwards through the pipeline (a stage's bad gradients are its
            # upstream peer's input gradients): on a tie the later stage is where it began
            stage = p.topo.stage_of(np.fromiter(counts, np.int64, len(counts)))
            stage_of = dict(zip(counts, stage.tolist()))
            first = min(counts, key=lambda r: (-counts[r], -stage_of[r], r))
            tied = sorted(r for r in counts if counts[r] == counts[first] and stage_of[r] == stage_of[first])
            counts = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:16])
            evidence = {**f.evidence, "overflow_steps_per_rank": {str(r): n for r, n in counts.items()}}
            if len(tied) == 1:
                f = replace(f, rank=first, node=p.topo.node_name(first), evidence={**evidence, "overflow_rank": first},
                            root_cause=f"{f.root_cause}; first and most often in rank {first}'s own gradients")
            else:
                # tensor-parallel partners: the overflow crosses the tp all-reduce inside backward, so
                # their own gradients are non-finite at the same steps and nothing tells the origin
                nodes = {p.topo.node_name(r) for r in tied}
                node = nodes.pop() if len(nodes) == 1 else None
                f = replace(f, rank=None, node=node,
                            evidence={**evidence, "overflow_suspects": tied,
                                      "why_no_single_rank": "their own gradients were non-finite at the same "
                                      "steps (one stage's tensor-parallel partners share them through the tp "
                                      "all-reduce in backward)"},
                            root_cause=f"{f.root_cause}; in the own gradients of ranks "
                                       f"{', '.join(map(str, tied))} alike" + (f" ({node})" if node else ""))
        p.report(f)

    def _judge(self, p, st: _State, attempt: int, step: int, scale: float, loss) -> None:
        cfg = self.cfg
        if st.start_step is None:
            st.start_step = step
        st.max_seen = max(st.max_seen, scale)
        if st.max_seen <= 1.0:  # no dynamic scaler in this run
            return
        last = st.last
        st.last = (attempt, step, scale)
        if last is None or attempt != last[0] or step <= last[1]:
            return  # a new attempt restarts the comparison (it reloaded the scaler's state)
        finite = loss is not None and math.isfinite(loss)
        warm = step - st.start_step < cfg.warmup_steps
        if scale < last[2] and finite and not warm:
            st.backoffs.append(step)
        while st.backoffs and st.backoffs[0] <= step - cfg.window_steps:
            st.backoffs.popleft()
        st.pinned = st.pinned + 1 if scale <= cfg.floor_scale else 0
        st.peak = max(st.peak, scale)
        collapsed = len(st.backoffs) >= cfg.max_backoffs or st.pinned >= cfg.pinned_steps
        if collapsed:
            st.quiet = 0
            if st.key is None:
                st.key = p.book.new_key("loss_scale_collapse")
                st.first_step = st.backoffs[0] if st.backoffs else step - st.pinned + 1
            pinned = st.pinned >= cfg.pinned_steps
            why = (f"pinned at its floor {cfg.floor_scale:g} for {st.pinned} steps" if pinned
                   else f"{len(st.backoffs)} backoffs in the last {cfg.window_steps} steps")
            st.finding = Finding(
                kind="loss_scale_collapse", key=st.key, run_id=p.run.run_id,
                severity="critical" if pinned else "warning", step_from=st.first_step, step_to=step,
                evidence={"scale": json_number(scale), "peak_scale": json_number(st.peak),
                          "floor_scale": cfg.floor_scale, "backoff_steps": list(st.backoffs)[-16:],
                          "num_backoffs": len(st.backoffs), "window_steps": cfg.window_steps,
                          "pinned_steps": st.pinned, "attempt": attempt},
                root_cause=f"fp16 loss scale {why}: gradients overflow at every scale",
                confidence=0.9 if pinned else 0.7)
            self._emit(p, st, st.finding)
        elif st.key is not None:
            st.quiet += 1 if scale >= last[2] else 0
            if st.quiet >= cfg.resolve_after_steps:
                p.resolve(st.key, evidence={**p.book.get(st.key).evidence, "resolved_because":
                                            f"{st.quiet} steps without a backoff"})
                st.key, st.finding = None, None
