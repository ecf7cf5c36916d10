"""The overview page's builders: the curves, their marks, the lineage, and the live
append (extendData) that a refresh sends instead of a redraw."""

from __future__ import annotations

import json

import plotly.io as pio
from dash import no_update

from dashboard.figures import Curve, XAxis, curve_traces, ema, plain
from dashboard.pages import overview
from tests.unit.dashboard.synthetic import RUN_ID


def _shapes(fig) -> list[dict]:
    return [s.to_plotly_json() for s in fig.layout.shapes]


def test_build_draws_every_curve_with_the_runs_marks(db_source):
    out = overview.build(db_source, RUN_ID)
    loss = out["curves"][0]
    assert [c.key for c in overview.CURVES] == ["loss", "grad_norm", "loss_scale", "lr", "tokens_per_s"]
    band_top, band_bottom, value, smoothed = loss.data[:4]
    assert list(value.x) == list(range(1, 61))  # 60 effective steps, one point each
    assert max(value.y) < 6  # the spike at step 35 was in attempt 0: rolled back, not on the effective curve
    assert band_bottom.fill == "tonexty" and list(smoothed.y) == []
    shapes = _shapes(loss)
    # the straggler (steps 20-40) and the spike (35) shaded; attempt 1 starting at step 31 a dashed line
    rects = [s for s in shapes if s["type"] == "rect"]
    assert sorted((s["x0"], s["x1"]) for s in rects) == [(19.5, 40.5), (34.5, 35.5)]
    assert [s["x0"] for s in shapes if s["type"] == "line"] == [31]
    texts = [a.text for a in loss.layout.annotations]
    assert "straggler r3" in texts and "loss_spike" in texts and "rollback → attempt 1" in texts
    assert loss.layout.yaxis.title.text == "nats" and loss.layout.xaxis.title.text == "step"
    assert out["curves"][2].layout.yaxis.type == "linear"  # the log toggle is the caller's
    assert out["drawn"]["last_step"] == 60 and out["drawn"]["run"] == RUN_ID


def test_the_lineage_shows_the_replaced_tail_of_attempt_0(db_source):
    fig = overview.build(db_source, RUN_ID)["lineage"]
    names = [t.name for t in fig.data]
    assert names == ["attempt 0", "attempt 0 (replaced)", "attempt 1"]
    replaced = fig.data[1]
    assert list(replaced.x) == list(range(31, 41)) and max(replaced.y) == 12.0  # the spike lives here
    assert replaced.line.dash == "dot"


def test_eval_curves_per_domain(db_source):
    fig = overview.build(db_source, RUN_ID)["eval"]
    assert sorted(t.name for t in fig.data) == ["code", "math"]
    assert list(fig.data[0].x) == [10, 20, 30, 40, 50, 60]


def test_wall_time_axis_and_log_scale(db_source):
    out = overview.build(db_source, RUN_ID, x="time", log=("loss_scale",))
    value = out["curves"][0].data[2]
    assert str(value.x[0]).startswith("2027-01-15")  # T0 = 1.8e9 s
    assert out["curves"][0].layout.xaxis.title.text == "wall time (UTC)"
    assert out["curves"][2].layout.yaxis.type == "log"


def test_extend_sends_only_new_steps_and_nothing_when_there_are_none(db_source):
    out = overview.build(db_source, RUN_ID)
    drawn = dict(out["drawn"], last_step=55)  # as if the last refresh had drawn up to step 55
    data, new = overview.extend(db_source, RUN_ID, drawn)
    first = data[0][0]
    assert data[0][1] == [0, 1, 2, 3]
    assert first["x"][2] == [56, 57, 58, 59, 60] and len(first["y"][2]) == 5
    assert new["last_step"] == 60 and new["appended"] == 5
    again, same = overview.extend(db_source, RUN_ID, new)
    assert all(d is no_update for d in again) and same is new


def test_extend_asks_for_a_redraw_when_the_marks_change(db_source):
    drawn = dict(overview.build(db_source, RUN_ID)["drawn"], marks="something else")
    assert overview.extend(db_source, RUN_ID, drawn) is None


def test_a_full_draw_is_small(db_source):
    out = overview.build(db_source, RUN_ID)
    size = sum(len(pio.to_json(f)) for f in [*out["curves"], out["eval"], out["lineage"]])
    assert size < 200_000
    json.dumps(out["drawn"])  # the drawn state is what dcc.Store keeps: plain JSON


def test_smoothing_is_a_debiased_ema_that_continues():
    assert ema([1, 2, 3], 0) == [1.0, 2.0, 3.0]
    assert ema([1, None, 3], 0.5) == [1.0, 1.0, 2.0]
    assert ema([3], 0.5, start=1.0) == [2.0]
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": 3.0}]
    traces = curve_traces(rows, Curve("loss", "Loss", "nats"), XAxis(), smoothing=0.5)
    assert plain(traces[2].y) == [1.0, None, 3.0] and plain(traces[3].y) == [1.0, 1.0, 2.0]


def test_a_zoomed_range_is_read_at_full_resolution_there(db_source):
    out = overview.build(db_source, RUN_ID, step_from=20, step_to=30)
    loss = out["curves"][0]
    assert list(loss.data[2].x) == list(range(19, 32))  # one step either side, so the lines reach the edges
    assert list(loss.layout.xaxis.range) == [20, 30]
    assert overview.build(db_source, RUN_ID, x="time", step_from=20, step_to=30)["curves"][0].layout.xaxis.range is None


def test_the_live_curves_go_out_with_lists_extendData_can_append_to(db_source):
    """A numpy column ships as a typed array ({dtype, bdata}), which plotly.js cannot extend."""
    from dashboard.figures import extendable

    fig = overview.build(db_source, RUN_ID)["curves"][0]
    out = extendable(fig)
    value = out["data"][2]
    assert isinstance(value["x"], list) and value["x"][:3] == [1, 2, 3] and isinstance(value["y"], list)
    assert "bdata" not in pio.to_json(out)
    assert "bdata" in pio.to_json(fig)  # what the same figure would have shipped
