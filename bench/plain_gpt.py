"""The plain-PyTorch peer of bench/bench_trainer.py: the trainer's GPT in ~70 lines of
ordinary torch, trained the way most people write it (torch DDP over gloo, gradient
accumulation under `no_sync`, bf16 autocast, AdamW, clip 1.0).

    torchrun --nproc-per-node 2 bench/plain_gpt.py --micro-batches 2 --steps 30 --out steps.json
    python bench/plain_gpt.py --micro-batches 4 --steps 30 --out steps.json      # one process

Same shapes as the trainer's (pre-LN blocks, causal SDPA, GELU MLP x4, learned
positions, the token embedding tied to the head, vocab 320), a global batch of
`world x micro_batches x micro_batch_size` samples of random tokens, each
micro-batch `seq_len` wide or as wide as `--widths` says (the trainer's own, from
bench/bench_trainer.py), built in memory before the loop (the trainer's data path is part of what it is
measured on; this peer's costs nothing). It writes each step's wall seconds to
`--out` (rank 0), which the bench compares with the trainer's metrics.jsonl `step_s`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = F.linear(self.ln(h), self.embed.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=320)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4, help="per replica")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--widths", help="JSON: per rank, per step, each micro-batch's width (default: all seq-len)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(a.vocab, a.d_model, a.heads, a.layers, a.seq_len)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(rank)
    widths = (json.load(open(a.widths))[rank] if a.widths
              else [[a.seq_len] * a.micro_batches for _ in range(a.steps)])
    data = [[torch.randint(0, a.vocab, (a.micro_batch_size, w + 1), generator=g) for w in step] for step in widths]
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        for m in range(a.micro_batches):
            batch = data[step][m]
            sync = m == a.micro_batches - 1 or world == 1
            with (ddp.no_sync() if not sync else torch.enable_grad()), torch.autocast("cpu", torch.bfloat16):
                loss = ddp(batch[:, :-1], batch[:, 1:]) / a.micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer reads its loss on the host every step too
        times.append(time.perf_counter() - t0)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.out, "w") as f:
            json.dump({"step_s": times, "world": world, "micro_batches": a.micro_batches}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
