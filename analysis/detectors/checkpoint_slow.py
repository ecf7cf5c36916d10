"""`checkpoint_slow`: a rank whose checkpoint shard writes are far slower than they should be.

Every rank reports each save twice:

- `checkpoint_queued` when `save()` handed its shards to the background writer
  (its `data`: `num_shards`, `bytes`, `stall_s`: how long the save held the loop);
- `checkpoint_saved` when they were written (`write_s`, the background seconds to
  serialize, hash and fsync them, `num_shards`, `bytes`).

The `checkpoints` table keeps only their sum and maximum; the events keep them per
rank, and that is what this detector reads.

A checkpoint is judged once every rank of the run reported it written. A rank that
has not, while it trains on (its step rows keep coming), is still writing: the
seconds from its `checkpoint_queued` to its newest step row (both on its own clock)
are a lower bound on its write, and once that bound alone is slow (below) the
checkpoint is judged at once, without waiting for a report that a stalled writer
never sends. A checkpoint still missing a report once `max_pending` newer ones are
pending is judged with the bounds it has (a rank with neither report nor bound is
left out: it died, and that is the crash and hang detectors' to say). A rank judged
there on a bound that was not slow, or left out, is judged again when its report comes
(within `LATE_CHECKPOINTS` judged checkpoints), against the reports that checkpoint had:
with checkpoints less than an agent's flush apart, a checkpoint falls overdue while
the slow rank's report and its step rows are still in its agent's buffer. Rank 0
reports a save only once it finalized it, after every rank's partial manifest came,
so its bound measures the slowest rank's write: it is judged on its report alone.
For the same reason its replicas always report first: a report with no reported peer
while a rank writing as many shards has yet to report is deferred (a peer to the
others all the same) and judged when that peer's report comes, or alone once none
can come; judged alone at once, a slow write would enter a short history as normal.

A rank's write is slow when it is at least `min_ratio` times

- the median write seconds of the other ranks of the same checkpoint that wrote
  as many shards (dp rank 0 of each (pp, tp) writes the model shard as well as its
  own small rank file; the others only the rank file), and
- that rank's own history: the median of its last `history_checkpoints` writes
  that were not slow (once it holds `min_history_checkpoints` of them; before, the
  peers alone decide; a rank's first write, which allocates buffers and creates
  files, is never judged; a rank no other rank wrote as many shards as, one
  replica per shard, is judged by its history alone),

and exceeds the larger of the two by at least `min_excess_s` (an fsync's jitter on
a tiny file is not a slow node). A write that was not slow enters its rank's history
capped at `min_ratio` x the history's median: a checkpoint that was slow for all its
ranks alike (a starved host, busy shared storage) does not make the next slow write
look normal. A still-writing bound is judged early only against peers that reported:
while all ranks writing as many shards are still writing, the checkpoint waits. The
incident is per node and names the slowest
rank; it resolves after `resolve_after_checkpoints` checkpoints in a row in which
none of its ranks wrote slowly. The evidence has the checkpoint's step, the write
seconds against both references (`still_writing`: the write seconds are the lower
bound of a write not finished when it was judged), and the excess in seconds per
checkpoint.
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


class _Pending:
    """One checkpoint not judged yet."""

    __slots__ = ("reports", "queued")

    def __init__(self) -> None:
        self.reports: dict[int, tuple[float, int, int]] = {}  # rank -> (write_s, num_shards, bytes): written
        self.queued: dict[int, tuple[float, int, int]] = {}  # rank -> (ts on its clock, num_shards, bytes)


class _Late:
    """A checkpoint judged without some ranks' reports: the reports it had (the peers of a
    late one), the ranks whose report is still to be judged, and the reports held back for
    want of a peer (`deferred`: judged once a rank writing as many shards reports)."""

    __slots__ = ("reports", "waiting", "deferred")

    def __init__(self, reports: dict[int, tuple[float, int, int]], waiting: set[int],
                 deferred: dict[int, tuple[float, int, int]]) -> None:
        self.reports = reports
        self.waiting = waiting
        self.deferred = deferred


LATE_CHECKPOINTS = 16  # judged checkpoints whose late reports are still judged


class _State:
    __slots__ = ("pending", "history", "episodes", "judged", "last_ts", "late", "shards")

    def __init__(self) -> None:
        self.pending: dict[tuple[int, int], _Pending] = {}  # (attempt, step) -> what its ranks reported
        self.history: dict[int, deque] = {}  # rank -> its recent write seconds that were not slow
        self.episodes: dict[str, _Episode] = {}  # node (or "rank<R>") -> open episode
        self.judged: deque = deque(maxlen=LATE_CHECKPOINTS)  # (attempt, step) judged already
        self.late: dict[tuple[int, int], _Late] = {}  # of those, the ones with ranks to judge on their report
        self.shards: dict[int, int] = {}  # rank -> the shards it writes (its last report or queue event)
        self.last_ts: dict[int, float] = {}  # rank -> its newest step row's ts, of the ranks with a write queued

    def footprint(self) -> dict[str, int]:
        return {"pending": sum(len(v.reports) + len(v.queued) for v in self.pending.values()),
                "episodes": len(self.episodes), "history": sum(len(d) for d in self.history.values()),
                "last_ts": len(self.last_ts), "shards": len(self.shards),
                "late": sum(len(v.waiting) + len(v.deferred) for v in self.late.values())}


def _written(reports: dict[int, tuple[float, int, int]]) -> dict[int, tuple[float, int, int, bool]]:
    """Reports as `_judge` takes them: each a finished write (not a still-writing bound)."""
    return {r: (*x, False) for r, x in reports.items()}


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
        if ev is not None and ev.height:
            kinds = ev["kind"].cast(pl.String)
            mine = ev.filter(kinds.is_in(["checkpoint_saved", "checkpoint_queued"]))
            if mine.height:
                for key, rank, report in self._read(st, mine):
                    self._judge_late(p, st, key, rank, report)
        if not st.pending:
            return
        self._advance(st, p.frames.steps)
        expected = p.topo.world_size or int(p.topo.seen.sum())
        for key in sorted(st.pending):
            pend = st.pending[key]
            complete = expected > 0 and len(pend.reports) >= expected
            bounds = self._bounds(st, pend)
            overdue = len(st.pending) > self.cfg.max_pending
            if not (complete or overdue or self._slow_bound(st, pend, bounds)):
                continue
            del st.pending[key]
            if len(st.judged) == st.judged.maxlen:
                self._retire(p, st, st.judged[0])
            st.judged.append(key)
            ranks = {int(r) for r in np.flatnonzero(p.topo.seen)} | set(pend.queued) | set(pend.reports)
            missing = ranks - set(pend.reports)
            # a report with no reported peer while a rank writing as many shards has yet to report
            # (rank 0 reports after it finalized, so its replicas' writes always come first) waits
            # for that peer: judged alone, a slow write would enter a short history as normal
            deferred = {r: x for r, x in pend.reports.items()
                        if not any(q != r and y[1] == x[1] for q, y in pend.reports.items())
                        and any(st.shards.get(q) == x[1] for q in missing)}
            reports = {**{r: (w, n, b, True) for r, (w, n, b) in bounds.items()},
                       **{r: (w, n, b, False) for r, (w, n, b) in pend.reports.items()}}
            slow = self._judge(p, st, key[1], reports, skip=set(deferred))
            waiting = missing - slow
            if waiting or deferred:
                st.late[key] = _Late({r: x for r, x in pend.reports.items() if r not in deferred}, waiting, deferred)
                if not waiting:
                    self._retire(p, st, key)
        if not st.pending:
            st.last_ts.clear()

    def _read(self, st: _State, ev: pl.DataFrame) -> list:
        """Take the events in; the reports of checkpoints judged already, to judge late:
        [((attempt, step), rank, (write_s, shards, bytes))]."""
        late = []
        attempts = ev["attempt"].to_list() if has(ev, "attempt") else [0] * ev.height
        for rank, step, attempt, kind, ts, data in zip(ev["rank"].to_list(), ev["step"].to_list(), attempts,
                                                       ev["kind"].cast(pl.String).to_list(), ev["ts"].to_list(),
                                                       ev["data"].to_list()):
            if rank is None or rank < 0 or step is None:
                continue
            key = (int(attempt or 0), int(step))
            if key in st.judged and not (kind == "checkpoint_saved" and key in st.late):
                continue
            try:
                d = json.loads(data) if data else {}
            except (TypeError, ValueError):
                continue
            if not isinstance(d, dict):
                continue
            shards, nbytes = int(d.get("num_shards") or 0), int(d.get("bytes") or 0)
            if shards:
                st.shards[int(rank)] = shards
            if kind == "checkpoint_queued":
                if isinstance(ts, (int, float)):
                    st.pending.setdefault(key, _Pending()).queued[int(rank)] = (float(ts), shards, nbytes)
                continue
            w = d.get("write_s")
            if isinstance(w, (int, float)) and w >= 0:
                if key in st.late:
                    late.append((key, int(rank), (float(w), shards, nbytes)))
                else:
                    st.pending.setdefault(key, _Pending()).reports[int(rank)] = (float(w), shards, nbytes)
        return late

    def _advance(self, st: _State, steps: pl.DataFrame | None) -> None:
        """The newest step row's ts of each rank that has a write queued and not reported."""
        waiting = {r for pend in st.pending.values() for r in pend.queued if r not in pend.reports}
        if not waiting or steps is None or not steps.height or not has(steps, "ts"):
            return
        newest = (steps.filter(pl.col("rank").is_in(list(waiting))).group_by("rank").agg(pl.col("ts").max()))
        for rank, ts in newest.iter_rows():
            if ts is not None and ts > st.last_ts.get(int(rank), float("-inf")):
                st.last_ts[int(rank)] = float(ts)

    @staticmethod
    def _bounds(st: _State, pend: _Pending) -> dict[int, tuple[float, int, int]]:
        """Ranks still writing: the seconds since they queued, to their newest step row."""
        out = {}
        for r, (t0, shards, nbytes) in pend.queued.items():
            if r != 0 and r not in pend.reports and r in st.last_ts and st.last_ts[r] > t0:
                out[r] = (st.last_ts[r] - t0, shards, nbytes)
        return out

    def _slow_bound(self, st: _State, pend: _Pending, bounds: dict[int, tuple[float, int, int]]) -> bool:
        """Whether a still-writing rank's lower bound alone is already a slow write. Only against
        peers that reported: while every rank writing as many shards is still writing, the slowness
        is common to them (shared storage, a starved host), and the checkpoint waits for its reports."""
        for r, (w, shards, _) in bounds.items():
            peers = [x[0] for q, x in pend.reports.items() if x[1] == shards]
            if not peers and any(q != r and x[1] == shards for q, x in pend.queued.items()):
                continue
            hist = st.history.get(r)
            if self._verdict(w, float(np.median(peers)) if peers else None, hist) is not None:
                return True
        return False

    def _verdict(self, w: float, peer_med: float | None, hist) -> tuple[float | None, float] | None:
        """(own median, reference) when a write of `w` s is slow against its peers' median and
        its own history; None when it is not (or cannot be judged)."""
        cfg = self.cfg
        own_med = float(np.median(hist)) if hist is not None and len(hist) >= cfg.min_history_checkpoints else None
        if not hist or (peer_med is None and own_med is None):
            return None
        ref = max(peer_med or 0.0, own_med or 0.0)
        if ((peer_med is None or w >= cfg.min_ratio * peer_med) and (own_med is None or w >= cfg.min_ratio * own_med)
                and w - ref >= cfg.min_excess_s):
            return own_med, ref
        return None

    def _judge_late(self, p, st: _State, key: tuple[int, int], rank: int, report: tuple[float, int, int]) -> None:
        """A report of a checkpoint judged without it: that rank alone, against the reports it had;
        then the reports deferred for want of a peer like it."""
        late = st.late[key]
        if rank not in late.waiting:
            return
        late.waiting.discard(rank)
        if late.reports or late.deferred:  # a peer to judge it against (it is not among them: it was waited for)
            self._judge(p, st, key[1], _written({**late.reports, **late.deferred, rank: report}), only=rank)
        late.reports[rank] = report
        for r in [r for r, x in late.deferred.items() if x[1] == report[1]]:
            self._judge_deferred(p, st, key, late, r)
        if not late.waiting:
            self._retire(p, st, key)

    def _retire(self, p, st: _State, key: tuple[int, int]) -> None:
        """No more late reports for `key`: what is still deferred is judged without a peer."""
        late = st.late.pop(key, None)
        for r in list(late.deferred) if late is not None else ():
            self._judge_deferred(p, st, key, late, r)

    def _judge_deferred(self, p, st: _State, key: tuple[int, int], late: _Late, rank: int) -> None:
        """A deferred report judged against the reports its checkpoint has now; a peer from then on."""
        late.reports[rank] = late.deferred.pop(rank)
        self._judge(p, st, key[1], _written(late.reports), only=rank)

    def _judge(self, p, st: _State, step: int, reports: dict[int, tuple[float, int, int, bool]],
               only: int | None = None, skip: set[int] = frozenset()) -> set[int]:
        """`reports`: rank -> (write seconds, shards, bytes, still writing: the seconds are a lower bound).
        `only`: judge that rank alone (a late report); `skip`: ranks not judged (deferred); the
        others are peers all the same. The ranks found slow."""
        cfg, topo = self.cfg, p.topo
        ranks = sorted(reports)
        slow: dict[int, dict] = {}
        for r in ranks:
            if (only is not None and r != only) or r in skip:
                continue
            w, shards, nbytes, writing = reports[r]
            peers = [reports[q][0] for q in ranks if q != r and reports[q][1] == shards and not reports[q][3]]
            peer_med = float(np.median(peers)) if peers else None
            hist = st.history.get(r)
            if not writing and (not hist or (peer_med is None and len(hist) < cfg.min_history_checkpoints)):
                # its first write (buffers allocated, files created) is not judged; nor is a rank
                # without peers (one replica per shard) before its own history is a reference
                self._remember(st, r, w)
                continue
            got = self._verdict(w, peer_med, hist)
            if got is not None:
                own_med, ref = got
                slow[r] = {"rank": r, "write_s": json_number(w, 4), "still_writing": writing,
                           "peers_median_s": json_number(peer_med, 4),
                           "own_median_s": json_number(own_med, 4), "num_shards": shards, "bytes": nbytes,
                           "ratio_vs_peers": json_number(w / peer_med if peer_med else None, 4),
                           "ratio_vs_history": json_number(w / own_med if own_med else None, 4),
                           "excess_s": json_number(w - ref, 4), **topo.coords(r)}
            elif not writing:  # a bound that is not slow says nothing about the write's length
                self._remember(st, r, w)
        by_node: dict[str, list[int]] = {}
        for r in slow:
            by_node.setdefault(topo.node_name(r) or f"rank{r}", []).append(r)
        for where, rs in by_node.items():
            ep = st.episodes.get(where)
            if ep is None:
                ep = st.episodes[where] = _Episode(p.book.new_key(f"checkpoint_slow:{where}"), step)
            ep.step_from = min(ep.step_from, step)  # a late report may be of an earlier checkpoint
            ep.members.update(rs)
            ep.calm = 0
            worst = max(rs, key=lambda r: reports[r][0] - max(reports[q][0] for q in ranks if q != r))
            ep.worst = slow[worst]
            self._report(p, ep, where, step, worst, {str(r): slow[r] for r in sorted(rs)})
        for where, ep in list(st.episodes.items()):
            if only is not None:  # the checkpoint's calm was counted when it was judged
                break
            if where in by_node or not any(r in reports and r not in skip for r in ep.members):
                continue
            ep.calm += 1
            if ep.calm >= cfg.resolve_after_checkpoints:
                if p.book.is_open(ep.key):
                    p.resolve(ep.key, step_to=step, evidence={**p.book.get(ep.key).evidence,
                                                             "resolved_because": "its shard writes are fast again"})
                del st.episodes[where]
        return set(slow)

    def _remember(self, st: _State, rank: int, w: float) -> None:
        """A write that was not slow enters its rank's history; one far past the rank's own median
        (its peers were as slow: a common slowdown) enters capped at `min_ratio` x that median, so one
        noisy checkpoint does not redefine the rank's normal, and a lasting change is learned in a few."""
        hist = st.history.setdefault(rank, deque(maxlen=self.cfg.history_checkpoints))
        if len(hist) >= self.cfg.min_history_checkpoints:
            w = min(w, self.cfg.min_ratio * float(np.median(hist)))
        hist.append(w)

    def _report(self, p, ep: _Episode, where: str, step: int, worst: int, per_rank: dict) -> None:
        node = p.topo.node_name(worst)
        w = ep.worst
        evidence = {"ranks": sorted(ep.members), "node": node, "checkpoint_step": step, "write_s": w["write_s"],
                    "still_writing": w["still_writing"], "peers_median_s": w["peers_median_s"], "own_median_s": w["own_median_s"],
                    "ratio_vs_peers": w["ratio_vs_peers"], "ratio_vs_history": w["ratio_vs_history"],
                    "cost_s_per_checkpoint": w["excess_s"], "min_ratio": self.cfg.min_ratio, "per_rank": per_rank}
        ratio = w["ratio_vs_peers"]
        took = "still writing after " if w["still_writing"] else ""
        root = (f"slow checkpoint writes on rank {worst}" + (f" on {node}" if node else "")
                + f": {took}{w['write_s']} s for its shards of step {step}"
                + (f", {ratio}x the other ranks'" if ratio is not None else "") + ": a slow storage node")
        p.report(Finding(kind="checkpoint_slow", key=ep.key, run_id=p.run.run_id, severity="warning", rank=worst,
                         node=node, step_from=ep.step_from, step_to=step, evidence=evidence, root_cause=root,
                         confidence=0.8))
