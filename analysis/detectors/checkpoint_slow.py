"""`checkpoint_slow`: a rank whose checkpoint shard writes are far slower than they should be.

Every rank reports each save it finished as a `checkpoint_saved` event (its `data`:
`write_s`, the background seconds to serialize, hash and fsync the shards it
wrote, `num_shards`, `bytes`). The `checkpoints` table keeps only their sum and
maximum; the events keep them per rank, and that is what this detector reads.

A checkpoint is judged once every rank of the run reported it (or, when a rank's
report never comes, once `max_pending` newer checkpoints were reported). A rank's
write is slow when it is at least `min_ratio` times

- the median write seconds of the other ranks of the same checkpoint that wrote
  as many shards (dp rank 0 of each (pp, tp) writes the model shard as well as its
  own small rank file; the others only the rank file), and
- that rank's own history: the median of its last `history_checkpoints` writes
  that were not slow (once it holds `min_history_checkpoints` of them; before, the
  peers alone decide; a rank's first write, which allocates buffers and creates
  files, is never judged; a rank no other rank wrote as many shards as, one
  replica per shard, is judged by its history alone),

and exceeds the larger of the two by at least `min_excess_s` (an fsync's jitter on
a tiny file is not a slow node). The incident is per node and names the slowest
rank; it resolves after `resolve_after_checkpoints` checkpoints in a row in which
none of its ranks wrote slowly. The evidence has the checkpoint's step, the write
seconds against both references, and the excess in seconds per checkpoint.
"""

from __future__ import annotations

import json
from collections import deque

import numpy as np
import polars as pl

from analysis.findings import Finding, json_number
from analysis.frames import has
from analysis.registry import register


class _Episode:
    __slots__ = ("key", "members", "step_from", "calm", "worst")

    def __init__(self, key: str, step_from: int) -> None:
        self.key = key
        self.members: set[int] = set()
        self.step_from = step_from
        self.calm = 0  # judged checkpoints in a row without a slow write of its ranks
        self.worst: dict = {}  # what the slowest write showed (for the evidence)


class _State:
    __slots__ = ("pending", "history", "episodes", "judged")

    def __init__(self) -> None:
        self.pending: dict[tuple[int, int], dict[int, tuple[float, int, int]]] = {}  # (attempt, step) -> rank -> w
        self.history: dict[int, deque] = {}  # rank -> its recent write seconds that were not slow
        self.episodes: dict[str, _Episode] = {}  # node (or "rank<R>") -> open episode
        self.judged: deque = deque(maxlen=16)  # (attempt, step) judged already: a late report is ignored

    def footprint(self) -> dict[str, int]:
        return {"pending": sum(len(v) for v in self.pending.values()), "episodes": len(self.episodes),
                "history": sum(len(d) for d in self.history.values())}


