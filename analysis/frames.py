"""The input contract: which columns of which tables the detectors read.

The collector's detection thread builds one `Frames` per group commit from the
Arrow tables it just committed (`Frames.from_arrow`, zero copy: dictionary
columns arrive as polars Categoricals, which the detectors accept); the offline
replay builds them from a closed DuckDB file the same way. Names and meanings
are those of docs/schema.md. Every table is optional (None: no rows of it in the
commit) and a frame may hold rows of several runs: `Frames.split_runs` cuts it
per run.

`OPTIONAL` columns do not exist yet; the detectors use them when present (a
column of nulls counts as absent) and fall back to what exists today:

- steps `local_loss` (DOUBLE): the token-mean loss of this rank's data-parallel
  replica over its own micro-batches, before the DP average; the same on every
  rank of the replica (the trainer can carry it in the PP all-reduce it already
  does: no new sync). Names the replica whose loss jumped (spikes) and the
  replica where a NaN started. Fallback: `loss`, which is global.
- steps `finite_fwd`, `finite_bwd` (TINYINT 1 finite / 0 not): whether the
  activations this rank produced in its forward (its stage's output, before the
  loss head's cross-rank reductions) and its local gradients (before the DP
  reduction) were all finite: `torch.isfinite(...).all()` on the device, read at
  the step's one existing host sync. Name the NaN's origin rank and phase.
  Fallback: non-finite `loss`/`grad_norm`, global, so the origin stays unknown.
- steps `sample_epoch`, `sample_from`, `sample_to` (BIGINT): this rank's
  replica's samples of the step, positions `[sample_from, sample_to)` in the
  epoch's order (trainer/data.py: the replica's run of the global batch's
  micro-batches, `micro_batches` of them, or its share after a rebalance). A spike
  finding carries them; the healing skips them; the compute detectors judge a
  rank's compute at an even share of them (`compute_at_even_share`). Fallback: the
  finding names the step only, and compute is taken as it is.
- heartbeats `last_op`, `last_axis`, `last_group_id`, `last_group_seq`: the
  collective `last_seq` names (the one the rank entered last). Makes a hang's
  waited-on collective exact. Fallback: predicted from the culprit's previous
  step.
- heartbeats `interval_s`: the agent's heartbeat interval. A rank is silent after
  `[crash] silence_beats` of its intervals when that is longer than the rules'
  fixed times (an agent of a 100,000-rank job beats every 30 s). Fallback: the
  fixed times alone.
- events `agent_closed` (sent by `Agent.close()`; data `{}`): the rank finished
  cleanly, its silence is not a crash. `rank_exited` (sent by the launcher;
  `rank` -1, data `{"rank", "exit_code", "signal", "cause": "exited" |
  "stopped"}`, `cause` "stopped" for the ranks that went down with
  the job after another failed: stopped by the launcher, or their collectives
  failed first): names a crashed rank at once, with its exit code or signal.

Builders (`steps_frame`, ...) make frames from rows for tests and benchmarks;
they fill columns left out with nulls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

import numpy as np
import polars as pl

F64, I64, I32, I8, STR = pl.Float64, pl.Int64, pl.Int32, pl.Int8, pl.String

# table -> column -> (dtype, meaning). REQUIRED: what a detector reads; a table
# given without one of these is refused (`check`).
REQUIRED: dict[str, dict[str, tuple]] = {
    "steps": {
        "run_id": (STR, "the run"), "attempt": (I32, "rollback lineage"), "step": (I64, "step number"),
        "rank": (I32, "global rank"), "ts": (F64, "when the step ended (rank clock, s)"),
        "loss": (F64, "training loss, global (NaN/Inf kept)"), "grad_norm": (F64, "global grad norm"),
        "loss_scale": (F64, "dynamic loss scale (1 without fp16)"),
        "step_s": (F64, "whole step, wall clock"), "fwd_s": (F64, "forward compute"),
        "bwd_s": (F64, "backward compute"), "opt_s": (F64, "optimizer compute"),
    },
    "collectives": {
        "run_id": (STR, ""), "attempt": (I32, ""), "step": (I64, ""), "rank": (I32, ""),
        "seq": (I64, "the rank's op counter"), "group_seq": (I64, "the group's op counter"),
        "op": (STR, "all_reduce, send, ..."), "axis": (STR, "dp, tp, pp, embed, world"),
        "group_id": (I32, "lowest global rank of the group"), "peer": (I32, "send/recv peer, -1 else"),
        "start_ts": (F64, "when the rank entered the op (comparable across ranks)"),
        "wait_s": (F64, "time the rank's compute thread was blocked on it"),
    },
    "heartbeats": {
        "run_id": (STR, ""), "rank": (I32, ""), "ts": (F64, "sent (rank clock)"), "node": (STR, ""),
        "pid": (I64, ""), "phase": (STR, "forward, data, checkpoint, eval, idle, ..."),
        "step": (I64, "step in progress"), "last_seq": (I64, "latest collective seq entered"),
    },
    "events": {
        "run_id": (STR, ""), "rank": (I32, "the reporting rank"), "ts": (F64, ""), "step": (I64, ""),
        "kind": (STR, "run_started, run_finished, checkpoint_saved, ..."), "data": (STR, "JSON"),
    },
    "ranks": {
        "run_id": (STR, ""), "rank": (I32, ""), "node": (STR, "host"),
        "dp": (I32, "mesh coordinate or null"), "tp": (I32, ""), "pp": (I32, ""),
    },
    "runs": {
        "run_id": (STR, ""), "world_size": (I32, "number of ranks"), "status": (STR, "running, finished..."),
        "config": (STR, "JSON: eval_every, ckpt.every are read"), "mesh": (STR, "JSON {dp, tp, pp}"),
        "node_map": (STR, 'JSON {"rank": "node"}'),
    },
    "nodes": {"run_id": (STR, ""), "node": (STR, ""), "ranks": (STR, "JSON [ranks]")},
    "scalars": {"run_id": (STR, ""), "attempt": (I32, ""), "step": (I64, ""), "rank": (I32, ""),
                "name": (STR, "eval/... names mark eval steps"), "value": (F64, "")},
    "device_health": {"run_id": (STR, ""), "rank": (I32, ""), "ts": (F64, "sample time (rank clock)")},
    # not telemetry of the run: what happened to its nodes in other runs (analysis/fleet.py),
    # given by the collector with the run's meta rows (collector/read/fleet.py)
    "node_history": {"run_id": (STR, "the run the history is for"), "past_run_id": (STR, "the run it happened in"),
                     "node": (STR, ""), "ts": (F64, "when (s)"),
                     "what": (STR, "seen, isolated, or an incident kind")},
}

OPTIONAL: dict[str, dict[str, tuple]] = {
    "steps": {
        "node": (STR, "the rank's node"), "skipped": (pl.Boolean, "optimizer step skipped"),
        "data_s": (F64, "data wait (s; NULL: not measured)"),
        "local_loss": (F64, "replica loss before the DP average"),
        "finite_fwd": (I8, "1: forward all finite"), "finite_bwd": (I8, "1: local grads all finite"),
        "sample_epoch": (I64, "epoch of the replica's samples"),
        "sample_from": (I64, "first sample position"), "sample_to": (I64, "end sample position"),
    },
    "collectives": {"duration_s": (F64, "entry to completion (slow_link: bus bandwidth)"),
                    "bytes": (I64, "payload (slow_link: bus bandwidth)"),
                    "num_ops": (I64, "ops the row stands for: a summary's (ops_from_summaries); null: one")},
    "heartbeats": {"last_op": (STR, "op of the collective last_seq names"),
                   "last_axis": (STR, "its axis"), "last_group_id": (I32, "its group"),
                   "last_group_seq": (I64, "its group_seq"),
                   "interval_s": (F64, "the agent's heartbeat interval (s; silence is read against it)")},
    "events": {"attempt": (I32, "attempt of a restart or checkpoint event")},
    "ranks": {"hw_id": (STR, "the rank's hardware id (node_history: a node's history follows it)")},
    "runs": {},
    "nodes": {"status": (STR, "healthy, suspect, isolated (not used)")},
    "scalars": {"ts": (F64, "sample time (not used)")},
    "device_health": {"node": (STR, "the rank's node"), "step": (I64, "step in progress"),
                      "throttle_reasons": (I64, "NVML clock event reason bits"),
                      "ecc_uncorrectable": (I64, "volatile uncorrectable ECC errors"),
                      "temperature_c": (F64, "GPU temperature (evidence)"),
                      "mem_available_bytes": (I64, "host MemAvailable"), "mem_total_bytes": (I64, "host MemTotal")},
    "node_history": {"incident_id": (I64, "the incident's id in its run (evidence)"),
                     "hw_id": (STR, "the node's hardware id in that run (analysis/fleet.py `mine`)")},
}

TABLES = tuple(REQUIRED)


class FrameError(ValueError):
    """A frame that lacks a column the detectors need."""


def has(df: pl.DataFrame | None, column: str) -> bool:
    """`column` is in `df` and not entirely null."""
    return df is not None and column in df.columns and df[column].null_count() < df.height


def ints(s: pl.Series, fill: int = -1) -> np.ndarray:
    """An integer column as int64 numpy, nulls as `fill` (no query unless there are nulls)."""
    if s.null_count():
        s = s.fill_null(fill)
    return s.to_numpy().astype(np.int64, copy=False)


def floats(s: pl.Series) -> np.ndarray:
    """A float column as float64 numpy, nulls as NaN."""
    return s.to_numpy().astype(float, copy=False)


class Interner:
    """Small ints for the strings of a column (axis names, ops), equal for equal
    strings across frames: a numpy key without hashing strings per row. Polars'
    own categorical codes are not stable across frames, so the table is ours."""

    __slots__ = ("index", "names")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def codes(self, s: pl.Series) -> np.ndarray:
        """One int64 per row (-1: null)."""
        if s.dtype == pl.Categorical:
            return self._categorical(s)
        s = s.cast(pl.String)
        self._learn(s.unique().to_list())
        return s.replace_strict(self.index, default=-1, return_dtype=pl.Int64).to_numpy()

    def _learn(self, names) -> None:
        for v in names:
            if v is not None and v not in self.index:
                self.index[v] = len(self.names)
                self.names.append(v)

    def _categorical(self, s: pl.Series) -> np.ndarray:
        """Through the column's Arrow dictionary: its values (a handful) looked up by name, each
        row through a table indexed by its dictionary index, with no string per row (a
        10,000-rank commit's collectives: 0.8 against 5.6 ms a column), and no polars
        expression (`unique` alone is ~0.1 ms however short the column: a small job's pass
        codes ~16 columns)."""
        a = s.to_arrow()
        if hasattr(a, "combine_chunks"):  # a chunked array
            a = a.combine_chunks()
        names = a.dictionary.to_pylist()
        self._learn(names)
        table = np.array([self.index[v] if v is not None else -1 for v in names] + [-1], np.int64)
        idx = a.indices
        return table[idx.fill_null(len(names)).to_numpy() if idx.null_count else idx.to_numpy()]


def step_keys(df: pl.DataFrame) -> np.ndarray:
    """One int64 per row for (attempt, step): attempt * 2**40 + step."""
    return (ints(df["attempt"], 0) << 40) + ints(df["step"])


def split_key(key: int) -> tuple[int, int]:
    return int(key) >> 40, int(key) - ((int(key) >> 40) << 40)


def _pack(keys: list[np.ndarray], n: int) -> tuple[np.ndarray | None, int]:
    """The keys (the first the most significant) as one int64 each row and the bits it takes;
    None when their ranges need more than 62."""
    packed, shift = np.zeros(n, np.int64), 0
    for k in reversed(keys):
        if not n:
            break
        lo = int(k.min())
        bits = max(1, (int(k.max()) - lo).bit_length())
        if shift + bits > 62:
            return None, shift
        packed |= (k - lo) << shift
        shift += bits
    return packed, shift


def _dense_rank(v: np.ndarray) -> np.ndarray:
    """Each value's rank among the distinct values (0 the smallest; NaN last, and all NaN one
    value, as a stable sort sees them; -0.0 and 0.0 one). Ties share a rank, so the order the
    unstable sort gave them does not show."""
    o = np.argsort(v)
    s = v[o]
    new = s[1:] != s[:-1]
    if s.dtype.kind == "f":
        nan = np.isnan(s)
        new &= ~(nan[1:] & nan[:-1])
    rank = np.empty(len(v), np.int64)
    rank[o] = np.r_[0, np.cumsum(new)]
    return rank


def key_order(keys: list[np.ndarray], within: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows sorted by `keys` (int64 columns, the first the most significant), then by
    `within` among rows of equal keys, else in their given order: `np.lexsort((within,
    *keys[::-1]))`, NaN last; and where each run of equal keys starts in that order.

    One stable sort of the keys packed into an int64 when their ranges fit (a pass's few
    steps, a few axes, its groups and ops: a five-key lexsort took half the wait book's time
    at 100,000 ranks), else a lexsort. `within` takes the packed key's low bits: an integer
    as its offset from its least, a float as its dense rank (`_dense_rank`, one sort of its
    values; rows whose values tie keep their order). The packed keys come nearly in order,
    which the stable sort is quick on. Sorting every row by a float first, as this did,
    scrambled them for the sort after it: 12 ms against 5 for 80,000 rows.
    """
    n = len(keys[0])
    packed, shift = _pack(keys, n)
    if packed is None:
        order = np.lexsort(([] if within is None else [within]) + keys[::-1])
        change = np.zeros(max(n - 1, 0), bool)
        for k in keys:
            sk = k[order]
            change |= sk[1:] != sk[:-1]
        return order, np.flatnonzero(np.r_[n > 0, change])
    if within is None or not n:
        order = np.argsort(packed, kind="stable")
    else:
        if within.dtype.kind == "i":  # its offset from its least orders it as well (no sort)
            lo = int(within.min())
            bits = max(1, (int(within.max()) - lo).bit_length())
            rank = within.astype(np.int64) - lo if shift + bits <= 62 else None
        else:
            rank = _dense_rank(within)
            bits = max(1, int(rank.max()).bit_length())
        if rank is not None and shift + bits <= 62:
            order = np.argsort((packed << bits) | rank, kind="stable")
        else:
            first = np.argsort(within, kind="stable")
            order = first[np.argsort(packed[first], kind="stable")]
    sp = packed[order]
    return order, np.flatnonzero(np.r_[n > 0, sp[1:] != sp[:-1]])


