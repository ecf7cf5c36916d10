"""Alerts: what an incident looks like to a pager, signed, and when to try again.

Pure functions, no I/O, so the webhook outbox (and tests) can call them with an
injected clock and random source:

- `webhook_payload` turns incident rows into Alertmanager's webhook shape
  (version 4), so any receiver built for Alertmanager (PagerDuty, Slack and
  Opsgenie bridges, Grafana OnCall, a team's own script) works unchanged. One
  llmwatch field is added at the top level, `llmwatch`: `sent_ts` (when the
  alert was made: the outbox sends the same bytes on every retry) and, from the
  outbox, `delivery_id` (its alert_outbox row), so a receiver can refuse a
  replayed delivery (the signature covers both).
- `alertmanager_alerts` gives the same alerts in the shape Alertmanager's own
  `POST /api/v2/alerts` takes, for pushing into a real Alertmanager.
- `sign` / `verify`: `X-Signature-256: sha256=<hex HMAC-SHA256 of the raw body>`,
  GitHub's convention, checked in constant time.
- `retry_delay_s`: exponential backoff with jitter ("equal jitter": half the
  exponential delay fixed, half random), so the delay really grows while a
  receiver is down, and receivers coming back after an outage are not hit by
  every collector at the same instant.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

SIGNATURE_HEADER = "X-Signature-256"
RECEIVER = "llmwatch"
NEVER = "0001-01-01T00:00:00Z"  # Alertmanager's "no end time"
SEVERITIES = ("info", "warning", "critical")


def severity_level(severity: str | None) -> int:
    """A severity's place in SEVERITIES (an unknown one counts as "warning")."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else 1


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def labels_of(incident: Mapping[str, Any]) -> dict[str, str]:
    """The labels that identify an incident's alert (Alertmanager groups and dedupes on them)."""
    labels = {"alertname": f"llmwatch_{incident['kind']}", "run_id": str(incident["run_id"]),
              "kind": str(incident["kind"]), "severity": str(incident.get("severity") or "warning"),
              "incident_id": str(incident["id"])}
    if incident.get("rank") is not None:
        labels["rank"] = str(incident["rank"])
    if incident.get("node"):
        labels["node"] = str(incident["node"])
    return labels


def fingerprint(labels: Mapping[str, str]) -> str:
    """16 hex digits from the sorted labels, stable across deliveries (like Alertmanager's)."""
    text = "\x00".join(f"{k}\x01{v}" for k, v in sorted(labels.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def summary_of(incident: Mapping[str, Any]) -> str:
    where = []
    if incident.get("rank") is not None:
        where.append(f"rank {incident['rank']}")
    if incident.get("node"):
        where.append(f"node {incident['node']}")
    steps = incident.get("step_from")
    if steps is not None:
        to = incident.get("step_to")
        where.append(f"step {steps}" if to in (None, steps) else f"steps {steps}-{to}")
    return f"{incident['kind']} in run {incident['run_id']}" + (f" ({', '.join(where)})" if where else "")


def _alert(incident: Mapping[str, Any], *, external_url: str) -> dict[str, Any]:
    labels = labels_of(incident)
    closed = incident.get("status") == "closed"
    annotations = {"summary": summary_of(incident)}
    if incident.get("evidence") is not None:
        annotations["evidence"] = json.dumps(incident["evidence"], sort_keys=True, default=str)
    if incident.get("root_cause"):
        annotations["root_cause"] = str(incident["root_cause"])
    return {
        "status": "resolved" if closed else "firing",
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(incident["opened_ts"]),
        "endsAt": rfc3339(incident["closed_ts"]) if closed and incident.get("closed_ts") else NEVER,
        "generatorURL": f"{external_url.rstrip('/')}/v1/runs/{incident['run_id']}/incidents" if external_url else "",
        "fingerprint": fingerprint(labels),
    }


def _common(dicts: list[dict[str, str]]) -> dict[str, str]:
    if not dicts:
        return {}
    out = dict(dicts[0])
    for d in dicts[1:]:
        out = {k: v for k, v in out.items() if d.get(k) == v}
    return out


def webhook_payload(incidents: Iterable[Mapping[str, Any]], *, now_ts: float, external_url: str = "",
                    receiver: str = RECEIVER, delivery_id: int | None = None) -> dict[str, Any]:
    """One webhook delivery for `incidents` (usually one), in Alertmanager's shape."""
    alerts = [_alert(i, external_url=external_url) for i in incidents]
    if not alerts:
        raise ValueError("a webhook carries at least one alert")
    group_labels = {k: alerts[0]["labels"][k] for k in ("alertname", "run_id")}
    return {
        "version": "4",
        "groupKey": "{}:{" + ", ".join(f'{k}="{v}"' for k, v in sorted(group_labels.items())) + "}",
        "truncatedAlerts": 0,
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": _common([a["labels"] for a in alerts]),
        "commonAnnotations": _common([a["annotations"] for a in alerts]),
        "externalURL": external_url,
        "alerts": alerts,
        "llmwatch": {"sent_ts": now_ts} if delivery_id is None else {"sent_ts": now_ts, "delivery_id": delivery_id},
    }


def alertmanager_alerts(incidents: Iterable[Mapping[str, Any]], *, external_url: str = "",
                        firing_until_ts: float | None = None) -> list[dict[str, Any]]:
    """The body of Alertmanager's `POST /api/v2/alerts` for `incidents`.

    A firing alert without endsAt is resolved by Alertmanager itself after its
    `resolve_timeout` (5 min by default) unless it is posted again, as Prometheus
    does every evaluation; `firing_until_ts` gives firing alerts that endsAt
    instead, for a sender that posts each change once (the outbox)."""
    out = []
    for i in incidents:
        a = _alert(i, external_url=external_url)
        posted = {"labels": a["labels"], "annotations": a["annotations"], "startsAt": a["startsAt"],
                  "generatorURL": a["generatorURL"]}
        if a["endsAt"] != NEVER:
            posted["endsAt"] = a["endsAt"]
        elif firing_until_ts is not None:
            posted["endsAt"] = rfc3339(firing_until_ts)
        out.append(posted)
    return out


def encode(payload: Any) -> bytes:
    """The exact bytes that are signed and sent."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True, allow_nan=False, default=str).encode()


def sign(body: bytes, secret: bytes) -> str:
    """The value of the X-Signature-256 header for `body`."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify(body: bytes, header: str | None, secret: bytes) -> bool:
    """What a receiver checks (and the tests do)."""
    return bool(header) and hmac.compare_digest(sign(body, secret), header.strip())


def retry_delay_s(attempt: int, *, base_s: float = 1.0, cap_s: float = 300.0,
                  rand: Callable[[], float]) -> float:
    """Seconds to wait before try `attempt + 1` (`attempt` >= 1 failed tries so far):
    uniform in [d/2, d) with d = min(cap, base * 2**(attempt - 1)); `rand()` in [0, 1)."""
    ceiling = min(cap_s, base_s * 2.0 ** max(0, min(attempt - 1, 30)))
    return ceiling * (0.5 + 0.5 * rand())
