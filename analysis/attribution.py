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

Inferred waits (a job we did not write). torch's Flight Recorder gives each op's
enqueue time but not how long the rank was blocked on it: its rows have `wait_s`
NULL (not measured), and treating that as 0 would leave a straggler's peers with
no wait at all. For such a row the wait is inferred from the arrival skew: with
`L` the last arrival of the collective's members and `a_next` the rank's arrival
at its next op of any group (by `seq`, among the rows held), the rank waited
`L - a` if `a_next` is unknown or `a_next >= L` (it could not have moved on
before the last member came), else 0 (it moved on: an async op, a DDP bucket,
whose wait is paid at the step's last op). DDP then waits the skew at the step's
final bucket, once, and blocking ops (an FSDP all-gather) the sum of theirs.

Enqueue times alone cannot tell an async op whose next op came after `L` (the
skew is smaller than the ops' spacing: a clean DDP run, buckets 5 ms apart and
ranks 3 ms apart) from a blocking one: "behind by the same lag at every op" is
both a lag carried through async ops and a peer slow by that much between every
pair of blocking ops. Counting each such op waited makes a clean DDP rank that
is 3 ms early wait 4 x 3 ms: on simulated clean DDP runs (+-20% jitter per
phase) that tripled the noise of the ranks' compute and opened false stragglers.
So the book learns, per `(axis, group_id, op)`, whether the ops are async: a
blocking op's rank cannot move on before its last member came, so a share of
`async_min_share` or more moved-on rows among those that were not the rank's
last of their kind in the step (once `_ASYNC_MIN_OPS` are seen) proves them async
(DDP's bucket all-reduces: ~10% with 4 buckets in clean runs, all of them behind
a straggler; a blocking broadcast or an FSDP all-gather: none). Of an async kind
a rank waits only at its last op of the step (its sync point, where DDP blocks:
`L - a` unless it moved on); the ones before are 0. A kind never seen to move on
keeps the rule above. Limitation: prefetched (async) FSDP2 all-gathers, whose
waits are paid at each layer, count only the last.

A point-to-point row without `wait_s` waited 0 (its peer's arrival says nothing
about a send posted early). A row with `wait_s` is measured and taken as it is
(our trainer), as above.

The per-rank totals of inferred waits of the last `_INFERRED_STEPS` final steps
are kept (`inferred_waits`): the straggler detector nets them out of a foreign
job's phase times, which include the time blocked.

Only those averages, the rows of the last few steps and those totals are kept.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analysis.frames import Interner, ints, key_order
from analysis.topology import _grow

_PAIR_BITS = 24  # a pair key is waiter << _PAIR_BITS | waited-for (ranks below 2**24)
_PAIR_FLOOR_S = 1e-6  # decayed below this, a pair is forgotten when the book prunes
_INFERRED_STEPS = 64  # final steps whose per-rank inferred waits are kept (the straggler reads them at once)
_PRUNE_EVERY_STEPS = 8  # final steps between sweeps of the decayed pairs (a sweep reads every pair)
_ASYNC_MIN_OPS = 16  # ambiguous rows of an op kind seen before it can be called async
_ASYNC_MEMORY = 4096  # past this many rows of a kind its counts are halved (recent evidence weighs more)
_CELLS = 1 << 20  # (step, rank) sums held at once when a pass finalizes many steps (8 MB a table)


def _distinct(x: np.ndarray) -> np.ndarray:
    """The sorted distinct values of an int array (a sort: np.unique hashes, slowly, here)."""
    if not len(x):
        return x
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]]


