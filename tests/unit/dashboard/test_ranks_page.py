"""The ranks page's builders: the rank x step heatmap, the per-rank time bars, the
slowest-ranks table and the mesh, on the synthetic run (rank 3 slow from step 20,
node1 isolated) and on hand-made rows for 64 ranks."""

from __future__ import annotations

import time
from types import SimpleNamespace

import plotly.io as pio
import pytest
from dash import no_update

from dashboard import state
from dashboard.figures import HEALTH_COLORS, Marks
from dashboard.pages import ranks
from tests.unit.dashboard.synthetic import RUN_ID, T0

LAST_HEARTBEAT = T0 + 37.5  # the synthetic run's ranks all beat last at its last step


def _cells(fig) -> dict[int, str]:
    """rank -> the fill colour of its cell in the mesh figure."""
    text = fig.data[0]
    fills = {(round((s.x0 + s.x1) / 2, 3), round((s.y0 + s.y1) / 2, 3)): s.fillcolor
             for s in fig.layout.shapes if s.type == "rect" and round(s.y1 - s.y0, 3) == 0.9}
    return {int(t[1:]): fills[(round(x, 3), round(y, 3))] for t, x, y in zip(text.text, text.x, text.y)}


def test_the_heatmap_has_a_row_per_rank_grouped_by_node_and_the_marks(db_source):
    fig = ranks.build(db_source, RUN_ID, now=LAST_HEARTBEAT)["heatmap"]
    heat = fig.data[0]
    assert list(heat.y) == ["r0 · node0", "r1 · node0", "r2 · node1", "r3 · node1"]
    assert list(heat.x) == list(range(1, 61))  # 60 effective steps, one column each
    assert heat.z[3][49] == pytest.approx(500.0)  # step_s 0.5 s, in ms
    assert "ms" in fig.layout.title.text and fig.layout.xaxis.title.text == "step"
    assert fig.layout.yaxis.autorange == "reversed"
    shapes = [s.to_plotly_json() for s in fig.layout.shapes]
    # a white rule between node0's and node1's ranks
    assert [s["y0"] for s in shapes if s["type"] == "line" and s.get("line", {}).get("color") == "#ffffff"] == [1.5]
    # the straggler (20-40) and the spike (35): outlined over the cells, and a labelled strip above
    strips = [s for s in shapes if s["type"] == "rect" and s.get("yref") == "paper"]
    assert sorted((s["x0"], s["x1"]) for s in strips) == [(19.5, 40.5), (34.5, 35.5)]
    assert {s["label"]["text"] for s in strips} == {"straggler r3", "loss_spike"}
    assert all(s["layer"] == "above" for s in shapes if s["type"] == "rect")
    # the rollback: a dashed line where attempt 1 began, and its name
    assert [s["x0"] for s in shapes if s["type"] == "line" and s.get("line", {}).get("dash") == "dash"] == [31]
    assert "rollback → attempt 1" in [a.text for a in fig.layout.annotations]


def test_compute_colouring_shows_the_straggler_as_a_row(db_source):
    heat = ranks.build(db_source, RUN_ID, metric="compute", now=LAST_HEARTBEAT)["heatmap"].data[0]
    assert heat.z[3][49] == pytest.approx(450.0) and heat.z[0][49] == pytest.approx(300.0)  # step 50
    assert heat.z[3][9] == pytest.approx(300.0)  # step 10: before it slowed down
    assert "compute time" in heat.hovertemplate


def test_the_bars_split_each_ranks_step_and_rank_3_computes_most(db_source):
    fig = ranks.build(db_source, RUN_ID, now=LAST_HEARTBEAT)["bars"]
    assert [t.name for t in fig.data] == ["compute (fwd+bwd+opt)", "data loading", "exposed comm", "other"]
    compute = dict(zip(fig.data[0].x, fig.data[0].y))
    assert max(compute, key=compute.get) == "r3" and compute["r3"] == pytest.approx(0.4025)
    exposed = dict(zip(fig.data[2].x, fig.data[2].y))
    assert exposed["r0"] > exposed["r3"]  # the others wait for it
    assert fig.layout.barmode == "stack" and fig.layout.yaxis.title.text == "s per step"
    assert "#d62728" in fig.layout.xaxis.ticktext[3]  # rank 3 in its colour, as on every page


def test_the_slowest_ranks_table_puts_rank_3_first_with_its_compute_ratio(db_source):
    table = ranks.build(db_source, RUN_ID, now=LAST_HEARTBEAT)["table"]
    assert len(table) == 4 and table[0]["rank"] == 3
    assert table[0] == {"rank": 3, "round": 0, "node": "node1", "coords": "dp1 · pp0 · tp1", "step_ms": 500.0,
                        "compute_ms": 402.5, "compute_ratio": 1.34}
    assert {r["compute_ratio"] for r in table[1:]} == {1.0}
    assert [c["id"] for c in ranks.TABLE_COLUMNS] == list(table[0])


