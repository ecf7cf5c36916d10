"""A plain PyTorch DDP job we did not write, as the agent's watch and Flight Recorder report it.

The commits a collector would see from `llmwatch-instrument` / `watch(model,
optimizer)` on a data-parallel loop (reusing `sim.Sim`'s shipping: flushes per
rank, urgent rows at once, group commits). What differs from our trainer's rows:

- collectives come from torch's Flight Recorder, one row per *completed* op:
  `seq` its record id (per rank), `group_seq` its collective seq id, `start_ts`
  when the rank enqueued it, `duration_s` NULL (gloo), and `wait_s` NULL: not
  measured;
- DDP's bucket all-reduces are async: a rank enqueues bucket j at a fraction of
  its backward, goes on computing, and blocks only at the end of backward until
  the last bucket is done (NCCL runs them in order: bucket j ends at the later of
  bucket j-1's end and its last member's enqueue, plus the transfer). With
  `broadcast_buffers` each forward starts with a blocking broadcast;
- `fwd_s` is the root module's forward, `bwd_s` the end of forward to the
  optimizer step (it holds the wait for the all-reduces: not net of
  communication), `step_s` the wall time between optimizer steps;
- `loss` NULL (the global loss is not known without a collective), `local_loss`
  this rank's own (each rank is its own replica: dp = rank), `finite_fwd` that
  loss finite, `finite_bwd` the reduced grads finite, `grad_norm` of the reduced
  grads (the same on every rank), `sample_*` -1;
- heartbeats carry `last_seq` (the record the rank enqueued last) with its
  `last_op/last_axis/last_group_id/last_group_seq`, and the step in progress
  (a rank that hangs before its forward stays at the step it finished).

Per-rank clocks keep a residual error of up to `clock_err_s` (the agent aligns
them). Faults: `Delay` (a straggler: extra forward time), `ReplicaSpike` (one
replica's poisoned batch), `ForeignNan`, and `sim.Hang`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from tests.unit.analysis.sim import Hang, Layout, Sim

_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Delay:
    """`rank`'s forward takes `extra_s` longer over steps [start, end)."""
    rank: int
    start: int
    extra_s: float
    end: int = 1 << 40


@dataclass(frozen=True)
class ReplicaSpike:
    """`rank`'s own batch at `step` is poisoned: its local loss `factor` times what it would be
    (over [step, end) when `end` is given: a shard that stays harder)."""
    rank: int
    step: int
    factor: float = 1.7
    grad_factor: float = 1.3
    end: int = 0


@dataclass(frozen=True)
class ForeignNan:
    """`rank`'s loss goes NaN at `step` (finite_fwd 0); the all-reduced grads are NaN on every
    rank from that step (finite_bwd 0, grad_norm NaN), every rank's loss from the next one."""
    rank: int
    step: int


