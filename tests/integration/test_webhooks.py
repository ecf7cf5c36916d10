"""Webhooks from a real `collector serve`: an incident the NaN detector finds in
rows sent over HTTP reaches a receiver on loopback, signed, and so does its
resolution; a receiver that fails or is down gets every alert once it is back,
across a collector restart too."""

from __future__ import annotations

import json
import os

import pytest

from collector.alerts import payloads
from tests.integration.alert_receiver import NanRun, WebhookReceiver
from tests.polling import wait_for as wait_until
from tests.unit.collector.collector_server import CollectorProcess
from trainer.launch import free_port

pytestmark = [pytest.mark.integration]

SECRET = "integration-webhook-secret-0123456789"
PATH_TOKEN = "T0K3N-in-the-path"
FAST_RETRIES = ("--alert-retry-base-s", "0.1", "--alert-retry-cap-s", "0.4")


def secret_file(tmp_path):
    path = tmp_path / "webhook-secret"
    path.write_text(SECRET + "\n")
    os.chmod(path, 0o600)
    return str(path)


def collector(tmp_path, hook_url: str, *extra: str, policy: str = "off") -> CollectorProcess:
    """A collector alerting `hook_url`. The policy is off by default: these tests follow an
    incident's alerts, and a policy would add an action (and its alerts) for the NaN."""
    return CollectorProcess(tmp_path / "c.duckdb", args=(
        "--webhook", hook_url, "--webhook-secret-file", secret_file(tmp_path), "--group-min-interval-s", "0",
        "--group-linger-s", "0", "--external-url", "http://collector.example:8428", "--policy", policy, *extra))


def outbox(c: CollectorProcess) -> list[list]:
    return c.sql("SELECT kind, status, attempts, last_error, receiver FROM alert_outbox ORDER BY id")


def fire_and_resolve(c, hook: WebhookReceiver, run_id: str) -> list:
    """Open a NaN incident and close it through collector `c`, wait until `hook` got the
    firing and the resolved alert and both outbox rows are delivered; the rows. Stops `c`."""
    run = NanRun(c.url, c.token, run_id=run_id)
    try:
        run.open_incident()
        wait_until(lambda: hook.alerts("firing"), 20, "the firing alert")
        run.close_incident()
        wait_until(lambda: hook.alerts("resolved"), 20, "the resolved alert")
        return wait_until(lambda: (r := outbox(c)) and all(x[1] == "delivered" for x in r) and r, 10,
                          "both rows delivered")
    finally:
        run.close()
        assert c.stop() == 0


def test_an_incident_and_its_resolution_reach_the_webhook_signed(tmp_path):
    with WebhookReceiver() as hook:
        c = collector(tmp_path, f"{hook.url}/{PATH_TOKEN}?key=q").start()
        rows = fire_and_resolve(c, hook, "hooked")
    assert [(k, s, a, r) for k, s, a, _, r in rows] == [("firing", "delivered", 1, "webhook:1"),
                                                        ("resolved", "delivered", 1, "webhook:1")]
    assert len(hook.requests) == 2
    for path, headers, body in hook.requests:
        assert path == f"/{PATH_TOKEN}?key=q"
        assert payloads.verify(body, headers.get(payloads.SIGNATURE_HEADER), SECRET.encode())
        assert not payloads.verify(body, headers.get(payloads.SIGNATURE_HEADER), b"another secret")
    fired, resolved = (json.loads(b) for _, _, b in hook.requests)
    assert set(fired) >= {"version", "groupKey", "status", "receiver", "groupLabels", "commonLabels",
                          "commonAnnotations", "externalURL", "alerts", "llmwatch"}
    (a,) = fired["alerts"]
    assert fired["status"] == "firing" and a["labels"]["alertname"] == "llmwatch_nan"
    assert (a["labels"]["run_id"], a["labels"]["kind"], a["labels"]["severity"], a["labels"]["rank"]) == (
        "hooked", "nan", "critical", "0")
    assert set(a["annotations"]) >= {"summary", "evidence", "root_cause"} and a["endsAt"] == payloads.NEVER
    assert a["generatorURL"] == "http://collector.example:8428/v1/runs/hooked/incidents"
    (r,) = resolved["alerts"]
    assert resolved["status"] == "resolved" and r["fingerprint"] == a["fingerprint"] and r["endsAt"] != payloads.NEVER
    assert resolved["llmwatch"]["sent_ts"] >= fired["llmwatch"]["sent_ts"]
    log = "".join(c.output)
    assert SECRET not in log and PATH_TOKEN not in log and "webhook:1" in log


def test_a_receiver_answering_503_three_times_still_gets_every_alert(tmp_path):
    with WebhookReceiver(fail_first=3) as hook:
        c = collector(tmp_path, hook.url, *FAST_RETRIES).start()
        rows = fire_and_resolve(c, hook, "flaky")
    assert hook.refused == 3 and len(hook.requests) == 2
    assert rows[0][:3] == ["firing", "delivered", 4] and rows[0][3] == "HTTP 503"  # the last failure stays


