"""Actions, node status and bad batches through the writer (collector/store/actions.py), and
the alerts actions send (collector/alerts/outbox.py): a real Storage on a tmp file."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import duckdb
import httpx
import pytest

from agent import wire
from collector.alerts import payloads
from collector.alerts.outbox import AlertOutbox
from collector.alerts.receivers import build_receivers
from collector.http.server import create_app
from collector.ingest.decode import decode
from collector.read import queries
from collector.settings import AlertSettings, Settings, WriterSettings
from collector.storage import Storage
from collector.store.actions import ActionPlan
from collector.store.incidents import IncidentPlan
from collector.store.projection import Group, Projection
from collector.store.schema import migrate
from tests.polling import wait_until
from tests.unit.collector.collector_batches import make_batch, steps_section
from tests.unit.collector.test_outbox import AM, HOOK, SECRET, FakeTransport, make_storage, outbox_rows


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def st(settings, clock) -> Iterator[Storage]:
    s = Storage(settings, clock=clock)
    yield s
    s.close()


def action(storage: Storage, aid: int) -> dict:
    (row,) = [a for run in ("run1", "run2") for a in storage.read(queries.actions, run) if a["id"] == aid]
    return row


class Held:
    """Holds the writer on a call of its own, so that what is submitted meanwhile
    commits as one group once released."""

    def __init__(self, storage: Storage) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self._fut = storage.write(lambda ctx: (self.started.set(), self.gate.wait(10.0)))
        assert self.started.wait(10.0)

    def release(self) -> None:
        self.gate.set()
        self._fut.result(10.0)


# -- rows ---------------------------------------------------------------------------------
def test_record_then_update_to_done_sets_finished_ts_once_terminal(st, clock):
    aid = st.record_action("run1", "rollback", "issued", incident_id=7, command_id=3, node="node1", rank=2,
                           detail={"reason": "loss spike at step 40", "to_step": 30}).result(10)
    a = action(st, aid)
    assert (a["run_id"], a["kind"], a["status"], a["mode"], a["dry_run"], a["incident_id"], a["command_id"],
            a["node"], a["rank"]) == ("run1", "rollback", "issued", "auto", False, 7, 3, "node1", 2)
    assert (a["requested_ts"], a["updated_ts"], a["finished_ts"]) == (1000.0, 1000.0, None)
    assert a["detail"] == {"reason": "loss spike at step 40", "to_step": 30}

    clock.t = 1010.0
    row = st.update_action(aid, status="acked", started_ts=1009.5).result(10)
    assert (row["status"], row["started_ts"], row["finished_ts"], row["updated_ts"]) == ("acked", 1009.5, None, 1010.0)
    clock.t = 1030.0
    st.update_action(aid, status="done", attempt=1, recovery_s=25.25, detail={"first_new_step": 31}).result(10)
    a = action(st, aid)
    assert (a["status"], a["attempt"], a["recovery_s"], a["finished_ts"], a["updated_ts"]) == (
        "done", 1, 25.25, 1030.0, 1030.0)
    assert (a["requested_ts"], a["started_ts"]) == (1000.0, 1009.5)  # untouched
    assert a["detail"] == {"reason": "loss spike at step 40", "to_step": 30, "first_new_step": 31}  # merged

    # a given finished_ts wins; finish_action (the older call) keeps the detail unless given one
    other = st.record_action("run1", "restart", "issued").result(10)
    st.update_action(other, status="failed", finished_ts=1020.0, detail={"error": "no checkpoint"}).result(10)
    b = action(st, other)
    assert (b["status"], b["finished_ts"], b["detail"]) == ("failed", 1020.0, {"error": "no checkpoint"})
    st.finish_action(other, "failed").result(10)
    st.update_action(other, detail=["not", "an", "object"]).result(10)  # replaces
    b = action(st, other)
    assert (b["finished_ts"], b["detail"]) == (1030.0, ["not", "an", "object"])


def test_shadow_and_refused_actions_are_finished_when_recorded(st):
    shadow = st.record_action("run1", "isolate", "shadow", mode="shadow", node="node1",
                              detail={"reason": "node1 is 1.6x slower"}).result(10)
    refused = st.record_action("run1", "rollback", "refused", incident_id=4,
                               detail={"guard": "cooldown", "reason": "last rollback 30 s ago"}).result(10)
    legacy = st.record_action("run1", "rollback", "running", dry_run=True).result(10)  # the older call
    s, r, old = action(st, shadow), action(st, refused), action(st, legacy)
    assert (s["mode"], s["dry_run"], s["command_id"], s["finished_ts"]) == ("shadow", True, None, s["requested_ts"])
    assert (r["mode"], r["dry_run"], r["finished_ts"], r["detail"]["guard"]) == (
        "auto", False, r["requested_ts"], "cooldown")
    assert (old["mode"], old["dry_run"], old["finished_ts"]) == ("shadow", True, None)
    assert [a["id"] for a in st.read(queries.actions, "run1")] == [shadow, refused, legacy]


def test_ids_continue_after_a_restart(settings):
    s = Storage(settings)
    try:
        first = s.record_action("run1", "rollback", "shadow", mode="shadow").result(10)
    finally:
        s.close()
    s = Storage(settings)
    try:
        assert s.record_action("run1", "rollback", "shadow", mode="shadow").result(10) == first + 1
    finally:
        s.close()


def test_node_status_upserts_and_isolated_ts_is_when_it_was_isolated(st, clock):
    run = {"run_id": "run1", "world_size": 4, "node_map": {"0": "node0", "1": "node0", "2": "node1", "3": "node1"}}
    st.ingest_blocking(decode(make_batch("run1", 0, 0, run=run, sections={wire.STEP: steps_section([1])})))
    assert st.set_node_status("run1", "node1", "suspect", "straggler", incident_id=5).result(10) is None
    clock.t = 1100.0
    st.set_node_status("run1", "node1", "isolated", "straggler for 20 steps", incident_id=5).result(10)
    clock.t = 1200.0
    st.set_node_status("run1", "node1", "isolated", "still slow", incident_id=6).result(10)  # isolated already
    st.set_node_status("run1", "node9", "isolated", "gone").result(10)  # a node the run never named
    nodes = {n["node"]: n for n in st.read(queries.nodes, "run1")}
    n1 = nodes["node1"]
    assert (n1["status"], n1["reason"], n1["ranks"], n1["isolated_ts"], n1["incident_id"], n1["updated_ts"]) == (
        "isolated", "still slow", [2, 3], 1100.0, 6, 1200.0)
    assert (nodes["node0"]["status"], nodes["node0"]["isolated_ts"]) == ("healthy", None)
    assert (nodes["node9"]["isolated_ts"], nodes["node9"]["ranks"]) == (1200.0, None)
    clock.t = 1300.0
    st.set_node_status("run1", "node1", "healthy", "back after restart").result(10)
    n1 = {n["node"]: n for n in st.read(queries.nodes, "run1")}["node1"]
    assert (n1["status"], n1["isolated_ts"], n1["incident_id"], n1["updated_ts"]) == ("healthy", 1100.0, None, 1300.0)


def test_bad_intents_are_answered_with_errors_and_the_rest_of_their_group_commits(st):
    held = Held(st)
    bad = [
        st.record_action("run1", "rollback", "running-ish"),
        st.record_action("run1", "rollback", "issued", mode="yolo"),
        st.record_action("run1", "Roll Back", "issued"),
        st.record_action("run1", "rollback", "issued", detail={"x": float("nan")}),
        st.record_action("run1", "rollback", "issued", rank=True),
        st.update_action(999, status="done"),
        st.update_action(1, colour="red"),
        st.update_action(1, recovery_s=float("inf")),
        st.update_action(1),
        st.set_node_status("run1", "node1", "on fire"),
        st._writer.submit_intent("actions", "not an intent"),
    ]
    good = st.record_action("run1", "rollback", "issued")
    update = st.update_action(1, status="acked")  # the action `good` creates, in the same group
    held.release()
    errors = []
    for f in bad:
        with pytest.raises((ValueError, KeyError, TypeError)) as e:
            f.result(10)
        errors.append(str(e.value))
    assert good.result(10) == 1 and update.result(10)["status"] == "acked"
    assert "running-ish" in errors[0] and "yolo" in errors[1] and "lowercase identifier" in errors[2]
    assert "JSON" in errors[3] and "rank" in errors[4] and "no action 999" in errors[5]
    assert "colour" in errors[6] and "recovery_s" in errors[7] and "on fire" in errors[9]
    assert [(a["id"], a["status"]) for a in st.read(queries.actions, "run1")] == [(1, "acked")]
    assert st.health() == (True, "")
    assert st.record_action("run1", "restart", "issued").result(10) == 2  # the writer goes on


# -- bad batches ------------------------------------------------------------------------
def skipped(epoch, lo, hi, step=40, **more) -> dict:
    return {"ts": 50.0 + lo, "step": step, "attempt": 1, "kind": "batch_skipped",
            "data": {"epoch": epoch, "sample_from": lo, "sample_to": hi, "incident_id": 3, "verdict": "data", **more}}


def test_bad_batches_from_batch_skipped_events_once_per_window(st):
    # every rank reports the same window; one also a second window; a malformed one stays an event only
    for rank in (0, 1):
        events = [skipped(0, 320, 352)] + ([skipped(1, 0, 32, step=None, step_hint=1)] if rank == 1 else [])
        st.ingest_blocking(decode(make_batch("run1", rank, 0, events=events)))
    body = make_batch("run1", 2, 0, events=[skipped(0, 320, 352),
                                            {"ts": 1.0, "kind": "batch_skipped", "data": {"epoch": "zero"}},
                                            {"ts": 2.0, "kind": "batch_skipped",
                                             "data": {"epoch": 0, "sample_from": 9, "sample_to": 3}}])
    st.ingest_blocking(decode(body))
    assert st.ingest_blocking(decode(body)).duplicate  # a batch sent twice adds nothing
    st.ingest_blocking(decode(make_batch("run2", 0, 0, events=[skipped(0, 320, 352)])))  # another run's
    assert st.read(queries.bad_batches, "run1") == [
        {"run_id": "run1", "epoch": 0, "sample_from": 320, "sample_to": 352, "step": 40, "incident_id": 3,
         "verdict": "data", "ts": 370.0},
        {"run_id": "run1", "epoch": 1, "sample_from": 0, "sample_to": 32, "step": None, "incident_id": 3,
         "verdict": "data", "ts": 50.0}]
    assert len(st.read(queries.bad_batches, "run2")) == 1
    assert len(st.read(queries.events, "run1", kind="batch_skipped")) == 6
    ok, anonymous = asyncio.run(get(create_app(st, close_storage=False), "/v1/runs/run1/bad_batches"))
    assert ok.status_code == 200 and ok.json() == st.read(queries.bad_batches, "run1")
    assert anonymous.status_code == 401  # the read role, as every query route


async def get(app, path: str) -> tuple[httpx.Response, httpx.Response]:
    """`path` with the fixture's token (settings: "tok") and without one."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://collector") as client:
        return (await client.get(path, headers={"Authorization": "Bearer tok"}), await client.get(path))


