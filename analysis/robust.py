"""Robust statistics the detectors share: rolling median/MAD, leave-one-out medians.

Median and MAD rather than mean and standard deviation because the values we
watch have outliers by nature (the spikes we look for, a GC pause, an eval
step): one of them must neither fire a verdict on its own nor widen the
baseline enough to hide the next.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution is 0.6745 sigma


class RollingBaseline:
    """The last `window` values (log space by the caller), their median and MAD."""

    __slots__ = ("_buf", "_w", "_n", "_i")

    def __init__(self, window: int) -> None:
        # each value twice, at i and i + window: the values oldest first are then one slice,
        # with no np.roll (~5 us; a spike detector reads them every step)
        self._buf = np.empty(2 * window)
        self._w = window
        self._n = 0
        self._i = 0

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._w

    def add(self, x: float) -> None:
        self._buf[self._i] = self._buf[self._i + self._w] = x
        self._i = (self._i + 1) % self._w
        self._n = min(self._n + 1, self._w)

    def clear(self) -> None:
        self._n = self._i = 0

    def ordered(self) -> np.ndarray:
        """The values, oldest first (a view: read it before the next `add`)."""
        if self._n < self._w:
            return self._buf[:self._n]
        return self._buf[self._i:self._i + self._w]

    def median_scale(self) -> tuple[float, float]:
        """(median, MAD scaled to a normal sigma)."""
        v = self._buf[:self._n]
        med = median1(v)
        return med, MAD_TO_SIGMA * median1(np.abs(v - med))

    def level_scale(self, level_steps: int) -> tuple[float, float]:
        """(level, noise): the median of the newest `level_steps` values, which follows
        a trend (a descending loss), and the step-to-step noise, the MAD of successive
        differences over the whole window divided by sqrt(2), which a slow trend does
        not inflate the way it inflates the MAD around the median."""
        v = self.ordered()
        level = median1(v[-level_steps:])
        if len(v) < 3:
            return level, 0.0
        d = np.diff(v)
        return level, MAD_TO_SIGMA * median1(np.abs(d - median1(d))) / math.sqrt(2.0)


class RollingBaselines:
    """`RollingBaseline` for many series at once (one per replica): a [series, window] ring."""

    __slots__ = ("_buf", "_n", "_i")

    def __init__(self, num_series: int, window: int) -> None:
        self._buf = np.full((num_series, window), np.nan)
        self._n = np.zeros(num_series, np.int64)
        self._i = np.zeros(num_series, np.int64)

    @property
    def num_series(self) -> int:
        return self._buf.shape[0]

    def ensure(self, num_series: int) -> None:
        if num_series <= self._buf.shape[0]:
            return
        n = max(num_series, 2 * self._buf.shape[0])
        buf = np.full((n, self._buf.shape[1]), np.nan)
        buf[:self._buf.shape[0]] = self._buf
        self._buf = buf
        self._n = np.concatenate([self._n, np.zeros(n - len(self._n), np.int64)])
        self._i = np.concatenate([self._i, np.zeros(n - len(self._i), np.int64)])

    def add(self, series: np.ndarray, values: np.ndarray) -> None:
        self.ensure(int(series.max()) + 1 if len(series) else 0)
        self._buf[series, self._i[series]] = values
        self._i[series] = (self._i[series] + 1) % self._buf.shape[1]
        self._n[series] = np.minimum(self._n[series] + 1, self._buf.shape[1])

    def count(self, series: np.ndarray) -> np.ndarray:
        self.ensure(int(series.max()) + 1 if len(series) else 0)
        return self._n[series]

    def median_scale(self, series: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self._buf[series]
        med = np.nanmedian(rows, axis=1) if rows.size else np.zeros(0)
        mad = np.nanmedian(np.abs(rows - med[:, None]), axis=1) if rows.size else np.zeros(0)
        return med, MAD_TO_SIGMA * mad


def median1(v: np.ndarray) -> float:
    """`float(np.median(v))` of a 1-D float64 array, the same value (NaN when one is NaN or
    `v` is empty), ~1 us against np.median's ~10 on the few values of a step (a detector
    takes a few per step and rank group, ~150 a pass of a small job)."""
    n = len(v)
    if n == 1:
        return float(v[0])
    if not n:
        return math.nan
    s = np.sort(v)  # NaN sorts last
    if s[-1] != s[-1]:
        return math.nan
    m = n // 2
    return float(s[m]) if n % 2 else 0.5 * (float(s[m - 1]) + float(s[m]))


def median_of(values: Collection[float], least: int = 1) -> float | None:
    """The median of a window of values (a deque), None with fewer than `least` of them; NaN
    when one is NaN. A sort in Python: for the few dozen values of a window ~5x faster than
    np.median, which the detectors call per group and per member every step."""
    n = len(values)
    if not n or n < least:
        return None
    if n > 32:  # a long window (the straggler's noise: hundreds, every step): numpy, ~4x faster there
        return median1(np.fromiter(values, float, n))
    s = sorted(values)
    m = n // 2
    med = float(s[m]) if n % 2 else (float(s[m - 1]) + float(s[m])) / 2.0
    return math.nan if any(v != v for v in values) else med


def row_medians(m: np.ndarray, least: int = 1) -> np.ndarray:
    """Each row's median over its values that are not NaN, NaN with fewer than `least` of them:
    one sort for all rows (np.nanmedian goes row by row through np.median when there are NaN,
    ~30 us a row)."""
    out = np.full(len(m), np.nan)
    if not m.size:
        return out
    k = np.isfinite(m).sum(axis=1)
    ok = k >= max(1, least)
    if ok.any():
        v = np.sort(m[ok], axis=1)  # NaN sort last
        k = k[ok]
        i = np.arange(len(k))
        out[ok] = 0.5 * (v[i, (k - 1) // 2] + v[i, k // 2])
    return out


def loo_median(values: np.ndarray, groups: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For each element, the median of the *other* elements of its group, and how
    many there are (0: alone, the median is NaN). Leave-one-out so that in a small
    group (two ranks per pipeline stage) a slow rank is compared with its peers, not
    with a median it pulls up itself. `groups` None: all in one group. Vectorised: a
    sort or two, no loop over groups."""
    n = len(values)
    one = groups is None or (n > 1 and groups.min() == groups.max())
    if n == 2 and one:  # a dp2 job's every call: each the other's peer (~2 us, not ~25)
        return np.asarray(values, float)[::-1].copy(), np.ones(2, np.int64)
    out = np.full(n, np.nan)
    if n <= 1:
        return out, np.zeros(n, np.int64)  # alone
    # by group, then by value. How ties fall does not matter: leaving out either of two equal
    # values leaves the same others. So an unstable sort of the values (half a stable one's
    # time, or a lexsort's), then a stable one of their groups, where there are several.
    order = np.argsort(values)
    v = values[order]
    if one:
        # One group (most calls: a job's ranks, its stages' levels): the k-th smallest of the
        # others is v[k + 1] for the elements sorted at or before k, else v[k]. So three values,
        # each for a run of the sorted elements (~5 us for 64 ranks against ~25 the general way)
        m = n - 1
        lo, hi = (m - 1) // 2, m // 2
        out[order[:lo + 1]] = 0.5 * (v[lo + 1] + v[hi + 1])
        out[order[lo + 1:hi + 1]] = 0.5 * (v[lo] + v[hi + 1])
        out[order[hi + 1:]] = 0.5 * (v[lo] + v[hi])
        return out, np.full(n, m, np.int64)
    order = order[np.argsort(groups[order], kind="stable")]
    g, v = groups[order], values[order]
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(g[1:], g[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    if len(starts) == n:  # every element alone
        return out, np.zeros(n, np.int64)
    sizes = np.empty(len(starts), np.int64)
    np.subtract(starts[1:], starts[:-1], out=sizes[:-1])
    sizes[-1] = n - starts[-1]
    gi = np.repeat(np.arange(len(starts)), sizes)
    start = starts[gi]
    pos = np.arange(n) - start
    m = sizes[gi] - 1  # peers of each element
    lo = np.maximum((m - 1) // 2, 0)
    hi = m // 2

    def at(k: np.ndarray) -> np.ndarray:  # k-th smallest of the group without this element
        idx = start + k + (k >= pos)
        return v[np.minimum(idx, n - 1)]

    med = 0.5 * (at(lo) + at(hi))
    med[m == 0] = np.nan
    out[order] = med
    peers = np.empty(n, np.int64)
    peers[order] = m
    return out, peers


def popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each (non-negative, < 2**32) integer."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(x.astype(np.uint64)).astype(np.int64)
    x = x.astype(np.uint64)
    count = np.zeros(x.shape, np.int64)
    while np.any(x):
        count += (x & np.uint64(1)).astype(np.int64)
        x >>= np.uint64(1)
    return count
