"""`slow_link`: a degraded link (a slow NIC, network jitter).

One rank's communication on one axis is slow while its compute is not.

The signal is each collective's **bus bandwidth**, from its bytes and its duration
with nccl-tests' conventions (`bus_bandwidth`): `algbw = bytes / time`, and
`busbw = algbw x 2(n-1)/n` for an all-reduce, `x (n-1)/n` for an all-gather or a
reduce-scatter, `x 1` for a broadcast, send or receive (n the group's size). The
time is the op's *transfer* time: from the last member's entry (the members'
rows matched by `(attempt, axis, group_id, group_seq)`, as in
analysis/attribution.py) to this member's completion, so a rank that waited for a
late peer (a compute straggler) does not look like a slow transfer. A send or
receive has no entry to wait for: its time is its duration. Ops of no bytes
(barriers) say nothing, and ops under `min_bytes` are not judged: their time is
latency, not bandwidth. The detector judges the collectives only: a receive's
duration includes waiting for its sender, so a pp peer of a rank slowed on another
axis looked like a slow pp link (a slow pp link is not detected yet).

Per judged step (excluded steps, analysis/marks.py, are skipped), and per group
of each axis:

- the group's bus bandwidth is its ops' bus bytes over their time at their
  slowest member (an op is done for the group when that member is done), summed
  over the step's ops: the large transfers weigh, not the latency-bound ones;
- it is *low* when it is below its own baseline (the median of its last
  `baseline_steps` steps that were not low, `min_history_steps` of them needed)
  by `min_ratio` or more, and below the median of the other groups of the same
  axis that step by `min_ratio` too (an axis of one group, a plain data-parallel
  job's dp, is judged against its baseline alone, with a lower confidence; the
  world axis, the control broadcast, is not judged), and one
  member's own transfers were the slow ones that step (its link ratio, below, at
  least `min_ratio`: host noise slows every member alike);
- each member's *link ratio* is the median over its ops of its transfer time
  over the others' median, against its usual one (the median over its group's
  last `baseline_steps` steps that were not low, once `min_history_steps` of
  them are seen): the rank whose own ops are slow has a ratio of about the
  injected factor, its partners the inverse. Not every member of a healthy
  group is as fast as its partners (the pp stages' tied-embedding all-reduce
  had the first stage's member at 1.2-1.9x on every step), and host noise on top
  of that is not a degraded link.

A group opens an incident when `min_slow_steps` of its last `window_steps` judged
steps were low and its member with the highest link ratio (smoothed, at least
`min_ratio`) is not a compute straggler: the excess of its compute (`fwd_s +
bwd_s + opt_s`, net of communication) over the other ranks' median is smaller
than the excess of its transfers over its partners' (both smoothed, s/step). A
straggler's transfers are not slow at all (they are timed from the last entry);
on an oversubscribed host a slow link's rank computes a little slower too (its
partner spins while it computes), but by far less than its link costs; and its
link costs `min_share` of the step or more on a typical step of the window (the
median of its per-step excess transfer time over the median step time: on an
oversubscribed host a rank descheduled as its op ends has a transfer 10-1000x
its partner's now and then, and a few of those raise a smoothed cost while most
steps cost nothing). That member is the culprit, with its node. The cost is the
seconds per step the job loses: the culprit's transfer time in excess of its
partners' in the group's ops of a step, summed (the others wait that long),
smoothed; and its share of the step time. The incident's range starts at the
first step of the latest run of low steps of the culprit's group (a lone low step
before is noise), over its last `2 x window_steps` judged steps; a lone step not
low within the run bridges it when the culprit's own link ratio was at least the
square root of `min_ratio` there (a degraded link read slow but not quite low once
amid its low steps on a loaded host, and CI dated a slow link from step 20 at 24).
It resolves after
`resolve_after_steps` judged steps in a row that were not low.

The rows of a step are final once the step `collective_lag_steps` after it is
complete (an async op of step s is recorded when waited, in step s+1). Only the
rows of the last few steps and per-group windows of a fixed length are kept.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import numpy as np
import polars as pl

from analysis.findings import Finding, json_number
from analysis.frames import Interner, StepColumns, floats, has, ints, key_order, split_key, step_keys
from analysis.registry import register
from analysis.robust import loo_median, median1, median_of, row_medians
from analysis.topology import _grow

_P2P = ("send", "recv")
_MIN_TRANSFER_S = 1e-7  # a transfer time floor (clock resolution)
_MAX_OPEN_STEPS = 16  # steps whose rows are held until final


# an op's bus factor kind (`bus_factor`), by name: one table for the scalar and the columns
_ALL_REDUCE, _HALF, _ONE = 1, 2, 3
_FACTOR_KIND = {"all_reduce": _ALL_REDUCE, "all_gather": _HALF, "reduce_scatter": _HALF,
                "broadcast": _ONE, "send": _ONE, "recv": _ONE}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of one op over `n` ranks (0: an op that moves no bus bytes)."""
    kind = _FACTOR_KIND.get(op, 0)
    if kind == _ONE:
        return 1.0
    if not kind or n <= 1:
        return 0.0
    return (2.0 if kind == _ALL_REDUCE else 1.0) * (n - 1) / n


