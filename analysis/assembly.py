"""When is a step's picture whole? `StepAssembler` holds a run's incomplete steps.

Ranks flush on their own schedules, so one step's rows arrive over several
commits and out of order across ranks. A step is *complete* when every rank of
the run has reported it, or `complete_timeout_s` after its first row arrived (a
rank that died, or dropped the row, must not hold verdicts back forever), or
when more than `max_open_steps` steps are waiting (the oldest go first). A
complete step is released once, with all its rows; a row arriving for a step
already released is late: dropped here and counted (`num_late_rows`). The NaN
detector reads rows as they arrive, so a late non-finite row is still seen.
Rows are counted, not deduplicated: the collector stores each batch once.

Each pass also yields a first sight of the steps whose first rows came in it
(`StepSight`: the median over the ranks seen so far; None where every row's
value is NULL, not measured: a job that reports no global loss). Loss, grad-norm and
loss-scale are global (identical on every rank), so the first rows suffice: the
spike and loss-scale verdicts need not wait for the slowest rank's flush.

State: the rows of incomplete steps (as the chunks they came in), a count per
open step, and a bounded memory of released steps.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np
import polars as pl

from analysis.frames import ints, split_key, step_keys
from analysis.robust import median1

KEY = ("attempt", "step")
_RELEASED_MEMORY = 1024  # released steps remembered (to recognise late rows)


class StepSight(NamedTuple):
    attempt: int
    step: int
    loss: float | None
    grad_norm: float | None
    loss_scale: float | None
    ts: float | None
    num_rows: int


class StepAssembler:
    __slots__ = ("complete_timeout_s", "max_open_steps", "_chunks", "_count", "_first_seen", "_released",
                 "_released_order", "num_late_rows", "num_forced", "newest")

    def __init__(self, *, complete_timeout_s: float, max_open_steps: int) -> None:
        self.complete_timeout_s = complete_timeout_s
        self.max_open_steps = max_open_steps
        self._chunks: list[pl.DataFrame] = []
        self._count: dict[tuple[int, int], int] = {}  # open step -> rows received
        self._first_seen: dict[tuple[int, int], float] = {}
        self._released: set[tuple[int, int]] = set()
        self._released_order: deque[tuple[int, int]] = deque()
        self.num_late_rows = 0
        self.num_forced = 0  # steps released incomplete (timeout, or too many open)
        self.newest: tuple[int, int] | None = None  # newest (attempt, step) seen

    @property
    def num_open_steps(self) -> int:
        return len(self._count)

    def open_keys(self) -> list[tuple[int, int]]:
        """The (attempt, step) of the steps not released yet."""
        return list(self._count)

    @property
    def num_pending_rows(self) -> int:
        return sum(c.height for c in self._chunks)

    def add(self, rows: pl.DataFrame | None, now: float) -> list[StepSight]:
        """Take a commit's step rows; returns the first sight of the steps new in this pass."""
        if rows is None or not rows.height:
            return []
        if rows["step"].null_count() or rows["attempt"].null_count() or rows["rank"].null_count():
            rows = rows.drop_nulls(["attempt", "step", "rank"])
            if not rows.height:
                return []
        keys = step_keys(rows)
        uniq, counts = np.unique(keys, return_counts=True)
        sights: list[StepSight] = []
        late: list[int] = []
        cols: dict[str, np.ndarray] | None = None
        # each step's rows, in their order: one stable sort, not a mask over every row per step (a
        # commit of a collector behind its job holds tens of steps)
        by_step = np.argsort(keys, kind="stable") if len(uniq) > 1 else None
        ends = np.cumsum(counts)
        for i, (key, n) in enumerate(zip(uniq.tolist(), counts.tolist())):
            k = split_key(key)
            if k in self._released:
                late.append(key)
                self.num_late_rows += n
                continue
            if k not in self._count:
                self._count[k] = 0
                self._first_seen[k] = now
                if cols is None:
                    cols = self._sight_columns(rows)
                rows_of = slice(None) if by_step is None else by_step[ends[i] - n:ends[i]]
                sights.append(self._sight(cols, rows_of, k, n))
            self._count[k] += n
            if self.newest is None or k > self.newest:
                self.newest = k
        if late:
            rows = rows.filter(pl.Series(~np.isin(keys, late)))
        if rows.height:
            self._chunks.append(rows)
        return sights

    @staticmethod
    def _sight_columns(rows: pl.DataFrame) -> dict[str, np.ndarray]:
        """The columns a first sight reads, as float64 numpy once per commit (not per step): a
        NULL loss or grad norm is NaN here, and `loss_null` says which losses were NULL."""
        cols = {c: rows[c].to_numpy().astype(float) for c in ("loss", "grad_norm", "loss_scale", "ts")}
        if rows["loss"].null_count():
            cols["loss_null"] = rows["loss"].is_null().to_numpy()
        return cols

    @staticmethod
    def _sight(cols: dict[str, np.ndarray], m: slice | np.ndarray, k: tuple[int, int], n: int) -> StepSight:
        """The step's first sight from its rows `m` (indices into `cols`, or all of them)."""

        def med(col: str) -> float | None:
            v = cols[col][m]
            if col != "loss":
                v = v[~np.isnan(v)]
            elif "loss_null" in cols:  # a NaN loss is kept (it is the finding), a NULL one is not measured
                v = v[~cols["loss_null"][m]]
            return median1(v) if len(v) else None

        ts = cols["ts"][m]
        return StepSight(k[0], k[1], med("loss"), med("grad_norm"), med("loss_scale"),
                         float(np.nanmax(ts)) if len(ts) else None, n)

    def release(self, now: float, expected_ranks: int) -> pl.DataFrame | None:
        """Rows of the steps that became complete, sorted by attempt, step, rank; or None."""
        if not self._count:
            return None
        done, waiting = [], []
        for k, n in self._count.items():
            full = expected_ranks > 0 and n >= expected_ranks
            if full or now - self._first_seen[k] >= self.complete_timeout_s:
                done.append(k)
                self.num_forced += not full
            else:
                waiting.append(k)
        excess = len(waiting) - self.max_open_steps
        if excess > 0:
            waiting.sort()
            done.extend(waiting[:excess])
            self.num_forced += excess
        if not done:
            return None
        pending = self._chunks[0] if len(self._chunks) == 1 else pl.concat(self._chunks, how="diagonal_relaxed")
        # numpy row indices and a gather, not polars filters and a sort: each of those is a lazy
        # plan collected, ~0.06-0.09 ms however few the rows
        keys = step_keys(pending)
        if len(done) == len(self._count):
            out, rest = np.arange(pending.height), None
        else:
            is_done = np.isin(keys, [(a << 40) + s for a, s in done])
            out, rest = np.flatnonzero(is_done), pending[np.flatnonzero(~is_done)]
        self._chunks = [rest] if rest is not None and rest.height else []
        for k in done:
            del self._count[k]
            del self._first_seen[k]
            self._released.add(k)
            self._released_order.append(k)
        while len(self._released_order) > _RELEASED_MEMORY:
            self._released.discard(self._released_order.popleft())
        return pending[out[np.lexsort((ints(pending["rank"])[out], keys[out]))]]  # by attempt, step, rank
