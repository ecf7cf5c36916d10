"""The correctness anchor: every dp x pp x tp (x sp) layout trains exactly like
the single-process model, over real gloo processes.

Every layout sees the same global batch of `GLOBAL_MB` micro-batches per step:
dp rank d takes micro-batches [d*M, (d+1)*M) with M = GLOBAL_MB / dp. The
single-process reference runs all GLOBAL_MB of them. Micro-batches have random
tokens, variable lengths (one odd, padded under SP) and variable right padding.
"""

from __future__ import annotations

import functools
import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests import ranks
from trainer.batch import IGNORE_INDEX, MicroBatch
from trainer.comm import Comm
from trainer.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, PrecisionConfig
from trainer.engine import TrainEngine
from trainer.faults import NO_FAULTS, StepFaults
from trainer.launch import free_port
from trainer.parallel_dims import ParallelDims

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_STEPS = 5
MB_SIZE = 2
SEQ_LENS = (32, 27, 32, 20)  # per micro-batch: length grouping gives variable L
REL_TOL = 1e-5


def make_config(*, dp=1, tp=1, pp=1, sp=False, micro_batches=1, precision="fp32", bucket_mb=1.0) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(layers=4, d_model=64, heads=4, seq_len=32),
        parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, sp=sp, micro_batch_size=MB_SIZE, micro_batches=micro_batches,
                                bucket_mb=bucket_mb),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        precision=PrecisionConfig(precision=precision),
        steps=NUM_STEPS,
        seed=7,
    )
    cfg.validate(world_size=dp * tp * pp)
    return cfg


