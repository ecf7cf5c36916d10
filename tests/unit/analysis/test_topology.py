"""Topology: ranks' coordinates and nodes from a run's meta rows, read again every pass until
every rank has reported (collector/live/detection.py) without parsing the same JSON again."""

from __future__ import annotations

import json

import polars as pl

from analysis.frames import Frames, nodes_frame, ranks_frame, runs_frame
from analysis.topology import Topology


def _meta(node_map: dict, nodes: dict[str, list[int]], ranks: list[tuple[int, str]] | None = None) -> Frames:
    f = Frames()
    f.runs = runs_frame([{"run_id": "r", "world_size": 8, "mesh": json.dumps({"dp": 4, "tp": 2}),
                          "node_map": json.dumps(node_map)}])
    f.nodes = nodes_frame([{"run_id": "r", "node": n, "ranks": json.dumps(rs)} for n, rs in nodes.items()])
    if ranks is not None:
        f.ranks = ranks_frame([{"run_id": "r", "rank": r, "node": n} for r, n in ranks])
    return f


def test_meta_read_again_gives_the_same_nodes_and_a_changed_row_is_applied():
    topo = Topology()
    node_map = {str(r): f"n{r // 4}" for r in range(6)}  # ranks 6 and 7 not in the map yet
    nodes = {"n0": [0, 1, 2, 3], "n1": [4, 5]}
    for _ in range(3):  # as a collector re-reads them
        topo.update(_meta(node_map, nodes))
        assert [topo.node_name(r) for r in range(8)] == ["n0"] * 4 + ["n1"] * 2 + [None, None]
        assert topo.coords(5) == {"dp": 2, "tp": 1, "pp": 0}
    # the rest arrive: a node's row grows, a new node appears; the map names what the rows do not
    node_map.update({"6": "n1", "7": "n9"})
    nodes["n1"] = [4, 5, 6]
    topo.update(_meta(node_map, nodes))
    assert [topo.node_name(r) for r in range(8)] == ["n0"] * 4 + ["n1"] * 3 + ["n9"]
    # a rank's own row moves it (a spare took its place), and a node's row read again, unchanged,
    # still claims its ranks after the ranks' rows, as every pass did
    topo.update(_meta(node_map, nodes, ranks=[(3, "spare0")]))
    assert topo.node_name(3) == "n0"
    nodes["n0"], nodes["spare0"] = [0, 1, 2], [3]
    topo.update(_meta(node_map, nodes, ranks=[(3, "spare0")]))
    assert topo.node_name(3) == "spare0"


def test_nodes_rows_with_lists_not_json_text_are_read():
    topo = Topology()
    f = Frames()
    f.nodes = pl.DataFrame({"run_id": ["r"], "node": ["a"], "ranks": [[0, 2]]})
    topo.update(f)
    topo.update(f)
    assert [topo.node_name(r) for r in range(3)] == ["a", None, "a"]
