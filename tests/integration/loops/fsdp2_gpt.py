"""A plain FSDP2 loop (`fully_shard` per block, then the root), as users write them: no
llmwatch in it. Faults come from the harness (faults.py, $LOOP_FAULTS)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_gpt import GPT, VOCAB, batches  # noqa: E402
from faults import Injector  # noqa: E402


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    faults = Injector(rank, VOCAB)
    faults.hook(model)
    data = batches(rank)
    for step in range(1, int(os.environ.get("LOOP_STEPS", "60")) + 1):
        faults.at(step)
        x, y = next(data)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