def global_batch(step: int, num_mb: int, vocab: int = 320) -> list[MicroBatch]:
    """Deterministic micro-batches of step `step`: random tokens, right-padded."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(num_mb):
        seq = SEQ_LENS[i % len(SEQ_LENS)]
        tokens = torch.randint(1, vocab, (MB_SIZE, seq + 1), generator=gen)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        for row in range(MB_SIZE):
            valid = int(torch.randint(seq // 3, seq + 1, (1,), generator=gen))
            inputs[row, valid:] = 0
            targets[row, valid:] = IGNORE_INDEX
        out.append(MicroBatch(inputs=inputs, targets=targets, num_tokens=int((targets != IGNORE_INDEX).sum())))
    return out


class ListSink:
    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def collective(self, *row) -> None:
        self.rows.append(row)


def train(cfg: JobConfig, dims: ParallelDims, num_global_mb: int, faults_at: dict[int, StepFaults]) -> dict:
    sink = ListSink()
    comm = Comm(dims, device=torch.device("cpu"), sink=sink)
    engine = TrainEngine(cfg, dims, comm, torch.device("cpu"))
    m = num_global_mb // dims.dp
    out = {"loss": [], "grad_norm": [], "skipped": [], "loss_scale": [], "bwd_end_ts": [], "param_sums": []}
    for step in range(1, NUM_STEPS + 1):
        mbs = global_batch(step, num_global_mb)
        tokens = sum(mb.num_tokens for mb in mbs)
        r = engine.train_step(step, mbs[dims.dp_rank * m:(dims.dp_rank + 1) * m], tokens, faults_at.get(step, NO_FAULTS))
        for key in ("loss", "grad_norm", "skipped", "loss_scale", "bwd_end_ts"):
            out[key].append(getattr(r, key))
        out["param_sums"].append(sum(float(p.detach().double().sum()) for p in engine.model.parameters()))
    out["eval"] = engine.eval_loss(global_batch(99, num_global_mb)[dims.dp_rank * m:(dims.dp_rank + 1) * m])
    out["num_buckets"] = engine.grads.num_buckets
    out["comm_rows"] = sink.rows
    return out


def _worker(rank: int, world: int, port: int, layout: dict, num_global_mb: int, faults_at: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        cfg = make_config(micro_batches=num_global_mb // layout.get("dp", 1), **layout)
        dims = ParallelDims.from_config(cfg.parallel, rank=rank, world_size=world)
        dims.build_mesh("cpu")
        queue.put((rank, dims.coords, train(cfg, dims, num_global_mb, faults_at.get(rank, {}))))
    finally:
        dist.destroy_process_group()


def run_layout(layout: dict, num_global_mb: int, faults_at: dict | None = None) -> dict[int, tuple[dict, dict]]:
    """{rank: (coords, results)} of a real multi-process run."""
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    ctx = ranks.context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, layout, num_global_mb, faults_at or {}, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(world):
            rank, coords, res = queue.get(timeout=240)
            results[rank] = (coords, res)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


@functools.cache
def reference(num_global_mb: int) -> dict:
    """The single-process run (no process group: Comm skips groups of one)."""
    torch.set_num_threads(1)
    cfg = make_config(micro_batches=num_global_mb)
    dims = ParallelDims.from_config(cfg.parallel, rank=0, world_size=1)
    return train(cfg, dims, num_global_mb, {})


@functools.cache
def layout_run(name: str) -> dict[int, tuple[dict, dict]]:
    layout, num_global_mb = LAYOUTS[name]
    return run_layout(layout, num_global_mb)


LAYOUTS = {
    "dp2xpp2xtp2": (dict(dp=2, pp=2, tp=2), 4),
    "pp2xtp2": (dict(pp=2, tp=2), 4),
    "dp2": (dict(dp=2, bucket_mb=0.1), 4),  # several buckets: the overlap test reads this run too
    "tp2+sp": (dict(tp=2, sp=True), 4),
    "pp3-M2": (dict(pp=3), 2),  # uneven split (2, 1, 1 layers) and fewer micro-batches than stages
}


def assert_close(got: list[float], want: list[float]) -> None:
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert math.isfinite(g) and abs(g - w) <= REL_TOL * abs(w), f"step {step}: {g!r} vs single-process {w!r}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_match_single_process(name):
    ref = reference(LAYOUTS[name][1])
    results = layout_run(name)
    assert len(ref["loss"]) == NUM_STEPS
    for rank, (coords, res) in results.items():
        assert_close(res["loss"], ref["loss"])  # identical on every rank, not only the last stage
        assert_close(res["grad_norm"], ref["grad_norm"])
        assert not any(res["skipped"])
    # eval: per dp rank sums; together they are the reference's sum
    eval_sum = sum(res["eval"][0] for coords, res in results.values() if coords["tp"] == 0 and coords["pp"] == 0)
    eval_tokens = sum(res["eval"][1] for coords, res in results.values() if coords["tp"] == 0 and coords["pp"] == 0)
    assert eval_tokens == ref["eval"][1]
    assert abs(eval_sum - ref["eval"][0]) <= REL_TOL * abs(ref["eval"][0])


def test_fp16_nan_skips_step_and_halves_scale():
    """A NaN injected on one rank (first stage, dp 0) at step 2: every rank of
    dp2 x pp2 skips that step, halves the scale, and leaves its weights alone."""
    faults = {0: {2: StepFaults(nan=True)}}
    results = run_layout(dict(dp=2, pp=2, precision="fp16"), 4, faults)
    init_scale = PrecisionConfig().init_scale
    for rank, (coords, res) in results.items():
        assert res["skipped"] == [False, True, False, False, False], (rank, res["skipped"])
        assert res["loss_scale"][0] == init_scale and res["loss_scale"][1] == init_scale / 2, res["loss_scale"]
        assert res["param_sums"][1] == res["param_sums"][0]  # the skipped step changed nothing
        assert res["param_sums"][2] != res["param_sums"][1]
        assert math.isnan(res["loss"][1]) or math.isnan(res["grad_norm"][1])
        assert all(math.isfinite(x) for i, x in enumerate(res["loss"]) if i != 1)


def test_dp_all_reduce_overlaps_backward():
    """At dp=2 the first bucket's all-reduce starts while backward still runs."""
    results = layout_run("dp2")
    for rank, (coords, res) in results.items():
        num_buckets = res["num_buckets"]
        assert num_buckets >= 3
        for step in range(1, NUM_STEPS + 1):
            # rows: (step, seq, group_seq, op, axis, group_id, peer, nbytes, start_ts, duration_s, wait_s)
            buckets = [r for r in res["comm_rows"] if r[0] == step and r[3] == "all_reduce" and r[4] == "dp"][:num_buckets]
            starts = [r[8] for r in buckets]
            assert len(starts) == num_buckets and starts == sorted(starts)
            assert starts[0] < res["bwd_end_ts"][step - 1], (step, starts[0], res["bwd_end_ts"][step - 1])
