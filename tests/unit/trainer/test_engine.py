"""TrainEngine in one process: norm, skipping, precision, eval, state, faults."""

import copy
import math

import pytest
import torch

from trainer.batch import IGNORE_INDEX, MicroBatch
from trainer.comm import Comm
from trainer.config import JobConfig, ModelConfig, OptimConfig, PrecisionConfig
from trainer.engine import TrainEngine
from trainer.faults import StepFaults
from trainer.parallel_dims import ParallelDims

MODEL = ModelConfig(layers=2, d_model=32, heads=2, seq_len=16)


def engine(precision="fp32", grad_clip=1.0) -> TrainEngine:
    cfg = JobConfig(model=MODEL, optim=OptimConfig(lr=1e-3, warmup_steps=1, grad_clip=grad_clip),
                    precision=PrecisionConfig(precision=precision), steps=10, seed=3)
    dims = ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1)
    return TrainEngine(cfg, dims, Comm(dims, device=torch.device("cpu")), torch.device("cpu"))


def batches(num_mb=2, seed=0) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_mb):
        tokens = torch.randint(1, MODEL.vocab_size, (2, 17), generator=gen)
        targets = tokens[:, 1:].clone()
        targets[1, 9:] = IGNORE_INDEX
        out.append(MicroBatch(inputs=tokens[:, :-1], targets=targets, num_tokens=int((targets != IGNORE_INDEX).sum())))
    return out


def tokens_of(mbs):
    return sum(mb.num_tokens for mb in mbs)


def params_of(e: TrainEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in e.model.parameters()]


def test_loss_and_norm_are_the_plain_definitions():
    e = engine(grad_clip=0.0)  # no clipping: after the step the buffers hold the raw grads
    mbs = batches()
    with torch.no_grad():
        want = sum(float(e.model(mb.inputs, mb.targets).sum()) for mb in mbs) / tokens_of(mbs)
    r = e.train_step(1, mbs, tokens_of(mbs))
    assert r.loss == pytest.approx(want, rel=1e-6)
    flat = torch.cat([p.grad.flatten() for p in e.model.parameters()])
    assert r.grad_norm == pytest.approx(float(flat.norm()), rel=1e-5)
    assert not r.skipped and r.num_micro_batches == 2 and r.loss_scale == 1.0
    assert r.fwd_s > 0 and r.bwd_s > 0 and r.opt_s > 0 and r.bwd_end_ts > 0


def test_clipping_bounds_the_applied_gradient():
    e = engine(grad_clip=1e-3)
    mbs = batches()
    r = e.train_step(1, mbs, tokens_of(mbs))
    assert r.grad_norm > 1e-3
    flat = torch.cat([p.grad.flatten() for p in e.model.parameters()])
    assert float(flat.norm()) == pytest.approx(1e-3, rel=1e-3)


def test_nan_step_is_skipped_in_fp32_and_weights_stay():
    e = engine()
    mbs = batches()
    before = params_of(e)
    r = e.train_step(1, mbs, tokens_of(mbs), StepFaults(nan=True))
    assert r.skipped and not math.isfinite(r.grad_norm) and math.isnan(r.loss)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(e)))
    r = e.train_step(2, mbs, tokens_of(mbs))
    assert not r.skipped and math.isfinite(r.loss)


def test_bf16_tracks_fp32():
    mbs = batches()
    fp32 = [engine().train_step(s, mbs, tokens_of(mbs)).loss for s in (1,)]
    bf16 = engine("bf16")
    first = bf16.train_step(1, mbs, tokens_of(mbs))
    assert first.loss == pytest.approx(fp32[0], rel=2e-2)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights stay fp32
    assert all(s["exp_avg"].dtype == torch.float32 for s in bf16.optimizer.state.values())


def test_eval_loss_is_the_token_sum():
    e = engine()
    mbs = batches(3)
    with torch.no_grad():
        want = sum(float(e.model(mb.inputs, mb.targets).sum()) for mb in mbs)
    loss_sum, num_tokens = e.eval_loss(mbs)
    assert num_tokens == tokens_of(mbs)
    assert loss_sum == pytest.approx(want, rel=1e-6)
    assert e.model.training


def test_state_round_trip_continues_identically():
    mbs = [batches(seed=s) for s in range(4)]
    a = engine()
    for step in (1, 2):
        a.train_step(step, mbs[step - 1], tokens_of(mbs[step - 1]))
    state = copy.deepcopy(a.state_dict())  # what a save to disk and a load give back
    assert set(state) == {"model", "optim", "scaler"} and a.shard_key == "pp00-tp00"
    assert list(state["model"]) == a.param_names
    b = engine()
    b.load_state_dict(state)
    for step in (3, 4):
        ra = a.train_step(step, mbs[step - 1], tokens_of(mbs[step - 1]))
        rb = b.train_step(step, mbs[step - 1], tokens_of(mbs[step - 1]))
        assert ra.loss == rb.loss and ra.grad_norm == rb.grad_norm


def test_straggler_fault_stretches_compute(monkeypatch):
    """The stall is (factor - 1) x the compute just measured, and it is counted as
    compute. Checked on a clock whose sleep advances time at once: the test does not
    depend on how fast this machine happens to be while it runs."""
    import time as real_time

    import trainer.engine as engine_mod

    class InstantSleep:
        def __init__(self) -> None:
            self.offset_s, self.slept = 0.0, []

        def perf_counter(self) -> float:
            return real_time.perf_counter() + self.offset_s

        def sleep(self, s: float) -> None:
            self.slept.append(s)
            self.offset_s += s

        def __getattr__(self, name):  # time.time() and the rest: the real ones
            return getattr(real_time, name)

    clock = InstantSleep()
    monkeypatch.setattr(engine_mod, "time", clock)
    e = engine()
    mbs = batches()
    e.train_step(1, mbs, tokens_of(mbs))  # warm up
    normal = e.train_step(2, mbs, tokens_of(mbs))
    assert clock.slept == []  # no fault, no stall
    for factor in (1.5, 4.0):
        clock.slept.clear()
        r = e.train_step(3, mbs, tokens_of(mbs), StepFaults(slowdown=factor))
        stalled = sum(clock.slept)
        compute = r.fwd_s + r.bwd_s
        assert clock.slept and all(x > 0 for x in clock.slept)
        # the stall is in the reported compute, and is (factor - 1) x the compute measured
        # before it (which the compute measured after it can only exceed)
        assert stalled <= compute
        assert stalled <= (factor - 1.0) * (compute - stalled) + 1e-9
    assert normal.fwd_s > 0 and normal.bwd_s > 0