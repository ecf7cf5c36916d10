"""TP/SP mappings, vocab-parallel embedding and cross entropy over 2 real gloo ranks.

Each rank builds the full tensors from one seed, runs the sharded op on its part
and checks forward values and grads against the plain single-tensor computation."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import ranks
from trainer.batch import IGNORE_INDEX
from trainer.comm import Comm
from trainer.launch import free_port
from trainer.parallel_dims import ParallelDims
from trainer.tensor_parallel import (
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TP = 2


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def check_mappings(comm: Comm, r: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, generator=gen)
    grads = [torch.randn(4, 3, 8, generator=gen) for _ in range(TP)]  # rank i's upstream grad
    chunk = slice(2 * r, 2 * r + 2)

    leaf = x.clone().requires_grad_()
    y = copy_to_tp(leaf, comm)
    close(y, x)
    y.backward(grads[r])
    close(leaf.grad, grads[0] + grads[1])  # all-reduce in backward

    leaf = x.clone().requires_grad_()
    y = reduce_from_tp(leaf * (r + 1), comm)
    close(y, 3 * x)
    y.backward(grads[r])
    close(leaf.grad, (r + 1) * grads[r])  # identity in backward

    leaf = x[chunk].clone().requires_grad_()
    y = gather_from_sp(leaf, comm)
    close(y, x)
    y.backward(grads[r])
    close(leaf.grad, (grads[0] + grads[1])[chunk])  # reduce-scatter in backward

    leaf = x.clone().requires_grad_()
    y = reduce_scatter_to_sp(leaf * (r + 1), comm)
    close(y, 3 * x[chunk])
    y.backward(grads[r][chunk])
    close(leaf.grad, (r + 1) * torch.cat([grads[0][0:2], grads[1][2:4]]))  # all-gather in backward

    leaf = x.clone().requires_grad_()
    y = scatter_to_sp(leaf, comm)
    close(y, x[chunk])
    y.backward(grads[r][chunk])
    close(leaf.grad, torch.cat([grads[0][0:2], grads[1][2:4]]))


def check_vocab_parallel(comm: Comm, r: int) -> None:
    gen = torch.Generator().manual_seed(1)
    vocab, dim = 16, 4
    logits = torch.randn(5, 2, vocab, generator=gen) * 3
    targets = torch.randint(0, vocab, (5, 2), generator=gen)
    targets[3:, 1] = IGNORE_INDEX
    upstream = torch.rand(5, 2, generator=gen)

    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none").view(5, 2)
    (want * upstream).sum().backward()
    shard = logits[..., r * 8:(r + 1) * 8].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(shard, targets, comm, vocab_start=r * 8)
    close(got, want.detach())
    assert torch.all(got[3:, 1] == 0)
    (got * upstream).sum().backward()
    close(shard.grad, full.grad[..., r * 8:(r + 1) * 8])

    table = torch.randn(vocab, dim, generator=gen)
    emb = VocabParallelEmbedding(vocab, dim, comm=comm)
    with torch.no_grad():
        emb.weight.copy_(table[r * 8:(r + 1) * 8])
    ids = torch.randint(0, vocab, (3, 5), generator=gen)
    close(reduce_from_tp(emb(ids), comm), F.embedding(ids, table))


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        dims = ParallelDims(dp=1, tp=TP, pp=1, sp=True, nodes=1, rank=rank, world_size=TP)
        dims.build_mesh("cpu")
        comm = Comm(dims, device=torch.device("cpu"))
        check_mappings(comm, rank)
        check_vocab_parallel(comm, rank)
        queue.put((rank, None))
    except Exception:  # report the failing assertion to the test process
        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_mappings_and_vocab_parallel_ops():
    ctx = ranks.context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    errors = [queue.get(timeout=120) for _ in range(TP)]
    for p in procs:
        p.join(30)
    assert [e for _, e in errors if e] == []
    assert all(p.exitcode == 0 for p in procs)
