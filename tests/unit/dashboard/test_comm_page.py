"""The communication page's builders on the synthetic run (per step one dp all-reduce
and two tp all-reduces; rank 3 enters late from step 20, so the others wait for it)
and on hand-made rows for 64 ranks."""

from __future__ import annotations

import plotly.io as pio
import pytest
from dash import no_update

from dashboard import state
from dashboard.pages import comm
from tests.unit.dashboard.synthetic import RUN_ID


def test_time_by_axis_and_op_split_exposed_and_overlapped(db_source):
    fig = comm.build(db_source, RUN_ID)["ops"]
    exposed, overlapped = fig.data
    assert list(exposed.x) == ["tp · all_reduce", "dp · all_reduce"]  # the most time first
    # tp: two ops a rank-step, dp one; each blocked 0.01 s, and 0.1 s more on the ranks that wait for the
    # straggler (ranks 0-2, steps 20-60); 0.01 s of each op overlapped compute
    assert list(exposed.y) == pytest.approx([0.1225, 0.06125])
    assert list(overlapped.y) == pytest.approx([0.02, 0.01])
    assert fig.layout.barmode == "stack" and fig.layout.yaxis.title.text == "s per rank-step"
    assert "per rank-step" in exposed.hovertemplate and exposed.customdata[0][0] == "122.5 ms"


def test_message_size_per_op_in_mib(db_source):
    fig = comm.build(db_source, RUN_ID)["bytes"]
    bars = fig.data[0]
    assert dict(zip(bars.x, bars.y)) == {"tp · all_reduce": 1.0, "dp · all_reduce": 4.0}  # 1 MiB and 4 MiB
    assert fig.layout.yaxis.title.text == "MiB per op"
    assert bars.customdata[1][0] == "4.0 MiB" and bars.customdata[1][1] == "960.0 MiB"  # 240 ops
    assert bars.marker.color[0] == comm.AXIS_COLORS["tp"] and bars.marker.color[1] == comm.AXIS_COLORS["dp"]


def test_latency_boxes_per_group_coloured_by_axis_on_a_log_axis(db_source):
    fig = comm.build(db_source, RUN_ID)["latency"]
    boxes = [t for t in fig.data if t.type == "box"]
    assert [t.name for t in boxes] == ["dp", "tp"]
    dp = boxes[0]
    assert list(dp.x) == ["dp · g0 · all_reduce", "dp · g1 · all_reduce"]
    assert dp.q1[0] == pytest.approx(20.0) and dp.median[0] == pytest.approx(120.0)  # ms
    assert dp.lowerfence[0] == pytest.approx(20.0) and dp.upperfence[0] == pytest.approx(120.0)
    assert dp.marker.color == comm.AXIS_COLORS["dp"] and boxes[1].marker.color == comm.AXIS_COLORS["tp"]
    # the hover names the quantiles (a box's own would call p5 and p99 min and max)
    hover = next(t for t in fig.data if t.type == "scatter" and t.legendgroup == "dp")
    assert hover.text[0].startswith("dp · group 0 · all_reduce<br>p5 20.0 ms · p25 20.0 ms · median 120.0 ms")
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.title.text == "ms (log)"


def test_the_waits_heatmap_and_its_caption_name_rank_3(db_source):
    out = comm.build(db_source, RUN_ID)
    heat = out["waits"].data[0]
    assert list(heat.x) == list(heat.y) == ["r0", "r1", "r2", "r3"]
    column = [row[3] for row in heat.z]  # waited for rank 3
    assert column[3] is None and column[2] == pytest.approx(0.1367, abs=1e-3) and column[1] > 0
    assert max(v or 0 for row in heat.z for v in row) == column[2]
    assert out["caption"].startswith("Most waiting is for rank 3 (node1): 0.20 s/step")
    assert out["waits"].layout.yaxis.title.text == "waiter (rank)"
    assert out["waits"].layout.xaxis.title.text == "waited for (rank)"
    assert out["range"] == (1, 60)
    assert [(t["rank"], t["node"], round(t["share"], 2)) for t in out["top_waited"]] == [(3, "node1", 1.0)]


def test_a_step_range_narrows_every_view(db_source):
    out = comm.build(db_source, RUN_ID, step_from=1, step_to=19)  # before rank 3 slowed down
    assert out["range"] == (1, 19)
    assert out["caption"] == "No rank waited for another in this range."
    assert list(out["ops"].data[1].y) == pytest.approx([0.02, 0.01])  # 0.02 s per op, half waited
    late = comm.build(db_source, RUN_ID, step_from=50)
    assert late["range"] == (50, 60)


def test_a_run_without_collectives_says_so(db_source):
    out = comm.build(db_source, "no-such-run")
    for key in ("ops", "bytes", "latency", "waits"):
        assert out[key].layout.annotations[0].text == comm.NO_COMM
    assert out["range"] is None
    assert comm.build(db_source, RUN_ID, step_from=500)["ops"].layout.annotations[0].text.endswith("in these steps")


def test_the_callback_redraws_only_when_the_run_moved(db_source, monkeypatch):
    monkeypatch.setattr(state, "_source", db_source)
    first = comm._draw(RUN_ID, 0, None, None, None)
    assert first[4].startswith("Most waiting is for rank 3") and "last 200 steps" in first[6]
    assert [li.children for li in first[5]] == ["rank 3 (node1): 0.205 s/step, 100%"]
    again = comm._draw(RUN_ID, 1, None, None, first[8])
    assert all(v is no_update for v in again)
    ranged = comm._draw(RUN_ID, 2, 30, 21, first[8])  # typed backwards
    assert ranged[6] == "showing steps 21–30"


def test_the_layout_reads_the_range_from_the_url():
    page = comm.layout(**{"from": "20", "to": "x"})
    controls = page.children[0].children[0].children
    assert controls[1].value == 20 and controls[3].value is None


def test_64_ranks_stay_readable_and_small():
    waits = [{"waiter": w, "waited_for": f, "num_ops": 10, "wait_s": 0.1 if f == 37 else 0.001}
             for w in range(64) for f in range(64) if w != f]
    fig = comm.waits_figure(waits)
    assert len(fig.data[0].x) == 64 and len(fig.data[0].z) == 64 and fig.layout.height <= 760
    assert comm.waits_caption(waits, {37: "node4"}).startswith("Most waiting is for rank 37 (node4): 6.30 s/step")
    latency = [{"axis": a, "group_id": g, "op": "all_reduce", "p5_s": 1e-3, "p25_s": 2e-3, "p50_s": 3e-3,
                "p75_s": 4e-3, "p99_s": 9e-3} for a in ("dp", "tp", "pp") for g in range(21)]
    box = comm.latency_figure(latency[:64])
    assert sum(len(t.x) for t in box.data if t.type == "box") == 63 and box.layout.xaxis.tickangle == -30
    assert sum(len(pio.to_json(f)) for f in (fig, box)) < 1_000_000
