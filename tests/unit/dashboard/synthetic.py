"""A small but complete run in a real collector file, for the dashboard's unit tests.

dp2 x tp2 on 4 ranks and 2 nodes (ranks 0-1 on node0, 2-3 on node1), 60 steps:
attempt 0 trains steps 1-40 with a loss spike at step 35 and rank 3 slow from step
20 (its compute 1.5x, so the others wait for it in every collective); a rollback
makes attempt 1, which trains 31-60 again. There are eval scalars every 10 steps,
checkpoints every 10 steps, a straggler and a loss_spike incident, a rollback and
an isolation action, and node1 isolated. Built through a real `Storage` from wire
batches, as an agent would send them, then closed: the file is what a finished
run leaves behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent import wire
from analysis.findings import Finding
from collector.ingest.decode import decode
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from tests.unit.collector.collector_batches import columns, make_batch

RUN_ID = "synth"
NUM_RANKS = 4
T0 = 1_800_000_000.0
STEP_S = 0.5
DICTS = {"op": ["all_reduce", "all_gather"], "axis": ["dp", "tp"], "phase": ["train", "eval"],
         "name": ["eval/code_loss", "eval/math_loss"]}
RUN = {"run_id": RUN_ID, "config": {"lr": 3e-4, "steps": 60}, "mesh": {"dp": 2, "tp": 2, "pp": 1}, "world_size": 4,
       "node_map": {"0": "node0", "1": "node0", "2": "node1", "3": "node1"}, "code_version": "abc123",
       "data_version": "v1", "started_ts": T0}


def _coords(rank: int) -> tuple[int, int]:
    return rank // 2, rank % 2  # (dp, tp)


def _attempt_batch(rank: int, seq: int, attempt: int, steps: np.ndarray, ts0: float) -> bytes:
    n = len(steps)
    slow = 1.5 if rank == 3 else 1.0
    compute = np.where(steps >= 20, 0.3 * slow, 0.3)
    ts = ts0 + (steps - steps[0] + 1) * STEP_S
    loss = 4.0 * np.exp(-steps / 30.0) + 2.0 + 0.01 * rank
    if attempt == 0:
        loss = np.where(steps == 35, 12.0, loss)
    step_cols = columns(wire.STEP, n, step=steps, attempt=attempt, ts=ts, loss=loss, grad_norm=1.0 + 0.1 * rank,
                        loss_scale=65536.0, lr=3e-4, tokens=1024, step_s=STEP_S, fwd_s=compute * 0.4,
                        bwd_s=compute * 0.5, opt_s=compute * 0.1, data_s=0.01,
                        comm_exposed_s=STEP_S - compute - 0.02, mem_bytes=1 << 30, skipped=0,
                        local_loss=loss, local_loss_valid=1, finite_fwd=1, finite_bwd=1, sample_epoch=0,
                        sample_from=steps * 8, sample_to=steps * 8 + 8)
    # per step: one dp all_reduce (group = tp index) and two tp all_reduces (group = dp index)
    dp, tp = _coords(rank)
    rows = []
    for i, s in enumerate(steps):
        start = ts[i] - STEP_S
        late = 0.1 if (rank == 3 and s >= 20) else 0.0
        for k, (axis, gid) in enumerate(((0, tp), (1, dp), (1, dp))):
            gseq = int(s) * 3 + k
            rows.append((s, int(s) * 3 + k, gseq, 0, axis, gid, -1, 4 << 20 if axis == 0 else 1 << 20,
                         start + 0.1 * k + late, 0.02 + (0.1 - late if rank != 3 and s >= 20 else 0.0),
                         0.01 + (0.1 if rank != 3 and s >= 20 else 0.0)))  # blocked while rank 3 is late
    a = np.array(rows, dtype=object)
    coll = columns(wire.COLLECTIVE, len(rows), step=a[:, 0].astype(np.int64), attempt=attempt,
                   seq=a[:, 1].astype(np.int64), group_seq=a[:, 2].astype(np.int64), op=a[:, 3].astype(np.int16),
                   axis=a[:, 4].astype(np.int16), group_id=a[:, 5].astype(np.int32), peer=-1,
                   bytes=a[:, 7].astype(np.int64), start_ts=a[:, 8].astype(float),
                   duration_s=a[:, 9].astype(float), wait_s=a[:, 10].astype(float))
    ev_steps = steps[steps % 10 == 0]
    scal = columns(wire.SCALAR, 2 * len(ev_steps), step=np.repeat(ev_steps, 2), attempt=attempt,
                   ts=ts0 + np.repeat(ev_steps - steps[0] + 1, 2) * STEP_S, name=np.tile([0, 1], len(ev_steps)),
                   value=np.tile([3.0, 2.5], len(ev_steps)) - np.repeat(ev_steps, 2) / 100.0)
    hb = columns(wire.HEARTBEAT, 1, ts=ts[-1], step=steps[-1], phase=0, last_seq=int(steps[-1]) * 3 + 2, last_op=0,
                 last_axis=1, last_group_id=dp, last_group_seq=int(steps[-1]) * 3 + 2)
    events = []
    if rank == 0:
        events = [{"ts": float(ts0 + (s - steps[0] + 1) * STEP_S), "step": int(s), "attempt": attempt,
                   "kind": "checkpoint_saved",
                   "data": {"step": int(s), "path": f"/ck/{s}", "num_shards": 4, "bytes": 4 << 20,
                            "checksums": ["a", "b", "c", "d"], "write_s": 0.2 + 0.01 * int(s), "verified": True}}
                  for s in steps if s % 10 == 0]
    return make_batch(RUN_ID, rank, seq, incarnation=f"inc{attempt}", node=f"node{rank // 2}", dicts=DICTS,
                      coords={"dp": dp, "tp": tp, "pp": 0}, run=RUN if (rank == 0 and seq == 0) else None, events=events,
                      sections={wire.STEP: (n, step_cols), wire.COLLECTIVE: (len(rows), coll),
                                wire.SCALAR: (2 * len(ev_steps), scal), wire.HEARTBEAT: (1, hb)})


def build(path: Path) -> Path:
    """Write the run into a new collector file at `path` and close it."""
    storage = Storage(Settings(db_path=path, writer=WriterSettings(linger_s=0.0, min_interval_s=0.0)))
    try:
        for rank in range(NUM_RANKS):
            storage.ingest_blocking(decode(_attempt_batch(rank, 0, 0, np.arange(1, 41), T0)))
        t1 = T0 + 45 * STEP_S
        for rank in range(NUM_RANKS):
            storage.ingest_blocking(decode(_attempt_batch(rank, 1, 1, np.arange(31, 61), t1)))
        storage.record_findings(RUN_ID, [Finding(kind="straggler", key="straggler:node1#1", run_id=RUN_ID, rank=3,
                                                 node="node1", step_from=20, step_to=40,
                                                 evidence={"compute_ratio": 1.5, "cost_s_per_step": 0.1})]).result(10)
        spike = storage.open_incident(RUN_ID, "loss_spike", "critical", rank=None, step_from=35, step_to=35,
                                      evidence={"z": 9.1}).result(10)
        storage.update_incident(spike, status="closed", root_cause="data", settled=True).result(10)
        rollback = storage.record_action(RUN_ID, "rollback", "issued", incident_id=spike,
                                         detail={"to_step": 30, "verdict": "data"}).result(10)
        storage.update_action(rollback, status="done", attempt=1, started_ts=T0 + 41 * STEP_S,
                              recovery_s=2.5).result(10)
        storage.record_action(RUN_ID, "isolate", "done", node="node1", detail={"node": "node1"}).result(10)
        storage.set_node_status(RUN_ID, "node1", "isolated", "straggler: rank 3 compute 1.5x").result(10)
    finally:
        storage.close()
    return path
