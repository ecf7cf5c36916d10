"""Actions and verdicts judged against injected faults (analysis/judging.py)."""

from analysis.judging import expected, judge, summary, verdict_of
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
