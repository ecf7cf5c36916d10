"""Actions and verdicts judged against injected faults (analysis/judging.py)."""

from analysis.judging import Expected, expected, judge, summary, verdict_of
from analysis.scoring import Truth, truths_from_rows


def truth(kind: str, *, mode: str | None = None, node: str | None = "1", step: int = 30, ts: float = 0.0) -> Truth:
    return Truth(kind=kind, rank=1, node=node, step=step, ts=ts, mode=mode)


def test_each_fault_has_its_expected_outcome():
    assert expected(truth("nan", mode="data"), mode="data").actions == ("rollback",)
    assert expected(truth("nan", mode="transient"), mode="transient").verdict == "transient"
    dev = expected(truth("nan", mode="device"), mode="device")
    assert dev.actions == ("rollback", "isolate") and dev.isolate_node == "1" and dev.verdict == "device"
    assert expected(truth("spike", node=None), mode=None).verdict == "data"
    assert expected(truth("hang"), mode=None).actions == ("isolate",)
    assert expected(truth("crash"), mode=None, crash_number=1).actions == ("restart",)
    assert expected(truth("crash"), mode=None, crash_number=2).actions == ("isolate",)
    assert expected(truth("overflow"), mode=None).actions == ()


def test_would_and_did_are_judged_separately():
    dev, strag, crash1, crash2 = (truth("nan", mode="device", ts=1.0), truth("straggler", ts=2.0),
                                  truth("crash", ts=3.0), truth("crash", ts=4.0))
    js = judge([crash2, dev, strag, crash1], {dev: "device"},
               replay_match={dev: "k1", strag: "k2", crash1: "k3", crash2: "k4"},
               replay_decisions={"k1": ["rollback"], "k2": [], "k3": ["restart"], "k4": ["isolate"]},
               live_match={dev: {"id": 7, "root_cause": "device: it stayed"}, strag: {"id": 8, "root_cause": "slow"}},
               live_actions={7: [{"kind": "rollback", "status": "done"},
                                 {"kind": "isolate", "status": "done", "node": "node1"}],
                             8: [{"kind": "isolate", "status": "done", "node": "node2"}]})
    by = {(j.truth.kind, j.truth.ts): j for j in js}
    assert [j.truth.ts for j in js] == [1.0, 2.0, 3.0, 4.0]  # in the order they happened
    d = by[("nan", 1.0)]
    assert d.would_right and d.did_right and d.verdict == "device"
    s = by[("straggler", 2.0)]
    assert s.would_right is False  # the replayed straggler did not persist long enough
    assert s.did_right is False  # the live isolate named another node
    assert by[("crash", 3.0)].expected.actions == ("restart",) and by[("crash", 4.0)].would_right
    assert by[("crash", 3.0)].did_right is None  # nothing live to judge
    assert summary(js) == {"faults": 4, "would_right": 3, "would_judged": 4, "did_right": 1, "did_judged": 2}


def test_a_stragglers_rebalance_on_its_node_stands_in_for_its_isolation():
    """The cost model chooses between moving micro-batches off the straggler's replica and taking
    its node out: either is right when it names the straggler's node; a rebalance elsewhere is not."""
    s = truth("straggler", node="node1")
    assert expected(s, mode=None).instead == ("rebalance",)
    right, wrong = (judge([s], {}, replay_match={s: "k"}, replay_decisions={"k": ["rebalance"]},
                          live_match={s: {"id": 3}},
                          live_actions={3: [{"kind": "rebalance", "status": "done", "node": node},
                                            {"kind": "rebalance", "status": "done", "node": node}]})[0]
                    for node in ("node1", "node0"))
    assert right.would_right and right.did_right
    assert wrong.did_right is False
    assert expected(truth("hang"), mode=None).instead == ()  # a hang's node must go


def test_a_wrong_verdict_makes_the_action_wrong():
    t = truth("nan", mode="data")
    [j] = judge([t], {t: "data"}, replay_match={}, replay_decisions={}, live_match={t: {"id": 1, "root_cause":
                                                                                        "transient: gone"}},
                live_actions={1: [{"kind": "rollback", "status": "done"}]})
    assert j.verdict == "transient" and j.did_right is False
    assert verdict_of("data: followed") == "data" and verdict_of("non-finite first in rank 1") is None


