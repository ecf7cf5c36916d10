"""The Nodes & checkpoints page on the synthetic run: node1 isolated for the straggler,
seven verified checkpoints (step 40 saved by both attempts)."""

from __future__ import annotations

import pytest
from dash import no_update

from dashboard import state
from dashboard.figures import HEALTH_COLORS, node_color


@pytest.fixture
def page(db_source):
    state.set_source(db_source)  # what the callbacks read; the builders take the source
    from dashboard.pages import nodes

    return nodes


def test_node_table_shows_node1_isolated(page, db_source):
    rows = {r["node"]: r for r in page.build(db_source, "synth")["nodes"]}
    assert rows["node1"]["status"] == "isolated" and rows["node1"]["ranks"] == "2, 3"
    assert rows["node1"]["reason"] == "straggler: rank 3 compute 1.5x" and rows["node1"]["isolated"] != "–"
    assert (rows["node0"]["status"], rows["node0"]["num_ranks"], rows["node0"]["isolated"]) == ("healthy", 2, "–")


def test_status_colours_follow_health(page):
    assert page.health_color("healthy") == HEALTH_COLORS["healthy"]
    assert page.health_color("suspect") == HEALTH_COLORS["warning"]
    assert page.health_color("isolated") == HEALTH_COLORS["isolated"]
    styled = {s["if"]["filter_query"]: s["color"] for s in page._NODE_STYLES if "color" in s}
    assert styled['{status} = "isolated"'] == HEALTH_COLORS["isolated"]


def test_ranks_per_node_chart(page, db_source):
    fig = page.build(db_source, "synth")["nodes_figure"]
    bars = {t.name: t for t in fig.data}
    assert list(bars["node1"].x) == [2] and "ranks 2, 3" in bars["node1"].text[0]
    assert bars["node1"].marker.pattern.shape == "/" and bars["node0"].marker.pattern.shape == ""
    assert bars["node0"].marker.color == node_color("node0", ["node0", "node1"])
    assert bars["node1"].marker.line.color == HEALTH_COLORS["isolated"]
    assert fig.layout.xaxis.title.text == "ranks (count)"


def test_checkpoint_table(page, db_source):
    rows = page.build(db_source, "synth")["checkpoints"]
    assert [(r["step"], r["attempt"]) for r in rows] == [(10, 0), (20, 0), (30, 0), (40, 0), (40, 1), (50, 1), (60, 1)]
    first = rows[0]
    assert (first["num_shards"], first["size"], first["write_s"], first["verified"], first["path"]) == (
        4, "4.0 MiB", 0.3, "✓", "/ck/10")


def test_checkpoint_chart_puts_two_attempts_side_by_side(page, db_source):
    fig = page.build(db_source, "synth")["checkpoint_figure"]
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["verified"]  # all seven were verified
    b = bars[0]
    at40 = [(o, w) for x, o, w in zip(b.x, b.offset, b.width) if x == 40]
    assert len(at40) == 2 and at40[0][0] + at40[0][1] <= at40[1][0] + 1e-9  # side by side, not on top
    assert max(b.y) == pytest.approx(0.8)
    assert fig.layout.yaxis.title.text == "write time (s)" and fig.layout.xaxis.title.text == "step"
    assert any("straggler" in (a.text or "") for a in fig.layout.annotations)  # the incidents are marked
    assert any("attempt 1" in (a.text or "") for a in fig.layout.annotations)  # and the rollback


def test_unverified_checkpoint_is_red_and_empty_states(page):
    fig = page.checkpoint_figure([{"step": 10, "attempt": 0, "write_s": 1.0, "verified": False}], None)
    assert fig.data[0].name == "not verified" and fig.data[0].marker.color == page.UNVERIFIED_COLOR
    assert page.checkpoint_figure([], None).layout.annotations[0].text == "no checkpoints written yet"
    assert page.nodes_figure([]).layout.annotations[0].text == "no nodes reported yet"


def test_callback(page, db_source):
    nodes, nodes_fig, nodes_empty, ckpts, ckpt_fig, ckpt_empty, drawn = page._draw("synth", None, None)
    assert len(nodes) == 2 and len(ckpts) == 7 and nodes_empty == "" and ckpt_empty == ""
    assert drawn.startswith("synth|")
    assert page._draw("synth", 1, drawn) == (no_update,) * 7  # nothing changed: nothing redrawn
