"""LR schedule, loss scaler and the pieces of the global grad norm."""

import pytest
import torch

from trainer.config import OptimConfig, PrecisionConfig
from trainer.optim import DynamicLossScaler, all_finite, clip_coef, counts_in_norm, lr_at
from trainer.tensor_parallel import make_param


def test_lr_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    assert lr_at(1, cfg, 20) == pytest.approx(0.25e-3)
    assert lr_at(4, cfg, 20) == pytest.approx(1e-3)
    decay = [lr_at(s, cfg, 20) for s in range(4, 21)]
    assert all(b < a for a, b in zip(decay, decay[1:]))
    assert lr_at(20, cfg, 20) == pytest.approx(1e-4)
    assert lr_at(30, cfg, 20) == pytest.approx(1e-4)
    assert lr_at(1, OptimConfig(lr=1e-3, warmup_steps=0), 10) == pytest.approx(1e-3)


def test_scaler_backs_off_to_the_floor_and_grows_after_good_steps():
    cfg = PrecisionConfig(precision="fp16", init_scale=8.0, backoff_factor=0.5, growth_factor=2.0,
                          growth_interval=3, min_scale=2.0)
    scaler = DynamicLossScaler(cfg, enabled=True)
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0
    scaler.update(found_inf=True)
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0  # floor
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0
    scaler.update(found_inf=False)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)  # an inf resets the run of good steps
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert scaler.scale == 2.0
    restored = DynamicLossScaler(cfg, enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_scaler_disabled_outside_fp16():
    scaler = DynamicLossScaler(PrecisionConfig(), enabled=False)
    scaler.update(found_inf=True)
    assert scaler.scale == 1.0


def test_clip_coef():
    assert clip_coef(0.5, 1.0) == 1.0
    assert clip_coef(4.0, 1.0) == pytest.approx(0.25)
    assert clip_coef(4.0, 0.0) == 1.0  # clipping disabled


def test_norm_counts_shards_everywhere_and_replicas_once():
    shard = make_param(4, tp_dim=0, init="normal")
    replica = make_param(4, tp_dim=None, init="ones")
    tied = make_param(4, 2, tp_dim=0, init="normal")
    tied.tied_copy = True
    assert counts_in_norm(shard, 0) and counts_in_norm(shard, 1)
    assert counts_in_norm(replica, 0) and not counts_in_norm(replica, 1)
    assert not counts_in_norm(tied, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_false_for_any_nan_or_infinity_and_true_for_large_finite_values(dtype):
    x = torch.full((1000,), 60000.0 if dtype == torch.float16 else 1e30).to(dtype)  # the sum is past fp16's range
    assert bool(all_finite(x))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[517] = bad
        assert not bool(all_finite(y)), bad
    y = x.clone()
    y[0], y[1] = float("inf"), -float("inf")  # they do not cancel
    assert not bool(all_finite(y))
