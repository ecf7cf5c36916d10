"""Pre-flight checks (trainer/preflight.py, analysis/detectors/preflight.py): the rounds of pairs
find the node whose link is slow (its first partner cleared in the second round), the report of a
failed node opens one critical incident at step 0 naming it, and the policy isolates it. The checks
themselves, on real processes under torchrun, are in tests/integration/test_preflight.py."""

from __future__ import annotations

import json

from analysis import Analyzer, Frames
from analysis.detectors.preflight import verdicts
from analysis.frames import _frame
from analysis.policy import ISOLATE, Policy, RunPolicy
from analysis.rules import rules_from_dict
from trainer.preflight import bad_nodes, compute_ratios, first_pairs, second_pairs, slow_pairs


def test_round_one_pairs_neighbours_and_the_odd_one_out_after_them():
    assert first_pairs(["a", "b", "c", "d"]) == [[("a", "b"), ("c", "d")]]
    assert first_pairs(["a", "b", "c"]) == [[("a", "b")], [("c", "a")]]  # "a" is in one pair at a time
    assert first_pairs(["a", "b"]) == [[("a", "b")]] and first_pairs(["a"]) == []


def test_a_slow_pair_is_twice_the_median_pair_and_two_pairs_compare_with_the_faster():
    times = {("a", "b"): 0.010, ("c", "d"): 0.011, ("e", "f"): 0.031, ("g", "h"): 0.012}
    assert slow_pairs(times, 2.0) == {("e", "f")}
    assert slow_pairs({("a", "b"): 0.010, ("c", "d"): 0.08}, 2.0) == {("c", "d")}
    assert slow_pairs({("a", "b"): 0.010}, 2.0) == set()  # one pair: nothing to compare it with


def test_round_two_pairs_each_suspect_with_a_healthy_node_in_disjoint_sub_rounds():
    assert second_pairs(["c", "d"], ["a", "b"]) == [[("c", "a"), ("d", "b")]]
    assert second_pairs(["c", "d", "e"], ["a"]) == [[("c", "a")], [("d", "a")], [("e", "a")]]
    assert second_pairs(["c"], []) == []
    assert compute_ratios({"a": 1.0, "b": 1.0, "c": 3.0}) == {"a": 1.0, "b": 1.0, "c": 3.0}


REPORT = {"nodes": {
    "node0": {"ranks": [0], "matmul_s": 0.001, "compute_ratio": 1.0, "link_s": [0.015, 0.09], "link_ratio": 6.0,
              "suspect": False, "verdict": "ok"},
    "node1": {"ranks": [1], "matmul_s": 0.001, "compute_ratio": 1.0, "link_s": [0.015], "link_ratio": 1.0,
              "suspect": False, "verdict": "ok"},
    "node2": {"ranks": [2, 3], "matmul_s": 0.001, "compute_ratio": 0.95, "link_s": [0.07, 0.09],
              "link_ratio": 6.07, "suspect": True, "verdict": "slow_link"},
    "node3": {"ranks": [4], "matmul_s": 0.004, "compute_ratio": 4.1, "link_s": [0.07, 0.008], "link_ratio": 4.6,
              "suspect": True, "verdict": "slow_compute"}},
    "rounds": 2, "pairs": [[["node0", "node1", 0.015], ["node2", "node3", 0.07]],
                           [["node2", "node0", 0.09], ["node3", "node1", 0.008]]],
    "ratio": 2.0, "elapsed_s": 1.2, "shared_host": True}


def _events(*rows) -> Frames:
    return Frames(events=_frame("events", [{"run_id": "r", "rank": 0, "ts": 100.0, "step": 0, "kind": k,
                                             "data": d} for k, d in rows]))


def test_each_failed_node_opens_one_critical_incident_at_step_0():
    assert bad_nodes(REPORT) == {"node2": "slow_link", "node3": "slow_compute"}
    a = Analyzer()
    got = a.feed(_events(("run_started", "{}"), ("preflight", json.dumps(REPORT)), ("preflight", "not json")),
                 now=101.0)
    got += a.feed(_events(("preflight", json.dumps(REPORT))), now=102.0)  # the same report again: no new ones
    flagged = {f.node: f for f in got if f.kind == "preflight"}
    assert sorted(flagged) == ["node2", "node3"] and len([f for f in got if f.kind == "preflight"]) == 2
    link, compute = flagged["node2"], flagged["node3"]
    assert (link.rank, link.step_from, link.step_to, link.severity) == (2, 0, 0, "critical")
    assert link.evidence["verdict"] == "slow_link" and link.evidence["rounds"] == 2
    assert "slow_link" in link.root_cause and "6.07x the median pair" in link.root_cause
    assert "matmuls take 4.10x the median node's" in compute.root_cause and compute.rank == 4
    assert not [f for f in got if f.kind == "preflight" and f.resolved]


def test_the_collector_judges_the_reports_times_by_the_rules_ratio():
    """node2 re-paired at 6x the first round's reference, node3's matmuls at 4.1x: both fail at the
    default 2, neither at 8; at 5 only node2 (the check's own verdicts are not what counts)."""
    assert verdicts(REPORT, 2.0) == {"node2": "slow_link", "node3": "slow_compute"}
    assert verdicts(REPORT, 8.0) == {}
    assert verdicts(REPORT, 5.0) == {"node2": "slow_link"}
    strict = Analyzer(rules_from_dict({"preflight": {"ratio": 8.0}}))
    assert not [f for f in strict.feed(_events(("preflight", json.dumps(REPORT))), now=101.0) if f.kind == "preflight"]


def test_the_policy_isolates_a_node_that_failed_its_checks():
    inc = {"id": 3, "kind": "preflight", "status": "open", "step_from": 0, "rank": 2, "node": "node2",
           "evidence": {"verdict": "slow_link"}}
    st = RunPolicy(run_id="r", nodes=["node0", "node1", "node2", "node3"], spares=1)
    d = Policy(rules_from_dict({})).on_incident(st, inc, now=5.0)
    assert [(x.kind, x.node, x.refused) for x in d] == [(ISOLATE, "node2", None)]
    assert "failed its pre-flight checks (slow_link)" in d[0].reason
    off = RunPolicy(run_id="r", nodes=["node0", "node2"])
    assert Policy(rules_from_dict({"policy": {"isolate_on_preflight": False}})).on_incident(off, inc, now=5.0) == []
    alone = RunPolicy(run_id="r", nodes=["node2"])  # min_nodes: the last node stays
    assert [x.refused is not None for x in Policy(rules_from_dict({})).on_incident(alone, inc, now=5.0)] == [True]
