"""The training run bench/bench_dashboard.py fills a collector with, simulated chunk by chunk.

A dp x tp8 mesh (8 ranks a node) with a straggler from 30% of the run, six
collectives a step (four tp all-reduces, a dp reduce-scatter overlapped with
backward, a dp all-gather) whose group_seq, start_ts and waits agree across each
group, a loss spike at 60% of the run, eval scalars, checkpoints and heartbeats;
each rank's chunk of steps is one agent.wire batch, as an agent would post it.
Kept apart from the bench so that each file holds one concern.
"""

from __future__ import annotations

import time

import numpy as np

from agent import wire

TP = 8  # ranks per node, the tp degree
OPS = ("all_reduce", "reduce_scatter", "all_gather")
AXES = ("tp", "dp")
PHASES = ("forward", "backward", "optimizer")
EVALS = ("eval/code_loss", "eval/math_loss", "eval/web_loss")
# per step: (op, axis, fraction of the rank's compute done when it enters, bytes, transfer s)
STEP_OPS = (("all_reduce", "tp", 0.10, 16 << 20, 0.0025), ("all_reduce", "tp", 0.25, 16 << 20, 0.0025),
            ("all_reduce", "tp", 0.55, 16 << 20, 0.0025), ("all_reduce", "tp", 0.75, 16 << 20, 0.0025),
            ("reduce_scatter", "dp", 0.85, 512 << 20, 0.040), ("all_gather", "dp", 1.00, 256 << 20, 0.020))
ASYNC_OP = 4  # the reduce-scatter: entered during backward, waited for when compute ends


