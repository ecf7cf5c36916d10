"""The alert outbox: rows written with the incident change they report, and a
sender that retries with backoff until a receiver takes them (fake transports,
injected clocks)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from analysis.findings import RESOLVED, Finding
from collector.alerts import delivery, payloads, receivers
from collector.alerts.delivery import Delivery, DeliveryResult, Lane, RetryPolicy
from collector.alerts.receivers import build_receivers
from collector.read import queries
from collector.settings import AlertSettings, Settings, WriterSettings
from collector.storage import Storage
from collector.store.projection import Projection
from tests.polling import wait_until

SECRET = "hook-secret-0123456789abcdef"
HOOK = "http://alice:pa55word@127.0.0.1:9/hooks/T0K3N?key=qu3ry"
AM = "http://127.0.0.1:9"


class FakeTransport:
    """Records every POST; answers `statuses` in turn (an exception is raised), then 200."""

    def __init__(self, *statuses) -> None:
        self.statuses = list(statuses)
        self.calls: list[tuple[str, bytes, dict]] = []
        self.lock = threading.Lock()

    def __call__(self, url, body, headers, timeout_s):
        with self.lock:
            self.calls.append((url, body, dict(headers)))
            answer = self.statuses.pop(0) if self.statuses else 200
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def bodies(self, url_part: str) -> list[dict | list]:
        with self.lock:
            return [json.loads(b) for u, b, _ in self.calls if url_part in u]


def make_storage(tmp_path, transport, **alerts) -> Storage:
    s = Settings(db_path=tmp_path / "t.duckdb", token="tok-0123456789abcdef", writer=WriterSettings(linger_s=0.0),
                 alerts=AlertSettings(webhook_secret=SECRET, **alerts))
    return Storage(s, alert_transport=transport)


def outbox_rows(storage) -> list[dict]:
    with storage.cursor() as cur:
        c = cur.execute("SELECT * FROM alert_outbox ORDER BY id")
        names = [d[0] for d in c.description]
        return [dict(zip(names, r)) for r in c.fetchall()]


def finding(*, resolved: bool = False, **kw) -> Finding:
    return Finding(**{"kind": "straggler", "key": "straggler:node1#1", "run_id": "run1", "rank": 3, "node": "node1",
                      "step_from": 40, "evidence": {"ratio": 1.5}, **({"status": RESOLVED} if resolved else {}), **kw})


# -- rows in the incident's transaction -------------------------------------------------
def test_an_opened_incident_is_one_signed_alert_per_receiver_delivered_at_once(tmp_path):
    t = FakeTransport()
    st = make_storage(tmp_path, t, webhooks=(HOOK, "https://example.org/b"), alertmanagers=(AM,),
                      external_url="http://collector:8428")
    try:
        (iid,) = st.record_findings("run1", [finding()]).result(5)
        assert wait_until(lambda: all(r["status"] == "delivered" for r in outbox_rows(st)) and len(t.calls) == 3)
        rows = outbox_rows(st)
    finally:
        st.close()
    assert [(r["receiver"], r["kind"], r["incident_id"], r["attempts"]) for r in rows] == [
        ("webhook:1", "firing", iid, 1), ("webhook:2", "firing", iid, 1), ("alertmanager:1", "firing", iid, 1)]
    assert all(HOOK not in json.dumps(r, default=str) and "T0K3N" not in str(r) for r in rows)
    by_url = {u: (b, h) for u, b, h in t.calls}
    # webhook 1: userinfo became Basic auth, the path and query kept, the body signed and as stored
    body, headers = by_url["http://127.0.0.1:9/hooks/T0K3N?key=qu3ry"]
    assert body == rows[0]["body"]
    assert payloads.verify(body, headers[payloads.SIGNATURE_HEADER], SECRET.encode())
    assert headers["Authorization"].startswith("Basic ")
    p = json.loads(body)
    assert p["status"] == "firing" and p["version"] == "4" and p["externalURL"] == "http://collector:8428"
    assert p["llmwatch"] == {"sent_ts": rows[0]["created_ts"], "delivery_id": rows[0]["id"]}
    (a,) = p["alerts"]
    assert a["labels"] == {"alertname": "llmwatch_straggler", "run_id": "run1", "kind": "straggler",
                           "severity": "warning", "rank": "3", "node": "node1", "incident_id": str(iid)}
    assert json.loads(rows[0]["labels"]) == a["labels"]
    # Alertmanager: its API path, no signature, a firing alert held (endsAt) rather than left to time out
    am_body, am_headers = by_url["http://127.0.0.1:9/api/v2/alerts"]
    (posted,) = json.loads(am_body)
    assert payloads.SIGNATURE_HEADER not in am_headers and posted["labels"] == a["labels"]
    assert posted["endsAt"] > posted["startsAt"]


class FailsWithIncidents(Projection):
    """A later projection whose write fails whenever the group holds incident intents."""

    name = "fails"

    def plan(self, group):
        return bool(group.intents.get("incidents"))

    def write(self, con, plan, group):
        if plan:
            raise RuntimeError("disk on fire")


def test_no_alert_row_survives_a_rolled_back_incident(tmp_path):
    s = Settings(db_path=tmp_path / "t.duckdb", token="tok-0123456789abcdef", writer=WriterSettings(linger_s=0.0),
                 alerts=AlertSettings(webhooks=(HOOK,), webhook_secret=SECRET))
    t = FakeTransport()
    st = Storage(s, alert_transport=t, extra_projections=[FailsWithIncidents()])
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            st.record_findings("run1", [finding()]).result(5)
        assert outbox_rows(st) == [] and st.read(queries.incidents, "run1") == []
    finally:
        st.close()
    assert t.calls == []


def test_severity_rise_realerts_other_updates_do_not_and_the_close_repeats_the_fired_labels(tmp_path):
    t = FakeTransport()
    st = make_storage(tmp_path, t, webhooks=(HOOK,))
    try:
        st.record_findings("run1", [finding()]).result(5)
        st.record_findings("run1", [finding(step_to=45, rank=2)]).result(5)  # culprit moved: no new alert
        assert len(outbox_rows(st)) == 1
        st.record_findings("run1", [finding(severity="critical", rank=2)]).result(5)
        st.record_findings("run1", [finding(severity="warning")]).result(5)  # lower again: nothing
        st.record_findings("run1", [finding(resolved=True, ts=1234.5)]).result(5)
        assert wait_until(lambda: len(t.calls) == 3)
        rows = outbox_rows(st)
    finally:
        st.close()
    assert [r["kind"] for r in rows] == ["firing", "firing", "resolved"]
    first, rise, close = (json.loads(r["body"]) for r in rows)
    old, new = rise["alerts"]
    assert (old["status"], old["labels"]["severity"], old["labels"]["rank"]) == ("resolved", "warning", "3")
    assert old["fingerprint"] == first["alerts"][0]["fingerprint"]  # resolves the alert that fired first
    assert (new["status"], new["labels"]["severity"], new["labels"]["rank"]) == ("firing", "critical", "2")
    assert rise["status"] == "firing"
    (done,) = close["alerts"]
    assert close["status"] == "resolved" and done["endsAt"] == payloads.rfc3339(1234.5)
    assert done["fingerprint"] == new["fingerprint"] and done["labels"]["severity"] == "critical"


def test_after_a_restart_the_close_matches_the_alert_that_fired_before_it(tmp_path):
    t = FakeTransport()
    st = make_storage(tmp_path, t, webhooks=(HOOK,))
    st.record_findings("run1", [finding()]).result(5)
    assert wait_until(lambda: len(t.calls) == 1)
    st.close()
    st = make_storage(tmp_path, t, webhooks=(HOOK,))
    try:
        st.record_findings("run1", [finding(rank=5, node="node2")]).result(5)  # an update: no alert
        st.record_findings("run1", [finding(resolved=True, evidence={"resolved_because": "fast again"})]).result(5)
        assert wait_until(lambda: len(t.calls) == 2)
    finally:
        st.close()
    fired, resolved = (json.loads(b)["alerts"][0] for _, b, _ in t.calls)
    assert resolved["status"] == "resolved" and resolved["fingerprint"] == fired["fingerprint"]
    assert (resolved["labels"]["rank"], resolved["labels"]["node"]) == ("3", "node1")
    assert json.loads(resolved["annotations"]["evidence"]) == {"resolved_because": "fast again"}  # the newest


def test_an_incident_that_never_fired_closes_silently(tmp_path):
    st = make_storage(tmp_path, FakeTransport())
    st.record_findings("run1", [finding()]).result(5)  # no receivers configured
    st.close()
    t = FakeTransport()
    st = make_storage(tmp_path, t, webhooks=(HOOK,))
    try:
        st.record_findings("run1", [finding(resolved=True)]).result(5)
        assert st.read(queries.incidents, "run1")[0]["status"] == "closed"
        assert outbox_rows(st) == []
    finally:
        st.close()


def test_manual_incidents_alert_too(tmp_path):
    t = FakeTransport()
    st = make_storage(tmp_path, t, alertmanagers=(AM,))
    try:
        iid = st.open_incident("run1", "hang", "critical", rank=1).result(5)
        st.update_incident(iid, status="closed").result(5)
        assert wait_until(lambda: len(t.calls) == 2)
    finally:
        st.close()
    (fired,), (resolved,) = t.bodies("/api/v2/alerts")
    assert fired["labels"] == resolved["labels"] and fired["labels"]["alertname"] == "llmwatch_hang"
    assert resolved["endsAt"] >= resolved["startsAt"]


def test_pending_alerts_are_delivered_after_a_restart(tmp_path):
    down = FakeTransport(*[503] * 1000)
    st = make_storage(tmp_path, down, webhooks=(HOOK,), retry_base_s=0.01, retry_cap_s=0.02)
    st.record_findings("run1", [finding()]).result(5)
    assert wait_until(lambda: len(down.calls) >= 2)
    st.close()
    (row,) = outbox_rows_closed(tmp_path)
    assert row["status"] == "pending" and row["attempts"] >= 1 and row["last_error"] == "HTTP 503"
    up = FakeTransport()
    st = make_storage(tmp_path, up, webhooks=(HOOK,))
    try:
        assert wait_until(lambda: outbox_rows(st)[0]["status"] == "delivered")
        (row2,) = outbox_rows(st)
    finally:
        st.close()
    assert up.calls[0][1] == row["body"] and row2["attempts"] == row["attempts"] + 1


def outbox_rows_closed(tmp_path) -> list[dict]:
    import duckdb

    con = duckdb.connect(str(tmp_path / "t.duckdb"), read_only=True)
    try:
        c = con.execute("SELECT * FROM alert_outbox ORDER BY id")
        names = [d[0] for d in c.description]
        return [dict(zip(names, r)) for r in c.fetchall()]
    finally:
        con.close()


# -- the sender's schedule, with a fake clock ----------------------------------------
class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def lane_for(transport, clock, **policy) -> tuple[Lane, list[DeliveryResult]]:
    reported: list[DeliveryResult] = []
    r = build_receivers(webhooks=[HOOK], webhook_secret=SECRET)[0]
    lane = Lane(r, report=reported.append, transport=transport, policy=RetryPolicy(**policy), clock=clock,
                rand=lambda: 0.5, timeout_s=1.0)
    return lane, reported


def test_503s_then_refused_back_off_exponentially_then_deliver():
    clock = Clock()
    t = FakeTransport(503, 503, ConnectionRefusedError(111, "Connection refused"))
    lane, reported = lane_for(t, clock, base_s=2.0, cap_s=60.0)
    lane.offer([Delivery(7, "webhook:1", b"{}", 0, clock.t, clock.t)])
    expected_delays = [1.5, 3.0, 6.0]  # rand 0.5: 3/4 of base * 2**(n-1)
    for n, delay in enumerate(expected_delays, 1):
        assert lane.deliver_due() == 1
        assert lane.deliver_due() == 0  # not due again before its time
        r = reported[-1]
        assert (r.status, r.attempts, r.next_attempt_ts) == ("pending", n, pytest.approx(clock.t + delay))
        clock.t = r.next_attempt_ts
    assert reported[2].last_error == "ConnectionRefusedError: [Errno 111] Connection refused"
    assert reported[0].last_error == "HTTP 503"
    assert lane.deliver_due() == 1
    assert (reported[-1].status, reported[-1].attempts, reported[-1].delivered_ts) == ("delivered", 4, clock.t)
    assert lane.num_pending() == 0 and len(t.calls) == 4


def test_the_retry_budget_ends_in_failed_by_age_or_by_attempts():
    clock = Clock()
    lane, reported = lane_for(FakeTransport(*[500] * 10), clock, base_s=10.0, max_age_s=25.0)
    lane.offer([Delivery(1, "webhook:1", b"{}", 0, clock.t, clock.t)])
    while lane.next_due_ts() is not None:
        clock.t = lane.next_due_ts()
        lane.deliver_due()
    # tried at +0, +7.5, +22.5 (still within 25 s), +52.5: past the budget, failed
    assert [(r.status, r.attempts) for r in reported] == [("pending", 1), ("pending", 2), ("pending", 3),
                                                          ("failed", 4)]
    assert reported[-1].last_error == "HTTP 500"
    clock = Clock()
    lane, reported = lane_for(FakeTransport(*[500] * 10), clock, base_s=0.1, max_attempts=2)
    lane.offer([Delivery(1, "webhook:1", b"{}", 0, clock.t, clock.t)])
    while lane.next_due_ts() is not None:
        clock.t = lane.next_due_ts()
        lane.deliver_due()
    assert [(r.status, r.attempts) for r in reported] == [("pending", 1), ("failed", 2)]


def test_a_lane_thread_wakes_for_an_offer_without_polling():
    t = FakeTransport()
    lane, reported = lane_for(t, time.time)
    lane.start()
    try:
        lane.offer([Delivery(1, "webhook:1", b"{}", 0, time.time(), time.time())])
        assert wait_until(lambda: len(reported) == 1, timeout_s=5.0)
    finally:
        lane.request_stop()
        lane.join(5.0)
    assert reported[0].status == "delivered" and not lane.alive()


# -- receivers: URLs checked, credentials kept out of logs and rows --------------------
def test_receivers_are_checked_and_named_not_stored_as_urls():
    with pytest.raises(ValueError, match="not http"):
        build_receivers(webhooks=["ftp://host/x"], webhook_secret=SECRET)
    with pytest.raises(ValueError, match="not http"):
        build_receivers(alertmanagers=["localhost:9093"])
    with pytest.raises(ValueError, match="needs a secret"):
        build_receivers(webhooks=["https://host/x"])
    rs = build_receivers(webhooks=[HOOK], alertmanagers=["http://am:9093/", "http://am2:9093/api/v2/alerts"],
                         webhook_secret=SECRET)
    assert [r.name for r in rs] == ["webhook:1", "alertmanager:1", "alertmanager:2"]
    assert [r.endpoint for r in rs[1:]] == ["http://am:9093/api/v2/alerts", "http://am2:9093/api/v2/alerts"]
    assert repr(rs[0]) == "Receiver(webhook:1, http://127.0.0.1:9/...)"
    assert receivers.redact_url("https://u:p@[::1]:8443/a?b=c") == "https://[::1]:8443/..."


def test_errors_and_logs_name_the_receiver_never_its_credentials(caplog):
    clock = Clock()
    leak = OSError(f"cannot reach {HOOK} (alice:pa55word, /hooks/T0K3N?key=qu3ry)")
    lane, reported = lane_for(FakeTransport(leak), clock)
    lane.offer([Delivery(3, "webhook:1", b"{}", 0, clock.t, clock.t)])
    with caplog.at_level(logging.WARNING, logger="collector.alerts.delivery"):
        lane.deliver_due()
    text = caplog.text + reported[0].last_error
    assert "webhook:1" in caplog.text
    for secret in ("pa55word", "T0K3N", "qu3ry", SECRET):
        assert secret not in text


def test_rows_for_a_receiver_no_longer_configured_are_left_pending_and_said_so(caplog):
    reported: list = []
    s = delivery.Sender(build_receivers(alertmanagers=[AM]), report=reported.append, transport=FakeTransport())
    with caplog.at_level(logging.WARNING, logger="collector.alerts.delivery"):
        s.offer([Delivery(1, "webhook:9", b"{}", 0, 0.0, 0.0), Delivery(2, "alertmanager:1", b"[]", 0, 0.0, 0.0)])
    assert s.num_pending() == 1 and s.deliver_due() == 1
    assert [r.id for r in reported] == [2]  # row 1 is not touched: it stays pending in the table
    assert "webhook:9 stay pending" in caplog.text


def test_cli_refuses_a_webhook_that_is_not_http_or_has_no_secret(tmp_path, capsys, monkeypatch):
    from collector import cli

    monkeypatch.setenv(receivers.WEBHOOK_SECRET_ENV, "")
    db = str(tmp_path / "c.duckdb")
    assert cli.main(["serve", "--db", db, "--token", "t" * 20, "--webhook", "file:///etc/passwd"]) == 2
    assert "not http(s)" in capsys.readouterr().err
    assert cli.main(["serve", "--db", db, "--token", "t" * 20, "--webhook", "https://h/x"]) == 2
    assert "needs a secret" in capsys.readouterr().err


def test_the_outbox_queries_in_operations_md_run_through_the_sql_guard(tmp_path):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text()
    section = doc.split("\n## Alerts\n")[1].split("\n## ")[0]
    (block,) = re.findall(r"```sql\n(.*?)```", section, flags=re.S)
    queries = [q.strip() for q in block.split(";") if q.strip()]
    st = make_storage(tmp_path, FakeTransport(*[503] * 100), webhooks=(HOOK,), retry_base_s=10.0)
    try:
        st.record_findings("run1", [finding()]).result(5)
        assert wait_until(lambda: outbox_rows(st)[0]["attempts"] == 1)
        results = [st.sql(q) for q in queries]
    finally:
        st.close()
    assert len(queries) == 2
    pending, summary = results
    assert [row[4:7] for row in pending.rows] == [("firing", "pending", 1)]
    assert summary.rows == [("webhook:1", "pending", 1, 1)]


def test_closing_commits_the_last_incidents_and_tries_their_alerts_once_more(tmp_path):
    t = FakeTransport()
    st = make_storage(tmp_path, t, webhooks=(HOOK,))
    st.record_findings("run1", [finding()], done=lambda result, error: None)  # not waited for
    st.close()
    (row,) = outbox_rows_closed(tmp_path)
    assert (row["status"], row["attempts"]) == ("delivered", 1) and len(t.calls) == 1