def bus_bandwidth(coll: pl.DataFrame) -> pl.DataFrame:
    """The collectives with bytes and a duration, one row each, with `group_size`
    (members matched in these rows; 2 for a send or receive), `transfer_s` (from the
    last member's entry to this member's completion; a send's or receive's duration),
    `algbw` (bytes / transfer_s, B/s) and `busbw` (algbw x the op's bus factor). Rows
    of no bytes, no duration or a lone member are left out. Pure: every member's row
    of a collective must be in `coll` for its `transfer_s` to be exact."""
    added = {"group_size": pl.Int64, "transfer_s": pl.Float64, "algbw": pl.Float64, "busbw": pl.Float64}
    if coll is None or not coll.height or not (has(coll, "bytes") and has(coll, "duration_s")):
        return pl.DataFrame(schema={**(dict(coll.schema) if coll is not None else {}), **added})
    ops = _OpColumns.of(coll, Interner(), Interner())
    got = ops.bus_bandwidth()
    return coll[got.rows].with_columns(pl.Series("group_size", got.group_size), pl.Series("transfer_s", got.transfer_s),
                                       pl.Series("algbw", got.algbw), pl.Series("busbw", got.busbw))


def _sizes(starts: np.ndarray, n: int) -> np.ndarray:
    return np.diff(np.r_[starts, n])