# -- alerts -------------------------------------------------------------------------------
def test_actions_alert_once_when_recorded_and_once_more_when_done_or_failed(tmp_path):
    t = FakeTransport()
    s = make_storage(tmp_path, t, webhooks=(HOOK,), alertmanagers=(AM,), external_url="http://collector:8428")
    try:
        iid = s.open_incident("run1", "loss_spike", "critical", rank=2, step_from=40).result(10)
        aid = s.record_action("run1", "rollback", "issued", incident_id=iid, command_id=5, rank=2,
                              detail={"reason": "loss spike at step 40", "to_step": 30}).result(10)
        s.update_action(aid, status="acked", started_ts=1.0).result(10)  # no alert
        s.update_action(aid, status="done", attempt=1, recovery_s=12.5).result(10)
        s.update_action(aid, recovery_s=13.0).result(10)  # done already: no alert
        refused = s.record_action("run1", "isolate", "refused", incident_id=iid, node="node1",
                                  detail={"guard": "min_nodes", "reason": "only 2 nodes left"}).result(10)
        shadow = s.record_action("run1", "restart", "shadow", mode="shadow").result(10)
        assert wait_until(lambda: len(t.calls) == 10 and all(r["status"] == "delivered" for r in outbox_rows(s)))
        rows = [r for r in outbox_rows(s) if r["kind"] == "action"]
    finally:
        s.close()
    assert [(r["receiver"], r["action_id"], r["incident_id"]) for r in rows] == [
        ("webhook:1", aid, iid), ("alertmanager:1", aid, iid), ("webhook:1", aid, iid), ("alertmanager:1", aid, iid),
        ("webhook:1", refused, iid), ("alertmanager:1", refused, iid),
        ("webhook:1", shadow, None), ("alertmanager:1", shadow, None)]
    hooks = [r for r in rows if r["receiver"] == "webhook:1"]
    sent = {b: h for _, b, h in t.calls}
    for r in hooks:  # signed, the stored bytes, a delivery id to dedupe on
        assert payloads.verify(r["body"], sent[r["body"]][payloads.SIGNATURE_HEADER], SECRET.encode())
        p = json.loads(r["body"])
        assert p["llmwatch"] == {"sent_ts": r["created_ts"], "delivery_id": r["id"]} and p["status"] == "firing"
        (a,) = p["alerts"]
        assert json.loads(r["labels"]) == a["labels"]
        assert a["endsAt"] == payloads.rfc3339(r["created_ts"] + 300.0)
        assert a["generatorURL"] == "http://collector:8428/v1/runs/run1/actions"
    issued, done, ref, sh = (json.loads(r["body"])["alerts"][0] for r in hooks)
    assert issued["labels"] == {"alertname": "llmwatch_action", "run_id": "run1", "action": "rollback",
                                "status": "issued", "mode": "auto", "severity": "info", "action_id": str(aid),
                                "incident_id": str(iid), "rank": "2"}
    assert issued["annotations"]["summary"] == (f"rollback in run run1 (rank 2, incident {iid}): issued (command 5)"
                                                "; loss spike at step 40")
    assert json.loads(issued["annotations"]["detail"]) == {"reason": "loss spike at step 40", "to_step": 30}
    assert (done["labels"]["status"], done["annotations"]["recovery_s"]) == ("done", "12.500")
    assert done["fingerprint"] != issued["fingerprint"]
    assert (ref["labels"]["severity"], ref["labels"]["node"]) == ("warning", "node1")
    assert "refused by a guard rail; only 2 nodes left" in ref["annotations"]["summary"]
    assert json.loads(ref["annotations"]["detail"])["guard"] == "min_nodes"
    assert (sh["labels"]["mode"], sh["labels"]["status"], sh["labels"]["severity"]) == ("shadow", "shadow", "info")
    # Alertmanager: no signature, a one-off event that ends by itself a few minutes later
    am = [r for r in rows if r["receiver"] == "alertmanager:1"]
    (posted,) = json.loads(am[0]["body"])
    assert payloads.SIGNATURE_HEADER not in sent[am[0]["body"]]
    assert posted["labels"] == issued["labels"] and posted["endsAt"] == payloads.rfc3339(am[0]["created_ts"] + 300.0)


