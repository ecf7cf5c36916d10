"""`data_stall`: a rank whose step time goes, persistently, to waiting for its data.

Per complete step, each rank's data-wait share is `data_s / step_s` (`data_s`: how
long the step's `next()` on the data loader blocked; with a working prefetch it is
a fraction of a millisecond). A rank is stalled at a step when that share is at
least `min_share` and its `data_s` exceeds the leave-one-out median of the other
ranks' by at least `min_excess_s` (a slow shared filesystem stalls every rank: each
is still stalled, their excess over each other is not the job's cost). The
incident opens once `min_slow_steps` of the rank's last `window_steps` judged
steps were stalled and its smoothed share is at least `min_share`; it resolves
after `resolve_after_steps` judged steps in a row without a stall. Excluded steps
(start, checkpoint, eval, skip: analysis/marks.py; a loader restarts after a
rollback, its first fetch is not a stall) neither add nor reset.

This is not a straggler: the straggler detector's measure is compute
(`fwd_s + bwd_s + opt_s`) and leaves `data_s` out, and a straggler's own data
wait stays at its prefetch's fraction of a millisecond (the ranks that wait for
it wait inside collectives, not in their data loaders). The two never see the
same time.

Incidents are per node (several stalled ranks on one node are one incident,
its `rank` the worst of them). The evidence states the cost: the worst member's
smoothed excess data wait over its peers in seconds per step (the others wait
that long for it at the next collective) and its share of the step, which the
policy's `data_stall_*` keys weigh before isolating the node.
"""

from __future__ import annotations

import numpy as np

from analysis.findings import Finding, json_number
from analysis.frames import has
from analysis.registry import register
from analysis.robust import loo_median, median1, popcount
from analysis.topology import _grow


class _Episode:
    __slots__ = ("key", "members", "onset")

    def __init__(self, key: str, onset: int) -> None:
        self.key = key
        self.members: set[int] = set()
        self.onset = onset


class _State:
    __slots__ = ("mask", "calm", "share", "excess", "data_s", "judged", "episodes", "step_s")

    def __init__(self) -> None:
        self.mask = np.zeros(0, np.int64)  # bit i: stalled at the i-th latest judged step
        self.calm = np.zeros(0, np.int64)  # judged steps in a row without a stall
        self.share = np.zeros(0)  # EWMA of data_s / step_s
        self.excess = np.zeros(0)  # EWMA of data_s - peers' median, s
        self.data_s = np.zeros(0)  # EWMA of data_s
        self.judged = np.full(0, -1, np.int64)  # last step judged, per rank
        self.episodes: dict[int, _Episode] = {}  # node code (or -1 - rank) -> open episode
        self.step_s = 0.0  # median step_s of the last judged step

    def ensure(self, n: int) -> None:
        self.mask = _grow(self.mask, n, 0)
        self.calm = _grow(self.calm, n, 0)
        self.share = _grow(self.share, n, 0.0)
        self.excess = _grow(self.excess, n, 0.0)
        self.data_s = _grow(self.data_s, n, 0.0)
        self.judged = _grow(self.judged, n, -1)

    def footprint(self) -> dict[str, int]:
        return {"episodes": len(self.episodes), "rank_slots": len(self.mask)}


