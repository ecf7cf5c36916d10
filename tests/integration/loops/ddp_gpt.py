"""A plain DDP GPT training loop, written the way users write them (nanoGPT's shape): no
llmwatch in it. Run under torchrun, watched by `llmwatch-instrument` (zero code) or, with
LOOP_WATCH=1, by one `watch(model, optimizer)` call.

The test harness injects faults through $LOOP_FAULTS ("kind:rank=R,step=S[,ms=M];..."):
  straggler  rank R's forward is M ms slower from step S (a slow device: the sleep is inside forward);
  hang       rank R sleeps forever before the forward of step S;
  nan        rank R's loss is NaN at step S (and so is every update after it);
  noise      rank R's batch at step S is random tokens (a poisoned batch on one replica).
What was injected goes to $LOOP_TRUTH (JSON lines, rank 0 and the faulted rank); llmwatch never reads it.
"""

import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, SEQ, D, LAYERS, HEADS = 64, 32, 64, 2, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1))
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    slow_s = 0.0  # the injected straggler's extra forward time

    def forward(self, idx, targets=None):
        if self.slow_s:
            time.sleep(self.slow_s)
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x, self.mask)
        logits = self.head(self.ln(x))
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return logits, loss


def batches(rank, batch_size=8):
    """Counting sequences mod VOCAB from a random start: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(1234 + rank)
    while True:
        start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def faults(rank):
    out = {}
    for spec in filter(None, os.environ.get("LOOP_FAULTS", "").split(";")):
        kind, _, args = spec.partition(":")
        kv = dict(a.split("=") for a in args.split(",") if a)
        if int(kv.get("rank", -1)) == rank:
            out[kind] = {k: int(v) for k, v in kv.items()}
    return out


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GPT(), bucket_cap_mb=0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w = None
    if os.environ.get("LOOP_WATCH") == "1":
        from agent.watch import watch

        w = watch(model, optimizer)
    mine = faults(rank)
    truth = os.environ.get("LOOP_TRUTH")
    if truth and mine:
        with open(f"{truth}.rank{rank}", "w") as f:
            for kind, kv in mine.items():
                f.write(json.dumps({"kind": kind, "rank": rank, **kv}) + "\n")
    steps = int(os.environ.get("LOOP_STEPS", "60"))
    data = batches(rank)
    t0 = time.time()
    for step in range(1, steps + 1):
        x, y = next(data)
        if "noise" in mine and step == mine["noise"]["step"]:
            x, y = torch.randint(0, VOCAB, x.shape), torch.randint(0, VOCAB, y.shape)
        if "hang" in mine and step == mine["hang"]["step"]:
            while True:
                time.sleep(1.0)
        if "straggler" in mine and step == mine["straggler"]["step"]:
            model.module.slow_s = mine["straggler"].get("ms", 40) / 1e3
        _, loss = model(x, y)
        if "nan" in mine and step == mine["nan"]["step"]:
            loss = loss * math.nan
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} {time.time() - t0:.1f}s", flush=True)
    if w is not None:
        w.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
