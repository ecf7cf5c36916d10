"""Cost of the replicas' parameter checksums (trainer/integrity.py) against the step.

    python bench/bench_checksum.py [--steps 20] [--every 10]

Side by side in one process, on the default model (trainer/config.py ModelConfig):
the median time of a training step (TrainEngine.train_step, dp=1), and of the
shard checksum over the same parameters. At `--every N` the checksum runs once per
N steps: the printed share is checksum / (N x step). The goal: <= 0.5% at the
default N (10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainer.batch import MicroBatch
from trainer.comm import Comm
from trainer.config import JobConfig, ModelConfig, OptimConfig, TelemetryConfig
from trainer.engine import TrainEngine
from trainer.integrity import shard_checksum
from trainer.parallel_dims import ParallelDims


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=TelemetryConfig().checksum_every)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = ModelConfig()
    cfg = JobConfig(model=model, optim=OptimConfig(lr=1e-3, warmup_steps=1), steps=a.steps + 1, seed=0)
    dims = ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1)
    dev = torch.device("cpu")
    e = TrainEngine(cfg, dims, Comm(dims, device=dev), dev)
    gen = torch.Generator().manual_seed(0)
    mbs = []
    for _ in range(cfg.parallel.micro_batches):
        tok = torch.randint(1, model.vocab_size, (cfg.parallel.micro_batch_size, model.seq_len + 1), generator=gen)
        mbs.append(MicroBatch(inputs=tok[:, :-1], targets=tok[:, 1:].clone(), num_tokens=tok[:, 1:].numel()))
    tokens = sum(mb.num_tokens for mb in mbs)
    e.train_step(1, mbs, tokens)  # warm-up
    params = list(e.model.parameters())
    step_s, cks_s = [], []
    for s in range(2, a.steps + 2):
        t0 = time.perf_counter()
        e.train_step(s, mbs, tokens)
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(10):
            shard_checksum(params).item()
        cks_s.append((time.perf_counter() - t0) / 10)
    step, cks = statistics.median(step_s), statistics.median(cks_s)
    share = cks / (a.every * step)
    n = sum(p.numel() for p in params)
    print(f"params {n:,}  step {1e3 * step:.2f} ms  checksum {1e3 * cks:.3f} ms  "
          f"checksum/step {100 * cks / step:.3f}%  at every={a.every}: {100 * share:.4f}% of step time "
          f"({'within' if share <= 0.005 else 'OVER'} the 0.5% goal)")


if __name__ == "__main__":
    main()
