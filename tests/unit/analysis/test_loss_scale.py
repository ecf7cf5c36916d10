"""Loss-scale collapse: repeated backoffs within a window, or pinned at the floor; quiet otherwise."""

from analysis import Analyzer, Frames
from analysis.frames import steps_frame


def feed_scales(scales, *, losses=None, world=2):
    a = Analyzer(detectors=["loss_scale_collapse"])
    out = []
    for i, scale in enumerate(scales):
        step = i + 1
        loss = losses[i] if losses else 2.0
        rows = [{"run_id": "r", "attempt": 0, "step": step, "rank": r, "ts": float(step), "loss": loss,
                 "grad_norm": 1.0, "loss_scale": scale} for r in range(world)]
        out += a.feed(Frames(steps=steps_frame(rows)), now=float(step))
    return out


def test_calibration_and_rare_backoffs_are_quiet():
    scales = [65536.0 / 2 ** min(i, 6) for i in range(10)] + [1024.0] * 100 + [512.0] * 100 + [1024.0] * 50
    assert feed_scales(scales) == []


def test_bf16_never_fires():
    assert feed_scales([1.0] * 200) == []


def test_repeated_backoffs_open_then_close():
    scales = [65536.0] * 30
    s = 65536.0
    for _ in range(6):  # six halvings within 12 steps
        scales += [s, s / 2]
        s /= 2
    scales += [s] * 200
    out = feed_scales(scales)
    assert {f.key for f in out} == {"loss_scale_collapse#1"}
    assert out[0].severity == "warning" and out[0].evidence["num_backoffs"] == 5
    assert out[-1].resolved


def test_pinned_at_the_floor_is_critical():
    scales = [65536.0] * 30 + [2.0 ** (15 - i) for i in range(16)] + [1.0] * 10
    out = feed_scales(scales)
    assert any(f.severity == "critical" and f.evidence["pinned_steps"] >= 3 for f in out)
    assert len({f.key for f in out}) == 1


def test_backoffs_on_non_finite_losses_are_the_nan_detectors():
    scales = [65536.0] * 30
    losses = [2.0] * 30
    s = 65536.0
    for _ in range(6):
        scales += [s, s / 2]
        losses += [2.0, float("nan")]
        s /= 2
    assert feed_scales(scales, losses=losses) == []