def _collectives(step_key: np.ndarray, axis: np.ndarray, group_id: np.ndarray, group_seq: np.ndarray,
                 start_ts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group rows into collectives, one per (step, axis, group_id, group_seq).

    Returns `order` (the rows sorted by collective, each collective's rows in their given
    order), `starts` (each collective's first position in `order`) and `last` (the position in
    `order` of the member that entered it last: the latest `start_ts`, the later row on a tie).
    The four keys are sorted as one packed int64 where they fit (`key_order`)."""
    n = len(step_key)
    if not n:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    order, starts = key_order([step_key, axis, group_id, group_seq])
    ts = start_ts[order]
    latest = np.fmax.reduceat(ts, starts)
    sizes = np.diff(np.r_[starts, n])
    pos = np.where(ts == np.repeat(latest, sizes), np.arange(n), -1)  # a NaN start is never the latest
    last = np.maximum.reduceat(pos, starts)
    last = np.where(last >= 0, last, np.r_[starts[1:], n] - 1)  # a collective with no time: its last row
    return order, starts, last


class WaitBook:
    __slots__ = ("alpha", "_chunks", "_axes", "caused_wait_s", "last_ops", "all_ops", "num_final", "_pair_keys",
                 "_pair_s", "_pairs_at", "_best", "_best_at", "inferring", "final_key", "_inferred", "_ops",
                 "async_min_share", "clock_error_s", "_kinds", "_pruned_at")

    def __init__(self, *, alpha: float, async_min_share: float = 0.05, clock_error_s: float = 0.0) -> None:
        self.alpha = alpha
        self.async_min_share = async_min_share
        self.clock_error_s = clock_error_s
        self._axes = Interner()
        self._ops = Interner()
        self._kinds: dict[int, list[float]] = {}  # (axis, op, group) key -> [moved-on rows, ambiguous + moved-on]
        self._chunks: list[dict[str, np.ndarray]] = []  # collective rows of steps not final yet, as they came
        self.caused_wait_s = np.zeros(0)  # EWMA over steps of the others' wait this rank caused
        self.last_ops = np.zeros(0)  # EWMA over steps of collectives it entered last
        self.all_ops = np.zeros(0)  # EWMA over steps of collectives it took part in
        self.num_final = 0  # final steps so far (the clock of the lazy decay)
        self._pair_keys = np.zeros(0, np.int64)  # sorted pair keys (waiter << _PAIR_BITS | waited-for)
        self._pair_s = np.zeros(0)  # their EWMA s/step as of num_final == _pairs_at (x _decay(): now)
        self._pairs_at = 0
        self._pruned_at = 0  # num_final at the last sweep of the decayed pairs
        self._best: dict[int, tuple[int | None, float]] = {}  # rank -> whom it waits for most, net (a cache)
        self._best_at = -1  # num_final the cache is for
        self.inferring = False  # rows without a measured wait_s were seen (a job we did not write)
        self.final_key = -1  # (attempt << 40) + step: every step up to it is final
        self._inferred: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # step key -> (ranks, inferred wait s)

    def footprint(self) -> dict[str, int]:
        return {"open_collective_rows": sum(len(c["rank"]) for c in self._chunks),
                "wait_pairs": len(self._pair_keys), "inferred_steps": len(self._inferred),
                "op_kinds": len(self._kinds)}

    def is_final(self, attempt: int, step: int) -> bool:
        """The step's collectives were closed (a later row of it would be matched alone)."""
        return (int(attempt) << 40) + int(step) <= self.final_key

    def inferred_waits(self, attempt: int, step: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ranks, seconds): each rank's inferred wait summed over the step's final collectives,
        for the ranks that had rows without `wait_s` in it; None when it had none (or the
        step is older than the last `_INFERRED_STEPS` final ones)."""
        return self._inferred.get((int(attempt) << 40) + int(step))

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
        wait_s = coll["wait_s"].to_numpy().astype(float)  # NaN: not measured (inferred when final)
        self.inferring = self.inferring or bool(np.isnan(wait_s).any())
        self._chunks.append({"attempt": ints(coll["attempt"], 0),
                             "step": ints(coll["step"], -1), "seq": ints(coll["seq"], -1),
                             "axis": self._axes.codes(coll["axis"]), "op": self._ops.codes(coll["op"]),
                             "group_id": ints(coll["group_id"], -1),
                             "group_seq": ints(coll["group_seq"], -1),
                             "rank": ints(coll["rank"], -1), "peer": ints(coll["peer"], -1),
                             "start_ts": coll["start_ts"].to_numpy().astype(float), "wait_s": wait_s,
                             # the ops a row stands for: a summary's mean op stands for num_ops (analysis/frames.py)
                             "n": ints(coll["num_ops"], 1).astype(float) if "num_ops" in coll.columns
                             else np.ones(coll.height)})

    def finalize(self, attempt: int, upto_step: int, max_open_steps: int = 16) -> None:
        """Close the collectives of `attempt`'s steps up to `upto_step` (and of older
        attempts), and of anything more than `max_open_steps` behind it."""
        self.final_key = max(self.final_key, (int(attempt) << 40) + int(upto_step))
        if not self._chunks:
            return

        def is_final(rows: dict[str, np.ndarray]) -> np.ndarray:
            a_, s_ = rows["attempt"], rows["step"]
            return (a_ < attempt) | ((a_ == attempt) & (s_ <= upto_step)) | (s_ < upto_step - max_open_steps)

        finals = [is_final(ch) for ch in self._chunks]
        if not any(fin.any() for fin in finals):
            return
        if any(np.isnan(ch["wait_s"][fin]).any() for ch, fin in zip(self._chunks, finals)):
            # waits to infer: each row needs its rank's next arrival, from every row held
            rows = _concat(self._chunks)
            rows["next_ts"] = _next_arrival(rows)
            final = np.concatenate(finals)
            self._chunks = [{k: v[~final] for k, v in rows.items() if k != "next_ts"}] if not final.all() else []
            f = {k: v[final] for k, v in rows.items()}
        else:
            # measured waits: only the final rows are gathered (the held ones stay in their chunks)
            done, held = [], []
            for ch, fin in zip(self._chunks, finals):
                if fin.all():
                    done.append(ch)
                elif fin.any():
                    done.append({k: v[fin] for k, v in ch.items()})
                    held.append({k: v[~fin] for k, v in ch.items()})
                else:
                    held.append(ch)
            self._chunks = held if len(held) <= 8 else [_concat(held)]  # many small commits: merged
            f = _concat(done)
            f["next_ts"] = np.full(len(f["rank"]), np.nan)
        if (f["rank"] < 0).any():
            f = {k: v[f["rank"] >= 0] for k, v in f.items()}
        if not len(f["rank"]):
            return
        self._ensure(int(max(f["rank"].max(), f["peer"].max())) + 1)
        size = len(self.caused_wait_s)
        step_key = (f["attempt"] << 40) + f["step"]
        p2p = f["peer"] >= 0
        # the collectives' rows, with the columns read below (the rest, 5 of 14, not copied)
        coll = np.flatnonzero(~p2p)
        c = {k: f[k][coll] for k in ("axis", "group_id", "group_seq", "n", "rank", "start_ts", "wait_s", "next_ts",
                                    "op", "seq")}
        c_key = step_key[coll]
        # one collective = (step, axis, group_id, group_seq); the last to enter it within each
        order, starts, last_at = _collectives(c_key, c["axis"], c["group_id"], c["group_seq"], c["start_ts"])
        last = order[last_at]
        of = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(order)]))  # collective of each sorted row
        last_in = c["start_ts"][last][of]  # L: the last member's arrival
        gap = np.maximum(0.0, last_in - c["start_ts"][order])
        measured = c["wait_s"][order]
        inferred = np.isnan(measured)
        waited = np.minimum(measured, gap)  # measured: blocked, less the transfer once all were in
        if inferred.any():
            waited[inferred] = self._infer(c, c_key, order[inferred], last_in[inferred], gap[inferred])
        waited[last_at] = 0.0  # the last one waited for nobody
        times = c["n"][order]
        waited = waited * times  # a summary's mean op stands for num_ops
        caused_s = np.add.reduceat(waited, starts) if len(order) else waited
        many = np.diff(np.r_[starts, len(order)]) >= 2
        col_step, col_last, col_caused = c_key[last][many], c["rank"][last][many], caused_s[many]
        col_n = c["n"][last][many]
        # pairs: (waiter, waited-for, seconds) from collectives and from point-to-point ops
        pa = np.concatenate([c["rank"][order], f["rank"][p2p]])
        pb = np.concatenate([c["rank"][last][of], f["peer"][p2p]])
        pw = np.concatenate([waited, np.nan_to_num(f["wait_s"][p2p]) * f["n"][p2p]])  # p2p not measured: 0
        ps = np.concatenate([c_key[order], step_key[p2p]])
        keep = (pw > 0) & (pa != pb)
        pa, pb, pw, ps = pa[keep], pb[keep], pw[keep], ps[keep]
        alpha = self.alpha
        keys = _distinct(step_key)
        n0 = self.num_final
        # each step's per-rank sums, in order (a step or two per pass live; a replay or a backlog: more).
        # One bincount of (step, rank) cells per block of steps, not a mask over every row per step: a
        # collector behind a 64-rank job at 400 steps/s judged ~50 steps a pass, and those masks were
        # two thirds of its detection thread
        j_col, j_c = np.searchsorted(keys, col_step), np.searchsorted(keys, c_key)
        block = max(1, _CELLS // max(size, 1))
        for lo in range(0, len(keys), block):
            hi = min(len(keys), lo + block)
            n = (hi - lo) * size
            if lo == 0 and hi == len(keys):
                mc, mr = slice(None), slice(None)
            else:
                mc, mr = (j_col >= lo) & (j_col < hi), (j_c >= lo) & (j_c < hi)
            cell_col = (j_col[mc] - lo) * size + col_last[mc]
            caused = np.bincount(cell_col, weights=col_caused[mc], minlength=n).reshape(-1, size)
            lasts = np.bincount(cell_col, weights=col_n[mc], minlength=n).reshape(-1, size)
            took = np.bincount((j_c[mr] - lo) * size + c["rank"][mr], weights=c["n"][mr],
                               minlength=n).reshape(-1, size)
            for k in range(hi - lo):
                part = took[k] > 0
                for arr, new in ((self.caused_wait_s, caused[k]), (self.last_ops, lasts[k]), (self.all_ops, took[k])):
                    arr[part] = alpha * new[part] + (1 - alpha) * arr[part]
        self.num_final = n0 + len(keys)
        if inferred.any():
            self._keep_inferred(c_key[order][inferred], c["rank"][order][inferred], waited[inferred])
        if len(pa):
            # every step of this call at once: the j-th final step's waits weigh alpha (1 - alpha)^(J-1-j)
            j = np.searchsorted(keys, ps)
            weight = alpha * (1.0 - alpha) ** (len(keys) - 1 - j)
            pk = (pa << _PAIR_BITS) | pb
            o = np.argsort(pk, kind="stable")  # a sort and a segmented sum: np.unique hashes slowly here
            pk = pk[o]
            first = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])
            uk, sums = pk[first], np.add.reduceat((pw * weight)[o], first)
            # the values stay as of _pairs_at (decayed lazily, by one factor: not every pair multiplied
            # every pass); the new waits are added in those units
            decay = self._decay()
            if decay < 1e-100:  # renormalized now and then, before the factor underflows
                self._pair_s, self._pairs_at, decay = self._pair_s * decay, self.num_final, 1.0
            sums = sums / decay
            value = self._pair_s
            at = np.searchsorted(self._pair_keys, uk)
            known = at < len(self._pair_keys)
            known[known] = self._pair_keys[at[known]] == uk[known]
            value[at[known]] += sums[known]
            # new pairs go in at their sorted places (both arrays are sorted: one O(n) insert; none
            # in a steady job, where np.insert would still copy both)
            new = ~known
            if new.any():
                self._pair_keys = np.insert(self._pair_keys, at[new], uk[new])
                value = np.insert(value, at[new], sums[new])
            self._pair_s = value
        self._prune(size)

    def _infer(self, c: dict[str, np.ndarray], c_key: np.ndarray, idx: np.ndarray, last_in: np.ndarray,
               gap: np.ndarray) -> np.ndarray:
        """The waits of the rows `idx` of `c` without `wait_s` (see the module doc), learning
        from them which op kinds are async."""
        moved = c["next_ts"][idx] < last_in  # NaN (unknown) compares False: it could have waited
        kind = (c["axis"][idx] << 48) | (c["op"][idx] << 32) | (c["group_id"][idx] & 0xFFFFFFFF)
        o = np.lexsort((c["seq"][idx], kind, c["rank"][idx], c_key[idx]))  # the rank's ops of a kind in a step
        seg = np.stack([c_key[idx][o], c["rank"][idx][o], kind[o]])
        sync = np.zeros(len(idx), bool)
        sync[o[np.r_[np.any(seg[:, 1:] != seg[:, :-1], axis=0), True]]] = True  # its last of the kind
        seen = ~sync & (gap > 0) & np.isfinite(c["next_ts"][idx])
        if seen.any():
            self._learn_kinds(kind[seen], moved[seen])
        uk, at = np.unique(kind, return_inverse=True)  # a few kinds: DDP's buckets, a broadcast
        is_async = np.array([self._is_async(k) for k in uk.tolist()], bool)[at]
        return np.where(moved | (is_async & ~sync), 0.0, np.maximum(0.0, gap - self.clock_error_s))

    def _learn_kinds(self, kind: np.ndarray, moved: np.ndarray) -> None:
        uk, at = np.unique(kind, return_inverse=True)
        n_moved = np.bincount(at, weights=moved.astype(float), minlength=len(uk))
        n_all = np.bincount(at, minlength=len(uk))
        for k, m, n in zip(uk.tolist(), n_moved.tolist(), n_all.tolist()):
            got = self._kinds.setdefault(k, [0.0, 0.0])
            got[0] += m
            got[1] += n
            if got[1] > _ASYNC_MEMORY:
                got[0] *= 0.5
                got[1] *= 0.5

    def _is_async(self, kind: int) -> bool:
        got = self._kinds.get(kind)
        return got is not None and got[1] >= _ASYNC_MIN_OPS and got[0] >= self.async_min_share * got[1]

    def _keep_inferred(self, keys: np.ndarray, ranks: np.ndarray, waited: np.ndarray) -> None:
        """Sum the inferred waits per (step, rank) into `_inferred` (merged with what an
        earlier call closed of the same step), keeping the newest `_INFERRED_STEPS` steps."""
        o = np.lexsort((ranks, keys))
        keys, ranks, waited = keys[o], ranks[o], waited[o]
        first = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (ranks[1:] != ranks[:-1])])
        k, r, w = keys[first], ranks[first], np.add.reduceat(waited, first)
        bounds = np.flatnonzero(np.r_[True, k[1:] != k[:-1], True])
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            key = int(k[lo])
            got = self._inferred.get(key)
            if got is None:
                self._inferred[key] = (r[lo:hi], w[lo:hi])
                continue
            both_r, both_w = np.concatenate([got[0], r[lo:hi]]), np.concatenate([got[1], w[lo:hi]])
            uniq, at = np.unique(both_r, return_inverse=True)
            self._inferred[key] = (uniq, np.bincount(at, weights=both_w, minlength=len(uniq)))
        if len(self._inferred) > _INFERRED_STEPS:
            for key in sorted(self._inferred)[:len(self._inferred) - _INFERRED_STEPS]:
                del self._inferred[key]

    def _prune(self, num_ranks: int) -> None:
        """Bound the pairs: forget those decayed to nothing once there are many."""
        if len(self._pair_keys) <= 4096 + 16 * num_ranks or self.num_final - self._pruned_at < _PRUNE_EVERY_STEPS:
            return
        self._pruned_at = self.num_final
        live = self._pair_s * self._decay() >= _PAIR_FLOOR_S
        self._pair_keys, self._pair_s = self._pair_keys[live], self._pair_s[live]


def _concat(chunks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(chunks) == 1:
        return dict(chunks[0])
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def _next_arrival(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Per row, the `start_ts` of the same rank's next op (the next `seq` held, of any
    group, in the same attempt); NaN where none is held."""
    order = np.lexsort((rows["seq"], rows["rank"], rows["attempt"]))
    same = (rows["rank"][order][1:] == rows["rank"][order][:-1]) & \
        (rows["attempt"][order][1:] == rows["attempt"][order][:-1])
    out = np.full(len(order), np.nan)
    out[order[:-1][same]] = rows["start_ts"][order][1:][same]
    return out
