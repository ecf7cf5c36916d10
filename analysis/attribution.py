"""Who waits for whom: collective rows matched across ranks by (axis, group_id, group_seq).

One collective is the rows of its members with the same `(axis, group_id,
group_seq)` (docs/schema.md). The member that entered last (`start_ts` is
comparable across ranks) is the one the others waited for; each earlier member
waited `min(wait_s, last entry - its entry)` for it: its time blocked in the op,
less what the transfer itself took once everyone was in (an async op's entry is
its launch, so the clip to `wait_s` keeps the compute it overlapped out).
Point-to-point ops (`peer >= 0`) count only towards the pairs: a rank blocked
on a send or receive waited `wait_s` for its peer (a send is posted early by
design, so "last to enter" says nothing there).

The members' rows of one collective arrive in different commits, so the rows
of a step are kept until the collective is final: once the step after its own
is complete (`collective_lag_steps`: a rank's async ops of step s are recorded
when waited, in step s+1). Final collectives feed moving averages over steps:

- per rank, `caused_wait_s` (seconds per step the others waited for it) and
  `last_share` (fraction of its collectives it entered last);
- per pair of ranks, `waited_for(a, b)`: seconds per step `a` waited for `b`.
  The straggler detector reads the pairs: a slow rank that, net, waits for
  another slow rank is that rank's waiter, not a culprit (the rank everyone
  waits for is). Pairs are kept sparse (only those that waited) in sorted numpy
  arrays (one pass merges a step's pairs into them vectorised, 10,000 ranks
  included), decayed together, and pruned beyond a bound proportional to the
  ranks seen.

Only those averages and the rows of the last few steps are kept.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analysis.frames import Interner, ints
from analysis.topology import _grow


_PAIR_BITS = 24  # a pair key is waiter << _PAIR_BITS | waited-for (ranks below 2**24)
_PAIR_FLOOR_S = 1e-6  # decayed below this, a pair is forgotten when the book prunes


def _distinct(x: np.ndarray) -> np.ndarray:
    """The sorted distinct values of an int array (a sort: np.unique hashes, slowly, here)."""
    if not len(x):
        return x
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]]


class WaitBook:
    __slots__ = ("alpha", "_chunks", "_axes", "caused_wait_s", "last_ops", "all_ops", "num_final", "_pair_keys",
                 "_pair_s", "_pairs_at", "_best", "_best_at")

    def __init__(self, *, alpha: float) -> None:
        self.alpha = alpha
        self._axes = Interner()
        self._chunks: list[dict[str, np.ndarray]] = []  # collective rows of steps not final yet, as they came
        self.caused_wait_s = np.zeros(0)  # EWMA over steps of the others' wait this rank caused
        self.last_ops = np.zeros(0)  # EWMA over steps of collectives it entered last
        self.all_ops = np.zeros(0)  # EWMA over steps of collectives it took part in
        self.num_final = 0  # final steps so far (the clock of the lazy decay)
        self._pair_keys = np.zeros(0, np.int64)  # sorted pair keys (waiter << _PAIR_BITS | waited-for)
        self._pair_s = np.zeros(0)  # their EWMA s/step, as of num_final == _pairs_at
        self._pairs_at = 0
        self._best: dict[int, tuple[int | None, float]] = {}  # rank -> whom it waits for most, net (a cache)
        self._best_at = -1  # num_final the cache is for

    def footprint(self) -> dict[str, int]:
        return {"open_collective_rows": sum(len(c["rank"]) for c in self._chunks),
                "wait_pairs": len(self._pair_keys)}

    def _decay(self) -> float:
        return (1.0 - self.alpha) ** (self.num_final - self._pairs_at)

    def waited_for(self, a: int, b: int) -> float:
        """Seconds per step (moving average) rank `a` waited for rank `b`."""
        key = (int(a) << _PAIR_BITS) | int(b)
        i = int(np.searchsorted(self._pair_keys, key))
        if i == len(self._pair_keys) or self._pair_keys[i] != key:
            return 0.0
        return float(self._pair_s[i]) * self._decay()

    def net_wait(self, a: int, b: int) -> float:
        """How much more `a` waited for `b` than `b` for `a` (s/step; > 0: `a` waits for `b`)."""
        return self.waited_for(a, b) - self.waited_for(b, a)

    def waits_most_for(self, a: int, need_s: float) -> int | None:
        """The rank `a` waits for most, net, if by `need_s` or more (cached until more steps are final)."""
        if self._best_at != self.num_final:
            self._best, self._best_at = {}, self.num_final
        got = self._best.get(a)
        if got is None:
            got = (None, 0.0)
            keys = self._pair_keys  # a's pairs are one run of the sorted keys
            lo, hi = np.searchsorted(keys, [int(a) << _PAIR_BITS, (int(a) + 1) << _PAIR_BITS])
            for key in keys[lo:hi].tolist():  # a waited for b at all: only then can the net be positive
                b = key & ((1 << _PAIR_BITS) - 1)
                net = self.net_wait(a, b)
                if net > got[1]:
                    got = (b, net)
            self._best[a] = got
        return got[0] if got[0] is not None and got[1] >= need_s else None

    def sink(self, a: int, need_s: float, floor_s: float) -> tuple[int, list[int]]:
        """Follow who waits for whom from `a` (its first step by `need_s` or more, the next
        ones by `floor_s`) to the rank that waits for nobody: the one the chain is held by.
        Returns it and the chain (`[a]` alone: `a` waits for nobody)."""
        chain = [int(a)]
        q = self.waits_most_for(a, need_s)
        while q is not None and q not in chain and len(chain) < 64:
            chain.append(int(q))
            q = self.waits_most_for(q, floor_s)
        return chain[-1], chain

    def last_share(self, ranks: np.ndarray) -> np.ndarray:
        self._ensure(int(ranks.max()) + 1 if len(ranks) else 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.all_ops[ranks] > 0, self.last_ops[ranks] / self.all_ops[ranks], np.nan)

    def caused(self, ranks: np.ndarray) -> np.ndarray:
        self._ensure(int(ranks.max()) + 1 if len(ranks) else 0)
        return self.caused_wait_s[ranks]

    def _ensure(self, n: int) -> None:
        self.caused_wait_s = _grow(self.caused_wait_s, n, 0.0)
        self.last_ops = _grow(self.last_ops, n, 0.0)
        self.all_ops = _grow(self.all_ops, n, 0.0)

    def add(self, coll: pl.DataFrame | None) -> None:
        if coll is None or not coll.height:
            return
        # numpy columns, the axis as a small int: no string work per row later
        self._chunks.append({"attempt": ints(coll["attempt"], 0),
                             "step": ints(coll["step"], -1),
                             "axis": self._axes.codes(coll["axis"]), "group_id": ints(coll["group_id"], -1),
                             "group_seq": ints(coll["group_seq"], -1),
                             "rank": ints(coll["rank"], -1), "peer": ints(coll["peer"], -1),
                             "start_ts": coll["start_ts"].to_numpy().astype(float),
                             "wait_s": np.nan_to_num(coll["wait_s"].to_numpy().astype(float))})

    def finalize(self, attempt: int, upto_step: int, max_open_steps: int = 16) -> None:
        """Close the collectives of `attempt`'s steps up to `upto_step` (and of older
        attempts), and of anything more than `max_open_steps` behind it."""
        if not self._chunks:
            return
        rows = self._chunks[0] if len(self._chunks) == 1 else \
            {k: np.concatenate([c[k] for c in self._chunks]) for k in self._chunks[0]}
        a_, s_ = rows["attempt"], rows["step"]
        final = (a_ < attempt) | ((a_ == attempt) & (s_ <= upto_step)) | (s_ < upto_step - max_open_steps)
        if not final.any():
            self._chunks = [rows]
            return
        rest = ~final
        self._chunks = [{k: v[rest] for k, v in rows.items()}] if rest.any() else []
        f = {k: v[final] for k, v in rows.items()}
        f = {k: v[f["rank"] >= 0] for k, v in f.items()}
        if not len(f["rank"]):
            return
        self._ensure(int(max(f["rank"].max(), f["peer"].max())) + 1)
        size = len(self.caused_wait_s)
        step_key = (f["attempt"] << 40) + f["step"]
        p2p = f["peer"] >= 0
        c = {k: v[~p2p] for k, v in f.items()}
        c_key = step_key[~p2p]
        # one collective = (step, axis, group_id, group_seq); the last to enter it within each
        order = np.lexsort((c["start_ts"], c["group_seq"], c["group_id"], c["axis"], c_key))
        if len(order):
            k = np.stack([c_key[order], c["axis"][order], c["group_id"][order], c["group_seq"][order]])
            starts = np.flatnonzero(np.r_[True, np.any(k[:, 1:] != k[:, :-1], axis=0)])
        else:
            starts = order
        ends = np.r_[starts[1:], len(order)].astype(np.int64) - 1 if len(order) else order
        last = order[ends]
        of = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(order)]))  # collective of each sorted row
        waited = np.minimum(c["wait_s"][order], np.maximum(0.0, c["start_ts"][last][of] - c["start_ts"][order]))
        waited[ends] = 0.0  # the last one waited for nobody
        caused_s = np.add.reduceat(waited, starts) if len(order) else waited
        many = np.diff(np.r_[starts, len(order)]) >= 2
        col_step, col_last, col_caused = c_key[last][many], c["rank"][last][many], caused_s[many]
        # pairs: (waiter, waited-for, seconds) from collectives and from point-to-point ops
        pa = np.concatenate([c["rank"][order], f["rank"][p2p]])
        pb = np.concatenate([c["rank"][last][of], f["peer"][p2p]])
        pw = np.concatenate([waited, f["wait_s"][p2p]])
        ps = np.concatenate([c_key[order], step_key[p2p]])
        keep = (pw > 0) & (pa != pb)
        pa, pb, pw, ps = pa[keep], pb[keep], pw[keep], ps[keep]
        alpha = self.alpha
        keys = _distinct(step_key)
        n0 = self.num_final
        for key in keys:  # a step or two per pass live, in order (a replay or a backlog: more)
            m = col_step == key
            caused = np.bincount(col_last[m], weights=col_caused[m], minlength=size)[:size]
            lasts = np.bincount(col_last[m], minlength=size)[:size].astype(float)
            took = np.bincount(c["rank"][c_key == key], minlength=size)[:size].astype(float)
            part = took > 0
            for arr, new in ((self.caused_wait_s, caused), (self.last_ops, lasts), (self.all_ops, took)):
                arr[part] = alpha * new[part] + (1 - alpha) * arr[part]
        self.num_final = n0 + len(keys)
        if len(pa):
            # every step of this call at once: the j-th final step's waits weigh alpha (1 - alpha)^(J-1-j)
            j = np.searchsorted(keys, ps)
            weight = alpha * (1.0 - alpha) ** (len(keys) - 1 - j)
            pk = (pa << _PAIR_BITS) | pb
            o = np.argsort(pk, kind="stable")  # a sort and a segmented sum: np.unique hashes slowly here
            pk = pk[o]
            first = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])
            uk, sums = pk[first], np.add.reduceat((pw * weight)[o], first)
            value = self._pair_s * self._decay()  # every pair decayed to now, then the new waits added
            at = np.searchsorted(self._pair_keys, uk)
            known = at < len(self._pair_keys)
            known[known] = self._pair_keys[at[known]] == uk[known]
            value[at[known]] += sums[known]
            # new pairs go in at their sorted places (both arrays are sorted: one O(n) insert)
            self._pair_keys = np.insert(self._pair_keys, at[~known], uk[~known])
            self._pair_s = np.insert(value, at[~known], sums[~known])
            self._pairs_at = self.num_final
        self._prune(size)

    def _prune(self, num_ranks: int) -> None:
        """Bound the pairs: forget those decayed to nothing once there are many."""
        if len(self._pair_keys) <= 4096 + 16 * num_ranks:
            return
        live = self._pair_s * self._decay() >= _PAIR_FLOOR_S
        self._pair_keys, self._pair_s = self._pair_keys[live], self._pair_s[live]