# -- the data set: a training run, simulated chunk by chunk ------------------------------
class TrainingRun:
    """The run's steps in execution order (attempt 0 up to just past the spike, then
    attempt 1 from the checkpoint before it) and each chunk's wire batches, one per rank."""

    def __init__(self, run_id: str, num_ranks: int, num_steps: int, *, seed: int = 0) -> None:
        self.run_id, self.num_ranks, self.num_steps = run_id, num_ranks, num_steps
        self.tp = TP if num_ranks % TP == 0 else num_ranks
        self.dp = num_ranks // self.tp
        self.rng = np.random.default_rng(seed)
        self.slow_rank = min(13, num_ranks - 1)
        self.slow_from = int(0.3 * num_steps)
        self.spike = int(0.6 * num_steps)
        self.ckpt_every = max(50, num_steps // 50)
        self.eval_every = max(100, num_steps // 20)
        self.resume = (self.spike - 1) // self.ckpt_every * self.ckpt_every + 1
        self.order = [(0, k) for k in range(self.spike + 6)] + [(1, k) for k in range(self.resume, num_steps)]
        self.t0 = time.time() - 0.45 * len(self.order) - 120  # the run "started" this long ago
        self.clock = self.t0
        self.batch_seq = 0
        k = np.arange(num_steps, dtype=np.float64)
        warm = max(1, min(500, num_steps // 10))
        self.lr = np.where(k < warm, 3e-4 * (k + 1) / warm,
                           3e-5 + 0.5 * 2.7e-4 * (1 + np.cos(np.pi * (k - warm) / max(1, num_steps - warm))))
        self.loss = 2.0 + 7.5 / np.sqrt(1 + k / 50)
        self.grad_norm = 0.35 + 2.0 / np.sqrt(1 + k / 100)
        self.incarnations = [f"inc-{r}-{seed}" for r in range(num_ranks)]
        self.ack_command: int | None = None  # the rollback's command, acked as attempt 1 starts

    @property
    def mesh(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": 1}

    def chunks(self, steps_per_batch: int):
        """(exec index of the first step, attempt, steps) per chunk; chunks never span attempts."""
        i = 0
        while i < len(self.order):
            att = self.order[i][0]
            j = i
            while j < len(self.order) and j - i < steps_per_batch and self.order[j][0] == att:
                j += 1
            yield i, att, np.array([k for _, k in self.order[i:j]], dtype=np.int64)
            i = j

    def _timing(self, steps: np.ndarray) -> dict[str, np.ndarray]:
        """Each rank's seconds per step and per op, (steps, ranks[, ops]): a rank enters an op
        when its compute got there, the op ends when its group's last member entered plus
        the transfer, and a synchronous op blocks the rank until then."""
        S, R, J, rng = len(steps), self.num_ranks, len(STEP_OPS), self.rng
        slow = np.ones((S, R))
        slow[steps >= self.slow_from, self.slow_rank] = 1.35
        compute = 0.32 * (1 + 0.015 * rng.standard_normal((S, 1))) * (1 + 0.01 * rng.standard_normal((S, R))) * slow
        data = 0.004 + 0.002 * rng.random((S, R))
        t, done = data.copy(), 0.0
        entry, dur, wait = np.zeros((S, R, J)), np.zeros((S, R, J)), np.zeros((S, R, J))
        for j, (_, axis, frac, _, xfer_s) in enumerate(STEP_OPS):
            t += compute * (frac - done)
            done = frac
            entry[:, :, j] = t
            grid = t.reshape(S, self.dp, self.tp)
            last = grid.max(axis=2 if axis == "tp" else 1, keepdims=True)
            end = np.broadcast_to(last, grid.shape).reshape(S, R) + xfer_s * (1 + 0.1 * rng.random((S, 1)))
            dur[:, :, j] = end - t
            if j == ASYNC_OP:  # overlapped with the rest of backward: blocks only for what is left
                done = STEP_OPS[j + 1][2]
                t_after = t + compute * (done - frac)
                wait[:, :, j] = np.maximum(0.0, end - t_after)
                t = np.maximum(t_after, end)
            else:
                wait[:, :, j] = end - t
                t = end
        opt = 0.015 * slow
        return {"compute": compute, "data": data, "opt": opt, "step_s": t + opt, "entry": entry, "dur": dur,
                "wait": wait}

    def _curves(self, attempt: int, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """loss, grad_norm and loss scale of these steps; attempt 0 has the spike."""
        S, rng = len(steps), self.rng
        loss = self.loss[steps] * np.exp(0.02 * rng.standard_normal(S))
        grad = self.grad_norm[steps] * np.exp(0.1 * rng.standard_normal(S))
        scale = np.full(S, 65536.0)
        if attempt == 0:
            bump = np.array([3.5, 1.8, 1.3, 1.15, 1.05, 1.0])
            off = steps - self.spike
            hit = (off >= 0) & (off < len(bump))
            loss[hit] *= bump[off[hit]]
            grad[hit] *= 10 * bump[off[hit]] / 3.5
            scale[off >= 0] = 32768.0
        return loss, grad, scale

    def batches(self, e0: int, attempt: int, steps: np.ndarray) -> list[tuple[int, int, bytes, int]]:
        """(rank, batch_seq, body, rows) of every rank for these steps, their clock advanced."""
        R, S, J = self.num_ranks, len(steps), len(STEP_OPS)
        if attempt == 1 and steps[0] == self.resume:
            self.clock += 45.0  # the rollback: stop, reload the checkpoint, start again
        tm = self._timing(steps)
        starts = self.clock + np.concatenate([[0.0], np.cumsum(tm["step_s"].max(axis=1) + 0.002)])
        self.clock = float(starts[-1])
        T = starts[:-1, None]
        loss, grad, scale = self._curves(attempt, steps)
        replica_loss = loss[:, None] * np.exp(0.01 * self.rng.standard_normal((S, self.dp)))
        e = e0 + np.arange(S)[:, None]  # execution index: seq and group_seq go on across a rollback
        is_tp = np.array([a == "tp" for _, a, *_ in STEP_OPS])
        group_seq = np.where(is_tp, e * is_tp.sum() + np.cumsum(is_tp) - 1, e * (~is_tp).sum() + np.cumsum(~is_tp) - 1)
        op_code = np.array([OPS.index(o) for o, *_ in STEP_OPS], dtype=np.int16)
        axis_code = np.array([AXES.index(a) for _, a, *_ in STEP_OPS], dtype=np.int16)
        n_bytes = np.array([b for *_, b, _ in STEP_OPS], dtype=np.int64)
        evals = np.flatnonzero((steps + 1) % self.eval_every == 0)
        out = []
        for r in range(R):
            tp, dp = r % self.tp, r // self.tp
            compute = tm["compute"][:, r]
            sample0 = steps * 8 * self.dp + 8 * dp
            st = {"step": steps, "attempt": np.full(S, attempt, np.int32), "ts": T[:, 0] + tm["step_s"][:, r],
                  "loss": loss, "grad_norm": grad, "loss_scale": scale, "lr": self.lr[steps],
                  "tokens": np.full(S, 16384, np.int64), "step_s": tm["step_s"][:, r],
                  "fwd_s": compute / 3, "bwd_s": compute * 2 / 3, "opt_s": tm["opt"][:, r],
                  "data_s": tm["data"][:, r], "comm_exposed_s": tm["wait"][:, r, :].sum(axis=1),
                  "mem_bytes": (61e9 + 1e8 * tp + 5e7 * self.rng.random(S)).astype(np.int64),
                  "skipped": np.zeros(S, np.int8), "local_loss": replica_loss[:, dp],
                  "local_loss_valid": np.ones(S, np.int8), "finite_fwd": np.ones(S, np.int8),
                  "finite_bwd": np.ones(S, np.int8), "sample_epoch": np.zeros(S, np.int64),
                  "sample_from": sample0, "sample_to": sample0 + 8}
            co = {"step": np.repeat(steps, J), "attempt": np.full(S * J, attempt, np.int32),
                  "seq": (e * J + np.arange(J)).reshape(-1), "group_seq": group_seq.reshape(-1),
                  "op": np.tile(op_code, S), "axis": np.tile(axis_code, S),
                  "group_id": np.tile(np.where(is_tp, dp * self.tp, tp).astype(np.int32), S),
                  "peer": np.full(S * J, -1, np.int32), "bytes": np.tile(n_bytes, S),
                  "start_ts": (T + tm["entry"][:, r, :]).reshape(-1), "duration_s": tm["dur"][:, r, :].reshape(-1),
                  "wait_s": tm["wait"][:, r, :].reshape(-1)}
            hb = {"ts": st["ts"][-1:], "step": steps[-1:], "phase": np.zeros(1, np.int16),
                  "last_seq": co["seq"][-1:], "last_op": co["op"][-1:], "last_axis": co["axis"][-1:],
                  "last_group_id": co["group_id"][-1:], "last_group_seq": co["group_seq"][-1:]}
            sections = {wire.STEP: st, wire.COLLECTIVE: co, wire.HEARTBEAT: hb}
            if len(evals):  # every rank records the (all-reduced) eval losses, as the trainer does
                n = len(evals) * len(EVALS)
                sections[wire.SCALAR] = {
                    "step": np.repeat(steps[evals], len(EVALS)), "attempt": np.full(n, attempt, np.int32),
                    "ts": np.repeat(st["ts"][evals], len(EVALS)),
                    "name": np.tile(np.arange(len(EVALS), dtype=np.int16), len(evals)),
                    "value": np.repeat(loss[evals], len(EVALS)) * np.tile([1.05, 1.12, 0.97], len(evals))}
            out.append(self._encode(r, attempt, steps, sections, st["ts"]))
        self.batch_seq += 1
        return out

    def _encode(self, rank: int, attempt: int, steps: np.ndarray, sections: dict, ts: np.ndarray):
        events = [{"ts": float(ts[i]), "step": int(k), "attempt": attempt, "kind": "checkpoint_saved",
                   "data": {"step": int(k), "path": f"/ckpt/{self.run_id}/step{k}", "num_shards": 1,
                            "bytes": 2_000_000_000, "write_s": 3.1, "verified": True}}
                  for i, k in enumerate(steps) if k > 0 and k % self.ckpt_every == 0]
        if attempt == 1 and steps[0] == self.resume and self.ack_command is not None:
            events.insert(0, {"ts": float(ts[0]), "step": int(steps[0]), "attempt": attempt, "kind": "command_ack",
                              "data": {"command_id": str(self.ack_command), "status": "done",
                                       "detail": f"rolled back to step {self.resume - 1}"}})
        last = attempt == 1 and steps[-1] == self.num_steps - 1
        if last and rank == 0:
            events.append({"ts": float(ts[-1]), "step": int(steps[-1]), "attempt": attempt, "kind": "run_finished",
                           "data": {"status": "completed"}})
        run = None
        if rank == 0 and self.batch_seq == 0:
            run = {"run_id": self.run_id, "config": {"bench": "dashboard", "steps": self.num_steps},
                   "mesh": self.mesh, "world_size": self.num_ranks,
                   "node_map": {str(r): f"node{r // TP}" for r in range(self.num_ranks)},
                   "code_version": "bench", "data_version": "synthetic", "started_ts": self.t0}
        header = {"run_id": self.run_id, "rank": rank, "incarnation": self.incarnations[rank],
                  "batch_seq": self.batch_seq, "node": f"node{rank // TP}", "pid": 1000 + rank,
                  "sent_ts": time.time(), "coords": {"dp": rank // self.tp, "tp": rank % self.tp, "pp": 0},
                  "dicts": {"op": list(OPS), "axis": list(AXES), "phase": list(PHASES), "name": list(EVALS)},
                  "events": events, "run": run, "stats": {"dropped": {}}}
        body = {kind: (len(cols["step"]), {c.name: np.ascontiguousarray(cols[c.name], c.numpy_dtype).tobytes()
                                            for c in wire.SCHEMA[kind] if c.name in cols})
                for kind, cols in sections.items()}
        rows = sum(n for n, _ in body.values())
        return rank, self.batch_seq, wire.encode_batch(header, body), rows