def iter_steps(df: pl.DataFrame):
    """(attempt, step, rows) of a frame sorted by attempt, step: zero-copy slices."""
    keys = step_keys(df)
    if not len(keys):
        return
    bounds = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        attempt, step = split_key(keys[lo])
        yield attempt, step, df.slice(int(lo), int(hi - lo))


class StepColumns:
    """A frame sorted by attempt and step (a pass's released steps) as numpy columns, each read
    once and on demand, with each step's row range: the detectors that judge step by step
    slice these instead of a polars frame per step (a polars slice and a column read per step
    and detector cost a small job's pass more than the judging did)."""

    __slots__ = ("frame", "keys", "bounds", "_cols")

    def __init__(self, frame: pl.DataFrame) -> None:
        self.frame = frame
        self.keys = step_keys(frame)
        self.bounds = np.flatnonzero(np.r_[True, self.keys[1:] != self.keys[:-1], True]) if len(self.keys) \
            else np.zeros(1, np.int64)
        self._cols: dict[tuple[str, str], np.ndarray] = {}

    def steps(self):
        """(attempt, step, lo, hi) of each step, in order: its rows are [lo, hi)."""
        for lo, hi in zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist()):
            attempt, step = split_key(self.keys[lo])
            yield attempt, step, lo, hi

    def floats(self, name: str) -> np.ndarray:
        """A float column (NULL as NaN; a column the frame lacks: all NaN)."""
        got = self._cols.get((name, "f"))
        if got is None:
            got = self._cols[(name, "f")] = floats(self.frame[name]) if name in self.frame.columns \
                else np.full(self.frame.height, np.nan)
        return got

    def ints(self, name: str) -> np.ndarray:
        """An integer column (NULL as -1; a column the frame lacks: all -1)."""
        got = self._cols.get((name, "i"))
        if got is None:
            got = self._cols[(name, "i")] = ints(self.frame[name]) if name in self.frame.columns \
                else np.full(self.frame.height, -1, np.int64)
        return got

    def even_share_compute(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
        """`even_share_compute` of the rows [lo, hi) (one step's)."""
        scale = share_scale_of(self.ints("sample_from")[lo:hi], self.ints("sample_to")[lo:hi])
        return _at_even_share(self.floats("fwd_s")[lo:hi] + self.floats("bwd_s")[lo:hi], self.floats("opt_s")[lo:hi],
                              scale), scale


def share_scale(rows: pl.DataFrame) -> np.ndarray | None:
    """Per row, the even share of the step's samples over the row's own (`sample_to -
    sample_from` against their mean over the step's rows: every replica has as many ranks,
    so that is the even share); 1 for a row without samples; None when the step is not
    split (no samples, or every row has the same). Below 1: the row carries more than an
    even share (it took a rebalanced replica's micro-batches); above: fewer."""
    if not (has(rows, "sample_from") and has(rows, "sample_to")):
        return None
    return share_scale_of(ints(rows["sample_from"]), ints(rows["sample_to"]))


def share_scale_of(sample_from: np.ndarray, sample_to: np.ndarray) -> np.ndarray | None:
    """`share_scale` of one step's rows from their sample columns (int64, NULL as -1)."""
    lo = sample_from
    n = (sample_to - lo).astype(float)
    known = (lo >= 0) & (n > 0)
    if known.sum() < 2 or np.all(n[known] == n[known][0]):
        return None
    return np.where(known, n[known].mean() / np.where(known, n, 1.0), 1.0)


def compute_at_even_share(rows: pl.DataFrame) -> np.ndarray:
    """Each row's compute (`fwd_s + bwd_s + opt_s`) as it would be on an even share of the
    step's samples: a rebalance (trainer/control.py) gives a slow replica fewer micro-batches
    and the others more, and a straggler must stay one per micro-batch (else the split that
    hides its cost would close its incident, and the undo would open it again). Forward and
    backward scale with the samples (`share_scale`); the optimizer's does not. A step that
    is not split is as it is."""
    return even_share_compute(rows)[0]


def even_share_compute(rows: pl.DataFrame) -> tuple[np.ndarray, np.ndarray | None]:
    """(`compute_at_even_share`, `share_scale`) of the rows, the scale read once."""
    scale = share_scale(rows)
    return _at_even_share(floats(rows["fwd_s"]) + floats(rows["bwd_s"]), floats(rows["opt_s"]), scale), scale


def _at_even_share(fwd_bwd: np.ndarray, opt: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """Forward and backward scaled to an even share, the optimizer's as it is."""
    return fwd_bwd + opt if scale is None else fwd_bwd * scale + opt


def finite_or_null(s: pl.Series) -> np.ndarray:
    """True where a float column is finite or null (a null is not a non-finite value)."""
    a = s.to_numpy()
    ok = np.isfinite(a)
    if s.null_count():
        ok |= s.is_null().to_numpy()
    return ok


@dataclass(slots=True)
class Frames:
    """The rows of one commit (or of one run in it). None: no rows of that table."""

    steps: pl.DataFrame | None = None
    collectives: pl.DataFrame | None = None
    heartbeats: pl.DataFrame | None = None
    events: pl.DataFrame | None = None
    ranks: pl.DataFrame | None = None
    runs: pl.DataFrame | None = None
    nodes: pl.DataFrame | None = None
    scalars: pl.DataFrame | None = None
    device_health: pl.DataFrame | None = None
    node_history: pl.DataFrame | None = None

    @classmethod
    def from_arrow(cls, tables: Mapping[str, object]) -> "Frames":
        """From the Arrow tables of a commit, keyed by table name (others ignored).
        `polars.from_arrow` shares the buffers; nothing is copied. A summarizing agent's
        rows (`collectives_rollup`, and its op rows flagged `sampled`) become one op each
        in `collectives` (`ops_from_summaries`)."""
        out = {}
        for name in TABLES:
            t = tables.get(name)
            if t is not None and t.num_rows:
                out[name] = pl.from_arrow(t)
        summ = tables.get(SUMMARIES)
        if (summ is not None and summ.num_rows) or has(out.get("collectives"), "sampled"):
            out["collectives"] = with_summaries(out.get("collectives"),
                                                pl.from_arrow(summ) if summ is not None and summ.num_rows else None)
        return cls(**out)

    def tables(self) -> dict[str, pl.DataFrame]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def check(self) -> None:
        for name, df in self.tables().items():
            missing = [c for c in REQUIRED[name] if c not in df.columns]
            if missing:
                raise FrameError(f"{name}: missing column(s) {', '.join(missing)} (see analysis/frames.py)")

    def run_ids(self) -> list[str]:
        ids: set[str] = set()
        for df in self.tables().values():
            if df.height:
                ids.update(str(v) for v in df["run_id"].unique().to_list() if v is not None)
        return sorted(ids)

    def split_runs(self) -> dict[str, "Frames"]:
        """One `Frames` per run id in these rows."""
        per_run: dict[str, dict[str, pl.DataFrame]] = {}
        for name, df in self.tables().items():
            if not df.height:
                continue
            ids = df["run_id"].unique()
            if ids.len() == 1:  # the usual case: one run per commit, no copy
                parts = {(ids[0],): df}
            else:
                parts = df.partition_by("run_id", as_dict=True, maintain_order=True)
            for (run_id,), part in parts.items():
                if run_id is not None:
                    per_run.setdefault(str(run_id), {})[name] = part
        return {run_id: Frames(**t) for run_id, t in per_run.items()}


def _frame(table: str, rows: Iterable[Mapping] | Mapping[str, list]) -> pl.DataFrame:
    schema = {c: spec[0] for c, spec in {**REQUIRED[table], **OPTIONAL[table]}.items()}
    if isinstance(rows, Mapping):
        data = dict(rows)
        n = len(next(iter(data.values()))) if data else 0
    else:
        rows = list(rows)
        n = len(rows)
        data = {c: [r.get(c) for r in rows] for c in {k for r in rows for k in r}}
    cols = {}
    for c, dtype in schema.items():
        if c in data:
            cols[c] = pl.Series(c, data[c], dtype=dtype, strict=False)
        elif c in REQUIRED[table]:
            cols[c] = pl.Series(c, [None] * n, dtype=dtype)
    for c in data:
        if c not in cols:  # a column this contract does not name: kept as it is
            cols[c] = pl.Series(c, data[c])
    return pl.DataFrame(cols)


# -- collectives summarized per step (agent/summary.py) ----------------------------------------
SUMMARIES = "collectives_rollup"  # the table a summarizing agent's rows go to
_SUMMARY_KEY = ("run_id", "attempt", "step", "rank", "op", "axis", "group_id", "peer")


def summarize_ops(coll: pl.DataFrame) -> pl.DataFrame:
    """Op rows -> one row per (run, attempt, step, rank, op, axis, group_id, peer), as
    agent/summary.py makes them (a duration or wait sum is NULL when one of its ops had none)."""
    def total(c: str) -> pl.Expr:
        return pl.when(pl.col(c).null_count() > 0).then(None).otherwise(pl.col(c).sum()).alias(c)

    dur = pl.col("duration_s") if "duration_s" in coll.columns else pl.lit(None, F64)
    return (coll.with_columns(dur.alias("duration_s"),
                              (pl.col("bytes") if "bytes" in coll.columns else pl.lit(0, I64)).alias("bytes"))
            .group_by(list(_SUMMARY_KEY))
            .agg(pl.len().cast(I64).alias("num_ops"), pl.col("bytes").sum().cast(I64), total("duration_s"),
                 pl.col("duration_s").max().alias("max_duration_s"), total("wait_s"),
                 pl.col("wait_s").max().alias("max_wait_s"), pl.col("start_ts").min(),
                 (pl.col("start_ts") + pl.col("duration_s").fill_null(0.0)).max().alias("end_ts"),
                 pl.col("start_ts").mean().alias("mean_start_ts"),
                 (pl.col("start_ts") + pl.col("duration_s").fill_null(0.0)).mean().alias("mean_end_ts"),
                 pl.col("seq").max().alias("max_seq"), pl.col("group_seq").max().alias("max_group_seq")))


def ops_from_summaries(summ: pl.DataFrame) -> pl.DataFrame:
    """Summary rows -> one op row each, for the detectors: the row's mean op, standing for
    `num_ops` of them (the detectors weigh what they add up by it):
    - `start_ts`, `duration_s`: the mean entry, and the mean completion less it;
    - `wait_s`, `bytes`: the means;
    - `seq`, `group_seq`: the highest (the same `group_seq` on every member that ran the
      same ops: the members' rows of one summary match as one collective).
    Who waited for whom and each member's transfer time follow from the means as from one
    op's times: exact when one member is the last in at every op (a straggler, or the owner
    of a slow link, is); otherwise the last arrival of the means is below the mean of the
    last arrivals, and the waits read smaller, alike for every member (docs/scale.md)."""
    n = pl.col("num_ops").cast(F64)
    start = pl.col("mean_start_ts").fill_null(pl.col("start_ts"))
    duration = pl.when(pl.col("duration_s").is_not_null()).then(pl.col("mean_end_ts").fill_null(pl.col("end_ts"))
                                                                 - start)
    return summ.select(
        pl.col("run_id").cast(STR), pl.col("attempt").cast(I32), pl.col("step").cast(I64), pl.col("rank").cast(I32),
        pl.col("max_seq").fill_null(-1).cast(I64).alias("seq"),
        pl.col("max_group_seq").fill_null(-1).cast(I64).alias("group_seq"),
        pl.col("op").cast(STR), pl.col("axis").cast(STR), pl.col("group_id").cast(I32),
        pl.col("peer").fill_null(-1).cast(I32), start.cast(F64).alias("start_ts"),
        (pl.col("wait_s") / n).alias("wait_s"), duration.cast(F64).alias("duration_s"),
        (pl.col("bytes").cast(F64) / n).round().cast(I64).alias("bytes"), pl.col("num_ops").cast(I64))


def with_summaries(coll: pl.DataFrame | None, summ: pl.DataFrame | None) -> pl.DataFrame | None:
    """The detectors' `collectives`: op rows as they are, and a summarizing agent's rows (its
    summaries, and its op rows flagged `sampled`, summarized the same way) one op each."""
    parts, summaries = [], [] if summ is None else [summ]
    if coll is not None and coll.height:
        if has(coll, "sampled"):
            sampled = pl.col("sampled").fill_null(0) > 0
            if (raw := coll.filter(sampled)).height:
                summaries.append(summarize_ops(raw))
            coll = coll.filter(~sampled)
        if coll.height:
            parts.append(coll.with_columns(pl.col("op").cast(STR), pl.col("axis").cast(STR),
                                           pl.col("run_id").cast(STR), pl.lit(None, I64).alias("num_ops")))
    for s in summaries:
        parts.append(ops_from_summaries(s))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else pl.concat(parts, how="diagonal_relaxed")


def steps_frame(rows) -> pl.DataFrame:
    return _frame("steps", rows)


def collectives_frame(rows) -> pl.DataFrame:
    return _frame("collectives", rows)


def heartbeats_frame(rows) -> pl.DataFrame:
    return _frame("heartbeats", rows)


def events_frame(rows) -> pl.DataFrame:
    return _frame("events", rows)


def ranks_frame(rows) -> pl.DataFrame:
    return _frame("ranks", rows)


def runs_frame(rows) -> pl.DataFrame:
    return _frame("runs", rows)


def nodes_frame(rows) -> pl.DataFrame:
    return _frame("nodes", rows)


def scalars_frame(rows) -> pl.DataFrame:
    return _frame("scalars", rows)


def device_health_frame(rows) -> pl.DataFrame:
    return _frame("device_health", rows)
