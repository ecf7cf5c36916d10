"""The Fleet page (dashboard/pages/fleet.py) over a file of many runs and its archive: the grid
has a column per run and a row per node, the slow node on top with its faults, ✕ where a node was
isolated; each run's goodput; the nodes' records with the flagged one marked; an empty window
says so."""

from __future__ import annotations

import time

import pytest

from collector.offline.archive import archive
from dashboard.source import DbSource
from tests.fleet_runs import fleet_file, runs_file

DAY = 86400.0


@pytest.fixture(scope="module")
def page():
    from dashboard.pages import fleet

    return fleet


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """8 runs of 4 of 6 nodes in the file (node2 slow and a straggler in each of its runs, every
    third run rolled back), and two archived runs where node5 was isolated after a hang."""
    d = tmp_path_factory.mktemp("fleetpage")
    now = time.time()
    path = fleet_file(d / "fleet.duckdb", num_runs=8, t0=now - 3 * DAY, steps=30)
    archive(runs_file(d / "old.duckdb", [("old1", now - 5 * DAY, {"node5": ["hang"]}, ("node5",)),
                                         ("old2", now - 4 * DAY, {"node5": ["crash"]})]), d / "archive")
    src = DbSource(path, archive_dir=d / "archive")
    yield src
    src.close()


def test_the_grid_has_every_run_and_node_worst_first(page, source):
    out = page.build(source, None)
    grid = out["grid"]
    heat = grid.data[0]
    assert list(heat.x)[:2] == ["old1", "old2"] and len(heat.x) == 10  # oldest first: the archive's, then the file's
    # by fault runs: node2 (6 of 6), node5 (2: the archive's), node1 and node3 (a hang each), the clean ones
    assert list(heat.y) == ["node2", "node5", "node1", "node3", "node0", "node4"]
    z = {(heat.y[i], heat.x[j]): heat.z[i][j] for i in range(len(heat.y)) for j in range(len(heat.x))}
    assert z[("node5", "old1")] == 1.0 and z[("node5", "run000")] is None  # run000 ran on node0-node3
    assert z[("node2", "run000")] == 1.0 and z[("node0", "run000")] == 0.0
    isolated = grid.data[1]
    assert list(zip(isolated.x, isolated.y)) == [("old1", "node5")] and list(isolated.text) == ["✕"]
    goodput = out["goodput"].data[0]
    assert len(goodput.x) == 8 and all(0 < y <= 100 for y in goodput.y)  # the file's runs have steps
    assert min(goodput.y) < 90  # a rolled-back run
    rows = {r["node"]: r for r in out["nodes"]}
    assert [n for n, r in rows.items() if r["flag"] == "!"] == ["node2", "node5"]
    assert rows["node2"]["kinds"] == "straggler 6" and rows["node5"]["kinds"] == "crash 1, hang 1, isolated 1"
    assert rows["node5"]["last"].endswith("crash in old2") and rows["node0"]["last"] == "–"
    assert "2 flagged" in out["summary"] and "in 10 run(s)" in out["summary"]


def test_an_empty_window_says_so(page, source):
    out = page.build(source, 60.0)  # the last minute: nothing ran
    assert out["nodes"] == [] and "no runs in this window" in out["grid"].layout.annotations[0].text
    assert "no goodput" in out["goodput"].layout.annotations[0].text
