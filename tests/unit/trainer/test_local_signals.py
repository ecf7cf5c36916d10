"""The trainer's side of the local signals: the engine's finite flags and replica
loss (one process), the DP buckets' pre-reduction check, the replica's sample
window, the comm layer's last-entered collective, and the single host sync."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.unit.trainer.test_data import loader, synthetic_corpus
from tests.unit.trainer.test_engine import batches, engine, tokens_of
from trainer.comm import NOOP_HANDLE, Comm
from trainer.data_parallel import GradBuckets
from trainer.faults import StepFaults
from trainer.parallel_dims import Axis, ParallelDims


def test_a_clean_step_is_finite_and_its_replica_loss_is_the_token_mean_of_its_own_batches():
    e = engine()
    mbs = batches()
    own = tokens_of(mbs)
    r = e.train_step(1, mbs, own)
    assert (r.finite_fwd, r.finite_bwd) == (1, 1)
    assert r.local_loss == pytest.approx(r.loss, rel=1e-6)  # one replica: its loss is the loss
    # as one of two replicas whose batches hold as many tokens again: the loss halves, the local one not
    e2 = engine()
    r2 = e2.train_step(1, batches(), 2 * own)
    assert r2.loss == pytest.approx(r.loss / 2, rel=1e-5) and r2.local_loss == pytest.approx(r.local_loss, rel=1e-5)


def test_a_nan_in_this_ranks_forward_clears_both_flags_for_that_step_only():
    e = engine()
    r = e.train_step(1, batches(), tokens_of(batches()), StepFaults(nan=True))
    assert (r.finite_fwd, r.finite_bwd) == (0, 0) and math.isnan(r.local_loss) and r.skipped
    again = e.train_step(2, batches(seed=1), tokens_of(batches(seed=1)))
    assert (again.finite_fwd, again.finite_bwd) == (1, 1) and math.isfinite(again.local_loss)


def test_the_step_reads_the_device_once():
    """The flags and the replica loss ride in the tensor the step already fetched."""
    e = engine()
    mbs = batches()
    calls = []
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "__float__", "__int__")}

    def counting(name):
        def fn(self, *args):
            calls.append(name)
            return real[name](self, *args)
        return fn

    try:
        for name in real:
            setattr(torch.Tensor, name, counting(name))
        e.train_step(1, mbs, tokens_of(mbs))
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
    # one tolist, before anything else reads a tensor; the `item`s after it are AdamW's step
    # counters, CPU tensors it keeps on the host (torch's default), not device reads
    assert calls[0] == "tolist" and set(calls[1:]) <= {"item"}, calls


class PeerComm:
    """A DP group of two whose peer contributes NaN gradients (the all-reduce adds them)."""

    device = torch.device("cpu")

    def size(self, axis):
        return 2 if axis == Axis.DP else 1

    def all_reduce(self, tensor, axis, *, async_op=False, **_):
        tensor.add_(torch.full_like(tensor, math.nan))
        return NOOP_HANDLE if async_op else None


def test_buckets_are_judged_before_the_dp_reduction_a_peers_nan_does_not_count():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    grads = GradBuckets(list(model.parameters()), PeerComm(), bucket_mb=1e-5, device=torch.device("cpu"))
    assert grads.num_buckets > 1
    grads.zero_grad()
    grads.arm()
    model(torch.ones(2, 4)).sum().backward()
    grads.finish()
    assert all(torch.isnan(b).all() for b in grads.buffers)  # reduced: the peer's NaN is in
    assert bool(grads.local_finite())  # this rank's own gradients were finite
    grads.zero_grad()
    grads.arm()
    model(torch.full((2, 4), math.nan)).sum().backward()
    grads.finish()
    assert not bool(grads.local_finite())


def test_without_dp_the_buffers_themselves_are_judged():
    model = nn.Linear(3, 1)
    comm = Comm(ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1), device=torch.device("cpu"))
    grads = GradBuckets(list(model.parameters()), comm, bucket_mb=1.0, device=torch.device("cpu"))
    model(torch.ones(1, 3)).sum().backward()
    assert bool(grads.local_finite())
    model.weight.grad[0, 1] = math.inf
    assert not bool(grads.local_finite())


def test_each_dp_rank_reports_its_own_disjoint_sample_window():
    corpus = synthetic_corpus()
    windows = []
    for dp_rank in (0, 1):
        dl = loader(corpus, dp_size=2, dp_rank=dp_rank, prefetch=0)
        step = [dl.next() for _ in range(3)][-1]
        dl.close()
        epoch, lo, hi = step.meta["window"]
        windows.append(step.meta["replica_window"])
        assert step.meta["replica_window"][0] == epoch
        assert sum(len(mb.sample_ids) for mb in step.micro_batches) == 2 * 4  # micro_batches x mbs
    (e0, a0, b0), (e1, a1, b1) = windows
    assert (a0, b0, a1, b1) == (lo, lo + 8, lo + 8, hi)  # lo + dp_rank * micro_batches * mbs, that many


def test_the_comm_layer_names_the_collective_it_entered_last():
    dims = ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1)
    comm = Comm(dims, device=torch.device("cpu"))
    assert comm.last_entered == (-1, None, None, -1, -1)
    comm._run("all_reduce", Axis.DP, 8, -1, lambda async_op: None, False)
    comm._run("broadcast", Axis.WORLD, 16, 0, lambda async_op: None, False)
    comm._run("all_reduce", Axis.DP, 8, -1, lambda async_op: None, False)
    assert comm.last_entered == (2, "all_reduce", "dp", 0, 1) and comm.last_seq == 2
