"""Who waits for whom: collective rows matched across ranks by (axis, group_id, group_seq).

One collective is the rows of its members with the same `(axis, group_id,
group_seq)` (docs/schema.md). The member that entered last (`start_ts` is
comparable across ranks) is the one the others waited for; their `wait_s` is
the time it cost them. Point-to-point ops (`peer >= 0`) are left out: a send is
posted early by design, so "last to enter" says nothing there.

The members' rows of one collective arrive in different commits, so partial
aggregates (count, latest entry and who, the waits) are kept per collective and
merged as rows come in; a collective is final once the step after its own is
complete (`collective_lag_steps`: a rank's async ops of step s are recorded when
waited, in step s+1). Final collectives feed per-rank moving averages over
steps: `caused_wait_s` (seconds per step the others waited for this rank) and
`last_share` (fraction of its collectives it entered last). Only those arrays
and the partials of the last few steps are kept.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analysis.frames import Interner, ints
from analysis.topology import _grow


class WaitBook:
    __slots__ = ("alpha", "_chunks", "_axes", "caused_wait_s", "last_ops", "all_ops", "num_final")

    def __init__(self, *, alpha: float) -> None:
        self.alpha = alpha
        self._axes = Interner()
        self._chunks: list[dict[str, np.ndarray]] = []  # collective rows of steps not final yet, as they came
        self.caused_wait_s = np.zeros(0)  # EWMA over steps of the others' wait this rank caused
        self.last_ops = np.zeros(0)  # EWMA over steps of collectives it entered last
        self.all_ops = np.zeros(0)  # EWMA over steps of collectives it took part in
        self.num_final = 0

    def footprint(self) -> dict[str, int]:
        return {"open_collective_rows": sum(len(c["rank"]) for c in self._chunks)}

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
        peer = ints(coll["peer"])
        keep = peer < 0
        if not keep.any():
            return
        # numpy columns, the axis as a small int: no string work per row later
        cols = {"attempt": ints(coll["attempt"], 0),
                "step": ints(coll["step"], -1),
                "axis": self._axes.codes(coll["axis"]), "group_id": ints(coll["group_id"], -1),
                "group_seq": ints(coll["group_seq"], -1),
                "rank": ints(coll["rank"], -1),
                "start_ts": coll["start_ts"].to_numpy().astype(float),
                "wait_s": np.nan_to_num(coll["wait_s"].to_numpy().astype(float))}
        if not keep.all():
            cols = {k: v[keep] for k, v in cols.items()}
        self._chunks.append(cols)

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
        rank = f["rank"]
        self._ensure(int(rank.max()) + 1)
        size = len(self.caused_wait_s)
        step_key = (f["attempt"] << 40) + f["step"]
        # one collective = (step, axis, group_id, group_seq); the last to enter it within each
        order = np.lexsort((f["start_ts"], f["group_seq"], f["group_id"], f["axis"], step_key))
        k = np.stack([step_key[order], f["axis"][order], f["group_id"][order], f["group_seq"][order]])
        starts = np.flatnonzero(np.r_[True, np.any(k[:, 1:] != k[:, :-1], axis=0)])
        ends = np.r_[starts[1:], len(order)] - 1
        n = ends - starts + 1
        last = order[ends]
        caused_s = np.maximum(np.add.reduceat(f["wait_s"][order], starts) - f["wait_s"][last], 0.0)
        many = n >= 2
        c_step, c_last, c_caused = step_key[last][many], rank[last][many], caused_s[many]
        alpha = self.alpha
        for key in np.unique(step_key):  # a step or two per pass, in order
            m = c_step == key
            caused = np.bincount(c_last[m], weights=c_caused[m], minlength=size)[:size]
            lasts = np.bincount(c_last[m], minlength=size)[:size].astype(float)
            took = np.bincount(rank[step_key == key], minlength=size)[:size].astype(float)
            part = took > 0
            for arr, new in ((self.caused_wait_s, caused), (self.last_ops, lasts), (self.all_ops, took)):
                arr[part] = alpha * new[part] + (1 - alpha) * arr[part]
            self.num_final += 1