def _medians(sorted_values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each run's median, of values sorted within each run."""
    return 0.5 * (sorted_values[starts + (sizes - 1) // 2] + sorted_values[starts + sizes // 2])


class _BusBandwidth(NamedTuple):
    rows: np.ndarray  # the rows it kept, by index
    group_size: np.ndarray
    transfer_s: np.ndarray
    algbw: np.ndarray
    busbw: np.ndarray


class _OpColumns:
    """Collective rows as numpy columns: the step key, axis and op as codes (their names in
    the interners), the member's rank and timing. Read once, from each commit's frame, and
    held so until their step is final: each polars call on a small job's few hundred rows
    costs ~0.1-0.3 ms (an eager call is a lazy plan collected), and at 100,000 ranks the
    window expressions (`over`) that matched an op's members cost more than the sorts here."""

    __slots__ = ("attempt", "key", "axis", "group_id", "group_seq", "rank", "kind", "is_p2p", "start_ts",
                 "nbytes", "duration_s", "num_ops", "axis_names")

    @classmethod
    def of(cls, coll: pl.DataFrame, axes: Interner, ops: Interner) -> "_OpColumns":
        c = cls()
        c.attempt = ints(coll["attempt"], 0)
        c.key = step_keys(coll)
        c.axis = axes.codes(coll["axis"])
        c.group_id, c.group_seq, c.rank = ints(coll["group_id"]), ints(coll["group_seq"]), ints(coll["rank"])
        op = ops.codes(coll["op"])
        kind_of = np.array([_FACTOR_KIND.get(name, 0) for name in ops.names] + [0], np.int64)
        c.kind = kind_of[op]  # -1 (NULL): the appended 0
        p2p_of = np.array([name in _P2P for name in ops.names] + [False])
        c.is_p2p = p2p_of[op]
        c.start_ts, c.duration_s = floats(coll["start_ts"]), floats(coll["duration_s"])
        c.nbytes = ints(coll["bytes"], -1)
        c.num_ops = ints(coll["num_ops"], 1) if "num_ops" in coll.columns else np.ones(coll.height, np.int64)
        c.axis_names = axes.names
        return c

    def __len__(self) -> int:
        return len(self.key)

    @classmethod
    def concat(cls, parts: list["_OpColumns"]) -> "_OpColumns":
        if len(parts) == 1:
            return parts[0]
        c = cls()
        for name in cls.__slots__:
            setattr(c, name, parts[-1].axis_names if name == "axis_names"
                    else np.concatenate([getattr(x, name) for x in parts]))
        return c

    def where(self, mask: np.ndarray) -> "_OpColumns":
        """The rows `mask` picks; these very columns when it picks them all (no copy)."""
        return self if mask.all() else self.take(np.flatnonzero(mask))

    def take(self, rows: np.ndarray) -> "_OpColumns":
        c = _OpColumns()
        for name in self.__slots__:
            v = getattr(self, name)
            setattr(c, name, v if name == "axis_names" else v[rows])
        return c

    def bus_bandwidth(self) -> _BusBandwidth:
        """`bus_bandwidth` on these columns: members matched by (attempt, axis, group_id, group_seq)."""
        ok = np.flatnonzero((self.nbytes > 0) & np.isfinite(self.duration_s) & (self.duration_s >= 0))
        key = [self.attempt[ok], self.axis[ok], self.group_id[ok], self.group_seq[ok]]
        order, starts = key_order(key, within=self.rank[ok])  # members by rank within each op
        n = len(ok)
        sizes = _sizes(starts, n)
        op_of = np.repeat(np.arange(len(starts)), sizes)  # per sorted row, its op
        r = self.rank[ok][order]
        new_rank = np.r_[True, r[1:] != r[:-1]]
        new_rank[starts] = True
        members = np.add.reduceat(new_rank.astype(np.int64), starts) if n else np.zeros(0, np.int64)
        last_in = np.fmax.reduceat(self.start_ts[ok][order], starts) if n else np.zeros(0)
        at = np.empty(n, np.int64)
        at[order] = op_of  # per row of `ok`, its op
        p2p = self.is_p2p[ok]
        size = np.where(p2p, 2, members[at])
        entered = np.where(p2p, self.start_ts[ok], last_in[at])
        dur = self.duration_s[ok]
        transfer = np.fmax(np.fmin(self.start_ts[ok] + dur - entered, dur), _MIN_TRANSFER_S)
        kind = self.kind[ok]
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = np.select([kind == _ALL_REDUCE, kind == _HALF, kind == _ONE],
                               [2.0 * (size - 1) / size, (size - 1) / size, 1.0], 0.0)
            algbw = self.nbytes[ok].astype(float) / transfer
        busbw = algbw * factor
        keep = (size >= 2) & (busbw > 0)
        return _BusBandwidth(ok[keep], size[keep], transfer[keep], algbw[keep], busbw[keep])


class _LinkFigures(NamedTuple):
    """A pass's final steps: per (step, axis, group, member) its log link ratio and excess
    transfer s; per (step, axis, group) its log bus bandwidth. Each sorted by step key, axis
    name, group id (and rank)."""
    m_key: np.ndarray
    m_axis: np.ndarray  # codes (`names`)
    m_gid: np.ndarray
    m_rank: np.ndarray
    m_lr: np.ndarray
    m_excess: np.ndarray
    g_key: np.ndarray
    g_axis: np.ndarray
    g_gid: np.ndarray
    g_lbw: np.ndarray
    names: list[str]


def _link_figures(c: _OpColumns) -> _LinkFigures:
    """Every final step's ops at once: each op's members matched (`bus_bandwidth`); each member's
    transfer against the others' median (leave this member out: exact for 2 and 3 members,
    the op's median beyond), as a log ratio and an excess (a summary's row is its mean op,
    analysis/frames.py ops_from_summaries: its excess counts num_ops times); per member and
    group, the median of its ratios and the sum of its excess; per group, its ops' bus bytes
    over their time at their slowest member."""
    bw = c.bus_bandwidth()
    o = c if len(bw.rows) == len(c) else c.take(bw.rows)  # rows in order, none repeated: all of them
    t, n_rows = bw.transfer_s, len(bw.rows)
    names = list(o.axis_names)
    by_name = np.argsort(np.argsort(np.array(names, dtype=object))) if names else np.zeros(0, np.int64)
    axis_rank = by_name[o.axis] if n_rows else o.axis  # sorts as the names do
    op_key = [o.key, axis_rank, o.group_id, o.group_seq]
    order, starts = key_order(op_key, within=t)
    sizes = _sizes(starts, n_rows)
    ts = t[order]
    op_of = np.repeat(np.arange(len(starts)), sizes)
    total = np.add.reduceat(ts, starts) if n_rows else np.zeros(0)
    med = _medians(ts, starts, sizes)
    op_s = ts[starts + sizes - 1]  # the slowest member's
    nn = sizes[op_of]
    with np.errstate(divide="ignore", invalid="ignore"):
        others = np.where(nn <= 2, (total[op_of] - ts) / (nn - 1), med[op_of])
        lr = np.log(ts / others)
    excess = np.clip(ts - others, 0.0, None) * o.num_ops[order]
    # per (step, axis, group): the bus bytes of each op (its first row's) over the op's time
    first = np.minimum.reduceat(order, starts) if n_rows else np.zeros(0, np.int64)
    bus_bytes = bw.busbw[first] * t[first]
    g_key = [o.key[first], axis_rank[first], o.group_id[first]]
    _, g_starts = key_order(g_key)  # the ops are in that order already: runs of equal groups
    with np.errstate(divide="ignore"):
        lbw = np.log(np.add.reduceat(bus_bytes, g_starts) / np.add.reduceat(op_s, g_starts)) if len(first) else \
            np.zeros(0)
    g_rows = first[g_starts]
    # per (step, axis, group, member): the median of its log ratios, the sum of its excess
    s_key, s_axis, s_gid, s_rank = o.key[order], axis_rank[order], o.group_id[order], o.rank[order]
    m_order, m_starts = key_order([s_key, s_axis, s_gid, s_rank], within=lr)
    m_sizes = _sizes(m_starts, n_rows)
    m_lr = _medians(lr[m_order], m_starts, m_sizes)
    m_excess = np.add.reduceat(excess[m_order], m_starts) if n_rows else np.zeros(0)
    m_rows = order[m_order[m_starts]]
    return _LinkFigures(o.key[m_rows], o.axis[m_rows], o.group_id[m_rows], o.rank[m_rows], m_lr, m_excess,
                        o.key[g_rows], o.axis[g_rows], o.group_id[g_rows], lbw, names)


def _onset(steps: np.ndarray, low: np.ndarray, link: np.ndarray, k: float) -> int:
    """The first step of the latest run of low steps (oldest first, at `steps`) that a lone step
    not low bridges when the culprit's own link ratio (`link`, in logs, against its usual) was at
    least `k` there: a degraded link read slow but not low once amid its low steps on a loaded host
    (a 4x link at 2.1x, its group's bandwidth not quite low), and the run that started after it
    dated a slow link from step 20 at 24 (CI). A low step before a steady one is noise, and so
    is one before a bridged step whose next is not low. -1: no low step."""
    start = -1
    for i in range(len(steps) - 1, -1, -1):
        if low[i] > 0:
            start = int(steps[i])
        elif start >= 0 and not (link[i] >= k and i > 0 and low[i - 1] > 0):
            break
    return start


def _runs(keys: np.ndarray, axes: np.ndarray) -> list[tuple[int, int]]:
    """(lo, hi) of each run of equal (key, axis) in rows sorted by them."""
    if not len(keys):
        return []
    change = np.r_[True, (keys[1:] != keys[:-1]) | (axes[1:] != axes[:-1]), True]
    bounds = np.flatnonzero(change)
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


class _Ring:
    """Per row (a rank, or a group), its latest `width` values: a NaN-padded ring buffer per row,
    written for many rows at once; its rows' medians in one call."""

    __slots__ = ("values", "count")

    def __init__(self, width: int) -> None:
        self.values = np.full((0, width), np.nan)
        self.count = np.zeros(0, np.int64)  # values written to each row, ever

    def ensure(self, n: int) -> None:
        if n > len(self.count):
            size = max(n, 2 * len(self.count))
            grown = np.full((size, self.values.shape[1]), np.nan)
            grown[:len(self.values)] = self.values
            self.values, self.count = grown, _grow(self.count, size, 0)

    def push(self, rows: np.ndarray, x: np.ndarray) -> None:
        """Append x[i] to row rows[i] (rows distinct)."""
        if len(rows):
            self.values[rows, self.count[rows] % self.values.shape[1]] = x
            self.count[rows] += 1

    def medians(self, rows: np.ndarray, least: int = 1) -> np.ndarray:
        """Each row's median, NaN with fewer than `least` values."""
        return row_medians(self.values[rows], least)

    def latest(self, row: int) -> np.ndarray:
        """The row's values, oldest first."""
        n, w = int(self.count[row]), self.values.shape[1]
        idx = np.arange(max(0, n - w), n) % w
        return self.values[row, idx]


class _Axis:
    """One axis's members (by rank) and groups (by group id), as arrays."""

    __slots__ = ("name", "link", "cost", "step_cost", "link_base", "step_link", "link_steps", "link_low", "history",
                 "recent", "calm", "judged", "last_lbw", "last_base", "last_peers", "member_gid", "member_rank")

    def __init__(self, name: str, baseline_steps: int, window_steps: int) -> None:
        self.name = name
        # per rank
        self.link = np.zeros(0)  # EWMA of its log link ratio, against its usual
        self.cost = np.zeros(0)  # EWMA of its excess transfer s/step
        self.step_cost = _Ring(window_steps)  # its excess transfer s at its latest judged steps
        self.link_base = _Ring(baseline_steps)  # its log link ratio at its group's latest steps not low (its usual)
        self.step_link = _Ring(2 * window_steps)  # its log link ratio against its usual at its latest judged steps
        self.link_steps = _Ring(2 * window_steps)  # and those steps
        self.link_low = _Ring(2 * window_steps)  # and whether its group was low there (1.0) or not (the onset)
        # per group id
        self.history = _Ring(baseline_steps)  # log busbw of its steps that were not low
        self.recent = _Ring(window_steps)  # 1.0 low / 0.0 not, at its latest judged steps
        self.calm = np.zeros(0, np.int64)  # judged steps in a row not low
        self.judged = np.zeros(0, np.int64)
        self.last_lbw = np.full(0, np.nan)  # what the last judged step measured
        self.last_base = np.full(0, np.nan)
        self.last_peers = np.full(0, np.nan)
        # the members seen at the axis's last judged step, sorted by (group id, rank)
        self.member_gid = np.zeros(0, np.int64)
        self.member_rank = np.zeros(0, np.int64)

    def members(self, gid: int) -> list[int]:
        """The group's ranks at the axis's last judged step."""
        lo, hi = np.searchsorted(self.member_gid, [gid, gid + 1])
        return self.member_rank[lo:hi].tolist()

    def ensure_ranks(self, n: int) -> None:
        if n > len(self.link):
            self.link, self.cost = _grow(self.link, n, 0.0), _grow(self.cost, n, 0.0)
        for ring in (self.step_cost, self.link_base, self.step_link, self.link_steps, self.link_low):
            ring.ensure(n)

    def ensure_groups(self, n: int) -> None:
        if n > len(self.calm):
            self.calm, self.judged = _grow(self.calm, n, 0), _grow(self.judged, n, 0)
            self.last_lbw = _grow(self.last_lbw, n, np.nan)
            self.last_base, self.last_peers = _grow(self.last_base, n, np.nan), _grow(self.last_peers, n, np.nan)
        for ring in (self.history, self.recent):
            ring.ensure(n)


class _Group:
    """A group with an open incident."""

    __slots__ = ("axis", "group_id", "key", "culprit", "onset", "fired_at")

    def __init__(self, axis: str, group_id: int) -> None:
        self.axis, self.group_id = axis, group_id
        self.key: str | None = None
        self.culprit = -1
        self.onset = -1
        self.fired_at = -1


class _State:
    __slots__ = ("rows", "axes", "open", "compute_ratio", "compute_excess", "step_s", "last_final",
                 "recent_step_s", "axis_codes", "op_codes")

    def __init__(self, window_steps: int) -> None:
        self.rows: list[_OpColumns] = []  # collective rows of steps not final yet
        self.axes: dict[str, _Axis] = {}
        self.open: dict[tuple[str, int], _Group] = {}  # (axis, group id) -> its open incident
        self.recent_step_s: deque[float] = deque(maxlen=window_steps)  # the latest steps' median step_s
        self.compute_ratio = np.ones(0)  # EWMA of compute / the others' median, per rank
        self.compute_excess = np.zeros(0)  # EWMA of compute - the others' median, s, per rank
        self.step_s = 0.0
        self.last_final = -1  # step key of the last final step
        self.axis_codes, self.op_codes = Interner(), Interner()  # the axes' and ops' names, as ints

    def axis(self, name: str, baseline_steps: int, window_steps: int) -> _Axis:
        ax = self.axes.get(name)
        if ax is None:
            ax = self.axes[name] = _Axis(name, baseline_steps, window_steps)
        return ax

    def footprint(self) -> dict[str, int]:
        return {"open_collective_rows": sum(len(r) for r in self.rows),
                "groups": sum(int((a.judged > 0).sum()) for a in self.axes.values()),
                "links": sum(int((a.link_base.count > 0).sum()) for a in self.axes.values())}


@register
class SlowLinkDetector:
    name = "slow_link"
    kinds = ("slow_link",)

    def __init__(self, rules) -> None:
        self.cfg = rules.slow_link
        self.log_min = math.log(self.cfg.min_ratio)

    def new_state(self) -> _State:
        return _State(self.cfg.window_steps)

    def run(self, p, st: _State) -> None:
        coll = p.frames.collectives
        if coll is not None and coll.height and has(coll, "bytes") and has(coll, "duration_s"):
            st.rows.append(_OpColumns.of(coll, st.axis_codes, st.op_codes))
        rel = p.released
        if rel is None or not rel.height:
            return
        self._computes(st, p.steps)
        last_attempt, last_step = split_key(int(step_keys(rel).max()))
        upto = (last_attempt << 40) + last_step - self.cfg.collective_lag_steps
        if not st.rows or upto <= st.last_final:
            return
        pending = _OpColumns.concat(st.rows)
        done = pending.key <= upto
        final, keep = pending.where(done), pending.where(~done)
        if len(keep):  # at most the newest _MAX_OPEN_STEPS steps (a backlog's far future is dropped)
            keep = keep.where(keep.key > int(keep.key.max()) - _MAX_OPEN_STEPS)
        st.rows = [keep] if len(keep) else []
        st.last_final = upto
        if not len(final):
            return
        # sends and receives are not judged: a receive's duration includes the wait for its
        # sender, so a pp peer of a rank slowed on another axis looked like a slow pp link
        # (bench_detection on dp2xpp2); a pp link is judged once p2p records their waits.
        # Nor is an op without an axis (there is no axis to judge it on)
        figures = _link_figures(final.where(~final.is_p2p & (final.nbytes >= self.cfg.min_bytes) & (final.axis >= 0)))
        if len(figures.g_key):
            self._judge(p, st, figures)

    # -- compute, net of communication ------------------------------------------
    def _computes(self, st: _State, steps: StepColumns) -> None:
        """`_compute` of each released step, in order."""
        rank, step_s = steps.ints("rank"), steps.floats("step_s")
        for _, _, lo, hi in steps.steps():
            # a rebalanced straggler is still one (analysis/frames.py compute_at_even_share)
            self._compute(st, rank[lo:hi], steps.even_share_compute(lo, hi)[0], step_s[lo:hi])

    def _compute(self, st: _State, r: np.ndarray, c: np.ndarray, step_s: np.ndarray) -> None:
        """One step's ranks `r`, their compute at an even share `c` and their `step_s`."""
        ok = np.isfinite(c) & (c > 0) & (r >= 0)
        step_s = step_s[np.isfinite(step_s)]
        if len(step_s):
            st.step_s = median1(step_s)
            st.recent_step_s.append(st.step_s)
        if ok.sum() < 2:
            return
        r, c = r[ok], c[ok]
        st.compute_ratio = _grow(st.compute_ratio, int(r.max()) + 1, 1.0)
        st.compute_excess = _grow(st.compute_excess, int(r.max()) + 1, 0.0)
        ref, peers = loo_median(c)
        good = (peers >= 1) & (ref > 0)
        a = self.cfg.ewma_alpha
        st.compute_ratio[r[good]] = a * (c[good] / ref[good]) + (1 - a) * st.compute_ratio[r[good]]
        st.compute_excess[r[good]] = a * (c[good] - ref[good]) + (1 - a) * st.compute_excess[r[good]]

    # -- the final steps -------------------------------------------------------------
    def _judge(self, p, st: _State, f: _LinkFigures) -> None:
        """Every final step of this pass, in order: each (step, axis) on numpy slices of the
        pass's figures (`_link_figures`, one pass over all their ops)."""
        cfg = self.cfg
        g_at = {(int(f.g_key[lo]), int(f.g_axis[lo])): (lo, hi) for lo, hi in _runs(f.g_key, f.g_axis)}
        for lo, hi in _runs(f.m_key, f.m_axis):
            k, code = int(f.m_key[lo]), int(f.m_axis[lo])
            name = f.names[code]
            attempt, step = split_key(k)
            if p.run.marks.is_excluded(attempt, step, p.topo):
                continue
            glo, ghi = g_at.get((k, code), (0, 0))
            if name == "world" and ghi - glo < 2:
                continue  # the control broadcast: latency, and every rank's (no one member's link)
            self._axis_step(p, st, st.axis(name, cfg.baseline_steps, cfg.window_steps), step,
                            f.m_rank[lo:hi], f.m_gid[lo:hi], f.m_lr[lo:hi], f.m_excess[lo:hi], f.g_gid[glo:ghi],
                            f.g_lbw[glo:ghi], cfg.ewma_alpha)

    def _axis_step(self, p, st: _State, ax: _Axis, step: int, r: np.ndarray, gid_r: np.ndarray, lr: np.ndarray,
                   excess: np.ndarray, gids: np.ndarray, lbw: np.ndarray, a: float) -> None:
        """One axis at one final step: every member's link ratio and cost (`r`, `gid_r`, `lr`,
        `excess`: one per member), then every group's bus bandwidth (`gids`, `lbw`: one per group)
        against its baseline and its peers (vectorised); then the few groups with an open
        incident or enough low steps to open one."""
        cfg = self.cfg
        ok = r >= 0
        r, gid_r, lr, excess = r[ok], gid_r[ok], lr[ok], excess[ok]
        if not len(r):
            return
        ax.ensure_ranks(int(r.max()) + 1)
        # the member's usual log link ratio (the median over its group's latest steps that were not
        # low, 0 before min_history_steps of them): not every member of a healthy group moves its
        # bytes as fast (the pp stages' tied-embedding all-reduce had the first stage's member at
        # 1.2-1.9x its partner's on every step, two shared cores); a degraded link is slow
        # against its own usual
        usual = np.nan_to_num(ax.link_base.medians(r, cfg.min_history_steps), nan=0.0)
        rel = lr - usual
        ax.link[r] = a * rel + (1 - a) * ax.link[r]
        ax.cost[r] = a * excess + (1 - a) * ax.cost[r]
        ax.step_cost.push(r, excess)

        keep = gids >= 0
        gids, lbw = gids[keep], lbw[keep]
        if not len(gids):
            return
        ax.ensure_groups(int(gids.max()) + 1)
        # the members by group (sorted once: a group's members and its highest link ratio this step)
        order = np.lexsort((r, gid_r))
        ax.member_gid, ax.member_rank = gid_r[order], r[order]
        first = np.flatnonzero(np.r_[True, ax.member_gid[1:] != ax.member_gid[:-1]])
        link_of = np.full(len(ax.calm), -np.inf)
        link_of[ax.member_gid[first]] = np.maximum.reduceat(rel[order], first)
        peers, npeers = loo_median(lbw)
        peers = np.where(npeers >= 1, peers, np.nan)
        base = ax.history.medians(gids, cfg.min_history_steps)
        ref = np.where(np.isfinite(peers), np.minimum(base, peers), base)
        # below its own baseline, and the other groups' when there are any, and one member's own
        # transfers were the slow ones (host noise slows every member alike)
        low = np.isfinite(base) & (lbw <= ref - self.log_min) & (link_of[gids] >= self.log_min)
        ax.judged[gids] += 1
        ax.recent.push(gids, low.astype(float))
        ax.calm[gids] = np.where(low, 0, ax.calm[gids] + 1)
        ax.history.push(gids[~low], lbw[~low])
        # each member's group this step: 0 no figure, 1 not low, 2 low (a lookup: np.isin is ~15 us a call)
        status = np.zeros(max(len(ax.calm), int(gid_r.max()) + 1), np.int8)
        status[gids] = np.where(low, 2, 1)
        of_member = np.where(gid_r >= 0, status[np.maximum(gid_r, 0)], 0)
        quiet = of_member == 1  # the members of a group not low: their ratio is their usual
        ax.step_link.push(r, rel)
        ax.link_steps.push(r, np.full(len(r), float(step)))
        ax.link_low.push(r, (of_member == 2).astype(float))
        ax.link_base.push(r[quiet], lr[quiet])
        ax.last_lbw[gids], ax.last_base[gids], ax.last_peers[gids] = lbw, base, peers
        lows = np.nansum(ax.recent.values[gids], axis=1)
        opened = [g for (n, g) in st.open if n == ax.name]
        for i in np.flatnonzero((lows >= cfg.min_slow_steps) | (np.isin(gids, opened) if opened else False)):
            self._group_step(p, st, ax, int(gids[i]), step)

    def _group_step(self, p, st: _State, ax: _Axis, gid: int, step: int) -> None:
        """A group with an open incident (report it, or resolve it once calm), or with enough
        low steps in its window to open one (when it has a culprit)."""
        cfg = self.cfg
        g = st.open.get((ax.name, gid))
        if g is not None:
            if ax.calm[gid] >= cfg.resolve_after_steps:
                p.resolve(g.key, step_to=step, evidence={**p.book.get(g.key).evidence,
                                                         "resolved_because": "bus bandwidth back to its baseline"})
                del st.open[(ax.name, gid)]
                return
            self._report(p, st, ax, g, step)
            return
        culprit = self._culprit(st, ax, gid)
        if culprit is None:
            return
        g = st.open[(ax.name, gid)] = _Group(ax.name, gid)
        g.fired_at, g.culprit = step, culprit
        g.onset = _onset(ax.link_steps.latest(culprit), ax.link_low.latest(culprit), ax.step_link.latest(culprit),
                         self.log_min / 2)
        if g.onset < 0:
            g.onset = step
        node = p.topo.node_name(culprit)
        g.key = p.book.new_key(f"slow_link:{node}" if node else f"slow_link:rank{culprit}")
        self._report(p, st, ax, g, step)

    def _culprit(self, st: _State, ax: _Axis, gid: int) -> int | None:
        """The member whose own ops are slow (link ratio at least min_ratio) while its compute is
        not: its compute's excess over the others' is below its transfers' excess."""
        members = ax.members(gid)
        if not members:
            return None
        r = max(members, key=lambda m: (ax.link[m], -m))
        if ax.link[r] < self.log_min:
            return None
        cost = float(ax.cost[r])
        if r < len(st.compute_excess) and st.compute_excess[r] >= cost:
            return None  # its compute costs more than its link: a straggler, the straggler detector's
        if self.typical_cost(ax, r) < self.cfg.min_share * self.typical_step_s(st):
            # a sliver of the step: a compute straggler's pp peers' small collectives looked slow
            # at ~1.4x (costing 1% of the step); a degraded link costs far more. And on a typical
            # step, not on average: on an oversubscribed host a rank descheduled as its op ends
            # has a transfer 10-1000x its partner's now and then, and a few of those in a window
            # raise the smoothed cost past the share while most steps cost nothing
            return None
        return r

    @staticmethod
    def typical_cost(ax: _Axis, rank: int) -> float:
        """The rank's excess transfer s on a typical step of the window: the median of its latest."""
        return median_of(ax.step_cost.latest(rank).tolist()) or 0.0

    @staticmethod
    def typical_step_s(st: _State) -> float:
        """The median step_s over the window (0.0 before any step_s)."""
        return median_of(st.recent_step_s) or 0.0

    def _report(self, p, st: _State, ax: _Axis, g: _Group, step: int) -> None:
        culprit, gid = g.culprit, g.group_id
        topo = p.topo
        node = topo.node_name(culprit)
        link = math.exp(float(ax.link[culprit]))
        cost = max(0.0, float(ax.cost[culprit]))
        share = cost / st.step_s if st.step_s > 0 else None
        cratio = float(st.compute_ratio[culprit]) if culprit < len(st.compute_ratio) else None
        cexcess = float(st.compute_excess[culprit]) if culprit < len(st.compute_excess) else None
        busbw = math.exp(float(ax.last_lbw[gid]))
        base, peers = float(ax.last_base[gid]), float(ax.last_peers[gid])
        base = math.exp(base) if math.isfinite(base) else None
        peers = math.exp(peers) if math.isfinite(peers) else None
        vs_base = busbw / base if base else None
        vs_peers = busbw / peers if peers else None
        evidence = {"axis": g.axis, "group_id": gid, "group_ranks": ax.members(gid), "node": node,
                    "busbw_Bps": json_number(busbw, 4), "baseline_busbw_Bps": json_number(base, 4),
                    "peer_groups_busbw_Bps": json_number(peers, 4),
                    "busbw_vs_baseline": json_number(vs_base, 3), "busbw_vs_peer_groups": json_number(vs_peers, 3),
                    "link_ratio": json_number(link, 3), "compute_ratio": json_number(cratio, 3),
                    "compute_excess_s_per_step": json_number(cexcess, 3),
                    "cost_s_per_step": json_number(cost, 4), "share_of_step": json_number(share, 3),
                    "step_s": json_number(st.step_s, 4), "onset_step": g.onset, "fired_at_step": g.fired_at,
                    "min_ratio": self.cfg.min_ratio, "window_steps": self.cfg.window_steps,
                    **topo.coords(int(culprit))}
        where = f" on {node}" if node else ""
        root = (f"slow {g.axis} link on rank {culprit}{where}: its {g.axis} ops take {link:.2f}x its partners' "
                f"while its compute is not slow; the group's bus bandwidth is "
                + (f"{vs_base:.2f}x its baseline" if vs_base is not None else "low")
                + (f" and {vs_peers:.2f}x the other {g.axis} groups'" if vs_peers is not None else "")
                + f"; costs {cost:.3g} s/step" + (f" ({100 * share:.0f}% of step time)" if share is not None else ""))
        p.report(Finding(kind="slow_link", key=g.key, run_id=p.run.run_id,
                         severity="critical" if share is not None and share >= 0.25 else "warning",
                         rank=int(culprit), node=node, step_from=g.onset, step_to=step, evidence=evidence,
                         root_cause=root, confidence=0.8 if vs_peers is not None else 0.6))
