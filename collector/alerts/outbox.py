"""The alert outbox: one row per alert and receiver, written with the incident
change it reports; a sender (collector/alerts/delivery.py) delivers the rows until
they are taken.

Receivers (collector/alerts/receivers.py) are the `--webhook` URLs (signed JSON in
Alertmanager's webhook shape) and the `--alertmanager` URLs (`POST
/api/v2/alerts`), named `webhook:<n>` / `alertmanager:<n>`: the table and the log
hold those names, never a URL.

When an alert is made (`AlertOutbox`, an `IncidentHook` of the incidents
projection, collector/store/incidents.py), planned like every projection and written
inside the incident's transaction:

- an incident opens: one `firing` alert;
- its severity rises (info < warning < critical): one `firing` row whose body
  resolves the alert of the lower severity and fires the new one (severity is a
  label, so they are two alerts to a receiver; anything else an update changes
  is not re-alerted: a pager is not a log);
- it closes: one `resolved` alert with the labels of the firing one, so a
  receiver matches them by fingerprint (even when the culprit moved since).
  An incident that never fired (it opened before any receiver was configured)
  closes silently.

Actions of the healing policy (collector/store/actions.py) alert too: `AlertOutbox` is
also an `ActionHook` of the actions projection, written in the action's
transaction. Every recorded action (shadow and refused ones included) is one
`action` row per receiver, and reaching done or failed is one more; each is a
one-off event (alertname `llmwatch_action`, collector/alerts/payloads.py) that Alertmanager
is told ends `action_hold_s` later. The rows carry `action_id` and the action's
`incident_id`.

How it leaves (collector/alerts/delivery.py): after the commit the writer hands
the new rows to the `Sender`, one `Lane` thread per receiver, which POSTs at once
and retries on a `RetryPolicy`. Status changes come back through the writer as
`DeliveryResult` intents of this projection (`AlertOutbox` again), never written
from a lane's thread. At start the pending rows are loaded and offered, so a
collector restarted while a receiver was down still delivers.

Delivery is at least once: a collector killed between a receiver's 2xx and the
commit of `delivered` sends that row again after the restart. A receiver dedupes
on `llmwatch.delivery_id` (the row id, inside the signed body; retries send the
same bytes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb

from collector.alerts import payloads
from collector.alerts.delivery import Delivery, DeliveryResult
from collector.alerts.receivers import WEBHOOK, Receiver
from collector.store.actions import ActionPlan
from collector.store.incidents import IncidentPlan
from collector.store.projection import Group, Projection

log = logging.getLogger("collector.alerts.outbox")

_LABEL_FIELDS = ("kind", "severity", "rank", "node")  # what a resolved alert repeats from the firing one
ACTION_ROW = "action"  # alert_outbox.kind of an action's alert
ACTION_ALERTS_AGAIN = frozenset({"done", "failed"})  # an action that reaches these alerts once more


@dataclass(slots=True)
class OutboxPlan:
    rows: list[dict[str, Any]] = field(default_factory=list)  # alert_outbox rows to insert
    incidents: dict[int, dict[str, Any] | None] = field(default_factory=dict)  # open incidents after (None: closed)
    alerted: dict[int, dict[str, Any] | None] = field(default_factory=dict)  # what fired, after
    next_id: int = 0


def _labels_view(alerted: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """`current` as the receivers know it: with the label fields of the alert that fired."""
    return {**current, **{k: alerted.get(k) for k in _LABEL_FIELDS}}


class AlertOutbox(Projection):
    """alert_outbox rows from incident changes (an IncidentHook of the incidents
    projection) and the sender's DeliveryResult intents (as the `outbox` projection).
    Owned by the writer thread, like every projection."""

    name = "outbox"
    writes = ("alert_outbox",)

    def __init__(self, con: duckdb.DuckDBPyConnection, *, receivers: Sequence[Receiver], external_url: str = "",
                 firing_hold_s: float = 86400.0, action_hold_s: float = 300.0,
                 on_commit: Callable[[list[Delivery]], None] | None = None) -> None:
        """`firing_hold_s`: how long Alertmanager holds a firing alert we pushed once
        (its endsAt) unless resolved sooner; `action_hold_s`: the same for an action's
        alert, an event that is never resolved. `on_commit(deliveries)`: called with the
        new rows after each commit that made some (the sender's `offer`)."""
        self.receivers = list(receivers)
        self.external_url = external_url
        self.firing_hold_s = firing_hold_s
        self.action_hold_s = action_hold_s
        self.on_commit = on_commit
        self._next_id = con.execute("SELECT coalesce(max(id), 0) + 1 FROM alert_outbox").fetchall()[0][0]
        # Where the next hook plan of the group being planned numbers its rows from: a
        # group's incident and action plans are both made before either commits, so the
        # second starts after the first's rows. Planning scratch, reset after each commit.
        self._planning: tuple[Group, int] | None = None
        self._open: dict[int, dict[str, Any]] = {}  # the open incidents, as their rows are now
        self._alerted: dict[int, dict[str, Any]] = {}  # what fired for each: its labels' fields
        self.pending_at_start: list[Delivery] = []
        if not self.receivers:  # nothing to alert: nothing to mirror (receivers are fixed at start)
            return
        cur = con.execute("SELECT * FROM incidents WHERE status = 'open' ORDER BY id")
        names = [d[0] for d in cur.description]
        for row in cur.fetchall():
            inc = dict(zip(names, row))
            inc["evidence"] = json.loads(inc["evidence"]) if inc.get("evidence") else None
            self._open[inc["id"]] = inc
        # What fired for each open incident: its newest firing row's labels.
        for iid, labels in con.execute("""SELECT incident_id, arg_max(labels, id) FROM alert_outbox
                                          WHERE kind = 'firing' AND incident_id IS NOT NULL
                                          GROUP BY incident_id""").fetchall():
            if iid in self._open and labels:
                lab = json.loads(labels)
                self._alerted[iid] = {"kind": lab.get("kind"), "severity": lab.get("severity"),
                                      "rank": int(lab["rank"]) if lab.get("rank") is not None else None,
                                      "node": lab.get("node")}
        self.pending_at_start = [Delivery(*r) for r in con.execute(
            "SELECT id, receiver, body, attempts, next_attempt_ts, created_ts FROM alert_outbox "
            "WHERE status = 'pending' ORDER BY next_attempt_ts, id").fetchall()]

    # -- incident changes (inside the incidents projection) -------------------------
    def _first_id(self, group: Group) -> int:
        if self._planning is not None and self._planning[0] is group:
            return max(self._planning[1], self._next_id)
        return self._next_id

    def plan_incidents(self, plan: IncidentPlan, group: Group) -> OutboxPlan:
        out = OutboxPlan(next_id=self._first_id(group))
        if not self.receivers:
            return out
        now = group.now

        def current(iid: int) -> dict[str, Any] | None:
            return out.incidents[iid] if iid in out.incidents else self._open.get(iid)

        def fired(iid: int) -> dict[str, Any] | None:
            return out.alerted[iid] if iid in out.alerted else self._alerted.get(iid)

        for row in plan.inserts:
            if row.get("status", "open") != "open":
                continue
            inc = dict(row)
            out.incidents[inc["id"]] = inc
            self._alert(out, inc, "firing", [inc], now)
        for iid, values in plan.updates:
            before = current(iid)
            if before is None:  # closed already (or never seen): nothing to say
                continue
            after = {**before, **values}
            was = fired(iid)
            if after.get("status", "open") != "open":
                out.incidents[iid] = None
                if was is not None:
                    out.alerted[iid] = None
                    self._alert(out, after, "resolved", [_labels_view(was, after)], now)
                continue
            out.incidents[iid] = after
            if was is not None and payloads.severity_level(after.get("severity")) > payloads.severity_level(
                    was.get("severity")):
                old = {**_labels_view(was, before), "status": "closed", "closed_ts": now}
                self._alert(out, after, "firing", [old, after], now)
        self._planning = (group, out.next_id)
        return out

    def _alert(self, out: OutboxPlan, inc: Mapping[str, Any], kind: str, shown: list[Mapping[str, Any]],
               now: float) -> None:
        """One row per receiver for the alerts `shown` (about incident `inc`)."""
        try:
            firing = shown[-1] if kind == "firing" else None
            labels = payloads.labels_of(firing) if firing is not None else None
            bodies = []
            for r in self.receivers:
                rid = out.next_id + len(bodies)
                if r.kind == WEBHOOK:
                    payload: Any = payloads.webhook_payload(shown, now_ts=now, external_url=self.external_url,
                                                          delivery_id=rid)
                else:
                    payload = payloads.alertmanager_alerts(shown, external_url=self.external_url,
                                                         firing_until_ts=now + self.firing_hold_s)
                bodies.append((rid, r, payloads.encode(payload)))
        except Exception:  # an alert must never sink the incident it reports
            log.exception("no alert for incident %s: its payload could not be built", inc.get("id"))
            return
        for rid, r, body in bodies:
            out.rows.append({"id": rid, "run_id": inc["run_id"], "incident_id": inc["id"], "receiver": r.name,
                             "kind": kind, "status": "pending", "body": body,
                             "labels": json.dumps(labels) if labels is not None else None,
                             "created_ts": now, "next_attempt_ts": now, "attempts": 0})
        out.next_id += len(bodies)
        if firing is not None:
            out.alerted[inc["id"]] = {k: firing.get(k) for k in _LABEL_FIELDS}

    # -- action changes (inside the actions projection) ------------------------------
    def plan_actions(self, plan: ActionPlan, group: Group) -> OutboxPlan:
        """One alert per recorded action, and one more when an action reaches done or failed."""
        out = OutboxPlan(next_id=self._first_id(group))
        if not self.receivers:
            return out
        for before, after in plan.changes:
            if before is None or (after.get("status") in ACTION_ALERTS_AGAIN
                                  and after.get("status") != before.get("status")):
                self._action_alert(out, after, group.now)
        self._planning = (group, out.next_id)
        return out

    def _action_alert(self, out: OutboxPlan, action: Mapping[str, Any], now: float) -> None:
        until = now + self.action_hold_s
        try:
            labels = payloads.action_labels(action)
            bodies = []
            for r in self.receivers:
                rid = out.next_id + len(bodies)
                if r.kind == WEBHOOK:
                    payload: Any = payloads.action_webhook_payload(action, now_ts=now, until_ts=until,
                                                                 external_url=self.external_url, delivery_id=rid)
                else:
                    payload = payloads.action_alertmanager_alerts(action, now_ts=now, until_ts=until,
                                                                external_url=self.external_url)
                bodies.append((rid, r, payloads.encode(payload)))
        except Exception:  # an alert must never sink the action it reports
            log.exception("no alert for action %s: its payload could not be built", action.get("id"))
            return
        for rid, r, body in bodies:
            out.rows.append({"id": rid, "run_id": action["run_id"], "incident_id": action.get("incident_id"),
                             "action_id": action["id"], "receiver": r.name, "kind": ACTION_ROW,
                             "status": "pending", "body": body, "labels": json.dumps(labels),
                             "created_ts": now, "next_attempt_ts": now, "attempts": 0})
        out.next_id += len(bodies)

    def write_actions(self, con: duckdb.DuckDBPyConnection, plan: OutboxPlan, group: Group) -> None:
        self.write_incidents(con, plan, group)

    def apply_actions(self, plan: OutboxPlan, group: Group) -> None:
        self.apply_incidents(plan, group)  # an action plan changes no incident: only the ids and the rows

    def write_incidents(self, con: duckdb.DuckDBPyConnection, plan: OutboxPlan, group: Group) -> None:
        for row in plan.rows:
            names = list(row)
            con.execute(f"INSERT INTO alert_outbox ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                        [row[n] for n in names])

    def apply_incidents(self, plan: OutboxPlan, group: Group) -> None:
        for iid, inc in plan.incidents.items():
            if inc is None:
                self._open.pop(iid, None)
            else:
                self._open[iid] = inc
        for iid, was in plan.alerted.items():
            if was is None:
                self._alerted.pop(iid, None)
            else:
                self._alerted[iid] = was
        self._next_id = max(self._next_id, plan.next_id)
        if plan.rows and self.on_commit is not None:
            self.on_commit([Delivery(r["id"], r["receiver"], r["body"], 0, r["next_attempt_ts"], r["created_ts"])
                            for r in plan.rows])

    # -- delivery results (the `outbox` projection's own intents) -----------------------
    def plan(self, group: Group) -> list[DeliveryResult] | None:
        return group.intents.get(self.name) or None

    def apply(self, plan: list[DeliveryResult] | None, group: Group) -> None:
        self._planning = None  # the group committed: its hook plans applied (or it had none)

    def write(self, con: duckdb.DuckDBPyConnection, plan: list[DeliveryResult] | None, group: Group) -> None:
        for r in plan or ():
            # a delivery (last_error None) keeps the last failure's reason
            con.execute("UPDATE alert_outbox SET status = ?, attempts = ?, next_attempt_ts = ?, "
                        "last_error = coalesce(?, last_error), delivered_ts = ? WHERE id = ?",
                        [r.status, r.attempts, r.next_attempt_ts, r.last_error, r.delivered_ts, r.id])

    def results(self, plan: list[DeliveryResult] | None) -> list[Any]:
        return [None] * len(plan or ())