def test_the_rerun_that_diagnoses_is_not_a_fault_and_a_device_fault_is_one_fault():
    rows = [{"kind": "nan", "rank": 1, "node": 1, "step": 30, "attempt": 0, "mode": "data"},
            {"kind": "nan", "rank": 0, "node": 0, "step": 30, "attempt": 1, "mode": "data", "replay": True,
             "probe": True},
            {"kind": "nan", "rank": 2, "node": 2, "step": 40, "attempt": 0, "mode": "device"},
            {"kind": "nan", "rank": 2, "node": 2, "step": 35, "attempt": 1, "mode": "device"}]
    truths = truths_from_rows(rows)
    assert [(t.rank, t.step, t.mode) for t in truths] == [(1, 30, "data"), (2, 40, "device")]


# a replica_divergence incident's evidence (analysis/detectors/replica_divergence.py), checksums every 10 steps
DP3_IN_TIME = {"shard": "pp0-tp0", "dp": 3, "majority": True, "divergent_ranks": [2], "healthy_ranks": [0, 1],
               "src_dp": 0, "last_agreeing_step": 20, "first_disagreeing_step": 30, "caught_within_steps": 10,
               "checksum_every": 10}
DP2 = {"shard": "pp0-tp0", "dp": 2, "majority": False, "divergent_ranks": [0, 1], "healthy_ranks": [],
       "src_dp": None, "last_agreeing_step": 50, "first_disagreeing_step": 60, "caught_within_steps": 10,
       "checksum_every": 10}
# a checksum lost: the first disagreeing one came 20 steps after the last agreeing one
DP3_LATE = {**DP3_IN_TIME, "last_agreeing_step": 10, "caught_within_steps": 20}


def test_a_bitflip_caught_in_time_with_a_majority_is_repaired_in_place():
    t = truth("bitflip", node="node2")
    assert expected(t, mode=None, evidence=DP3_IN_TIME).actions == ("repair",)
    [j] = judge([t], {}, replay_match={t: "k"}, replay_decisions={"k": ["repair"]},
                live_match={t: {"id": 4, "root_cause": "silent data corruption"}},
                live_actions={4: [{"kind": "repair", "status": "done", "node": "node2"}]},
                evidence={t: DP3_IN_TIME})
    assert j.expected.actions == ("repair",) and j.would_right is True and j.did_right is True


def test_a_bitflip_without_a_majority_is_rolled_back_and_a_repair_is_wrong():
    t = truth("bitflip", node="node0")
    assert expected(t, mode=None, evidence=DP2).actions == ("rollback",)
    [right] = judge([t], {}, replay_match={t: "k"}, replay_decisions={"k": ["rollback"]},
                    live_match={t: {"id": 5, "root_cause": "silent data corruption"}},
                    live_actions={5: [{"kind": "rollback", "status": "done"}]}, evidence={t: DP2})
    assert right.expected.actions == ("rollback",) and right.would_right is True and right.did_right is True
    [wrong] = judge([t], {}, replay_match={t: "k"}, replay_decisions={"k": ["repair"]},
                    live_match={t: {"id": 5, "root_cause": "silent data corruption"}},
                    live_actions={5: [{"kind": "repair", "status": "done"}]}, evidence={t: DP2})
    assert wrong.would_right is False and wrong.did_right is False
    # the counts decide, not only the flag: 2 of 4 replicas differing leave no majority
    assert expected(t, mode=None, evidence={**DP3_IN_TIME, "dp": 4, "divergent_ranks": [2, 3]}).actions == (
        "rollback",)


def test_a_bitflip_caught_late_or_unmatched_is_rolled_back():
    t = truth("bitflip")
    assert expected(t, mode=None, evidence=DP3_LATE).actions == ("rollback",)
    # before the shard's first compared checksum: neither the catch nor the interval is known
    assert expected(t, mode=None, evidence={**DP3_IN_TIME, "caught_within_steps": None,
                                            "checksum_every": None}).actions == ("rollback",)
    [j] = judge([t], {}, replay_match={t: "k"}, replay_decisions={"k": ["repair"]}, live_match={},
                live_actions={}, evidence={t: DP3_LATE})
    assert j.expected.actions == ("rollback",) and j.would_right is False and j.did_right is None
    [lost] = judge([t], {}, replay_match={}, replay_decisions={}, live_match={}, live_actions={})
    assert lost.matched is False and lost.expected.actions == ("rollback",) and lost.would_right is False