class FailsWithActions(Projection):
    """A later projection whose write fails whenever the group holds action intents."""

    name = "fails"

    def plan(self, group):
        return bool(group.intents.get("actions"))

    def write(self, con, plan, group):
        if plan:
            raise RuntimeError("disk on fire")


def test_no_action_and_no_alert_survive_a_rolled_back_transaction(tmp_path):
    t = FakeTransport()
    s = Settings(db_path=tmp_path / "t.duckdb", token="tok-0123456789abcdef", writer=WriterSettings(linger_s=0.0),
                 alerts=AlertSettings(webhooks=(HOOK,), webhook_secret=SECRET))
    storage = Storage(s, alert_transport=t, extra_projections=[FailsWithActions()])
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            storage.record_action("run1", "rollback", "issued").result(10)
        assert storage.read(queries.actions, "run1") == [] and outbox_rows(storage) == []
        storage.open_incident("run1", "hang", "critical").result(10)  # the writer goes on; ids were not taken
        assert [r["id"] for r in outbox_rows(storage)] == [1]
    finally:
        storage.close()


def test_an_incident_and_an_action_alerting_in_one_group_get_distinct_delivery_ids(tmp_path):
    con = duckdb.connect(str(tmp_path / "o.duckdb"))
    migrate(con)
    box = AlertOutbox(con, receivers=build_receivers(webhooks=[HOOK], alertmanagers=[AM], webhook_secret=SECRET))
    group = Group(now=1000.0)
    incident = {"id": 1, "run_id": "run1", "kind": "hang", "severity": "critical", "status": "open",
                "opened_ts": 1000.0}
    inc_plan = box.plan_incidents(IncidentPlan(inserts=[incident]), group)
    act = {"id": 1, "run_id": "run1", "kind": "rollback", "status": "issued", "mode": "auto", "incident_id": 1}
    act_plan = box.plan_actions(ActionPlan(changes=[(None, act)]), group)
    assert [r["id"] for r in inc_plan.rows] == [1, 2] and [r["id"] for r in act_plan.rows] == [3, 4]
    assert json.loads(act_plan.rows[0]["body"])["llmwatch"]["delivery_id"] == 3
    box.write_incidents(con, inc_plan, group)
    box.write_actions(con, act_plan, group)
    box.apply_incidents(inc_plan, group)
    box.apply_actions(act_plan, group)
    box.apply(None, group)
    assert box.plan_actions(ActionPlan(changes=[(None, act)]), Group(now=1001.0)).next_id == 7  # the next group
    con.close()