@register
class DataStallDetector:
    name = "data_stall"
    kinds = ("data_stall",)

    def __init__(self, rules) -> None:
        self.cfg = rules.data_stall
        self.full = (1 << self.cfg.window_steps) - 1

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        rel = p.released
        if rel is None or not rel.height or not has(rel, "data_s"):
            return
        steps = p.steps
        rank, data_s, step_s = steps.ints("rank"), steps.floats("data_s"), steps.floats("step_s")
        for attempt, step, lo, hi in steps.steps():
            if p.run.marks.is_excluded(attempt, step, p.topo):
                continue
            if self._judge(st, step, rank[lo:hi], data_s[lo:hi], step_s[lo:hi]):
                self._episodes(p, st, step)

    def _judge(self, st: _State, step: int, r: np.ndarray, d: np.ndarray, s: np.ndarray) -> bool:
        """One step: its rows' ranks `r`, `data_s` `d` and `step_s` `s`."""
        ok = np.isfinite(d) & np.isfinite(s) & (s > 0) & (d >= 0) & (r >= 0)
        if not ok.any():
            return False
        r, d, s = r[ok], d[ok], s[ok]
        st.ensure(int(r.max()) + 1)
        peers, n = loo_median(d)
        peers = np.where(n >= 1, peers, 0.0)
        share = d / s
        excess = d - peers
        stalled = (share >= self.cfg.min_share) & (excess >= self.cfg.min_excess_s)
        st.mask[r] = ((st.mask[r] << 1) | stalled.astype(np.int64)) & self.full
        st.calm[r] = np.where(stalled, 0, st.calm[r] + 1)
        a = self.cfg.ewma_alpha
        st.share[r] = a * share + (1 - a) * st.share[r]
        st.excess[r] = a * excess + (1 - a) * st.excess[r]
        st.data_s[r] = a * d + (1 - a) * st.data_s[r]
        st.judged[r] = step
        st.step_s = median1(s)
        return True

    def _episodes(self, p, st: _State, step: int) -> None:
        cfg, topo = self.cfg, p.topo
        firing = np.flatnonzero((popcount(st.mask & self.full) >= cfg.min_slow_steps) & (st.share >= cfg.min_share))
        for rank in firing.tolist():
            node = _node(topo, rank)
            ep = st.episodes.get(node)
            if ep is None:
                prefix = f"data_stall:{topo.node_names[node]}" if node >= 0 else f"data_stall:rank{rank}"
                # the onset: the oldest stalled step still in the window (judged steps are about consecutive)
                onset = step - (int(st.mask[rank] & self.full).bit_length() - 1)
                ep = st.episodes[node] = _Episode(p.book.new_key(prefix), onset)
            ep.members.add(rank)
        for node, ep in list(st.episodes.items()):
            for rank in list(ep.members):
                if st.calm[rank] >= cfg.resolve_after_steps or step - st.judged[rank] > cfg.resolve_after_steps:
                    ep.members.discard(rank)  # its data flows again, or it is gone (isolated)
            if not ep.members:
                if p.book.is_open(ep.key):
                    p.resolve(ep.key, step_to=step,
                              evidence={**p.book.get(ep.key).evidence, "resolved_because": "its data flows again"})
                del st.episodes[node]
                continue
            self._report(p, st, ep, step)

    def _report(self, p, st: _State, ep: _Episode, step: int) -> None:
        topo = p.topo
        members = np.array(sorted(ep.members), np.int64)
        worst = int(members[np.argmax(st.excess[members])])
        cost_s = float(max(0.0, st.excess[worst]))
        share = float(st.share[worst])
        node = topo.node_name(worst)
        per_rank = {str(int(r)): {"data_share": json_number(st.share[r], 3), "data_s": json_number(st.data_s[r], 4),
                                  "excess_s": json_number(st.excess[r], 4), **topo.coords(int(r))}
                    for r in members.tolist()}
        evidence = {"ranks": members.tolist(), "node": node, "data_share": json_number(share, 3),
                    "data_s": json_number(st.data_s[worst], 4), "cost_s_per_step": json_number(cost_s, 4),
                    "share_of_step": json_number(cost_s / st.step_s if st.step_s > 0 else None, 3),
                    "step_s": json_number(st.step_s, 4), "onset_step": ep.onset,
                    "min_share": self.cfg.min_share, "window_steps": self.cfg.window_steps, "per_rank": per_rank}
        where = f" on {node}" if node else ""
        root = (f"data stall on rank {worst}{where}: {100 * share:.0f}% of its step waits for data "
                f"({cost_s:.3g} s/step more than its peers): a slow storage or data loader")
        p.report(Finding(kind="data_stall", key=ep.key, run_id=p.run.run_id,
                         severity="critical" if share >= 0.5 else "warning", rank=worst, node=node,
                         step_from=ep.onset, step_to=step, evidence=evidence, root_cause=root, confidence=0.8))


def _node(topo, rank: int) -> int:
    return int(topo.node_of[rank]) if rank < len(topo.node_of) and topo.node_of[rank] >= 0 else -1 - rank