@dataclass
class DdpRun(Sim):
    layout: Layout = None  # type: ignore[assignment]  # dp only: Layout(dp=world, nodes=...)
    jitter: float = 0.2  # each phase of each rank U(1 - jitter, 1 + jitter) of its mean
    fwd_mean_s: float = 0.010
    bwd_mean_s: float = 0.020
    opt_mean_s: float = 0.003
    data_mean_s: float = 0.001
    xfer_s: float = 0.0005  # one bucket's transfer once every member enqueued it
    buckets: int = 4
    broadcast_buffers: bool = False  # a blocking broadcast at each forward's start
    timings: bool = True  # False: a Trainer callback, step_s alone (fwd/bwd/opt NULL)
    clock_err_s: float = 0.001
    loss_noise: float = 0.03  # sigma of a replica's log local loss around the curve (batch noise)
    loss_tail_df: float = 0.0  # > 0: that noise heavy-tailed, a Student t with this many degrees of freedom
    hang_tail_s: float = 60.0  # heartbeats go on this long after a hang
    global_loss: bool = False  # True: `loss` is the replicas' mean, as a Trainer logs it (else NULL)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = Layout(dp=2, nodes=2)
        assert self.layout.tp == 1 and self.layout.pp == 1

    def build(self):
        rng = np.random.default_rng(self.seed)
        W, S = self.layout.world, self.steps
        hang = next((f for f in self.faults if isinstance(f, Hang)), None)
        clock = rng.uniform(-self.clock_err_s, self.clock_err_s, W)
        ops: list[dict] = []
        cols: dict[str, list] = {k: [] for k in ("step", "rank", "ts", "step_s", "fwd_s", "bwd_s", "opt_s",
                                                  "data_s")}
        fwd_start = np.zeros((S + 1, W))  # when each rank started each step's forward
        end_prev = np.full(W, self.start_ts)
        seq = np.zeros(W, np.int64)
        gseq = 0
        starts, ends, compute = [], [], []
        last_step = S if hang is None else hang.step - 1
        for s in range(1, S + 1):
            u = rng.uniform(1 - self.jitter, 1 + self.jitter, (4, W))
            data, fwd, bwd, opt = (m * u[i] for i, m in enumerate(
                (self.data_mean_s, self.fwd_mean_s, self.bwd_mean_s, self.opt_mean_s)))
            for f in self.faults:
                if isinstance(f, Delay) and f.start <= s < f.end:
                    fwd[f.rank] += f.extra_s
            t = end_prev + data
            fwd_start[s] = t
            if s > last_step:  # the hung step: the culprit never starts it, the others block in it
                fwd_start[s, hang.rank] = 0.0
                self._hung_ops(ops, s, t, fwd, bwd, seq, gseq, hang.rank, clock)
                break
            if self.broadcast_buffers:
                done = t.max() + self.xfer_s
                self._op(ops, s, np.arange(W), seq, gseq, "broadcast", t, done, clock)
                seq += 1
                gseq += 1
                t = np.full(W, done)
            fwd_end = t + fwd
            enq = fwd_end[:, None] + bwd[:, None] * (np.arange(1, self.buckets + 1) / self.buckets)[None, :]
            done = -np.inf
            for j in range(self.buckets):
                done = max(done, enq[:, j].max()) + self.xfer_s
                self._op(ops, s, np.arange(W), seq, gseq, "all_reduce", enq[:, j], done, clock)
                seq += 1
                gseq += 1
            bwd_end = np.maximum(fwd_end + bwd, done)  # blocked until the last bucket is done
            end = bwd_end + opt
            for k, v in (("step", np.full(W, s)), ("rank", np.arange(W)), ("ts", end + clock),
                         ("step_s", end - end_prev), ("fwd_s", fwd_end - fwd_start[s]), ("bwd_s", bwd_end - fwd_end),
                         ("opt_s", opt), ("data_s", data)):
                cols[k].append(v)
            compute.append(fwd + bwd + opt)  # the truth the detectors estimate (no waits)
            starts.append(float(fwd_start[s].min()))
            ends.append(float(end.max()))
            end_prev = end
        self._starts, self._ends, self._compute = np.array(starts), np.array(ends), np.array(compute)
        self._fwd_start = fwd_start
        steps, urgent = self._steps(rng, {k: np.concatenate(v) for k, v in cols.items()})
        coll = pl.DataFrame(ops).with_columns(pl.lit(self.run_id).alias("run_id"), pl.lit(0, pl.Int32).alias("attempt"))
        done_col = coll["_done"]
        coll = coll.with_columns(done_col.alias("_emit_ts")).drop("_done")
        hb = self._ddp_heartbeats(coll, hang)
        coll = coll.filter(pl.col("_emit_ts").is_finite())  # the ops of a hang never complete: no rows
        events = self._events(last_step, hang)
        return self._commits(steps, urgent, coll, hb, events, None, hang)

    # -- rows -------------------------------------------------------------------------
    @staticmethod
    def _op(ops: list, s: int, ranks: np.ndarray, seq: np.ndarray, gseq: int, op: str, enq: np.ndarray,
            done: float, clock: np.ndarray) -> None:
        for r in ranks.tolist():
            ops.append({"step": s, "rank": r, "seq": int(seq[r]), "group_seq": gseq, "op": op, "axis": "dp",
                        "group_id": 0, "peer": -1, "bytes": _BUCKET_BYTES, "start_ts": float(enq[r] + clock[r]),
                        "duration_s": None, "wait_s": None, "_done": float(done)})

    def _hung_ops(self, ops, s, t, fwd, bwd, seq, gseq, culprit, clock) -> None:
        """The peers enter step `s` and block (never complete): in the forward's broadcast, or
        after enqueuing every bucket of their backward. Their entries exist (heartbeats), no rows."""
        peers = np.array([r for r in range(self.layout.world) if r != culprit])
        if self.broadcast_buffers:
            self._op(ops, s, peers, seq, gseq, "broadcast", t, np.inf, clock)
            return
        enq = (t + fwd)[:, None] + bwd[:, None] * (np.arange(1, self.buckets + 1) / self.buckets)[None, :]
        for j in range(self.buckets):
            self._op(ops, s, peers, seq + j, gseq + j, "all_reduce", enq[:, j], np.inf, clock)

    def _steps(self, rng, c: dict[str, np.ndarray]) -> tuple[pl.DataFrame, np.ndarray]:
        W = self.layout.world
        s_idx, r_idx = c["step"] - 1, c["rank"]
        n_steps = int(c["step"].max()) if len(s_idx) else 0
        curve = 2.0 + 6.0 * np.exp(-np.arange(1, n_steps + 1) / 150.0)
        noise = rng.standard_t(self.loss_tail_df, (n_steps, W)) if self.loss_tail_df else rng.normal(0, 1, (n_steps, W))
        local = curve[:, None] * np.exp(self.loss_noise * noise)
        grad = (0.8 + 2.0 * np.exp(-np.arange(1, n_steps + 1) / 80.0)) * np.exp(rng.normal(0, 0.1, n_steps))
        finite_fwd = np.ones((n_steps, W), np.int8)
        finite_bwd = np.ones((n_steps, W), np.int8)
        urgent = np.zeros((n_steps, W), bool)
        for f in self.faults:
            if isinstance(f, ReplicaSpike) and f.step <= n_steps:
                span = slice(f.step - 1, max(f.end - 1, f.step))
                local[span, f.rank] *= f.factor
                grad[span] *= f.grad_factor  # flushed as usual: the agent cannot tell a spike
                self.truth.append({"kind": "spike", "rank": f.rank, "node": self.layout.node(f.rank), "step": f.step,
                                   "attempt": 0, "replica": f.rank})
            if isinstance(f, ForeignNan) and f.step <= n_steps:
                k = f.step - 1
                local[k, f.rank] = np.nan
                finite_fwd[k, f.rank] = 0
                finite_bwd[k:] = 0
                grad[k:] = np.nan
                local[k + 1:] = np.nan
                finite_fwd[k + 1:] = 0
                urgent[k:] = True
                self.truth.append({"kind": "nan", "rank": f.rank, "node": self.layout.node(f.rank), "step": f.step,
                                   "attempt": 0, "mode": "transient"})
        nulls = pl.Series([None] * len(s_idx), dtype=pl.Float64)
        phases = {k: (pl.Series(c[k]) if self.timings else nulls) for k in ("fwd_s", "bwd_s", "opt_s")}
        n = len(s_idx)
        df = pl.DataFrame({
            "run_id": [self.run_id] * n, "attempt": np.zeros(n, np.int32), "step": c["step"].astype(np.int64),
            "rank": r_idx.astype(np.int32), "ts": c["ts"],
            "loss": local.mean(axis=1)[s_idx] if self.global_loss else nulls, "grad_norm": grad[s_idx],
            "loss_scale": nulls, "lr": np.full(n, 1e-3), "step_s": c["step_s"], **phases,
            "data_s": c["data_s"] if self.timings else nulls, "local_loss": local[s_idx, r_idx],
            "finite_fwd": finite_fwd[s_idx, r_idx], "finite_bwd": finite_bwd[s_idx, r_idx],
            "sample_epoch": np.full(n, -1), "sample_from": np.full(n, -1), "sample_to": np.full(n, -1),
            "node": [self.layout.node(int(r)) for r in r_idx],
        })
        return df, urgent[s_idx, r_idx]

    def _ddp_heartbeats(self, coll: pl.DataFrame, hang) -> pl.DataFrame:
        W = self.layout.world
        until = (self._ends[-1] if len(self._ends) else self.start_ts) + (self.hang_tail_s if hang else 0.1)
        parts = []
        for r in range(W):
            mine = coll.filter(pl.col("rank") == r).sort("seq")
            enq = mine["start_ts"].to_numpy()
            t = self.start_ts + self._phase(r) + np.arange(0, until - self.start_ts, self.flush_s)
            t = t[t <= until]
            if self.finish and hang is None:
                t = np.append(t, until)
            i = np.searchsorted(enq, t, side="right") - 1  # the last op it enqueued by t
            known = i >= 0
            j = np.maximum(i, 0)
            starts = self._fwd_start[1:, r]
            step = np.searchsorted(starts[starts > 0], t, side="right")  # forwards started by t
            parts.append(pl.DataFrame({
                "rank": np.full(len(t), r, np.int32), "ts": t, "node": [self.layout.node(r)] * len(t),
                "pid": np.full(len(t), 10_000 + r), "phase": ["train"] * len(t), "step": step.astype(np.int64),
                "last_seq": np.where(known, mine["seq"].to_numpy()[j], -1),
                "last_op": [v if k else None for v, k in zip(mine["op"].to_numpy()[j].tolist(), known.tolist())],
                "last_axis": [v if k else None for v, k in zip(mine["axis"].to_numpy()[j].tolist(), known.tolist())],
                "last_group_id": np.where(known, mine["group_id"].to_numpy()[j], -1).astype(np.int32),
                "last_group_seq": np.where(known, mine["group_seq"].to_numpy()[j], -1),
            }))
        return pl.concat(parts).with_columns(pl.lit(self.run_id).alias("run_id"))

    def fwd_started(self, step: int) -> float:
        return float(self._fwd_start[step].min())
