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


def test_the_rank_whose_own_gradients_overflowed_is_named():
    """With `finite_bwd` (a rank's own gradients, before the DP reduction spread them) the
    collapse names the rank that overflowed at its backoff steps."""
    a = Analyzer(detectors=["loss_scale_collapse"])
    out = []
    s = 65536.0
    for step in range(1, 61):
        overflow = 31 <= step <= 37
        if overflow:
            s /= 2
        rows = [{"run_id": "r", "attempt": 0, "step": step, "rank": r, "ts": float(step), "loss": 2.0,
                 "grad_norm": 1.0, "loss_scale": s, "node": f"node{r}",
                 "finite_bwd": 0 if overflow and r == 1 else 1} for r in range(2)]
        out += a.feed(Frames(steps=steps_frame(rows)), now=float(step))
    named = [f for f in out if f.rank is not None]
    assert named and {(f.rank, f.node) for f in named} == {(1, "node1")}
    assert named[-1].step_from == 31 and named[-1].evidence["overflow_steps_per_rank"]["1"] >= 5


def feed_overflow(mesh: str, overflow_steps: range, overflowing: tuple[int, ...]):
    """Four ranks on two nodes (ranks 0, 1 on node0; 2, 3 on node1) whose scale halves at each of
    `overflow_steps`, when the ranks `overflowing` report non-finite own gradients."""
    from analysis.frames import runs_frame

    a = Analyzer(detectors=["loss_scale_collapse"])
    runs = runs_frame([{"run_id": "r", "world_size": 4, "status": "running", "config": "{}",
                        "mesh": mesh, "node_map": '{"0": "node0", "1": "node0", "2": "node1", "3": "node1"}'}])
    out = a.feed(Frames(runs=runs), now=0.0)
    s = 65536.0
    for step in range(1, 61):
        overflow = step in overflow_steps
        if overflow:
            s /= 2
        rows = [{"run_id": "r", "attempt": 0, "step": step, "rank": r, "ts": float(step), "loss": 2.0,
                 "grad_norm": 1.0, "loss_scale": s, "finite_bwd": 0 if overflow and r in overflowing else 1}
                for r in range(4)]
        out += a.feed(Frames(steps=steps_frame(rows)), now=float(step))
    return out


def test_an_overflow_in_the_last_stage_is_named_there_not_upstream():
    """Backward runs from the last stage: rank 3's infinite gradients reach rank 1 (its stage-0 peer
    in the pipeline) too, so both report non-finite local gradients; the origin is the later stage."""
    out = feed_overflow('{"dp": 2, "tp": 1, "pp": 2}', range(31, 38), (1, 3))
    named = [f for f in out if f.rank is not None]
    assert named and {(f.rank, f.node) for f in named} == {(3, "node1")}


def test_tensor_parallel_partners_overflowing_alike_name_their_node_not_one_rank():
    """Seen on a real dp2 x tp2 run: rank 3's injected overflow crossed the tp all-reduce in backward,
    so ranks 2 and 3 reported non-finite own gradients at the same 8 steps, and the tie went to
    rank 2. Nothing tells them apart: the incident names their node and both as suspects."""
    from analysis.scoring import suspects_of

    out = feed_overflow('{"dp": 2, "tp": 2, "pp": 1}', range(39, 47), (2, 3))
    assert out and {(f.rank, f.node) for f in out} == {(None, "node1")}
    last = out[-1]
    assert last.evidence["overflow_suspects"] == [2, 3] and "overflow_rank" not in last.evidence
    assert "tensor-parallel" in last.evidence["why_no_single_rank"]
    assert suspects_of(last.kind, last.rank, last.evidence) == (2, 3)
