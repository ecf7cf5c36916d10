"""Benchmark: the training loop's stall per checkpoint, asynchronous `Checkpointer.save()` vs an
inline synchronous save of the same state (`torch.save` + fsync).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_checkpoint.py [--steps 40 --every 10 --layers 8 --width 1024]

A model of a few tens of MB (`--layers` fp32 linears of `--width`^2) trains with AdamW (whose
state is twice the parameters) on random data in one process; every `--every` steps the loop
checkpoints. The stall is the wall time of the checkpoint call inside the loop. The three modes
(none / async / sync) run interleaved `--reps` times, because absolute times on a shared machine
are noise; the loop's total time against the run without checkpoints is printed too, since the
background writer shares the CPU with the loop and the save() stall alone does not show that.
Goal: async stall <= 10% of the synchronous save.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trainer.checkpoint import Checkpointer
from trainer.comm import Comm
from trainer.config import CheckpointConfig
from trainer.parallel_dims import ParallelDims


def rank_state() -> dict:
    return {"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}


def sync_save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """The baseline: what a loop without async checkpoints does inline."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / f"step-{step:08d}.pt", "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "rank": rank_state(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())


def run(mode: str, model, opt, args, root: Path) -> dict:
    """One training loop of `args.steps` steps; returns loop seconds and the per-checkpoint stalls."""
    x = torch.randn(args.batch, args.width)
    ck = None
    if mode == "async":
        dims = ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1)
        comm = Comm(dims, device=torch.device("cpu"))
        ck = Checkpointer(CheckpointConfig(dir=str(root), keep=2), dims=dims, comm=comm, log=lambda m: None)
    stalls_s = []
    t_loop = time.perf_counter()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if mode != "none" and step % args.every == 0:
            t0 = time.perf_counter()
            if ck is not None:
                ck.save(step, model_state=model.state_dict(), optim_state=opt.state_dict(), rank_state=rank_state(),
                        meta={"step": step})
            else:
                sync_save(root, model, opt, step)
            stalls_s.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_loop
    drain_s = 0.0
    write_s = []
    if ck is not None:
        t0 = time.perf_counter()
        ck.close()
        drain_s = time.perf_counter() - t0
        write_s = [r.write_s for r in ck.poll()]
    return {"loop_s": loop_s, "stalls_s": stalls_s, "drain_s": drain_s, "write_s": write_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20

    results: dict[str, list[dict]] = {"none": [], "async": [], "sync": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run("none", model, opt, args, Path(tmp) / "warmup")  # allocates the optimizer state
        state_mb = model_mb * 3
        print(f"state: model {model_mb:.1f} MB + AdamW {2 * model_mb:.1f} MB = {state_mb:.1f} MB; "
              f"{args.steps} steps, a checkpoint every {args.every}, {args.reps} interleaved reps; dir {tmp}")
        for rep in range(args.reps):
            for mode in results:
                results[mode].append(run(mode, model, opt, args, Path(tmp) / f"{mode}-{rep}"))

    def stalls(mode: str) -> list[float]:
        return [s for r in results[mode] for s in r["stalls_s"]]

    async_stall_s = statistics.median(stalls("async"))
    sync_stall_s = statistics.median(stalls("sync"))
    none_loop_s = statistics.median(r["loop_s"] for r in results["none"])
    num_ckpt = args.steps // args.every
    print(f"{'mode':<6} {'stall/ckpt median':>18} {'max':>9} {'loop s':>8} {'extra loop s/ckpt':>18}")
    for mode in ("sync", "async"):
        loop_s = statistics.median(r["loop_s"] for r in results[mode])
        print(f"{mode:<6} {statistics.median(stalls(mode)) * 1e3:>15.1f} ms {max(stalls(mode)) * 1e3:>6.1f} ms "
              f"{loop_s:>8.2f} {(loop_s - none_loop_s) / num_ckpt * 1e3:>15.1f} ms")
    print(f"{'none':<6} {'':>18} {'':>9} {none_loop_s:>8.2f}")
    write_s = [w for r in results["async"] for w in r["write_s"]]
    print(f"async background write per checkpoint (median): {statistics.median(write_s) * 1e3:.1f} ms")
    print(f"ratio async/sync stall: {async_stall_s / sync_stall_s:.3f} (goal <= 0.10)")


if __name__ == "__main__":
    main()
