"""A synthetic hybrid-parallel run, as the commits a collector would see. Seeded, vectorised.

Model (close enough to trainer/ to exercise every detector, cheap enough for
thousands of steps):

- layout `pp x dp x tp`, ranks in the trainer's order (tp innermost), `nodes`
  nodes of consecutive ranks; each pipeline stage may have its own speed;
- per step and rank a compute time `base * stage_speed * U(1 - jitter, 1 + jitter)`
  split 30/60/10 into fwd/bwd/opt; the step ends when the slowest rank is done
  (plus a little communication), and an eval or checkpoint adds a pause;
- a decaying loss curve with multiplicative noise, global (identical on every
  rank), the mean of per-replica local losses; a noisy grad norm;
- each rank's ops per step in a fixed order (TP all-reduces in forward and
  backward, pipeline send/recv, the DP all-reduce, the TP norm all-reduce, the PP
  all-reduce, then the async WORLD broadcast of the control channel, recorded
  only when waited at the end of the next step), with `seq` per rank and
  `group_seq` per group as trainer/comm.py counts them; the last rank to enter a
  collective is waited for by the others;
- heartbeats once per flush; every rank flushes every `flush_s` at its own
  phase; rows with a non-finite loss, or a spike, are flushed at once; the
  collector group-commits every `tick_s`.

Faults: `Straggler`, `Spike`, `Nan`, `Hang`, `Crash` (see each); `Contention`
slows a rank without being a fault (no ground truth). The ground
truth comes back as `Sim.truth`, rows shaped like injections.jsonl.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from analysis.frames import Frames


@dataclass(frozen=True)
class Straggler:
    rank: int
    start: int
    factor: float
    end: int = 1 << 40


@dataclass(frozen=True)
class Contention:
    """A rank's compute stretched by `factor` over `[start, end)` steps without being a fault (no
    ground truth): on an oversubscribed host, the culprit's tensor-parallel partner computes in
    lockstep with it and shares its contention. One step (`end = start + 1`) is a hiccup."""
    rank: int
    start: int
    factor: float
    end: int = 1 << 40


@dataclass(frozen=True)
class Rebalance:
    """From step `start` on, dp replica d takes `shares[d]` micro-batches of the global batch
    (trainer/control.py's rebalance): its samples and its forward and backward compute scale with
    its share over the even one, to the power `exponent` (1: linear; on shared cores a replica of 5
    micro-batches computed 1.15-1.3x its peer's one per micro-batch, ~1.16), until step `end` (the
    split undone). Needs `local_signals` (the sample windows)."""
    start: int
    shares: tuple[int, ...]
    end: int = 1 << 40
    exponent: float = 1.0


@dataclass(frozen=True)
class Spike:
    step: int
    factor: float = 3.0
    replica: int | None = None  # None: the whole global batch (every replica)
    grad_factor: float = 4.0


@dataclass(frozen=True)
class Nan:
    step: int
    rank: int
    local_signals: bool = True  # the agent records finite_fwd/finite_bwd/local_loss


@dataclass(frozen=True)
class Hang:
    rank: int
    step: int


@dataclass(frozen=True)
class Crash:
    rank: int
    step: int
    launcher: bool = False  # the launcher reports the exit and stops the others
    cascade: bool = False  # the peers die too, right after (gloo connection errors)


@dataclass
class Layout:
    dp: int = 2
    tp: int = 1
    pp: int = 1
    nodes: int = 2
    stage_speed: tuple[float, ...] = ()

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, r: int) -> tuple[int, int, int]:
        return (r // self.tp) % self.dp, r % self.tp, r // (self.tp * self.dp)  # dp, tp, pp

    def node(self, r: int) -> str:
        return f"node{r // (self.world // self.nodes)}"

    def rank(self, dp: int, tp: int, pp: int) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp


def _ops(layout: Layout, r: int) -> list[tuple[str, str, int, int, float]]:
    """(op, axis, group_id, peer, fraction of compute when entered) in entry order."""
    dp, tp, pp = layout.coords(r)
    tp_gid = r - tp
    dp_gid = layout.rank(0, tp, pp)
    pp_gid = layout.rank(dp, tp, 0)
    stride = layout.dp * layout.tp
    ops = []
    if layout.tp > 1:
        ops += [("all_reduce", "tp", tp_gid, -1, 0.10), ("all_reduce", "tp", tp_gid, -1, 0.25)]
    if layout.pp > 1:
        if pp > 0:
            ops.append(("recv", "pp", min(r, r - stride), r - stride, 0.02))
        if pp < layout.pp - 1:
            ops.append(("send", "pp", r, r + stride, 0.30))
    if layout.tp > 1:
        ops += [("all_reduce", "tp", tp_gid, -1, 0.50), ("all_reduce", "tp", tp_gid, -1, 0.75)]
    if layout.pp > 1:
        if pp < layout.pp - 1:
            ops.append(("recv", "pp", r, r + stride, 0.35))
        if pp > 0:
            ops.append(("send", "pp", min(r, r - stride), r - stride, 0.80))
    if layout.dp > 1:
        ops.append(("all_reduce", "dp", dp_gid, -1, 0.90))
    if layout.tp > 1:
        ops.append(("all_reduce", "tp", tp_gid, -1, 0.95))
    if layout.pp > 1:
        ops.append(("all_reduce", "pp", pp_gid, -1, 1.0))
    if layout.world > 1:
        ops.append(("broadcast", "world", 0, -1, 1.0))  # async: recorded when waited, a step later
    return ops


@dataclass
class Sim:
    layout: Layout = field(default_factory=Layout)
    steps: int = 300
    seed: int = 0
    run_id: str = "sim"
    base_s: float = 0.2
    jitter: float = 0.10
    # each step, each pipeline's (the ranks of one dp x tp coordinate) compute times a common factor within
    # 1 -/+ this: a shared host's contention, or batches whose cost varies, moves a pipeline's stages together
    pipeline_jitter: float = 0.0
    flush_s: float = 1.0
    tick_s: float = 0.25
    eval_every: int = 0
    ckpt_every: int = 0
    pause_s: float = 0.8  # eval / checkpoint pause after their step
    fp16: bool = False
    local_signals: bool = False  # the agent sends local_loss/finite_* and sample windows on clean steps too
    ranks_rows: bool = True  # send `ranks` rows with coordinates (else only the mesh in `runs`)
    warmup_slow: bool = True  # the first steps are slow on some ranks (compile), as in real runs
    ckpt_slow_rank: int | None = 0  # this rank computes 1.6x slower on the 2 steps after a checkpoint
    finish: bool = True  # the run ends normally: run_finished, agent_closed
    hb_ops: bool = False  # heartbeats carry last_op/last_axis/last_group_id/last_group_seq (optional columns)
    hb_interval: bool = False  # heartbeats say their interval (`interval_s`: flush_s, one a flush), as the agent's do
    ckpt_slow_steps: int = 2
    faults: tuple = ()
    start_ts: float = 1000.0
    truth: list[dict] = field(default_factory=list)

    # -- generation ---------------------------------------------------------------
    def build(self) -> list[tuple[float, Frames]]:
        """The run's commits in order: (now, frames)."""
        rng = np.random.default_rng(self.seed)
        L, S = self.layout, self.steps
        W = L.world
        step_ids = np.arange(1, S + 1)
        speed = np.array([(L.stage_speed[L.coords(r)[2]] if L.stage_speed else 1.0) for r in range(W)])
        compute = self.base_s * speed[None, :] * rng.uniform(1 - self.jitter, 1 + self.jitter, (S, W))
        if self.pipeline_jitter:
            pipe = np.array([L.coords(r)[0] * L.tp + L.coords(r)[1] for r in range(W)])
            compute *= rng.uniform(1 - self.pipeline_jitter, 1 + self.pipeline_jitter, (S, L.dp * L.tp))[:, pipe]
        if self.warmup_slow:
            compute[:3] *= rng.uniform(1.0, 3.0, (3, W))
        if self.ckpt_every and self.ckpt_slow_rank is not None:
            for s in range(self.ckpt_every, S, self.ckpt_every):
                compute[s:s + self.ckpt_slow_steps, self.ckpt_slow_rank] *= 1.6  # the steps after the checkpoint
        hang = next((f for f in self.faults if isinstance(f, (Hang, Crash))), None)
        last_step = S if hang is None else hang.step - 1  # steps that complete
        for f in self.faults:
            if isinstance(f, Contention):
                compute[max(f.start, 1) - 1:min(f.end, S + 1) - 1, f.rank] *= f.factor
            if isinstance(f, Straggler):
                lo, hi = max(f.start, 1) - 1, min(f.end, S)
                compute[lo:hi, f.rank] *= f.factor
                self.truth.append({"kind": "straggler", "rank": f.rank, "node": L.node(f.rank), "step": f.start,
                                   "factor": f.factor, "attempt": 0})
        pause = np.zeros(S)
        for s in step_ids:
            if (self.eval_every and s % self.eval_every == 0) or (self.ckpt_every and s % self.ckpt_every == 0):
                pause[s - 1] = self.pause_s
        dp_of = np.array([L.coords(r)[0] for r in range(W)])
        rebalance = next((f for f in self.faults if isinstance(f, Rebalance)), None)
        share = np.ones((S, W))  # each rank's micro-batches over the even share, per step
        if rebalance is not None:
            even = sum(rebalance.shares) / L.dp
            share[rebalance.start - 1:rebalance.end - 1] = np.array(rebalance.shares, float)[dp_of] / even
        work = share ** (rebalance.exponent if rebalance is not None else 1.0)  # the forward and backward's work
        compute = compute * (0.9 * work + 0.1)  # forward and backward scale (0.9 of it), the optimizer not
        step_dur = compute.max(axis=1) + 0.01 + rng.uniform(0, 0.005, S)
        starts = self.start_ts + np.concatenate([[0.0], np.cumsum(step_dur + pause)[:-1]])
        ends = starts + step_dur
        self._starts, self._ends, self._compute = starts, ends, compute

        # losses
        replicas = L.dp
        curve = 2.0 + 6.0 * np.exp(-step_ids / 150.0)
        local = curve[:, None] * np.exp(rng.normal(0, 0.02, (S, replicas)))
        grad = (0.8 + 2.0 * np.exp(-step_ids / 80.0)) * np.exp(rng.normal(0, 0.12, S))
        urgent = np.zeros(S, bool)
        for f in self.faults:
            if isinstance(f, Spike):
                cols = slice(None) if f.replica is None else [f.replica]
                local[f.step - 1, cols] *= f.factor
                grad[f.step - 1] *= f.grad_factor
                urgent[f.step - 1] = True
                self.truth.append({"kind": "spike", "rank": -1, "node": None, "step": f.step, "attempt": 0,
                                   "replica": f.replica})
        loss = local.mean(axis=1)
        scale = np.ones(S)
        if self.fp16:
            scale = self._scales(rng, S)

        # step rows
        r_idx = np.tile(np.arange(W), S)
        s_idx = np.repeat(np.arange(S), W)
        keep = s_idx < last_step
        c = compute[s_idx, r_idx]
        sh = work[s_idx, r_idx]
        u = c / (0.9 * sh + 0.1)  # the compute at an even share
        steps = {
            "run_id": [self.run_id] * len(r_idx), "attempt": np.zeros(len(r_idx), np.int32),
            "step": step_ids[s_idx], "rank": r_idx.astype(np.int32),
            "ts": ends[s_idx] + 0.0005 * r_idx, "loss": loss[s_idx], "grad_norm": grad[s_idx],
            "loss_scale": scale[s_idx], "lr": np.full(len(r_idx), 1e-3), "tokens": np.full(len(r_idx), 4096),
            # a rebalanced rank's forward and backward scale with its share, its optimizer's does not
            "step_s": step_dur[s_idx], "fwd_s": 0.3 * u * sh, "bwd_s": 0.6 * u * sh, "opt_s": 0.1 * u,
            "data_s": np.full(len(r_idx), 0.001), "comm_exposed_s": step_dur[s_idx] - c,
            "mem_bytes": np.full(len(r_idx), 1 << 30), "skipped": np.zeros(len(r_idx), bool),
            "node": [L.node(r) for r in r_idx],
        }
        nan_fault = next((f for f in self.faults if isinstance(f, Nan)), None)
        local_cols = self.local_signals or (nan_fault is not None and nan_fault.local_signals)
        if local_cols:
            steps["local_loss"] = local[s_idx, dp_of[r_idx]]
            steps["finite_fwd"] = np.ones(len(r_idx), np.int8)
            steps["finite_bwd"] = np.ones(len(r_idx), np.int8)
        if self.local_signals:
            per_replica = 64
            n = np.rint(per_replica * share).astype(np.int64)  # samples per rank and step
            before = np.zeros((S, W), np.int64)  # the samples of the replicas before each rank's
            for r in range(W):
                before[:, r] = n[:, [q for q in range(W) if dp_of[q] < dp_of[r] and L.coords(q)[1:] == (0, 0)]].sum(1)
            steps["sample_epoch"] = np.zeros(len(r_idx), np.int64)
            steps["sample_from"] = s_idx * replicas * per_replica + before[s_idx, r_idx]
            steps["sample_to"] = steps["sample_from"] + n[s_idx, r_idx]
        for f in self.faults:  # each NaN fault poisons its step
            if isinstance(f, Nan):
                self._poison(steps, s_idx, r_idx, f, local_cols)
                urgent[f.step - 1] = True
        steps_df = pl.DataFrame(steps).filter(pl.Series(keep))
        step_urgent = urgent[s_idx][keep]

        coll = self._collectives(rng, last_step, hang)
        hb = self._heartbeats(last_step, hang)
        events = self._events(last_step, hang)
        scalars = self._scalars(last_step)
        return self._commits(steps_df, step_urgent, coll, hb, events, scalars, hang)

    def _scales(self, rng, S: int) -> np.ndarray:
        scale = np.empty(S)
        s = 65536.0
        for i in range(S):
            if i < 4:
                s /= 2  # calibration backoffs at start
            elif rng.random() < 0.002:
                s /= 2
            elif i % 200 == 0:
                s *= 2
            scale[i] = s
        return scale

    def _poison(self, steps: dict, s_idx, r_idx, f: Nan, local_cols: bool) -> None:
        L = self.layout
        at = s_idx == f.step - 1
        steps["loss"] = np.where(at, np.nan, steps["loss"])
        steps["grad_norm"] = np.where(at, np.nan, steps["grad_norm"])
        odp, otp, opp = L.coords(f.rank)
        if local_cols:
            same_replica = np.array([L.coords(r)[0] == odp for r in range(L.world)])
            later = np.array([L.coords(r)[2] > opp for r in range(L.world)])
            fwd_bad = (r_idx == f.rank) | (same_replica[r_idx] & later[r_idx])
            steps["finite_fwd"] = np.where(at & fwd_bad, 0, steps["finite_fwd"]).astype(np.int8)
            steps["finite_bwd"] = np.where(at & same_replica[r_idx], 0, steps["finite_bwd"]).astype(np.int8)
            steps["local_loss"] = np.where(at & same_replica[r_idx], np.nan, steps["local_loss"])
        self.truth.append({"kind": "nan", "rank": f.rank, "node": L.node(f.rank), "step": f.step, "attempt": 0,
                           "mode": "transient"})

    def _collectives(self, rng, last_step: int, hang) -> pl.DataFrame:
        L, W = self.layout, self.layout.world
        starts, compute = self._starts, self._compute
        parts = []
        for r in range(W):
            ops = _ops(L, r)
            n = len(ops)
            if not n:
                continue
            steps_done = last_step  # steps whose ops all complete
            k = np.arange(steps_done)
            frac = np.array([o[4] for o in ops])
            start = starts[k][:, None] + frac[None, :] * compute[k, r][:, None]
            seq = k[:, None] * n + np.arange(n)[None, :]
            gidx = _group_index(ops)
            gseq = k[:, None] * gidx["per_step"][None, :] + gidx["index"][None, :]
            parts.append(pl.DataFrame({
                "rank": np.full(seq.size, r, np.int32), "step": (k[:, None] + 1).repeat(n, 1).ravel(),
                "seq": seq.ravel(), "group_seq": gseq.ravel(),
                "op": [o[0] for o in ops] * steps_done, "axis": [o[1] for o in ops] * steps_done,
                "group_id": np.array([o[2] for o in ops] * steps_done, np.int32),
                "peer": np.array([o[3] for o in ops] * steps_done, np.int32),
                "start_ts": start.ravel(),
            }))
            if hang is not None:
                parts.append(self._hung_step_rows(r, ops, hang))
        df = pl.concat([p for p in parts if p.height], how="vertical_relaxed")
        key = ["axis", "group_id", "group_seq", pl.col("peer").clip(upper_bound=0)]
        done = pl.col("start_ts").max().over(key) + 0.002
        # an async broadcast is recorded at the end of the next step; everything else when complete
        steps_col = df["step"].to_numpy()
        end_of_next = pl.Series(self._ends[np.minimum(steps_col, len(self._ends) - 1)])
        df = df.with_columns(
            pl.when(pl.col("peer") >= 0).then(0.001).otherwise(done - pl.col("start_ts")).alias("duration_s"))
        df = df.with_columns(pl.col("duration_s").alias("wait_s"),
                             pl.when(pl.col("op") == "broadcast").then(pl.lit(end_of_next))
                             .otherwise(pl.col("start_ts") + pl.col("duration_s")).alias("_emit_ts"))
        if hang is not None:  # broadcasts of the step before the hang are never waited
            df = df.filter(~((pl.col("op") == "broadcast") & (pl.col("step") >= hang.step - 1)))
        return df.with_columns(pl.lit(self.run_id).alias("run_id"), pl.lit(0, pl.Int32).alias("attempt"),
                               pl.lit(0, pl.Int64).alias("bytes"))

    def _hung_step_rows(self, r: int, ops, hang) -> pl.DataFrame:
        """The completed ops of the hung step: each rank advances until a group needs a rank stuck before it."""
        entered = self._hung_progress()
        n_done = entered[r]
        k = hang.step - 1
        if r == hang.rank or n_done == 0:
            return pl.DataFrame()
        n = len(ops)
        gidx = _group_index(ops)
        frac = np.array([o[4] for o in ops[:n_done]])
        return pl.DataFrame({
            "rank": np.full(n_done, r, np.int32), "step": np.full(n_done, hang.step),
            "seq": k * n + np.arange(n_done), "group_seq": k * gidx["per_step"][:n_done] + gidx["index"][:n_done],
            "op": [o[0] for o in ops[:n_done]], "axis": [o[1] for o in ops[:n_done]],
            "group_id": np.array([o[2] for o in ops[:n_done]], np.int32),
            "peer": np.array([o[3] for o in ops[:n_done]], np.int32),
            "start_ts": self._starts[k] + frac * self._compute[k, r],
        })

    def _hung_progress(self) -> dict[int, int]:
        """Ops each rank completes in the hung step (the one it waits in is the next)."""
        if hasattr(self, "_progress"):
            return self._progress
        L = self.layout
        hang = next(f for f in self.faults if isinstance(f, (Hang, Crash)))
        ops = {r: _ops(L, r) for r in range(L.world)}
        keys = {r: _op_keys(ops[r]) for r in ops}
        pos = {r: {k: i for i, k in enumerate(keys[r])} for r in ops}
        idx = {r: 0 for r in ops}
        idx[hang.rank] = -1  # never enters anything
        changed = True
        while changed:
            changed = False
            for r in ops:
                if r == hang.rank or idx[r] >= len(ops[r]) - 1:  # the last op (async broadcast) ends the step
                    continue
                key = keys[r][idx[r]]
                members = [m for m in ops if key in pos[m]]
                if all(m != hang.rank and idx[m] >= pos[m][key] for m in members):
                    idx[r] += 1
                    changed = True
        self._progress = {r: max(i, 0) for r, i in idx.items()}
        return self._progress

    def _seq_at(self, r: int, t: np.ndarray, last_step: int, hang) -> np.ndarray:
        """The last seq rank r entered by time t."""
        L = self.layout
        ops = _ops(L, r)
        n = len(ops)
        if not n:
            return np.full(len(t), -1)
        frac = np.array([o[4] for o in ops])
        k = np.arange(last_step)
        entries = (self._starts[k][:, None] + frac[None, :] * self._compute[k, r][:, None]).ravel()
        seqs = np.arange(len(entries))
        if hang is not None and r != hang.rank:
            kk = hang.step - 1
            m = self._hung_progress()[r] + 1  # completed ops plus the one it waits in
            extra = self._starts[kk] + frac[:m] * self._compute[kk, r]
            entries = np.concatenate([entries, extra])
            seqs = np.concatenate([seqs, kk * n + np.arange(m)])
        order = np.argsort(entries, kind="stable")
        entries, seqs = entries[order], np.maximum.accumulate(seqs[order])
        i = np.searchsorted(entries, t, side="right") - 1
        return np.where(i >= 0, seqs[np.maximum(i, 0)], -1)

    def _alive_until(self, r: int, last_step: int, hang) -> float:
        end = self._ends[last_step - 1] if last_step else self.start_ts
        if isinstance(hang, Crash):
            if r == hang.rank:
                return float(self._ends[hang.step - 2]) + 0.05
            if hang.launcher or hang.cascade:
                return float(self._ends[hang.step - 2]) + 0.15
        if hang is not None:
            return end + max(60.0, 8 * self.flush_s)  # hung: the run would sit there; tests stop earlier
        return end + 0.1

    def _heartbeats(self, last_step: int, hang) -> pl.DataFrame:
        L = self.layout
        parts = []
        for r in range(L.world):
            phase0 = self._phase(r)
            until = self._alive_until(r, last_step, hang)
            t = self.start_ts + phase0 + np.arange(0, until - self.start_ts, self.flush_s)
            t = t[t <= until]
            if self.finish and hang is None:
                t = np.append(t, until)  # the final flush at close
            k = np.searchsorted(self._starts, t, side="right")  # step in progress (1-based)
            k = np.clip(k, 1, self.steps)
            in_step = t < self._ends[k - 1]
            phase = np.where(in_step, "train", "idle").astype(object)
            for every, name in ((self.eval_every, "eval"), (self.ckpt_every, "checkpoint")):
                if every:
                    phase = np.where(~in_step & (k % every == 0), name, phase)
            step = k.copy()
            if hang is not None:
                stuck = t >= self._starts[hang.step - 1]
                if r == hang.rank:
                    step = np.where(stuck, hang.step - 1, step)
                    phase = np.where(stuck, "idle", phase)
                else:
                    step = np.where(stuck, hang.step, step)
                    phase = np.where(stuck, "train", phase)
            seq = self._seq_at(r, t, last_step, hang)
            cols = {
                "rank": np.full(len(t), r, np.int32), "ts": t, "node": [L.node(r)] * len(t),
                "pid": np.full(len(t), 10_000 + r), "phase": phase.astype(str).tolist(), "step": step,
                "last_seq": seq,
            }
            if self.hb_ops:
                ops = _ops(L, r)
                gidx = _group_index(ops)
                n = len(ops)
                pos, k = np.maximum(seq, 0) % n, np.maximum(seq, 0) // n
                cols["last_op"] = [ops[i][0] for i in pos]
                cols["last_axis"] = [ops[i][1] for i in pos]
                cols["last_group_id"] = np.array([ops[i][2] for i in pos], np.int32)
                cols["last_group_seq"] = k * gidx["per_step"][pos] + gidx["index"][pos]
            if self.hb_interval:
                cols["interval_s"] = np.full(len(t), self.flush_s)
            parts.append(pl.DataFrame(cols))
        return pl.concat(parts).with_columns(pl.lit(self.run_id).alias("run_id"))

    def _events(self, last_step: int, hang) -> pl.DataFrame:
        L = self.layout
        rows = [{"rank": r, "ts": self.start_ts, "step": 0, "kind": "run_started", "data": "{}"}
                for r in range(L.world)]
        if self.ckpt_every:
            for s in range(self.ckpt_every, last_step + 1, self.ckpt_every):
                rows += [{"rank": r, "ts": float(self._ends[s - 1]) + 0.5, "step": s, "kind": "checkpoint_saved",
                          "data": json.dumps({"step": s, "num_shards": 1})} for r in range(L.world)]
        if hang is None and self.finish:
            end = float(self._ends[last_step - 1])
            rows.append({"rank": 0, "ts": end + 0.05, "step": last_step, "kind": "run_finished",
                         "data": json.dumps({"status": "completed"})})
            rows += [{"rank": r, "ts": end + 0.1, "step": last_step, "kind": "agent_closed", "data": "{}"}
                     for r in range(L.world)]
        if isinstance(hang, Crash):
            t0 = float(self._ends[hang.step - 2]) + 0.05
            if hang.launcher:
                rows.append({"rank": -1, "ts": t0 + 0.05, "step": -1, "kind": "rank_exited",
                             "data": json.dumps({"rank": hang.rank, "exit_code": 17, "signal": None,
                                                 "cause": "exited"})})
                rows += [{"rank": -1, "ts": t0 + 0.2, "step": -1, "kind": "rank_exited",
                          "data": json.dumps({"rank": r, "exit_code": None, "signal": "SIGTERM", "cause": "stopped"})}
                         for r in range(L.world) if r != hang.rank]
            self.truth.append({"kind": "crash", "rank": hang.rank, "node": L.node(hang.rank), "step": hang.step,
                               "attempt": 0, "ts": t0})
        elif isinstance(hang, Hang):
            self.truth.append({"kind": "hang", "rank": hang.rank, "node": L.node(hang.rank), "step": hang.step,
                               "attempt": 0, "ts": float(self._ends[hang.step - 2])})
        return pl.DataFrame(rows).with_columns(pl.lit(self.run_id).alias("run_id"),
                                               pl.lit(0, pl.Int32).alias("attempt"))

    def _scalars(self, last_step: int) -> pl.DataFrame | None:
        if not self.eval_every:
            return None
        rows = [{"rank": 0, "step": s, "ts": float(self._ends[s - 1]) + 0.3, "name": "eval/code_loss", "value": 2.0}
                for s in range(self.eval_every, last_step + 1, self.eval_every)]
        if not rows:
            return None
        return pl.DataFrame(rows).with_columns(pl.lit(self.run_id).alias("run_id"),
                                               pl.lit(0, pl.Int32).alias("attempt"))

    def _phase(self, r: int) -> float:
        return ((r * 0.37) % 1.0) * self.flush_s

    # -- shipping and committing -------------------------------------------------
    def _ship(self, ranks: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Next flush of each row's rank at or after t."""
        phase = np.array([self._phase(r) for r in range(self.layout.world)])[ranks]
        j = np.ceil((t - self.start_ts - phase) / self.flush_s - 1e-9)
        return self.start_ts + phase + j * self.flush_s

    def _commit_of(self, ship: np.ndarray) -> np.ndarray:
        return np.ceil((ship - self.start_ts) / self.tick_s + 1e-9).astype(np.int64)

    def _commits(self, steps, step_urgent, coll, hb, events, scalars, hang) -> list[tuple[float, Frames]]:
        L = self.layout
        last_step = hang.step - 1 if hang is not None else self.steps
        st_rank = steps["rank"].to_numpy()
        ship = np.where(step_urgent, steps["ts"].to_numpy() + 0.01, self._ship(st_rank, steps["ts"].to_numpy()))
        tables = {"steps": steps.with_columns(pl.Series("_c", self._commit_of(ship)))}
        c_rank = coll["rank"].to_numpy()
        tables["collectives"] = coll.with_columns(pl.Series("_c", self._commit_of(
            self._ship(c_rank, coll["_emit_ts"].to_numpy())))).drop("_emit_ts")
        tables["heartbeats"] = hb.with_columns(pl.Series("_c", self._commit_of(hb["ts"].to_numpy() + 0.001)))
        ev_rank = events["rank"].to_numpy()
        ev_ship = np.where(ev_rank >= 0, self._ship(np.maximum(ev_rank, 0), events["ts"].to_numpy()),
                           events["ts"].to_numpy())
        tables["events"] = events.with_columns(pl.Series("_c", self._commit_of(ev_ship)))
        if scalars is not None:
            tables["scalars"] = scalars.with_columns(pl.Series("_c", self._commit_of(
                self._ship(scalars["rank"].to_numpy(), scalars["ts"].to_numpy()))))
        config = {"eval_every": self.eval_every, "ckpt": {"every": self.ckpt_every}}
        runs = pl.DataFrame({"run_id": [self.run_id], "world_size": [L.world], "status": ["running"],
                             "config": [json.dumps(config)],
                             "mesh": [json.dumps({"dp": L.dp, "tp": L.tp, "pp": L.pp})],
                             "node_map": [json.dumps({str(r): L.node(r) for r in range(L.world)})], "_c": [1]})
        tables["runs"] = runs
        if self.ranks_rows:
            tables["ranks"] = pl.DataFrame({
                "run_id": [self.run_id] * L.world, "rank": list(range(L.world)),
                "node": [L.node(r) for r in range(L.world)], "dp": [L.coords(r)[0] for r in range(L.world)],
                "tp": [L.coords(r)[1] for r in range(L.world)], "pp": [L.coords(r)[2] for r in range(L.world)],
                "_c": [1] * L.world})
        if isinstance(hang, Crash):  # what a dead rank had not flushed is lost with it
            death = np.array([self._alive_until(r, last_step, hang) for r in range(L.world)])
            for name in ("steps", "collectives", "heartbeats", "events"):
                df = tables[name]
                r = np.maximum(df["rank"].to_numpy(), 0)
                sent = self.start_ts + (df["_c"].to_numpy() - 1) * self.tick_s
                lost = (df["rank"].to_numpy() >= 0) & (sent > death[r] + 1e-6)
                tables[name] = df.filter(pl.Series(~lost))
        per_table = {name: df.sort("_c").partition_by("_c", as_dict=True, include_key=False)
                     for name, df in tables.items()}
        commit_ids = sorted({c for parts in per_table.values() for (c,) in parts})
        out = []
        for c in commit_ids:
            f = Frames(**{name: parts.get((c,)) for name, parts in per_table.items()})
            out.append((self.start_ts + c * self.tick_s + 0.005, f))
        return out

    def step_end_ts(self, step: int) -> float:
        return float(self._ends[step - 1])


def _op_keys(ops) -> list[tuple]:
    """(axis, group_id, peer-pair, n-th op of that group in the step) for matching across ranks."""
    seen: dict[tuple, int] = {}
    out = []
    for op, axis, gid, peer, _ in ops:
        g = (axis, gid, peer >= 0)
        n = seen.get(g, 0)
        seen[g] = n + 1
        out.append((axis, gid, peer >= 0, n))
    return out


def _group_index(ops) -> dict[str, np.ndarray]:
    """Per op: its index among its group's ops in a step, and that group's ops per step."""
    keys = _op_keys(ops)
    count: dict[tuple, int] = {}
    for k in keys:
        count[k[:3]] = count.get(k[:3], 0) + 1
    return {"index": np.array([k[3] for k in keys]), "per_step": np.array([count[k[:3]] for k in keys])}


def feed(analyzer, commits, *, until: float | None = None, tick_to: float | None = None, tick_s: float = 0.25):
    """Feed commits in order (stopping after `until`), then tick the clock on to
    `tick_to`; returns every finding emitted."""
    out = []
    last = None
    for now, frames in commits:
        if until is not None and now > until:
            break
        out.extend(analyzer.feed(frames, now=now))
        last = now
    if tick_to is not None:
        t = (last or 0.0) + tick_s
        while t <= tick_to:
            out.extend(analyzer.tick(now=t))
            t += tick_s
    return out


def opened(findings, kind: str | None = None) -> dict[str, object]:
    """The first finding of each key (of `kind`)."""
    seen = {}
    for f in findings:
        if (kind is None or f.kind == kind) and f.key not in seen:
            seen[f.key] = f
    return seen


def last_of(findings) -> dict[str, object]:
    out = {}
    for f in findings:
        out[f.key] = f
    return out


def isfinite(x) -> bool:
    return x is not None and math.isfinite(x)


def backlogged(commits, every_s: float):
    """The same rows as commits arriving in bursts of `every_s` seconds (a collector
    that fell behind, or a replay window): each burst is one commit, fed at its end."""
    out: list[tuple[float, Frames]] = []
    group: list[Frames] = []
    end = None
    for now, frames in commits:
        if end is not None and now > end:
            out.append((end, _merge(group)))
            group = []
        if not group:
            end = now + every_s
        group.append(frames)
    if group:
        out.append((end, _merge(group)))
    return out


def _merge(group: list[Frames]) -> Frames:
    tables: dict[str, list[pl.DataFrame]] = {}
    for f in group:
        for name, df in f.tables().items():
            tables.setdefault(name, []).append(df)
    return Frames(**{name: pl.concat(dfs, how="diagonal_relaxed") for name, dfs in tables.items()})
