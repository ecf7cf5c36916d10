"""Alert payloads in Alertmanager's shape, their signature, and the retry schedule."""

from __future__ import annotations

import json
import random

import pytest

from collector.alerts import payloads

INCIDENT = {"id": 7, "run_id": "run42", "kind": "straggler", "severity": "warning", "rank": 3, "node": "node1",
            "step_from": 40, "step_to": 52, "status": "open", "opened_ts": 1_700_000_000.25, "closed_ts": None,
            "evidence": {"compute_ratio": 1.52, "cost_s_per_step": 0.05}, "root_cause": "slow node"}


def test_payload_has_alertmanagers_webhook_shape():
    p = payloads.webhook_payload([INCIDENT], now_ts=1_700_000_001.0, external_url="https://collector:8428")
    assert set(p) >= {"version", "groupKey", "status", "receiver", "groupLabels", "commonLabels",
                      "commonAnnotations", "externalURL", "alerts"}
    assert p["version"] == "4" and p["status"] == "firing" and p["receiver"] == "llmwatch"
    (a,) = p["alerts"]
    assert set(a) == {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}
    assert a["labels"] == {"alertname": "llmwatch_straggler", "run_id": "run42", "kind": "straggler",
                           "severity": "warning", "rank": "3", "node": "node1", "incident_id": "7"}
    assert a["annotations"]["summary"] == "straggler in run run42 (rank 3, node node1, steps 40-52)"
    assert json.loads(a["annotations"]["evidence"]) == INCIDENT["evidence"]
    assert a["annotations"]["root_cause"] == "slow node"
    assert a["startsAt"] == "2023-11-14T22:13:20.250Z" and a["endsAt"] == payloads.NEVER
    assert a["generatorURL"] == "https://collector:8428/v1/runs/run42/incidents"
    assert p["commonLabels"] == a["labels"] and p["groupLabels"] == {"alertname": "llmwatch_straggler",
                                                                     "run_id": "run42"}
    assert p["llmwatch"]["sent_ts"] == 1_700_000_001.0  # inside the signed body: replays can be refused


def test_resolved_alert_and_a_stable_fingerprint():
    closed = {**INCIDENT, "status": "closed", "closed_ts": 1_700_000_100.0, "step_to": 60}
    a_open = payloads.webhook_payload([INCIDENT], now_ts=1.0)["alerts"][0]
    p = payloads.webhook_payload([closed], now_ts=2.0)
    assert p["status"] == "resolved" and p["alerts"][0]["endsAt"] == "2023-11-14T22:15:00.000Z"
    assert p["alerts"][0]["fingerprint"] == a_open["fingerprint"]  # the same alert, resolved
    other = payloads.webhook_payload([{**INCIDENT, "id": 8}], now_ts=1.0)["alerts"][0]
    assert other["fingerprint"] != a_open["fingerprint"]


def test_alertmanager_push_shape():
    (posted,) = payloads.alertmanager_alerts([INCIDENT])
    assert set(posted) == {"labels", "annotations", "startsAt", "generatorURL"}  # no endsAt while firing
    (resolved,) = payloads.alertmanager_alerts([{**INCIDENT, "status": "closed", "closed_ts": 5.0}])
    assert resolved["endsAt"] == "1970-01-01T00:00:05.000Z"


def test_signature_round_trip_and_tamper():
    body = payloads.encode(payloads.webhook_payload([INCIDENT], now_ts=1.0))
    header = payloads.sign(body, b"s3cret")
    assert header.startswith("sha256=") and len(header) == 7 + 64
    assert payloads.verify(body, header, b"s3cret")
    assert not payloads.verify(body + b" ", header, b"s3cret")
    assert not payloads.verify(body, header, b"other")
    assert not payloads.verify(body, None, b"s3cret")


def test_encode_refuses_nan_rather_than_sending_invalid_json():
    with pytest.raises(ValueError):
        payloads.encode({"x": float("nan")})


def test_retry_delays_grow_with_jitter_up_to_the_cap():
    rng = random.Random(1)
    delays = [payloads.retry_delay_s(n, base_s=1.0, cap_s=60.0, rand=rng.random) for n in range(1, 12)]
    for n, d in enumerate(delays, 1):
        ceiling = min(60.0, 2.0 ** (n - 1))
        assert ceiling / 2 <= d < ceiling
    assert payloads.retry_delay_s(10_000, cap_s=60.0, rand=lambda: 0.999) < 60.0


def test_the_outboxs_delivery_id_and_a_held_firing_alert():
    p = payloads.webhook_payload([INCIDENT], now_ts=3.0, delivery_id=12)
    assert p["llmwatch"] == {"sent_ts": 3.0, "delivery_id": 12}
    (held,) = payloads.alertmanager_alerts([INCIDENT], firing_until_ts=1_700_086_400.25)
    assert held["endsAt"] == "2023-11-15T22:13:20.250Z"
    closed = {**INCIDENT, "status": "closed", "closed_ts": 5.0}
    (resolved,) = payloads.alertmanager_alerts([closed], firing_until_ts=1e12)
    assert resolved["endsAt"] == "1970-01-01T00:00:05.000Z"  # a resolved alert ends when it closed
    assert [payloads.severity_level(s) for s in ("info", "warning", "critical", "bogus")] == [0, 1, 2, 1]
