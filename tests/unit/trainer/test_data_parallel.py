"""Gradient buckets in one process: grads live in the flat buffers."""

import torch
from torch import nn

from trainer.comm import Comm
from trainer.data_parallel import GradBuckets
from trainer.parallel_dims import ParallelDims


def test_grads_are_views_into_reverse_ordered_buckets():
    dims = ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1)
    params = [nn.Parameter(torch.randn(n)) for n in (3000, 1000, 200000, 500, 500)]
    buckets = GradBuckets(params, Comm(dims, device=torch.device("cpu")), bucket_mb=0.01, device=torch.device("cpu"))
    cap = int(0.01 * 2**20) // 4
    sizes = [b.numel() for b in buckets.buffers]
    # reverse order: [500, 500]; 200000 and 3000 exceed a bucket: alone; 1000 + 3000 would too
    assert cap == 2621 and sizes == [1000, 200000, 1000, 3000]
    for _ in range(2):  # two micro-batches accumulate in place
        sum((p * (i + 1)).sum() for i, p in enumerate(params)).backward()
    for i, p in enumerate(params):
        assert any(p.grad.data_ptr() >= b.data_ptr() and p.grad.data_ptr() < b.data_ptr() + b.numel() * 4
                   for b in buckets.buffers)
        assert torch.all(p.grad == 2.0 * (i + 1))
    buckets.zero_grad()
    assert all(torch.all(b == 0) for b in buckets.buffers)
    params[0].grad = None
    buckets.zero_grad()
    assert params[0].grad is not None and params[0].grad.data_ptr() == buckets.buffers[-1].data_ptr()