def test_the_mesh_colours_the_isolated_node_and_silent_ranks(db_source):
    fig = ranks.build(db_source, RUN_ID, now=LAST_HEARTBEAT + 5)["mesh"]
    cells = _cells(fig)
    assert cells == {0: HEALTH_COLORS["healthy"], 1: HEALTH_COLORS["healthy"],
                     2: HEALTH_COLORS["isolated"], 3: HEALTH_COLORS["isolated"]}
    reasons = {t: cd[2] for t, cd in zip(fig.data[0].text, fig.data[0].customdata)}
    assert reasons["r3"].startswith("node1 isolated: straggler")
    assert "dp2 × pp1 × tp2" in fig.layout.title.text
    bands = {s.label.text for s in fig.layout.shapes if s.label and s.label.text}
    assert bands == {"node0", "node1"}
    # the run says "running": a minute without a heartbeat is silent (an isolated node stays isolated)
    later = _cells(ranks.build(db_source, RUN_ID, now=LAST_HEARTBEAT + 60)["mesh"])
    assert later[0] == later[1] == HEALTH_COLORS["silent"] and later[3] == HEALTH_COLORS["isolated"]


def test_health_prefers_isolation_then_an_incident_then_silence():
    row = {"node": "n", "node_status": "healthy", "open_incidents": 1, "incident_kinds": "straggler",
           "heartbeat_ts": 0.0}
    assert ranks.health_of(row, "running", 100.0) == ("incident", "open incident: straggler")
    assert ranks.health_of({**row, "node_status": "isolated"}, "running", 100.0)[0] == "isolated"
    assert ranks.health_of({**row, "open_incidents": 0}, "running", 100.0) == ("silent", "no heartbeat for 100 s")
    assert ranks.health_of({**row, "open_incidents": 0}, "completed", 100.0)[0] == "healthy"
    # an agent that beats every 60 s: silent after 3 of its beats, not after 30 s
    slow = {**row, "open_incidents": 0, "heartbeat_interval_s": 60.0}
    assert ranks.health_of(slow, "running", 100.0)[0] == "healthy"
    assert ranks.health_of(slow, "running", 181.0) == ("silent", "no heartbeat for 181 s")


def test_the_rank_filter_narrows_the_heatmap_and_bars_but_not_the_table(db_source):
    out = ranks.build(db_source, RUN_ID, ranks=[0, 3], now=LAST_HEARTBEAT)
    assert list(out["heatmap"].data[0].y) == ["r0 · node0", "r3 · node1"]
    assert list(out["bars"].data[0].x) == ["r0", "r3"]
    assert len(out["table"]) == 4
    assert [o["label"] for o in out["rank_options"]] == ["r0 · node0", "r1 · node0", "r2 · node1", "r3 · node1"]


def test_a_step_range_reads_those_steps_and_sets_the_first_x_range(db_source):
    out = ranks.build(db_source, RUN_ID, step_from=21, step_to=40, now=LAST_HEARTBEAT)
    heat = out["heatmap"]
    assert list(heat.data[0].x) == list(range(21, 41)) and list(heat.layout.xaxis.range) == [20.5, 40.5]
    assert out["range"] == (21, 40)
    assert out["table"][0]["compute_ms"] == pytest.approx(450.0)  # all 20 steps slow


def test_a_run_without_steps_says_so(db_source):
    out = ranks.build(db_source, "no-such-run", now=LAST_HEARTBEAT)
    for key in ("heatmap", "bars", "mesh"):
        assert out[key].layout.annotations[0].text.startswith(("no steps yet", "no ranks yet"))
    assert out["table"] == [] and out["range"] is None


def test_the_layout_reads_its_state_from_the_url():
    page = ranks.layout(ranks="3,0,x", metric="compute", **{"from": "10", "to": "50", "run": RUN_ID})
    found = {}

    def walk(c):
        cid = getattr(c, "id", None)
        if isinstance(cid, str):
            found[cid] = c
        for child in (getattr(c, "children", None) or []) if isinstance(getattr(c, "children", None), list) else \
                [getattr(c, "children", None)]:
            if child is not None and hasattr(child, "to_plotly_json"):
                walk(child)
    walk(page)
    assert found["rk-ranks"].value == [0, 3] and found["rk-metric"].value == "compute"
    assert found["rk-range"].data == {"from": 10, "to": 50}