def devhealth(what: str, node: str = "node1") -> Truth:
    return Truth(kind="devhealth", rank=1, node=node, step=60, ts=0.0, what=what)


def test_a_device_health_fault_is_judged_by_what_failed():
    ecc, memory, thermal = devhealth("ecc"), devhealth("memory"), devhealth("thermal")
    assert expected(ecc, mode=None) == Expected(("isolate",), None, "node1")
    assert expected(memory, mode=None) == Expected(("checkpoint",))
    assert expected(thermal, mode=None) == Expected(())
    js = judge([ecc, memory, thermal], {}, replay_match={ecc: "k1", memory: "k2", thermal: "k3"},
               replay_decisions={"k1": ["isolate"], "k2": ["checkpoint"], "k3": []},
               live_match={ecc: {"id": 1, "root_cause": "ecc"}, memory: {"id": 2, "root_cause": "memory"},
                           thermal: {"id": 3, "root_cause": "hot"}},
               live_actions={1: [{"kind": "isolate", "status": "done", "node": "node1"}],
                             2: [{"kind": "checkpoint", "status": "done", "node": "node1"}], 3: []})
    assert [(j.truth.what, j.would_right, j.did_right) for j in js] == [
        ("ecc", True, True), ("memory", True, True), ("thermal", True, True)]


def test_a_wrong_or_failed_device_health_action_is_wrong():
    ecc, memory, thermal = devhealth("ecc"), devhealth("memory"), devhealth("thermal")
    [other_node] = judge([ecc], {}, replay_match={}, replay_decisions={}, live_match={ecc: {"id": 1}},
                         live_actions={1: [{"kind": "isolate", "status": "done", "node": "node0"}]})
    assert other_node.did_right is False and other_node.would_right is False  # the replay matched nothing
    # a run without --ckpt-dir rejects the checkpoint: the action failed, the fault was not dealt with
    [rejected] = judge([memory], {}, replay_match={memory: "k"}, replay_decisions={"k": ["checkpoint"]},
                       live_match={memory: {"id": 2}},
                       live_actions={2: [{"kind": "checkpoint", "status": "failed", "node": "node1"}]})
    assert rejected.would_right is True and rejected.did_right is False
    [isolated] = judge([thermal], {}, replay_match={thermal: "k"}, replay_decisions={"k": ["isolate"]},
                       live_match={thermal: {"id": 3}},
                       live_actions={3: [{"kind": "isolate", "status": "done", "node": "node1"}]})
    assert isolated.would_right is False and isolated.did_right is False  # throttling is an alert only


def test_a_place_bound_slowdown_on_the_node_that_replaced_the_first_expects_a_stop():
    rows = [{"kind": "straggler", "rank": 1, "node": 1, "step": 52, "attempt": 0, "ts": 1.0, "factor": 8.0,
             "on": "place"},
            {"kind": "straggler", "rank": 1, "node": 2, "step": 80, "attempt": 1, "ts": 2.0, "factor": 8.0,
             "on": "place"}]
    first, second = truths_from_rows(rows)
    assert (first.on, second.on) == ("place", "place")
    js = judge([second, first], {}, replay_match={}, replay_decisions={},
               live_match={first: {"id": 1, "root_cause": None}, second: {"id": 2, "root_cause": None}},
               live_actions={1: [{"kind": "isolate", "status": "done", "node": "node1"}],
                             2: [{"kind": "stop", "status": "done", "node": "node2"}]})
    assert [(j.truth.node, j.expected.actions, j.did_right) for j in js] == [
        ("1", ("isolate",), True), ("2", ("stop",), True)]
    # a hardware-bound straggler on the replacing node is its own fault: isolate (or rebalance) it
    hw = truths_from_rows([{**rows[1], "on": None}])[0]
    assert expected(hw, mode=None).actions == ("isolate",)
