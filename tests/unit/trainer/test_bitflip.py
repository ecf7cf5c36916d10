"""Silent data corruption: the bit flip injection and the shard checksum (trainer/integrity.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.trainer.test_engine import batches, engine, tokens_of
from trainer.config import ConfigError
from trainer.faults import FaultInjector, parse_injection
from trainer.integrity import FLIP_BIT, flip_bit, named_tensors, shard_checksum


def _bits(t):
    return t.reshape(-1).view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_flip_changes_exactly_one_bit_of_one_element_and_stays_finite(dtype):
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = t.clone()
    bit, old, new = flip_bit(t, 1000)
    assert bit == FLIP_BIT[dtype] and old ^ new in (1 << bit, -(1 << bit))
    changed = (t != before).reshape(-1).nonzero().flatten().tolist()
    assert changed == [1000] and torch.isfinite(t).all()
    ratio = float(t.reshape(-1)[1000] / before.reshape(-1)[1000])
    assert 0.6 < abs(ratio) < 1.6 and ratio != 1.0  # noticeable, finite


def test_checksum_equal_for_identical_params_and_differs_after_one_flip():
    a = [torch.randn(128, 64), torch.randn(300), torch.zeros(5)]
    b = [t.clone() for t in a]
    assert shard_checksum(a).item() == shard_checksum(b).item()
    assert shard_checksum(a).dtype == torch.float64
    for bit in (0, 22, 30, 31):
        c = [t.clone() for t in a]
        flip_bit(c[1], 17, bit)
        assert shard_checksum(c).item() != shard_checksum(a).item()
    # exact: the value is an integer below 2^52, whatever the order of the tensors
    v = shard_checksum(a).item()
    assert v == int(v) and 0 <= v < 2 ** 52 and shard_checksum(a[::-1]).item() == v


def test_engine_reads_the_checksum_at_its_one_sync_and_nothing_else_changes():
    e1, e2 = engine(), engine()
    want = shard_checksum(list(e1.model.parameters())).item()
    mbs = batches()
    r1 = e1.train_step(1, mbs, tokens_of(mbs), checksum=True)
    r2 = e2.train_step(1, mbs, tokens_of(mbs))
    assert r1.checksum == want and r2.checksum is None
    assert (r1.loss, r1.grad_norm, r1.local_loss, r1.finite_fwd, r1.finite_bwd) == \
        (r2.loss, r2.grad_norm, r2.local_loss, r2.finite_fwd, r2.finite_bwd)
    for p, q in zip(e1.model.parameters(), e2.model.parameters()):
        assert torch.equal(p, q)
    r3 = e1.train_step(2, mbs, tokens_of(mbs), checksum=True)  # the params after step 1's update
    assert r3.checksum == shard_checksum(list(e2.model.parameters())).item() != want
    # the checksum is device work only: no .item()/.tolist() of its own inside the step
    calls = []
    orig = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: (calls.append(1), orig(self))[1]
    try:
        e1.train_step(3, mbs, tokens_of(mbs), checksum=True)
    finally:
        torch.Tensor.tolist = orig
    assert len(calls) == 1


@pytest.mark.parametrize("target", ["param", "optim"])
def test_injector_flips_one_bit_after_the_update_and_writes_the_truth(tmp_path, target):
    e = engine()
    mbs = batches()
    e.train_step(1, mbs, tokens_of(mbs))  # the optimizer state exists after a step
    inj = FaultInjector([parse_injection(f"bitflip@rank=0,step=2,target={target}")], rank=0, node=0,
                        run_dir=tmp_path)
    before = {n: t.clone() for n, t in named_tensors(e, target)}
    inj.after_update(1, 0, lambda t: named_tensors(e, t))  # not its step
    inj.after_update(2, 0, lambda t: named_tensors(e, t))
    inj.after_update(2, 1, lambda t: named_tensors(e, t))  # a later attempt's replay: once only
    diffs = {n: int((t != before[n]).sum()) for n, t in named_tensors(e, target) if not torch.equal(t, before[n])}
    (truth,) = [json.loads(line) for line in (tmp_path / "injections.jsonl").read_text().splitlines()]
    assert diffs == {truth["tensor"]: 1}
    assert (truth["kind"], truth["rank"], truth["step"], truth["target"]) == ("bitflip", 0, 2, target)
    assert truth["bits_before"] ^ truth["bits_after"] == 1 << truth["bit"]
    t = dict(named_tensors(e, target))[truth["tensor"]]
    assert int(_bits(t)[truth["index"]]) == truth["bits_after"]


def test_bitflip_spec_is_validated():
    assert parse_injection("bitflip@rank=1,step=5").target == "param"
    with pytest.raises(ConfigError, match="target"):
        parse_injection("bitflip@rank=1,step=5,target=grads")
    with pytest.raises(ConfigError, match="missing"):
        parse_injection("bitflip@rank=1")


def test_an_optimizer_state_flip_reaches_the_parameter_checksum_at_the_next_update():
    """`target=optim`: the checksum reads parameters only, so a flipped moment is invisible
    until the update that uses it has moved the replica's parameters: the checksum of the
    step after that update differs."""
    healthy, hit = engine(), engine()
    mbs = batches()
    for e in (healthy, hit):
        e.train_step(1, mbs, tokens_of(mbs))
    name, t = next((n, t) for n, t in named_tensors(hit, "optim") if n.endswith(".exp_avg"))
    flip_bit(t, 0)
    r_healthy, r_hit = (e.train_step(2, mbs, tokens_of(mbs), checksum=True) for e in (healthy, hit))
    assert r_healthy.checksum == r_hit.checksum  # as step 2 began: the parameters still agree
    r_healthy, r_hit = (e.train_step(3, mbs, tokens_of(mbs), checksum=True) for e in (healthy, hit))
    assert r_healthy.checksum != r_hit.checksum, name  # step 2's update used the flipped moment