def test_alerts_for_a_receiver_that_is_down_survive_a_collector_restart(tmp_path):
    port = free_port()  # nothing listens here until the receiver starts: connection refused
    c = collector(tmp_path, f"http://127.0.0.1:{port}/hook", *FAST_RETRIES).start()
    run = NanRun(c.url, c.token, run_id="restarted")
    try:
        run.open_incident()
        wait_until(lambda: (r := outbox(c)) and r[0][2] >= 3, 20, "three refused attempts")
    finally:
        run.close()
        assert c.stop() == 0
    (row,) = outbox_closed(tmp_path)
    assert row[:2] == ("firing", "pending") and "Connection refused" in row[3], row
    with WebhookReceiver(port=port) as hook:
        c = collector(tmp_path, f"http://127.0.0.1:{port}/hook", *FAST_RETRIES).start()
        try:
            wait_until(lambda: hook.alerts("firing"), 20, "the alert after the restart")
            rows = wait_until(lambda: (r := outbox(c)) and r[0][1] == "delivered" and r, 10, "the row delivered")
        finally:
            assert c.stop() == 0
    (alert,) = hook.alerts("firing")
    assert alert["labels"]["run_id"] == "restarted" and rows[0][2] > row[2]


def outbox_closed(tmp_path) -> list[tuple]:
    import duckdb

    con = duckdb.connect(str(tmp_path / "c.duckdb"), read_only=True)
    try:
        return con.execute("SELECT kind, status, attempts, last_error FROM alert_outbox ORDER BY id").fetchall()
    finally:
        con.close()


@pytest.mark.slow
def test_trainer_hands_webhooks_and_the_secret_to_its_embedded_collector(tmp_path):
    import duckdb

    from tests.integration.trainer_run import run_trainer

    with WebhookReceiver() as hook:
        url = f"{hook.url}/{PATH_TOKEN}"
        r = run_trainer(tmp_path / "run", "--telemetry", "--steps", "10", "--inject", "nan@step=4,rank=0",
                        "--webhook", url, "--webhook-secret-file", secret_file(tmp_path),
                        env={"LLMWATCH_WEBHOOK_SECRET": ""})
        assert r.returncode == 0, r.stderr[-3000:]
        firing = wait_until(lambda: hook.alerts("firing"), 10, "the alert of the injected NaN")
    assert any(a["labels"]["kind"] == "nan" for a in firing)
    for _, headers, body in hook.requests:
        assert payloads.verify(body, headers.get(payloads.SIGNATURE_HEADER), SECRET.encode())
    run_dir = r.run_dir
    assert oct((run_dir / "tokens" / "webhook-secret").stat().st_mode & 0o777) == "0o600"
    con = duckdb.connect(str(run_dir / "telemetry.duckdb"), read_only=True)
    try:
        stored = " ".join(str(row) for row in con.execute("SELECT config FROM runs").fetchall())
    finally:
        con.close()
    files = [run_dir / "config.json", run_dir / "collector.log"]
    text = stored + r.stdout + r.stderr + "".join(p.read_text() for p in files)
    assert SECRET not in text and PATH_TOKEN not in text
    assert "webhook:1" in (run_dir / "collector.log").read_text()


def test_an_action_of_the_policy_reaches_the_webhook_signed(tmp_path):
    """With the policy on, the NaN's rollback is an alert of its own (llmwatch_action), signed
    like the incident's, naming the action, its status and the incident."""
    with WebhookReceiver() as hook:
        c = collector(tmp_path, f"{hook.url}/hook", policy="auto").start()
        run = NanRun(c.url, c.token, run_id="acted")
        try:
            run.open_incident()
            actions = wait_until(lambda: [a for a in hook.alerts("firing")
                                          if a["labels"]["alertname"] == "llmwatch_action"], 20, "the action's alert")
            rows = wait_until(lambda: (r := c.sql("SELECT kind, status, action_id, incident_id FROM alert_outbox "
                                                  "WHERE kind = 'action'")) and r, 10, "the action's outbox row")
            incident_id = c.sql("SELECT id FROM incidents WHERE run_id = 'acted'")[0][0]
        finally:
            run.close()
            assert c.stop() == 0
    a = actions[0]
    assert (a["labels"]["action"], a["labels"]["status"], a["labels"]["mode"], a["labels"]["run_id"]) == (
        "rollback", "issued", "auto", "acted")
    assert a["labels"]["incident_id"] == str(incident_id) and "nan at step" in a["annotations"]["summary"]
    assert rows[0][0] == "action" and rows[0][3] == incident_id and rows[0][2] is not None
    for _, headers, body in hook.requests:
        assert payloads.verify(body, headers.get(payloads.SIGNATURE_HEADER), SECRET.encode())
