"""`straggler`: a rank whose compute is persistently slower than its pipeline stage's peers.

Per complete step, each rank's compute (`fwd_s + bwd_s + opt_s`, already net of
the time blocked on communication, so the ranks that *wait* for a straggler do
not look slow; at an even share of the step's samples, `frames.compute_at_even_share`:
a rebalanced straggler stays one) is compared with its peers'. Under a split (a
rebalance in force) the ranks carrying more than an even share are compared with one
another only (`_split_ratios`: compute is not linear in the micro-batches), and a rank carrying less opens no
new incident once its own has closed (the split is then being undone). A pipeline whose stages differ in
speed is not a straggler, so each stage's own level is taken out first: the
log compute minus the stage's level (the median over the last
`_STAGE_LEVEL_STEPS` judged steps of the stage's per-step median, over its ranks
whose sum is not climbing when it has any: in a stage of two the median is their
mean, and half a straggler's own slowness became its stage's level once it had
lasted half those steps). The rank's ratio is then its normalised compute over
the leave-one-out median of its own pipeline's other stages (the ranks of its
data- and tensor-parallel coordinates: they pass one another the same
micro-batches, and a shared host's contention moves them together), or of every
other rank's when it has no such partner (a slow rank does not pull its own
reference up). On two shared cores a dp2 x pp2 run's replicas swung between 0.05
and 0.1 s of compute from one step to the next, each its own way: a rank's log
ratio to its pipeline partner had a step-to-step noise of ~0.05, to every other
rank ~0.25 (and to its stage peer ~0.3), where a 1.3x straggler is 0.26; on quiet
cores the three were alike. With fewer than three ranks the ratio is the plain
leave-one-out one within the stage. The cost is the compute's excess over what
its reference makes it (`c (1 - 1/ratio)`), in seconds.

Persistence is a one-sided CUSUM on the log ratio: `S = max(0, S + min(log r,
log max_step_ratio) - k)`. Clean ranks drift to 0; a rank that is slow every
step climbs. The reference `k` and the threshold `h` are `log min_ratio` and
`cusum_threshold` on a quiet machine, and grow with the measured noise of the
run (`noise_k`, `noise_h` times the step-to-step noise of the log ratios, a
robust MAD over the last `noise_window` of them): on a loaded host, where
compute times swing by tens of percent from one step to the next, a verdict
takes more steps instead of firing on the swings. The reference is also at least
`drift_k` sigmas of the drift, the noise of a rank's `window_steps`-step mean
(from the changes between consecutive blocks' means): processes sharing cores
drift apart by 15-50% for tens of steps, which step-to-step noise does not see
and a CUSUM at `log min_ratio` takes for a straggler. On a quiet one 1.5x opens in
~2 steps and 1.25x in ~4 (the goals: 5 and 10) when a step takes 0.25 s or more; a
faster job's climb must last `min_persist_s` first (below). The clip keeps a single hiccup
(a GC pause) below the threshold, and `min_slow_steps` slow steps within the
last `window_steps` are required as well. The sum is capped at twice the
threshold, so a rank that recovers after a long straggle drains in a few steps.
Excluded steps (start, checkpoint, eval: analysis/marks.py) neither add nor
reset.

A rank fires when its sum is over the threshold, enough recent steps were slow,
its level stands out of the run's noise (`levels`: the median of its log
ratios since its climb began, over at least `level_steps` steps (`inferred_level_steps`
in a job without measured waits), `level_z` sigmas up (`inferred_level_z`); the sum climbs on a burst of
slow steps, the median only when most are slow), that level is above every healthy
swing of the run that lasted as long (`above_swings`: the latest `swing_memory` climbs
that ended with no incident, their length and peak level: host noise measured on the
run itself), by `swing_margin_z` sigmas of the level, its group waits for it
(`_witnessed`: the waits it caused are `witness_share` of its excess or more),
its climb has lasted `min_persist_s` seconds (`inferred_min_persist_s` in a job without
measured waits while its level is below `max_step_ratio`: on a loaded host a clean 2-rank DDP
job's ranks took turns at 1.3-1.5x for 0.8 and 1.3 s, each named before; judged steps since the
sum left zero
times the smoothed step time: a shared host's swings are the scheduler's, a fraction
of a second whatever the step; on two shared cores a clean rank ran 1.3-1.8x its peer
for 0.15-0.35 s, its own compute up and its peer's not, just as a straggler's),
its smoothed ratio is at least `min_ratio`, its smoothed excess compute is at
least `min_share` of the step time (on an oversubscribed host a slow link's rank
and its partner compute a little slower too, ~1.2x of a compute that is a sliver
of a step spent in slow transfers: that costs the job nothing and is the
`slow_link` detector's), against a single peer (a two-rank stage, or a pipeline of two stages) its own
compute is also `min_ratio` above its own past (the median of its judged steps
before its climb began, or of those `window_steps` and more ago when fewer than
`window_steps` came before it; or the ratio is `max_step_ratio` or more): two
ranks' ratio cannot tell one slowing down from the other speeding up, and on
shared cores a rank's compute drops to ~0.65x for stretches while its peer's
stays put, and it is not a *waiter*: the
rank everyone waits for is the culprit, and a rank that, net, waits for another
slow rank (`waiter_share` of its own excess compute or more, from the waits
matched by `group_seq` in analysis/attribution.py) is held back by it, even when
its own compute looks slow too (on an oversubscribed host the culprit's tensor-
parallel partner computes in lockstep with it and shares its contention).

The incident's range starts at the onset: the change point of the rank's log
ratios over its last judged steps (the split that best separates a lower level
before from a higher one after, by least squares), no earlier than where the sum
last left zero (and there, when that lies before the steps looked over: a verdict
that waited for the drift of a job without measured waits must not date the
slowness from itself). Counting slow steps instead puts it early: on a loaded host a
few noisy steps before the fault already cross `min_ratio`, but they do not
shift the level.

Incidents are per node: several slow ranks on one node are one incident (a slow
node: `rank` not named once `node_min_ranks` of them are slow). Only members
whose smoothed ratio is at least `min_ratio` are reported (a report with none is
not emitted); a member is dropped once its sum stayed below half the threshold
for `resolve_after_steps` judged steps (the margin keeps a rank hovering at the
threshold from opening and closing incidents), or once it turned out to be a
waiter. The
evidence states the cost: the seconds per step the job loses (the slowest
member's compute excess over its peers; the others wait that long every step)
and its share of the step time, and the attribution from collective waits: how
often the rank was the last to enter its collectives, how much waiting it
caused, and the ranks found to wait for it. An incident resolves when it has no
member left.

A job we did not write (torch's Flight Recorder rows, `wait_s` not measured):
its phase times are not net of communication (DDP's `bwd_s` holds the wait for
the bucket all-reduces), so the waiters would look slow. Once the book has seen
such rows, a released step is held until its collectives are final (one step
later: `collective_lag_steps`), and a rank's compute is then its `step_s` less
its data wait (`data_s`, when measured: that is the data_stall detector's) and
less its waits inferred from the arrival skew at that step's collectives
(analysis/attribution.py); no verdict comes before the drift is measured (about
64 judged steps on two ranks). The whole step, not `fwd_s + bwd_s + opt_s`: a wait
can fall outside the hooked phases (DDP broadcasts its buffers before the inner
module's forward hook runs; a framework's logging collectives run between
steps), and every wait lies inside the step (with `fwd_s + bwd_s + opt_s` as
the base, a rank 0 that logs 4 ms a step in a Hugging Face job was a 1.2x
straggler). A step without inferred waits, or a rank without
them, is not judged there (its time is not net); the rest is as above. Held
steps are bounded (`_MAX_HELD_STEPS`; beyond it the oldest are dropped,
counted in `num_unjudged_steps`).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import polars as pl

from analysis.attribution import WaitBook
from analysis.findings import Finding, json_number
from analysis.frames import iter_steps, split_key, step_keys
from analysis.registry import register
from analysis.robust import MAD_TO_SIGMA, loo_median, median1, median_of, popcount, row_medians
from analysis.topology import _grow

_STAGE_LEVEL_STEPS = 32  # judged steps a stage's level (median of its per-step medians of log compute) is taken over
_MIN_NOISE_SAMPLES = 48  # step-to-step changes measured before any verdict (the noise must be known)
_LEVEL_MAX_STEPS = 32  # judged steps a level is taken over at most (and a rank's own past compute)
# judged steps looked back over for the onset of a climb: a verdict that waited for the drift to be
# measured (~64 steps into a two-rank job) must still see the steps before a straggler's onset
_ONSET_STEPS = 64
_MIN_JUDGED_STEPS = 16  # and judged steps: a run's first steps after its warm-up are noisier than the rest
_MIN_DRIFT_SAMPLES = 12  # changes of block means measured before the drift counts
_DRIFT_PRIOR = 0.5  # the drift assumed, in sigmas of the step-to-step noise, until it is measured
_WAITER_FLOOR_S = 1e-4  # net waits below this (s/step) say nothing
# a rise within the steps after the onset's split that is larger than the split's own moves the onset
# there when it stands this many sigmas of the step-to-step noise out of them (least-squares gain)
_LATER_RISE_Z = 3.0
_MAX_HELD_STEPS = 64  # released steps held for their collectives to be final (a job without measured waits)


def _left_zero(x: np.ndarray, k: float, steps: np.ndarray, default: int, *, hold: bool = False) -> int:
    """The step at which a one-sided sum of `x` less `k` last left zero over these steps
    (`default` when it ends at zero). `hold`: a step slower than its peers (x > 0), even by
    less than `k`, does not lower the sum; only faster ones do."""
    inc = x - k
    if hold:
        inc = np.where(x > 0, np.maximum(inc, 0.0), inc)
    total, left = 0.0, 0
    for i, v in enumerate(inc.tolist()):
        total = max(0.0, total + v)
        if total == 0.0:
            left = i + 1
    return int(steps[left]) if left < len(x) else default


def _split_weight(n: int, t: np.ndarray | int) -> np.ndarray | float:
    """t (n - t) / n for a split of n values after the first t + 1: a split's least-squares gain is
    this times the squared difference of the means on its two sides."""
    return (t + 1) * (n - t - 1) / n


def _rise(x: np.ndarray) -> tuple[int, float]:
    """(index of the last value before the split, the rise of the mean across it) for the split of `x`
    into a lower level before and a higher one after that best separates them by least squares; (-1,
    0) when no split has a higher mean after it."""
    n = len(x)
    if n < 2:
        return -1, 0.0
    t = np.arange(n - 1)
    head = np.cumsum(x)[:-1]
    before = head / (t + 1)
    after = (x.sum() - head) / (n - t - 1)
    score = np.where(after > before, _split_weight(n, t) * (after - before) ** 2, -1.0)
    best = int(np.argmax(score))
    return (best, float(after[best] - before[best])) if score[best] > 0 else (-1, 0.0)


def _change_sigma(changes: deque, min_samples: int) -> float | None:
    """The sigma of a level from |changes| between its consecutive values (a robust MAD: the
    difference of two has sqrt(2) times its sigma), None with fewer than `min_samples`."""
    med = median_of(changes, min_samples)
    return None if med is None else MAD_TO_SIGMA * med / math.sqrt(2.0)


class _Columns:
    """A value per rank at each of the latest `width` judged steps, newest first (column 0 the
    latest), NaN where a rank was not judged. `view` is a slice of a buffer twice as wide: a
    step writes its column to the left of the last one, and the buffer moves back once every
    `width` steps (shifting the whole matrix a column every step moved 77 MB a step at
    100,000 ranks)."""

    __slots__ = ("buf", "head", "width")

    def __init__(self, width: int) -> None:
        self.buf = np.full((0, 2 * width), np.nan)
        self.head = width
        self.width = width

    @property
    def view(self) -> np.ndarray:
        return self.buf[:, self.head:self.head + self.width]

    def push(self, rows: np.ndarray, values: np.ndarray) -> None:
        """A new newest column: `values` for `rows`, NaN for every other rank."""
        if self.head == 0:
            self.buf[:, self.width:] = self.buf[:, :self.width]
            self.head = self.width
        self.head -= 1
        self.buf[:, self.head] = np.nan
        self.buf[rows, self.head] = values

    def ensure(self, n: int) -> None:
        self.buf = _grow_rows(self.buf, n)


def _grow_rows(a: np.ndarray, n: int) -> np.ndarray:
    """`a` (a row per rank) with at least `n` rows, the new ones NaN (doubling, as _grow)."""
    if len(a) >= n:
        return a
    grown = np.full((max(n, 2 * len(a)), a.shape[1]), np.nan)
    grown[:len(a)] = a
    return grown


class _Episode:
    __slots__ = ("key", "node", "members", "onset", "fired_at", "ever", "held")

    def __init__(self, key: str, node: int) -> None:
        self.key = key
        self.node = node
        self.members: set[int] = set()  # the culprits
        self.onset = 1 << 62
        self.fired_at = -1
        self.ever: set[int] = set()
        self.held: dict[int, tuple[int, list[int]]] = {}  # rank found waiting for a culprit -> (it, the chain)


class _State:
    __slots__ = ("cusum", "mask", "calm", "ratio", "excess", "compute", "onset", "judged", "last_lr", "noise",
                 "episodes", "waits", "last_judged", "step_s", "num_steps_judged", "stage_levels", "split_levels", "kh",
                 "lr_cols", "hist_steps", "block_sum", "block_n", "last_block", "drift",
                 "own_cols", "own_base", "paired", "held", "num_unjudged_steps", "climb_peak", "swings")

    def __init__(self, alpha: float, noise_window: int, async_min_share: float = 0.05,
                 clock_error_s: float = 0.0, swing_memory: int = 64) -> None:
        self.cusum = np.zeros(0)
        self.mask = np.zeros(0, np.int64)  # bit i: slow at the i-th latest judged step
        self.calm = np.zeros(0, np.int64)  # judged steps in a row with the sum below half the threshold
        self.ratio = np.ones(0)  # EWMA of compute / peers
        self.excess = np.zeros(0)  # EWMA of compute - peers, s
        self.compute = np.zeros(0)  # EWMA of compute, s
        self.onset = np.full(0, -1, np.int64)  # step at which the current climb began
        self.judged = np.full(0, -1, np.int64)  # last step judged, per rank
        self.last_lr = np.full(0, np.nan)  # log ratio at the rank's last judged step
        self.noise: deque[float] = deque(maxlen=noise_window)  # recent |step-to-step change of log ratio|
        self.block_sum = np.zeros(0)  # sum of the rank's log ratios over its current block of steps
        self.block_n = np.zeros(0, np.int64)  # and how many steps it holds
        self.last_block = np.full(0, np.nan)  # mean log ratio of the rank's last complete block
        # recent |change of a rank's block mean from its previous block|: the drift
        self.drift: deque[float] = deque(maxlen=max(_MIN_DRIFT_SAMPLES, noise_window // 4))
        self.episodes: dict[int, _Episode] = {}  # node code (or -1 - rank) -> open episode
        self.waits = WaitBook(alpha=alpha, async_min_share=async_min_share, clock_error_s=clock_error_s)
        self.last_judged: tuple[int, int] | None = None
        self.step_s = 0.0  # EWMA of the judged steps' median step_s
        self.num_steps_judged = 0
        self.stage_levels: dict[int, deque] = {}  # stage -> its recent per-step median log compute
        self.split_levels: dict[int, deque] = {}  # and of the ranks carrying more than an even share, under a split
        self.kh = (0.0, 0.0)  # the CUSUM reference and threshold of the last judged step
        # column i: log ratio (not clipped) at the i-th latest judged step
        self.lr_cols = _Columns(_ONSET_STEPS)
        self.hist_steps: deque[int] = deque(maxlen=_ONSET_STEPS)  # the judged steps those columns are for
        self.own_cols = _Columns(_LEVEL_MAX_STEPS)  # column i: log compute at the i-th latest judged step
        self.own_base = np.full(0, np.nan)  # median log compute before the current climb began (NaN: too few steps)
        self.paired = np.zeros(0, bool)  # judged against a single peer at its last step
        self.held: deque[tuple[int, int, pl.DataFrame]] = deque()  # released steps waiting for their waits
        self.num_unjudged_steps = 0  # held steps dropped past _MAX_HELD_STEPS
        self.climb_peak = np.zeros(0)  # the highest level (log) of the rank's current climb
        # the run's healthy swings: (judged steps, peak level, rank, last climbing step) of the latest
        # climbs that ended with no incident
        self.swings: deque[tuple[int, float, int, int]] = deque(maxlen=max(1, swing_memory))

    @property
    def lr_hist(self) -> np.ndarray:
        """Per rank, its log ratio (not clipped) at the latest judged steps, newest first."""
        return self.lr_cols.view

    @property
    def own_hist(self) -> np.ndarray:
        """Per rank, its log compute at the latest judged steps, newest first."""
        return self.own_cols.view

    def ensure(self, n: int) -> None:
        self.cusum = _grow(self.cusum, n, 0.0)
        self.mask = _grow(self.mask, n, 0)
        self.calm = _grow(self.calm, n, 0)
        self.ratio = _grow(self.ratio, n, 1.0)
        self.excess = _grow(self.excess, n, 0.0)
        self.compute = _grow(self.compute, n, 0.0)
        self.onset = _grow(self.onset, n, -1)
        self.judged = _grow(self.judged, n, -1)
        self.last_lr = _grow(self.last_lr, n, np.nan)
        self.block_sum = _grow(self.block_sum, n, 0.0)
        self.block_n = _grow(self.block_n, n, 0)
        self.last_block = _grow(self.last_block, n, np.nan)
        self.lr_cols.ensure(n)
        self.own_cols.ensure(n)
        self.own_base = _grow(self.own_base, n, np.nan)
        self.paired = _grow(self.paired, n, False)
        self.climb_peak = _grow(self.climb_peak, n, 0.0)

    def footprint(self) -> dict[str, int]:
        return {"episodes": len(self.episodes), "rank_slots": len(self.cusum), "noise": len(self.noise),
                "drift": len(self.drift), "swings": len(self.swings),
                "stage_levels": sum(len(d) for d in (*self.stage_levels.values(), *self.split_levels.values())),
                "held_steps": len(self.held),
                **self.waits.footprint()}


@register
class StragglerDetector:
    name = "straggler"
    kinds = ("straggler",)

    def __init__(self, rules) -> None:
        self.cfg = rules.straggler
        self.k0 = math.log(self.cfg.min_ratio)
        self.clip = math.log(self.cfg.max_step_ratio)
        self.full = (1 << self.cfg.window_steps) - 1

    def new_state(self) -> _State:
        return _State(self.cfg.ewma_alpha, self.cfg.noise_window, self.cfg.async_min_share, self.cfg.clock_error_s,
                      self.cfg.swing_memory)

    # -- the noise-adaptive reference and threshold ----------------------------------
    def noise_s(self, st: _State) -> float | None:
        """Step-to-step noise of a rank's log ratio (a sigma), None until enough is seen."""
        return _change_sigma(st.noise, _MIN_NOISE_SAMPLES)

    def drift_s(self, st: _State) -> float | None:
        """Noise of a rank's mean log ratio over `window_steps` steps (a sigma, from the
        changes between consecutive blocks' means), None until enough is seen. White
        step-to-step noise averages out over a block (sigma / sqrt(window_steps)); ranks
        that drift apart for tens of steps (processes sharing cores) do not. A level shift
        (a straggler's onset) is one large change among many and leaves the median alone."""
        return _change_sigma(st.drift, _MIN_DRIFT_SAMPLES)

    def reference(self, st: _State) -> tuple[float, float]:
        """(k, h): the CUSUM's per-step reference and its threshold. The drift counts as far as it
        exceeds what the step-to-step noise alone makes of a block's mean (sigma / sqrt(window_steps),
        in quadrature): ranks that drift apart raise the reference, white noise does not twice (its
        sigma already does). On a loaded host's small model, with white noise of ~0.27 a step, the
        whole drift (~0.09, nearly all of it white) put the reference at 1.04 sigmas, above a 1.3x
        straggler's 0.26: its sum never climbed (the bench's small-model runs, seeds 111-114, 201
        and 202: 5 of 44 stragglers missed, all 1.3x, and one more dated 27 steps late; with this,
        2 missed, 1.3x on dp2, and no false one in their clean runs or in the tiny model's corpus)."""
        sigma = self.noise_s(st) or 0.0
        drift = self.drift_s(st)
        if drift is None:  # not measured yet: at least half the step-to-step noise (white noise averaged
            drift = _DRIFT_PRIOR * sigma  # over 8 steps is 0.35 of it; clean dp2 runs on 2 cores measured ~1.0)
        else:
            drift = math.sqrt(max(0.0, drift * drift - sigma * sigma / self.cfg.window_steps))
        return (max(self.k0, self.cfg.noise_k * sigma, self.cfg.drift_k * drift),
                max(self.cfg.cusum_threshold, self.cfg.noise_h * sigma))

    def levels(self, st: _State) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per rank: (its level, how many sigmas that lies above its peers', that sigma): the median of its log
        ratios (not clipped) over the steps since its climb began, at least `level_steps` of
        its latest judged steps and at most `_LEVEL_MAX_STEPS`. The sigma of that median of m
        steps is the larger of 1.25 x the step-to-step noise over sqrt(m) and the drift (ranks
        that drift apart on shared cores: a median over a block does not average that out),
        the drift shrinking as sqrt(2 window_steps / m) once m passes two blocks: a swing of a
        shared host ends (clean runs on two shared cores: 8-30 steps), a straggler stays, and
        the longer it stays the surer it is. A median of several steps is what a real
        straggler moves and a burst of two or three slow steps does not (a clean Lightning rank on shared cores ran 1.5x its peer for three
        steps in a row)."""
        n = len(st.cusum)
        have = min(len(st.hist_steps), _LEVEL_MAX_STEPS)
        if not n or not have:
            return np.zeros(n), np.zeros(n), np.zeros(n)
        sigma = self.noise_s(st) or 0.0
        drift = self.drift_s(st)
        least = self.cfg.inferred_level_steps if st.waits.inferring else self.cfg.level_steps
        if drift is None:  # not measured yet (~56 steps on two ranks): the prior, and the median over twice
            drift = _DRIFT_PRIOR * sigma  # the steps (a clean rank on two loaded cores was 1.14x for 7 steps
            least *= 2  # at step 48, 5 sigmas of that prior; a 1.5x straggler is named ~8 steps in)
        steps = np.fromiter(st.hist_steps, np.int64, len(st.hist_steps))[:have]  # newest first
        since = np.where(st.onset[:n] >= 0, (steps[None, :] >= st.onset[:n, None]).sum(axis=1), 0)
        m = np.clip(since, min(least, have), have)
        hist = np.where(np.arange(have)[None, :] < m[:, None], st.lr_hist[:n, :have], np.nan)
        cnt = np.isfinite(hist).sum(axis=1)
        level, out, scale = np.zeros(n), np.zeros(n), np.zeros(n)
        got = cnt > 0
        if got.any():
            level[got] = row_medians(hist[got])  # np.nanmedian: row by row through numpy.ma here
            c = cnt[got]
            settled = 2 * self.cfg.window_steps  # swings of a shared host last up to a few blocks
            scale[got] = np.maximum(drift * np.sqrt(settled / np.maximum(c, settled)), 1.25 * sigma / np.sqrt(c))
            with np.errstate(divide="ignore", invalid="ignore"):
                out[got] = np.where(scale[got] > 0, level[got] / scale[got], np.where(level[got] > 0, np.inf, 0.0))
        return level, out, scale

    def above_swings(self, st: _State, ranks: np.ndarray, level: np.ndarray, scale: np.ndarray,
                     step: int) -> np.ndarray:
        """Per rank of `ranks`: its level stands above every healthy swing of this run that
        lasted as long as its climb so far and still ended (`swings`: climbs that ended with
        no incident, the latest `swing_memory`), by `swing_margin_z` sigmas of the level
        (`scale`, per rank, from levels(): a swing's peak was a median of noisy steps too). Host noise is the run's own: on two
        shared cores a clean rank climbed to 1.3x for 17 steps after another had swung to
        1.35x for 21 steps and come back; a clean Lightning rank 0 on a loaded host swung to
        1.49x for 20 steps, then to 1.6x for 13 (0.07 above the first's peak, under one
        sigma of its level); a straggler stays, and once it outlasts every swing seen only
        the priors above (the level's sigmas) judge it. A climb of the rank's own that ended
        within `window_steps` before this one began is not a bar to it. No swing seen yet: true."""
        if not st.swings or not len(ranks) or self.cfg.swing_memory <= 0:
            return np.ones(len(ranks), bool)
        n = len(st.swings)
        d = np.fromiter((x[0] for x in st.swings), np.int64, n)
        peak = np.fromiter((x[1] for x in st.swings), float, n)
        whose = np.fromiter((x[2] for x in st.swings), np.int64, n)
        ended = np.fromiter((x[3] for x in st.swings), np.int64, n)
        onset = st.onset[ranks]
        lasted = step - onset + 1
        # not the rank's own climb that touched zero within window_steps before this one began: a
        # straggler's sum dips on a noisy host, and that is one slowness, not a swing to beat
        dip = (whose[None, :] == ranks[:, None]) & (onset[:, None] - ended[None, :] <= self.cfg.window_steps)
        bar = np.where((d[None, :] >= lasted[:, None]) & ~dip, peak[None, :], -np.inf).max(axis=1)
        return level[ranks] > bar + self.cfg.swing_margin_z * scale[ranks]

    def _swings(self, st: _State, ended: np.ndarray, last: np.ndarray) -> None:
        """Remember the climbs of `ended` (their last climbing step `last`) that opened no
        incident: the run's healthy swings, their length in steps and their peak level."""
        if not len(ended):
            return
        blamed = {r for ep in st.episodes.values() for r in ep.ever}
        for rank, at in zip(ended.tolist(), last.tolist()):
            if rank not in blamed and st.onset[rank] >= 0:
                st.swings.append((int(at - st.onset[rank] + 1), float(st.climb_peak[rank]), rank, int(at)))

    def run(self, p, st: _State) -> None:
        st.waits.add(p.frames.collectives)
        rel = p.released
        if rel is None or not rel.height:
            return
        marks, topo = p.run.marks, p.topo
        last_attempt, last_step = split_key(int(step_keys(rel).max()))
        st.waits.finalize(last_attempt, last_step - self.cfg.collective_lag_steps)
        if st.waits.inferring or st.held:
            self._judge_inferred(p, st, rel)
            return
        steps = p.steps
        rank, step_s = steps.ints("rank"), steps.floats("step_s")
        for attempt, step, lo, hi in steps.steps():
            if marks.is_excluded(attempt, step, topo):
                continue
            c, scale = steps.even_share_compute(lo, hi)
            if self._judge(st, topo, step, rank[lo:hi], c, scale, step_s[lo:hi]):
                st.last_judged = (attempt, step)
                self._episodes(p, st)  # per step: a pass may release many (a replay, a backlog)

    def _judge_inferred(self, p, st: _State, rel: pl.DataFrame) -> None:
        """A job without measured waits: judge the held steps whose collectives are final, their
        compute net of the inferred waits."""
        marks, topo = p.run.marks, p.topo
        st.held.extend(iter_steps(rel))
        while len(st.held) > _MAX_HELD_STEPS:
            st.held.popleft()
            st.num_unjudged_steps += 1
        while st.held and st.waits.is_final(st.held[0][0], st.held[0][1]):
            attempt, step, rows = st.held.popleft()
            if marks.is_excluded(attempt, step, topo):
                continue
            got = self._net_compute(st, attempt, step, rows)
            if got is not None and self._judge(st, topo, step, *got):
                st.last_judged = (attempt, step)
                self._episodes(p, st)

    @staticmethod
    def _net_compute(st: _State, attempt: int, step: int, rows: pl.DataFrame):
        """(ranks, compute s, None, step_s) of the ranks with inferred waits at the step (`_judge`'s
        arguments): compute is `step_s` less `data_s` (when measured) less the rank's inferred
        wait (else `fwd_s + bwd_s + opt_s` less it, for a row without `step_s`); None when the
        step had none."""
        got = st.waits.inferred_waits(attempt, step)
        if got is None:
            return None
        ranks, waited = got
        r = rows["rank"].to_numpy().astype(np.int64)
        at = np.searchsorted(ranks, r)
        at = np.minimum(at, len(ranks) - 1)
        known = ranks[at] == r
        if not known.any():
            return None
        phases = sum(rows[col].to_numpy().astype(float) for col in ("fwd_s", "bwd_s", "opt_s"))
        step_s = rows["step_s"].to_numpy().astype(float)
        data_s = np.nan_to_num(rows["data_s"].to_numpy().astype(float)) if "data_s" in rows.columns else 0.0
        c = np.where(np.isfinite(step_s), step_s - data_s, phases) - waited[at]
        return r[known], c[known], None, step_s[known]

    # -- one step ------------------------------------------------------------------
    def _judge(self, st: _State, topo, step: int, r: np.ndarray, c: np.ndarray, scale: np.ndarray | None,
               step_s: np.ndarray) -> bool:
        """Judge one step: its rows' ranks `r`, compute `c` (s: our trainer's `fwd_s + bwd_s +
        opt_s` at an even share, already net of communication, with its `share_scale`; or
        netted of inferred waits by the caller, `scale` None) and `step_s`."""
        rows_r = r
        ok = np.isfinite(c) & (c > 0) & (r >= 0)
        if ok.sum() < 2:
            return False
        r, c = r[ok], c[ok]
        st.ensure(int(r.max()) + 1)
        more = np.zeros(len(r), bool) if scale is None else scale[ok] < 1.0
        if not more.any():
            st.split_levels.clear()
            got = self._ratios(st, st.stage_levels, topo, r, c)
        else:
            got = self._split_ratios(st, topo, r, c, more)
        if got is None:
            return False
        r, c, ratio, single = got
        raw = np.log(ratio)
        lr = np.clip(raw, -self.clip, self.clip)
        k, h = st.kh = self.reference(st)  # from the noise before this step
        prev = st.last_lr[r]
        seen = np.isfinite(prev) & (st.judged[r] >= 0)
        st.noise.extend(np.abs(lr[seen] - prev[seen]).tolist())
        st.last_lr[r] = lr
        self._blocks(st, r, lr)
        before = st.cusum[r]
        # a step adds at most log(max_step_ratio / min_ratio) above the reference, wherever the noise
        # put the reference: clipped at log max_step_ratio alone, a reference raised to ~log 1.5 by a
        # noisy host let a 2x straggler add 0.04 a step, and the demo named it 54 steps late
        step_in = np.clip(raw, -self.clip, k + self.clip - self.k0)
        after = np.clip(before + step_in - k, 0.0, 2.0 * h)  # capped: a long straggle recovers fast
        lighter = np.zeros(len(r), bool) if scale is None else np.isin(r, rows_r[ok][scale[ok] > 1.0])
        if lighter.any():
            # a rank on less than an even share got it from a rebalance for its own incident: once that
            # closed, the split is being undone, and its reading per micro-batch is not linear either
            # (recovered on 1 of 6 micro-batches, a rank read 1.1-1.3x scaled to an even share: its step's
            # fixed costs counted 3 times). Its sum does not climb towards a new incident until the split
            # is undone; while its incident is open it goes on as every rank's
            ongoing = np.isin(r, [m for ep in st.episodes.values() for m in ep.members])
            after = np.where(lighter & ~ongoing, 0.0, after)
        st.cusum[r] = after
        climbing = (before <= 0) & (after > 0)
        ended = (before > 0) & (after <= 0)
        self._swings(st, r[ended], st.judged[r[ended]])
        st.onset[r[climbing]] = step
        # its own compute before the climb (this step's not in yet)
        st.own_base[r[climbing]] = row_medians(st.own_hist[r[climbing]], self.cfg.window_steps)
        st.climb_peak[r[climbing]] = -np.inf
        st.onset[r[after <= 0]] = -1
        st.calm[r] = np.where(after < 0.5 * h, st.calm[r] + 1, 0)  # hysteresis: calm well below the threshold
        slow = (ratio >= self.cfg.min_ratio).astype(np.int64)
        st.mask[r] = ((st.mask[r] << 1) | slow) & self.full
        st.lr_cols.push(r, np.log(ratio))  # a column is one judged step: NaN where a rank was not judged
        st.own_cols.push(r, np.log(c))
        st.paired[r] = single
        st.hist_steps.appendleft(step)
        a = self.cfg.ewma_alpha
        st.ratio[r] = a * ratio + (1 - a) * st.ratio[r]
        st.excess[r] = a * c * (1.0 - 1.0 / ratio) + (1 - a) * st.excess[r]  # over what its reference makes it
        st.compute[r] = a * c + (1 - a) * st.compute[r]
        st.judged[r] = step
        step_s = step_s[np.isfinite(step_s)]
        if len(step_s):  # smoothed as the excess is: the share of the step they make is steady
            med = median1(step_s)
            st.step_s = med if st.step_s <= 0 else a * med + (1 - a) * st.step_s
        st.num_steps_judged += 1
        return True

    def _ratios(self, st: _State, levels: dict[int, deque], topo, r: np.ndarray, c: np.ndarray):
        """(ranks, compute, ratio to their reference, judged against a single peer) of the ranks
        `r` with compute `c` that have a reference; None when none has. `levels`: the stages'
        recent levels (fed this step's)."""
        ref, peers = loo_median(c, topo.stage_of(r))
        ok = (peers >= 1) & (ref > 0)
        if not ok.any():
            return None
        r, c, ref = r[ok], c[ok], ref[ok]
        ratio = c / ref
        single = np.ones(len(r), bool) if len(r) < 3 else peers[ok] < 2
        if len(r) >= 3:  # each stage's own level taken out: against its pipeline's other stages, else every rank
            stage = topo.stage_of(r)
            lc = np.log(c)
            stages, at = np.unique(stage, return_inverse=True)
            level = np.empty(len(stages))
            suspect = st.onset[r] >= 0  # their sum is climbing
            for i, g in enumerate(stages.tolist()):
                hist = levels.setdefault(g, deque(maxlen=_STAGE_LEVEL_STEPS))
                mine = at == i
                healthy = mine & ~suspect
                hist.append(median1(lc[healthy if healthy.any() else mine]))
                level[i] = median_of(hist)
            x = lc - level[at]
            x_pipe, partners = loo_median(x, topo.pipeline_of(r))
            x_all, _ = loo_median(x)
            x_ref = np.where(partners >= 1, x_pipe, x_all)
            single = partners == 1
            ratio = np.exp(x - x_ref)
        return r, c, ratio, single

    def _split_ratios(self, st: _State, topo, r: np.ndarray, c: np.ndarray, more: np.ndarray):
        """Ratios under a split of the global batch (a rebalance in force): the ranks with an even
        share or less against every rank (compute at an even share: the rebalanced straggler stays
        one per micro-batch, and its incident closes when it recovers), the ranks carrying more
        (`more`) against one another only. Compute is not linear in the micro-batches on shared
        cores: a replica of 5 micro-batches read 1.15-1.3x of its rebalanced peer's one, per
        micro-batch, once the peer had recovered, and was named a straggler in the second or two
        before the split was undone. A rank carrying more with no such peer (a job of two
        replicas) is not judged until the split ends."""
        whole = self._ratios(st, st.stage_levels, topo, r, c)
        if whole is not None:
            keep = ~np.isin(whole[0], r[more])
            whole = tuple(a[keep] for a in whole)
        rest = self._ratios(st, st.split_levels, topo, r[more], c[more]) if more.sum() >= 2 else None
        parts = [p for p in (whole, rest) if p is not None and len(p[0])]
        if not parts:
            return None
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))

    def _blocks(self, st: _State, r: np.ndarray, lr: np.ndarray) -> None:
        """Each rank's log ratios in blocks of `window_steps` judged steps: a complete
        block's mean, against the rank's previous block's, feeds the drift."""
        st.block_sum[r] += lr
        st.block_n[r] += 1
        done = r[st.block_n[r] >= self.cfg.window_steps]
        if not len(done):
            return
        mean = st.block_sum[done] / st.block_n[done]
        prev = st.last_block[done]
        seen = np.isfinite(prev)
        st.drift.extend(np.abs(mean[seen] - prev[seen]).tolist())
        st.last_block[done] = mean
        st.block_sum[done] = 0.0
        st.block_n[done] = 0

    def _slowed(self, st: _State) -> np.ndarray:
        """Per rank: not judged against a single peer, or slower than its own past too. Two
        ranks' ratio cannot tell one slowing down from the other speeding up (on shared cores
        a rank's compute drops to ~0.65x while its peer's stays put); a straggler's own
        compute rises above its level before the climb (`own_base`: the median of its judged
        steps before the climb began; with fewer than `window_steps` of them, of its steps
        `window_steps` and more ago). Not the steps just before now: a verdict that waits
        for the climb to last `min_persist_s` (dozens of steps of a fast job) would compare
        the straggler with its own slow steps (a dp2 straggler of the bench was never named).
        A ratio of `max_step_ratio` or more is slow either way (a straggler from the first
        step has no faster past)."""
        n = len(st.cusum)
        ok = ~st.paired[:n] | (st.ratio >= self.cfg.max_step_ratio)
        w, m = self.cfg.window_steps, max(1, self.cfg.min_slow_steps)
        idx = np.flatnonzero(~ok)
        if not len(idx):
            return ok
        recent = row_medians(st.own_hist[idx, :m])
        base = np.where(st.onset[idx] >= 0, st.own_base[idx], np.nan)
        # no climb, or too few steps before it: the steps window_steps and more ago
        base = np.where(np.isfinite(base), base, row_medians(st.own_hist[idx, w:], w))
        known = np.isfinite(recent) & np.isfinite(base)
        ok[idx[known]] = np.exp(recent[known] - base[known]) >= self.cfg.min_ratio
        return ok

    def _persist_s(self, st: _State, level: np.ndarray) -> np.ndarray | float:
        """How long each rank's climb must have lasted (s) before it fires: `min_persist_s`; in a job
        without measured waits, `inferred_min_persist_s` while its level is below `max_step_ratio`
        (its inferred ratios swing longer: a clean 2-rank DDP job's ranks took turns at 1.3-1.5x for
        0.8 and 1.3 s on a loaded host; its stragglers of 1.8-2x stood above that at once)."""
        if not st.waits.inferring:
            return self.cfg.min_persist_s
        return np.where(level < self.clip, self.cfg.inferred_min_persist_s, self.cfg.min_persist_s)

    # -- who is held back by whom --------------------------------------------------
    def _witnessed(self, st: _State) -> np.ndarray:
        """Per rank: its group waits for it, the second witness of its slowness: the others'
        waits it caused (s/step, from the collectives matched by `group_seq`) are at least
        `witness_share` of its excess compute. A rank slower than its peers whom nobody
        waits for costs the job nothing (a clean Lightning rank 0 on two shared cores:
        1.12x, 1.7 ms/step of excess for 18 steps, 9 us/step of waits caused). A rank with
        no collective seen has no witness to ask: true."""
        n = len(st.cusum)
        ranks = np.arange(n)
        caused = st.waits.caused(ranks)
        took_part = st.waits.all_ops[:n] > 0
        return ~took_part | (caused >= self.cfg.witness_share * np.maximum(st.excess[:n], 0.0))

    def _held_by(self, st: _State, rank: int, culprits: set[int]) -> tuple[int, list[int]] | None:
        """The slow rank `rank` is held back by: the end of its chain of net waits (its own
        by `waiter_share` of its excess or more), when that rank is slow too (a culprit, or
        its sum climbing); None when `rank` is the one the others wait for."""
        need = max(_WAITER_FLOOR_S, self.cfg.waiter_share * max(float(st.excess[rank]), 0.0))
        sink, chain = st.waits.sink(rank, need, _WAITER_FLOOR_S)
        if sink == rank or not (sink in culprits or (sink < len(st.cusum) and st.cusum[sink] > 0)):
            return None
        return sink, chain

    # -- incidents -----------------------------------------------------------------
    def _episodes(self, p, st: _State) -> None:
        if not st.episodes and st.kh[1] > 0 and not (st.onset >= 0).any():
            # nothing to report or resolve, and no rank can fire: a firing rank's sum is at least
            # h > 0, and a rank's sum is above zero exactly while its climb has an onset (`_judge`).
            # Most steps of a healthy run: the levels and the checks below cost a small job's
            # collector ~1.5 ms a pass of 12 steps
            return
        cfg, topo = self.cfg, p.topo
        _, h = st.kh
        step = st.last_judged[1]
        known = len(st.noise) >= _MIN_NOISE_SAMPLES and st.num_steps_judged >= _MIN_JUDGED_STEPS
        costly = st.excess >= cfg.min_share * st.step_s  # a few ms of a long step is contention, not a fault
        if st.waits.inferring and self.drift_s(st) is None:
            # inferred waits are noisier than measured ones, and early on a shared host two ranks
            # drift apart for tens of steps (clean 2-rank DDP, HF and Lightning runs opened 1.1-1.3x
            # stragglers at steps 8-39, one through a hiccup that took a rank's smoothed ratio past
            # max_step_ratio for a step): no verdict before the drift is measured
            known = False
        level, sigmas, scale = self.levels(st)
        up = st.onset[:len(level)] >= 0
        st.climb_peak[up] = np.maximum(st.climb_peak[up], level[up])
        lasted = np.where(st.onset >= 0, (step - st.onset + 1) * st.step_s, 0.0)  # s, the climb so far
        firing = np.flatnonzero((st.cusum >= h) & (popcount(st.mask & self.full) >= cfg.min_slow_steps)
                                & (lasted >= self._persist_s(st, level))
                                & (st.ratio >= cfg.min_ratio) & costly & self._slowed(st)
                                & (sigmas >= (cfg.inferred_level_z if st.waits.inferring else cfg.level_z))
                                & self._witnessed(st)) \
            if known else np.zeros(0, np.int64)
        firing = firing[self.above_swings(st, firing, level, scale, step)]
        # culprits: the firing ranks and the open incidents' members; a culprit that waits for
        # another culprit is held back by it (the rank everyone waits for is the culprit)
        culprits = set(firing.tolist()) | {r for ep in st.episodes.values() for r in ep.members}
        held: dict[int, tuple[int, list[int]]] = {}
        for rank in sorted(culprits):
            got = self._held_by(st, rank, culprits)
            if got is not None:
                held[rank] = got
        culprits -= set(held)
        for rank in firing.tolist():
            if rank in held:
                continue
            node = self._node(topo, rank)
            ep = st.episodes.get(node)
            if ep is None:
                prefix = f"straggler:{topo.node_names[node]}" if node >= 0 else f"straggler:rank{rank}"
                ep = st.episodes[node] = _Episode(p.book.new_key(prefix), node)
                ep.fired_at = step
            if rank not in ep.members:
                ep.members.add(rank)
                ep.ever.add(rank)
                ep.onset = min(ep.onset, self._onset(st, rank, step, self.clip, cfg.window_steps,
                                                              self.noise_s(st) or 0.0))
        for node, ep in list(st.episodes.items()):
            for rank in list(ep.members):
                if rank in held:
                    ep.members.discard(rank)  # it waits for another culprit
                    ep.held[rank] = held[rank]
            for rank in list(ep.members) + list(ep.held):
                if st.calm[rank] >= cfg.resolve_after_steps or (
                        st.judged[rank] >= 0 and step - st.judged[rank] > cfg.resolve_after_steps):
                    ep.members.discard(rank)  # recovered, or gone (isolated, no longer reporting)
                    ep.held.pop(rank, None)
            if not ep.members and not ep.held:
                if p.book.is_open(ep.key):
                    p.resolve(ep.key, step_to=step,
                              evidence={**p.book.get(ep.key).evidence, "resolved_because": "back to its peers' speed"})
                del st.episodes[node]
                continue
            waiters = {r: got for r, got in held.items() if got[0] in ep.members}
            self._report(p, st, ep, step, waiters)

    @staticmethod
    def _onset(st: _State, rank: int, step: int, clip: float, near: int, sigma: float) -> int:
        """Where the rank's slowness began: the change point of its log ratios (clipped at
        `clip`, as the sum takes them) over the last
        `_ONSET_STEPS` judged steps (the split maximising t(n-t)/n (mean after - mean before)^2
        with the later level higher), no earlier than the climb's start (where the sum left zero);
        and the climb's start when the `near` steps just before the split were as slow (their
        median at least the CUSUM's reference, and the rise across the split no larger): the
        slowness began before the split, which is noise among slow steps (a straggler from step
        25 of a job whose verdict waited for the drift, to step 61, was dated from such a split,
        61). Only the steps next to the split count: a burst of slow steps well before it (whose
        sum never came back to zero) is not the straggler's onset (a DDP straggler from step 40
        was dated 23). A rise larger than the split's within the steps after it, standing
        `_LATER_RISE_Z` sigmas of the step-to-step noise out of them (least-squares gain), is
        where the level the rank is named at began: on a loaded host a rank ran 1.1-1.15x for
        eleven steps before a 1.5x straggler was injected into it, the stretch made no verdict
        by itself, and the incident was dated from the stretch (CI: 41 for a fault at 52).

        The climb's start is also where a sum with today's reference would have left zero
        (the earlier of the two): the reference falls once the drift is measured, and a rank
        slow under the prior's higher one had its sum reset again and again (a dp2 straggler
        from step 42 of a loaded host, whose sum started for good at 60 when the drift was
        measured at 63, was dated 60). The split itself may lie before the climb's start as
        far back as such a sum left zero when only the steps faster than the rank's peers
        lower it: a few of a 1.5x straggler's steps at 1.2x on a loaded host (slower than its
        peers, below the reference) reset the plain sum, and one from step 50 was dated 68.
        (A sum at half the reference instead held up over three noisy steps and a fast one
        just before the demo's straggler, and dated it 4 steps early.) Not in a job without
        measured waits: its inferred ratios are noisier, and held such a sum up for 25 steps."""
        climb = int(st.onset[rank]) if st.onset[rank] >= 0 else step
        steps = np.fromiter(st.hist_steps, np.int64, len(st.hist_steps))[::-1]  # oldest first
        x = np.clip(st.lr_hist[rank, :len(steps)][::-1], -clip, clip)
        keep = np.isfinite(x)
        steps, x = steps[keep], x[keep]
        n = len(x)
        if n < 2:
            return climb
        climb = min(climb, _left_zero(x, st.kh[0], steps, climb))
        # not from inferred waits: a foreign DDP job's noisy ratios kept such a sum up for 25 steps
        # before its straggler, and dated it 15 for an onset at 40
        floor = climb if st.waits.inferring else min(climb, _left_zero(x, st.kh[0], steps, climb, hold=True))
        best, rise = _rise(x)
        if best < 0:
            return climb  # no rise among these steps: the climb's start
        level = float(np.median(x[max(0, best + 1 - near):best + 1]))
        if level >= st.kh[0] and rise <= level:
            return climb  # they were as slow before it: the climb's start
        # a larger rise later on, out of the noise: the level the rank is named at began there
        later, more = _rise(x[best + 1:])
        if later >= 0 and more > rise and more * more * _split_weight(len(x) - best - 1, later) >= (
                _LATER_RISE_Z * sigma) ** 2:
            return int(steps[best + 2 + later])
        return max(floor, int(steps[best + 1]))

    @staticmethod
    def _node(topo, rank: int) -> int:
        return int(topo.node_of[rank]) if rank < len(topo.node_of) and topo.node_of[rank] >= 0 else -1 - rank

    def _report(self, p, st: _State, ep: _Episode, step: int, waiters: dict[int, tuple[int, list[int]]]) -> None:
        cfg, topo = self.cfg, p.topo
        members = np.array(sorted(r for r in ep.members if st.ratio[r] >= cfg.min_ratio), np.int64)
        if not len(members):
            return  # its members are calming down: the row keeps what it showed while they were slow
        slowest = int(members[np.argmax(st.excess[members])])
        cost_s = float(max(0.0, st.excess[members].max()))
        share = cost_s / st.step_s if st.step_s > 0 else None
        last_share = st.waits.last_share(members)
        caused = st.waits.caused(members)
        node = topo.node_name(slowest)
        aggregated = len(members) >= cfg.node_min_ranks
        k, h = st.kh
        per_rank = {str(int(r)): {"compute_ratio": json_number(st.ratio[r], 4),
                                  "compute_s": json_number(st.compute[r], 4),
                                  "excess_s": json_number(st.excess[r], 4), "cusum": json_number(st.cusum[r], 4),
                                  "last_share": json_number(ls, 3) if np.isfinite(ls) else None,
                                  "caused_wait_s_per_step": json_number(cw, 4), **topo.coords(int(r))}
                    for r, ls, cw in zip(members.tolist(), last_share, caused)}
        known = last_share[np.isfinite(last_share)]
        agree = float(known.max()) if len(known) else None
        confidence = 0.7 if agree is None else round(0.55 + 0.45 * min(1.0, agree), 3)
        ratio = float(st.ratio[slowest])
        waiters = {str(w): {"waits_for": q, "chain": chain[:8],
                            "net_wait_s_per_step": json_number(st.waits.net_wait(w, chain[1]), 4)}
                   for w, (q, chain) in sorted(waiters.items())[:16] if q in members}
        evidence = {"ranks": members.tolist(), "node": node, "stage": topo.coords(slowest)["pp"],
                    "compute_ratio": json_number(ratio, 4), "onset_step": ep.onset, "fired_at_step": ep.fired_at,
                    "cost_s_per_step": json_number(cost_s, 4), "share_of_step": json_number(share, 3),
                    "step_s": json_number(st.step_s, 4), "window_steps": cfg.window_steps,
                    "min_ratio": cfg.min_ratio, "cusum_reference": json_number(k, 3),
                    "cusum_threshold": json_number(h, 3), "per_rank": per_rank,
                    "waited_on": {"last_share": json_number(agree, 3) if agree is not None else None,
                                  "waiters": waiters}}
        cost = f"costs {cost_s:.3g} s/step" + (f" ({100 * share:.0f}% of step time)" if share is not None else "")
        if aggregated:
            root = (f"slow node {node}: ranks {', '.join(map(str, members.tolist()))} compute up to "
                    f"{ratio:.2f}x their stage peers; {cost}")
        else:
            where = f" on {node}" if node else ""
            root = f"slow rank {slowest}{where}: compute {ratio:.2f}x its stage peers; {cost}"
            if waiters:
                root += f"; rank(s) {', '.join(waiters)} wait for it"
        p.report(Finding(kind="straggler", key=ep.key, run_id=p.run.run_id,
                         severity="critical" if share is not None and share >= 0.25 else "warning",
                         rank=None if aggregated else slowest, node=node, step_from=ep.onset, step_to=step,
                         evidence=evidence, root_cause=root, confidence=confidence))