def test_the_callback_redraws_only_when_the_run_moved(db_source, monkeypatch):
    """The page's clock is pinned: a running run's signature has the clock in 10 s buckets
    (a rank goes silent by time alone), so two draws that straddled a bucket's edge redrew
    and the test failed (once in CI, where a draw takes a second)."""
    clock = [time.time()]
    monkeypatch.setattr(ranks, "time", SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.setattr(state, "_source", db_source)
    first = ranks._draw(RUN_ID, 0, [3], "step", {}, None)
    assert list(first[0].data[0].y) == ["r3 · node1"] and first[6].startswith("steps 1–60")
    again = ranks._draw(RUN_ID, 1, [3], "step", {}, first[7])
    assert all(v is no_update for v in again)
    clock[0] += 10.0  # the next bucket: a running run's page redraws by time alone
    assert not all(v is no_update for v in ranks._draw(RUN_ID, 1, [3], "step", {}, first[7]))
    other = ranks._draw(RUN_ID, 2, [], "step", {}, first[7])
    assert len(other[0].data[0].y) == 4
    zoomed = ranks._draw(RUN_ID, 3, [], "step", {"from": 41, "to": 50}, other[7])  # the heatmap's zoom
    assert list(zoomed[0].data[0].x) == list(range(41, 51)) and zoomed[6].startswith("steps 41–50")


# -- a big mesh, from hand-made rows -----------------------------------------------------------
def _big(num_dp=4, num_pp=4, num_tp=4, steps=300, width=34):
    n = num_dp * num_pp * num_tp
    info = {r: {"rank": r, "node": f"node{r // 8}", "dp": r // (num_pp * num_tp), "pp": (r // num_tp) % num_pp,
                "tp": r % num_tp, "node_status": "isolated" if r // 8 == 6 else "healthy",
                "open_incidents": int(r == 37), "incident_kinds": "straggler" if r == 37 else None,
                "heartbeat_ts": 1000.0} for r in range(n)}
    grid = [{"step": 1 + j * width, "rank": r, "step_s": 0.5 + 0.001 * j, "step_s_max": 0.9,
             "compute_s": 0.45 if r == 37 else 0.3} for j in range(steps) for r in range(n)]
    times = [{**info[r], "step_s": 0.5, "compute_s": 0.45 if r == 37 else 0.3, "data_s": 0.01,
              "comm_exposed_s": 0.05 if r == 37 else 0.18, "other_s": 0.01} for r in range(n)]
    return info, grid, times


def test_64_ranks_over_10000_steps_stay_readable_and_small():
    info, grid, times = _big()
    marks = Marks(incidents=[{"id": 1, "kind": "straggler", "severity": "warning", "rank": 37, "step_from": 6000,
                              "step_to": 9000}], attempts=[{"attempt": 0, "step_from": 1}], actions=[])
    heat = ranks.heatmap_figure(grid, info, marks)
    assert len(heat.data[0].y) == 64 and len(heat.data[0].x) == 300
    assert heat.data[0].y[0] == "r0 · node0" and heat.data[0].y[63] == "r63 · node7"
    assert "each cell the mean of 34 steps" in heat.layout.title.text
    assert list(heat.data[0].customdata[0][0]) == [1, 34, 900.0]  # the bucket's steps and its slowest step
    assert heat.layout.height <= 820
    rules = [s for s in heat.layout.shapes if s.type == "line" and s.line.color == "#ffffff"]
    assert len(rules) == 7  # 8 nodes
    mesh = ranks.mesh_figure(list(info.values()), "running", 1010.0)
    cells = _cells(mesh)
    assert len(cells) == 64 and cells[37] == HEALTH_COLORS["incident"] and cells[48] == HEALTH_COLORS["isolated"]
    assert "dp4 × pp4 × tp4" in mesh.layout.title.text
    assert sorted(a.text for a in mesh.layout.annotations if a.text.startswith("dp")) == ["dp0", "dp1", "dp2", "dp3"]
    assert 240 <= mesh.layout.height <= 720
    bars = ranks.bars_figure(times)
    assert len(bars.data[0].x) == 64
    table = ranks.slowest_table(times)
    assert table[0]["rank"] == 37 and table[0]["compute_ratio"] == 1.5 and len(table) == ranks.TOP_SLOWEST
    size = sum(len(pio.to_json(f)) for f in (heat, mesh, bars))
    assert size < 1_000_000


@pytest.mark.parametrize(("num_dp", "num_pp", "num_tp", "per_row"), [(2, 1, 2, 2), (4, 4, 4, 4), (8, 1, 8, 2),
                                                                      (64, 1, 1, 13), (1, 1, 4, 1)])
def test_replica_tiles_wrap_into_even_rows(num_dp, num_pp, num_tp, per_row):
    assert ranks._tiles_per_row(num_dp, num_pp, num_tp, gap_x=0.6, gap_y=0.9, row_h=1.35) == per_row
