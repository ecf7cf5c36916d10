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
- `action_webhook_payload` / `action_alertmanager_alerts`: the same two shapes for
  an action of the healing policy (collector/store/actions.py): alertname
  `llmwatch_action`, a one-off event rather than a condition, so it carries its
  own end (`endsAt` a few minutes after it was made) and is never resolved.
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
    return _envelope([_alert(i, external_url=external_url) for i in incidents], now_ts=now_ts,
                     external_url=external_url, receiver=receiver, delivery_id=delivery_id)


def _envelope(alerts: list[dict[str, Any]], *, now_ts: float, external_url: str, receiver: str,
              delivery_id: int | None) -> dict[str, Any]:
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


def _posted(a: Mapping[str, Any]) -> dict[str, Any]:
    """A webhook-shaped alert as Alertmanager's API takes it (no status, no fingerprint)."""
    posted = {"labels": a["labels"], "annotations": a["annotations"], "startsAt": a["startsAt"],
              "generatorURL": a["generatorURL"]}
    if a["endsAt"] != NEVER:
        posted["endsAt"] = a["endsAt"]
    return posted


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
        posted = _posted(a)
        if a["endsAt"] == NEVER and firing_until_ts is not None:
            posted["endsAt"] = rfc3339(firing_until_ts)
        out.append(posted)
    return out


# -- actions: what the healing policy did (collector/store/actions.py rows) ---------------------
ACTION_ALERTNAME = "llmwatch_action"
_ACTION_DID = {"shadow": "recorded in shadow mode, not done", "issued": "issued",
               "acked": "acknowledged by the trainer", "done": "done", "failed": "failed",
               "refused": "refused by a guard rail"}


def action_severity(status: str | None) -> str:
    return "warning" if status in ("failed", "refused") else "info"


def action_labels(action: Mapping[str, Any]) -> dict[str, str]:
    """The labels of an action's alert: one alert per action and status."""
    labels = {"alertname": ACTION_ALERTNAME, "run_id": str(action["run_id"]), "action": str(action["kind"]),
              "status": str(action["status"]), "mode": str(action.get("mode") or "auto"),
              "severity": action_severity(action.get("status")), "action_id": str(action["id"])}
    for name in ("incident_id", "rank", "node"):
        if action.get(name) is not None and action.get(name) != "":
            labels[name] = str(action[name])
    return labels


def action_summary(action: Mapping[str, Any]) -> str:
    """What was done, to what, and (from detail's `reason`, when it has one) why."""
    where = [f"{k} {action[k]}" for k in ("node", "rank") if action.get(k) is not None]
    if action.get("incident_id") is not None:
        where.append(f"incident {action['incident_id']}")
    status = action.get("status")
    did = _ACTION_DID.get(status, str(status))
    if action.get("command_id") is not None:
        did += f" (command {action['command_id']})"
    text = f"{action['kind']} in run {action['run_id']}" + (f" ({', '.join(where)})" if where else "") + f": {did}"
    detail = action.get("detail")
    reason = detail.get("reason") if isinstance(detail, Mapping) else None
    return text + (f"; {reason}" if reason else "")


def _action_alert(action: Mapping[str, Any], *, now_ts: float, until_ts: float, external_url: str) -> dict[str, Any]:
    labels = action_labels(action)
    annotations = {"summary": action_summary(action)}
    if action.get("detail") is not None:
        annotations["detail"] = json.dumps(action["detail"], sort_keys=True, default=str)
    if action.get("recovery_s") is not None:
        annotations["recovery_s"] = f"{action['recovery_s']:.3f}"
    return {
        "status": "firing",
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(now_ts),
        "endsAt": rfc3339(until_ts),  # an event, not a condition: it ends by itself
        "generatorURL": f"{external_url.rstrip('/')}/v1/runs/{action['run_id']}/actions" if external_url else "",
        "fingerprint": fingerprint(labels),
    }


def action_webhook_payload(action: Mapping[str, Any], *, now_ts: float, until_ts: float, external_url: str = "",
                           receiver: str = RECEIVER, delivery_id: int | None = None) -> dict[str, Any]:
    """One webhook delivery about an action row (as it is after the change it reports)."""
    return _envelope([_action_alert(action, now_ts=now_ts, until_ts=until_ts, external_url=external_url)],
                     now_ts=now_ts, external_url=external_url, receiver=receiver, delivery_id=delivery_id)


def action_alertmanager_alerts(action: Mapping[str, Any], *, now_ts: float, until_ts: float,
                               external_url: str = "") -> list[dict[str, Any]]:
    """The body of Alertmanager's `POST /api/v2/alerts` for an action: pushed once,
    ending at `until_ts`."""
    return [_posted(_action_alert(action, now_ts=now_ts, until_ts=until_ts, external_url=external_url))]


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
