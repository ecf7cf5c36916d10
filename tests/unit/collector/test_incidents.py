"""Incidents: one per cause, opened, updated and closed from findings; the book
plans without changing and reloads what is open."""

from __future__ import annotations

from analysis.findings import RESOLVED, Finding
from collector.read import queries
from collector.store.incidents import OpenIncident, OpenIncidents, RecordFindings, UpdateIncident, default_key


def finding(kind: str, *, key: str | None = None, run_id: str = "r", resolved: bool = False, **kw) -> Finding:
    """The analysis's Finding; keyed "kind:rank:node" (a manual incident's key) unless given one."""
    key = key or default_key(kind, kw.get("rank"), kw.get("node"))
    return Finding(kind=kind, key=key, run_id=run_id, **({"status": RESOLVED} if resolved else {}), **kw)


def straggler(**kw) -> Finding:
    return finding("straggler", rank=3, node="n1", **kw)


def test_open_update_close_for_one_cause():
    book = OpenIncidents()
    plan = book.plan([RecordFindings("r", (straggler(step_from=10, evidence={"ratio": 1.4}),))], now=5.0,
                     next_id=7)
    assert plan.results == [[7]] and plan.next_id == 8 and plan.updates == []
    (row,) = plan.inserts
    assert (row["id"], row["status"], row["step_from"], row["step_to"], row["opened_ts"]) == (7, "open", 10, 10, 5.0)
    assert book.open_for(("r", default_key("straggler", 3, "n1"))) is None  # a plan changes nothing
    book.apply(plan)
    assert book.open_for(("r", "straggler:3:n1")).id == 7
    plan = book.plan([RecordFindings("r", (straggler(step_from=12, step_to=15, severity="critical",
                                                     evidence={"ratio": 1.6}),))], now=6.0, next_id=8)
    assert plan.inserts == [] and plan.results == [[7]]
    assert plan.updates == [(7, {"severity": "critical", "rank": 3, "node": "n1", "step_from": 10, "step_to": 15,
                                 "updated_ts": 6.0, "evidence": {"ratio": 1.6}, "confidence": 0.5})]
    book.apply(plan)
    plan = book.plan([RecordFindings("r", (straggler(resolved=True, ts=6.5),))], now=7.0, next_id=8)
    assert plan.updates == [(7, {"status": "closed", "closed_ts": 6.5, "updated_ts": 7.0})]
    book.apply(plan)
    assert book.open_for(("r", "straggler:3:n1")) is None
    # the same cause again: a new incident; closing what is not open: nothing
    plan = book.plan([RecordFindings("r", (straggler(step_from=40),)),
                      RecordFindings("r", (finding("hang", resolved=True),))], now=8.0, next_id=8)
    assert plan.results == [[8], [None]] and len(plan.inserts) == 1


def test_findings_of_one_plan_see_each_other():
    book = OpenIncidents()
    plan = book.plan([RecordFindings("r", (finding("nan", key="nan#1", step_from=5),
                                           finding("nan", key="nan#1", step_from=5, step_to=6),
                                           finding("nan", key="nan#2", step_from=9))),
                      RecordFindings("other", (finding("nan", key="nan#1", step_from=1),))],
                     now=1.0, next_id=1)
    assert plan.results == [[1, 1, 2], [3]]
    assert [r["id"] for r in plan.inserts] == [1, 2, 3]
    assert plan.updates == [(1, {"severity": "warning", "rank": None, "node": None, "step_from": 5, "step_to": 6,
                                 "updated_ts": 1.0, "confidence": 0.5})]  # no evidence or root cause given: kept
    book.apply(plan)
    assert book.open_for(("r", "nan#1")).step_to == 6 and book.open_for(("other", "nan#1")).id == 3


def test_manual_open_and_close_keep_the_book_true():
    book = OpenIncidents()
    plan = book.plan([OpenIncident("r", {"kind": "crash", "severity": "critical", "rank": 2})], now=1.0, next_id=4)
    assert plan.results == [4]
    book.apply(plan)
    found = book.plan([RecordFindings("r", (finding("crash", rank=2),))], now=2.0, next_id=5)
    assert found.results == [[4]]  # a detector's finding for the same cause updates the manual incident
    plan = book.plan([UpdateIncident(4, {"status": "closed"})], now=3.0, next_id=5)
    assert plan.updates == [(4, {"status": "closed", "updated_ts": 3.0, "closed_ts": 3.0})]
    book.apply(plan)
    assert book.open_for(("r", "crash:2:-")) is None


def test_the_book_reloads_open_incidents(storage):
    ids = storage.record_findings("run1", [finding("hang", rank=1, step_from=3),
                                           finding("crash", rank=0)]).result(10)
    storage.record_findings("run1", [finding("crash", rank=0, resolved=True)]).result(10)
    with storage.cursor() as cur:
        book = OpenIncidents.load(cur)
    assert book.open_for(("run1", "hang:1:-")).id == ids[0]
    assert book.open_for(("run1", "crash:0:-")) is None


def test_through_storage_rows_follow_the_findings(storage):
    first = storage.record_findings("run1", [finding("loss_spike", key="spike#1", step_from=20, rank=1,
                                                     evidence={"z": 9.5}, root_cause="data", ts=50.0)]).result(10)
    again = storage.record_findings("run1", [finding("loss_spike", key="spike#1", step_from=21,
                                                     rank=1, confidence=0.8)]).result(10)
    assert first == again
    (inc,) = storage.read(queries.incidents, "run1")
    assert (inc["id"], inc["status"], inc["step_from"], inc["step_to"], inc["evidence"], inc["root_cause"],
            inc["confidence"], inc["opened_ts"]) == (first[0], "open", 20, 21, {"z": 9.5}, "data", 0.8, 50.0)
    assert storage.read(queries.open_incidents) == {"run1": 1}
    storage.record_findings("run1", [finding("loss_spike", key="spike#1", rank=1, resolved=True,
                                             ts=60.0)]).result(10)
    (inc,) = storage.read(queries.incidents, "run1")
    assert (inc["status"], inc["closed_ts"]) == ("closed", 60.0)
    assert storage.read(queries.open_incidents) == {}


def test_a_restarted_collector_matches_a_keyed_cause_to_its_open_incident(settings):
    """The detector's own key is stored: after a restart the same cause updates the
    open incident instead of opening a second one."""
    from collector.storage import Storage

    s = Storage(settings)
    try:
        (iid,) = s.record_findings("run1", [straggler(key="straggler:n1#1", step_from=40, step_to=45)]).result(10)
    finally:
        s.close()
    s = Storage(settings)
    try:
        assert s.record_findings("run1", [straggler(key="straggler:n1#1", step_from=46, step_to=50)]).result(10) == [iid]
        (row,) = s.read(queries.incidents, "run1")
        assert (row["id"], row["cause_key"], row["step_from"], row["step_to"]) == (iid, "straggler:n1#1", 40, 50)
    finally:
        s.close()


def test_an_update_carries_the_newest_culprit(storage):
    """A slow rank that turns out to be a slow node: the row names the node, no rank."""
    (iid,) = storage.record_findings("run1", [straggler(key="straggler:n1#1", step_from=40)]).result(10)
    storage.record_findings("run1", [finding("straggler", key="straggler:n1#1", rank=None, node="n1",
                                             step_from=40, step_to=48)]).result(10)
    (row,) = storage.read(queries.incidents, "run1")
    assert (row["id"], row["rank"], row["node"], row["step_to"]) == (iid, None, "n1", 48)