@register
class CheckpointSlowDetector:
    name = "checkpoint_slow"
    kinds = ("checkpoint_slow",)

    def __init__(self, rules) -> None:
        self.cfg = rules.checkpoint_slow

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        ev = p.frames.events
        if ev is None or not ev.height:
            return
        saved = ev.filter(pl.col("kind").cast(pl.String) == "checkpoint_saved")
        if not saved.height:
            return
        attempts = saved["attempt"].to_list() if has(saved, "attempt") else [0] * saved.height
        for rank, step, attempt, data in zip(saved["rank"].to_list(), saved["step"].to_list(), attempts,
                                             saved["data"].to_list()):
            try:
                d = json.loads(data) if data else {}
            except (TypeError, ValueError):
                continue
            w = d.get("write_s")
            if rank is None or rank < 0 or step is None or not isinstance(w, (int, float)) or not w >= 0:
                continue
            key = (int(attempt or 0), int(step))
            if key in st.judged:
                continue
            st.pending.setdefault(key, {})[int(rank)] = (float(w), int(d.get("num_shards") or 0),
                                                         int(d.get("bytes") or 0))
        expected = p.topo.world_size or int(p.topo.seen.sum())
        for key in sorted(st.pending):
            reports = st.pending[key]
            complete = expected > 0 and len(reports) >= expected
            if complete or len(st.pending) > self.cfg.max_pending:
                del st.pending[key]
                st.judged.append(key)
                if len(reports) >= 2:
                    self._judge(p, st, key[1], reports)

    def _judge(self, p, st: _State, step: int, reports: dict[int, tuple[float, int, int]]) -> None:
        cfg, topo = self.cfg, p.topo
        ranks = sorted(reports)
        slow: dict[int, dict] = {}
        for r in ranks:
            w, shards, nbytes = reports[r]
            peers = [reports[q][0] for q in ranks if q != r and reports[q][1] == shards]
            peer_med = float(np.median(peers)) if peers else None
            hist = st.history.get(r)
            own_med = float(np.median(hist)) if hist is not None and len(hist) >= cfg.min_history_checkpoints else None
            if not hist or (peer_med is None and own_med is None):
                # its first write (buffers allocated, files created) is not judged; nor is a rank
                # without peers (one replica per shard) before its own history is a reference
                st.history.setdefault(r, deque(maxlen=cfg.history_checkpoints)).append(w)
                continue
            ref = max(peer_med or 0.0, own_med or 0.0)
            if ((peer_med is None or w >= cfg.min_ratio * peer_med) and (own_med is None or w >= cfg.min_ratio * own_med)
                    and w - ref >= cfg.min_excess_s):
                slow[r] = {"rank": r, "write_s": json_number(w, 4), "peers_median_s": json_number(peer_med, 4),
                           "own_median_s": json_number(own_med, 4), "num_shards": shards, "bytes": nbytes,
                           "ratio_vs_peers": json_number(w / peer_med if peer_med else None, 4),
                           "ratio_vs_history": json_number(w / own_med if own_med else None, 4),
                           "excess_s": json_number(w - ref, 4), **topo.coords(r)}
            else:
                st.history.setdefault(r, deque(maxlen=cfg.history_checkpoints)).append(w)
        by_node: dict[str, list[int]] = {}
        for r in slow:
            by_node.setdefault(topo.node_name(r) or f"rank{r}", []).append(r)
        for where, rs in by_node.items():
            ep = st.episodes.get(where)
            if ep is None:
                ep = st.episodes[where] = _Episode(p.book.new_key(f"checkpoint_slow:{where}"), step)
            ep.members.update(rs)
            ep.calm = 0
            worst = max(rs, key=lambda r: reports[r][0] - max(reports[q][0] for q in ranks if q != r))
            ep.worst = slow[worst]
            self._report(p, ep, where, step, worst, {str(r): slow[r] for r in sorted(rs)})
        for where, ep in list(st.episodes.items()):
            if where in by_node or not any(r in reports for r in ep.members):
                continue
            ep.calm += 1
            if ep.calm >= cfg.resolve_after_checkpoints:
                if p.book.is_open(ep.key):
                    p.resolve(ep.key, step_to=step, evidence={**p.book.get(ep.key).evidence,
                                                             "resolved_because": "its shard writes are fast again"})
                del st.episodes[where]

    def _report(self, p, ep: _Episode, where: str, step: int, worst: int, per_rank: dict) -> None:
        node = p.topo.node_name(worst)
        w = ep.worst
        evidence = {"ranks": sorted(ep.members), "node": node, "checkpoint_step": step, "write_s": w["write_s"],
                    "peers_median_s": w["peers_median_s"], "own_median_s": w["own_median_s"],
                    "ratio_vs_peers": w["ratio_vs_peers"], "ratio_vs_history": w["ratio_vs_history"],
                    "cost_s_per_checkpoint": w["excess_s"], "min_ratio": self.cfg.min_ratio, "per_rank": per_rank}
        ratio = w["ratio_vs_peers"]
        root = (f"slow checkpoint writes on rank {worst}" + (f" on {node}" if node else "")
                + f": {w['write_s']} s for its shards of step {step}"
                + (f", {ratio}x the other ranks'" if ratio is not None else "") + ": a slow storage node")
        p.report(Finding(kind="checkpoint_slow", key=ep.key, run_id=p.run.run_id, severity="warning", rank=worst,
                         node=node, step_from=ep.step_from, step_to=step, evidence=evidence, root_cause=root,
                         confidence=0.8))
