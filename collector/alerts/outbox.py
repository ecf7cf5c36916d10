"""The alert outbox: one row per alert and receiver, written with the incident
change it reports, and a sender that delivers the rows until they are taken.

Receivers are the `--webhook` URLs (signed JSON in Alertmanager's webhook shape)
and the `--alertmanager` URLs (`POST /api/v2/alerts`). They are named
`webhook:<n>` / `alertmanager:<n>` (n counts from 1, in flag order): the table
and the log hold those names, never a URL (its userinfo, path or query may be a
credential: a Slack webhook's path is one).

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

How it leaves (`Sender`: one `Lane`, i.e. one thread, per receiver, so a receiver
that hangs does not hold up the others): after the commit the writer hands the
new rows to the sender (`AlertOutbox.apply_incidents` -> `Sender.offer`, a deque
append and a notify), whose lane wakes and POSTs at once. A 2xx marks the row
`delivered`; anything else (an HTTP status, a refused connection, a timeout)
counts an attempt and schedules the next after `alerts.retry_delay_s`
(exponential, with jitter, capped), until the retry budget (`RetryPolicy`: an age
and optionally a number of attempts) is spent: then `failed`. Status changes go
back through the writer as `DeliveryResult` intents of the `outbox` projection
(this module's `AlertOutbox` again), never written from the lane's thread. At
start the pending rows are loaded and offered, so a collector restarted while a
receiver was down still delivers.

Delivery is at least once: a collector killed between a receiver's 2xx and the
commit of `delivered` sends that row again after the restart. A receiver dedupes
on `llmwatch.delivery_id` (the row id, inside the signed body; retries send the
same bytes).
"""

from __future__ import annotations

import base64
import heapq
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb

from collector.alerts import payloads
from collector.store.actions import ActionPlan
from collector.store.incidents import IncidentPlan
from collector.store.projection import Group, Projection

log = logging.getLogger("collector.alerts.outbox")

WEBHOOK, ALERTMANAGER = "webhook", "alertmanager"
WEBHOOK_SECRET_ENV = "LLMWATCH_WEBHOOK_SECRET"  # the webhook HMAC key, when not in --webhook-secret-file
AM_ALERTS_PATH = "/api/v2/alerts"
_LABEL_FIELDS = ("kind", "severity", "rank", "node")  # what a resolved alert repeats from the firing one
ACTION_ROW = "action"  # alert_outbox.kind of an action's alert
ACTION_ALERTS_AGAIN = frozenset({"done", "failed"})  # an action that reaches these alerts once more
MAX_ERROR_CHARS = 300


# -- receivers ------------------------------------------------------------------------
def redact_url(url: str) -> str:
    """What a log may say about `url`: its scheme, host and port (no userinfo, path,
    query or fragment, any of which may hold a token)."""
    try:
        u = urllib.parse.urlsplit(url)
        host = u.hostname or "?"
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "<unparsable URL>"
    host = f"[{host}]" if ":" in host else host
    return f"{u.scheme}://{host}{port}/..."


def check_url(url: str, *, flag: str) -> None:
    """ValueError unless `url` is http(s) with a host. The message holds no more of
    the URL than `redact_url` shows."""
    try:
        u = urllib.parse.urlsplit(url)
        u.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError:
        raise ValueError(f"{flag}: not a URL") from None
    if u.scheme not in ("http", "https"):
        raise ValueError(f"{flag}: {u.scheme or 'a URL without a scheme'}:// is not http(s); "
                         "alerts go to http:// or https:// URLs")
    if not u.hostname:
        raise ValueError(f"{flag}: the URL has no host")


@dataclass(frozen=True, slots=True)
class Receiver:
    """Where one receiver's alerts go. `url` and `secret` never reach a log or a table."""

    name: str  # webhook:1, alertmanager:1
    kind: str  # WEBHOOK or ALERTMANAGER
    url: str = field(repr=False)
    secret: bytes = field(default=b"", repr=False)  # HMAC key of a webhook's X-Signature-256

    def __repr__(self) -> str:
        return f"Receiver({self.name}, {redact_url(self.url)})"

    @property
    def endpoint(self) -> str:
        """The URL to POST to, without userinfo (sent as Basic auth instead)."""
        u = urllib.parse.urlsplit(self.url)
        netloc = u.hostname or ""
        netloc = f"[{netloc}]" if ":" in netloc else netloc
        if u.port:
            netloc += f":{u.port}"
        path = u.path
        if self.kind == ALERTMANAGER and not path.rstrip("/").endswith(AM_ALERTS_PATH):
            path = path.rstrip("/") + AM_ALERTS_PATH
        return urllib.parse.urlunsplit((u.scheme, netloc, path or "/", u.query, ""))

    def headers(self, body: bytes) -> dict[str, str]:
        h = {"Content-Type": "application/json", "User-Agent": "llmwatch-collector"}
        u = urllib.parse.urlsplit(self.url)
        if u.username is not None:
            cred = f"{urllib.parse.unquote(u.username)}:{urllib.parse.unquote(u.password or '')}"
            h["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        if self.kind == WEBHOOK:
            h[payloads.SIGNATURE_HEADER] = payloads.sign(body, self.secret)
        return h

    def scrub(self, text: str) -> str:
        """`text` without any part of the URL that may be a credential."""
        u = urllib.parse.urlsplit(self.url)
        secrets = [self.url, self.endpoint, u.netloc, u.path + ("?" + u.query if u.query else ""), u.query,
                   u.password or "", u.username or ""]
        for s in sorted((s for s in secrets if s and s != "/" and len(s) > 1), key=len, reverse=True):
            text = text.replace(s, "...")
        return text


def build_receivers(*, webhooks: Sequence[str] = (), alertmanagers: Sequence[str] = (),
                    webhook_secret: str | bytes = "") -> list[Receiver]:
    """The receivers the flags name. ValueError for a URL that is not http(s), or for
    webhooks without a secret: a webhook is always signed, so that its receiver can
    tell our alerts from anyone's who learns its URL."""
    secret = webhook_secret.encode() if isinstance(webhook_secret, str) else bytes(webhook_secret)
    out = []
    for n, url in enumerate(webhooks, 1):
        check_url(url, flag=f"--webhook #{n}")
        out.append(Receiver(f"{WEBHOOK}:{n}", WEBHOOK, url, secret))
    for n, url in enumerate(alertmanagers, 1):
        check_url(url, flag=f"--alertmanager #{n}")
        out.append(Receiver(f"{ALERTMANAGER}:{n}", ALERTMANAGER, url))
    if webhooks and not secret.strip():
        raise ValueError("--webhook needs a secret to sign with: --webhook-secret-file FILE (0600) or "
                         "$LLMWATCH_WEBHOOK_SECRET (receivers check X-Signature-256; docs/operations.md)")
    return out


# -- rows and intents ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Delivery:
    """One pending alert_outbox row, as the sender holds it."""

    id: int
    receiver: str
    body: bytes
    attempts: int
    next_attempt_ts: float
    created_ts: float


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """Intent for the `outbox` projection: what one delivery attempt came to."""

    id: int
    status: str  # 'pending' (will retry), 'delivered' or 'failed'
    attempts: int
    next_attempt_ts: float
    last_error: str | None = None  # None: keep the row's (a delivery after failures keeps the last one)
    delivered_ts: float | None = None


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


# -- sending ------------------------------------------------------------------------------
Transport = Callable[[str, bytes, Mapping[str, str], float], int]  # (url, body, headers, timeout_s) -> status


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # a 3xx is an answer, not a detour
        return None


_OPENER = urllib.request.build_opener(_NoRedirect())


def urllib_transport(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> int:
    """POST `body`; the HTTP status (any, 2xx or not). Raises OSError when there is none
    (refused, reset, timed out: `timeout_s` bounds the connect and each read)."""
    req = urllib.request.Request(url, data=body, method="POST", headers=dict(headers))
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            resp.read(64 * 1024)
            return resp.status
    except urllib.error.HTTPError as e:
        e.close()
        return e.code


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """When to try again and when to give up. Defaults: 1 s doubling to 5 min, for
    a day (an outage of a receiver up to a day loses nothing)."""

    base_s: float = 1.0
    cap_s: float = 300.0
    max_age_s: float = 86400.0  # give up once an alert is this old ...
    max_attempts: int = 0  # ... or has been tried this often (0: no limit but the age)

    def gives_up(self, *, attempts: int, age_s: float) -> bool:
        return age_s >= self.max_age_s or (self.max_attempts > 0 and attempts >= self.max_attempts)


def describe_error(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        reason = e.reason
        return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else f"URLError: {reason}"
    return f"{type(e).__name__}: {e}"


class Lane:
    """One receiver's pending deliveries, tried in due order on a thread of their own.
    The lock guards the heap only; it is never held while a request runs."""

    def __init__(self, receiver: Receiver, *, report: Callable[[DeliveryResult], None], transport: Transport,
                 policy: RetryPolicy, clock: Callable[[], float], rand: Callable[[], float], timeout_s: float,
                 count: Callable[[str, str], None] | None = None) -> None:
        self.receiver = receiver
        self._report, self._transport, self._policy = report, transport, policy
        self._clock, self._rand, self._timeout_s = clock, rand, timeout_s
        self._count = count or (lambda receiver, outcome: None)
        self._heap: list[tuple[float, int, Delivery]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._drain = False  # when stopping: one last try of what is due first
        self._thread = threading.Thread(target=self._run, name=f"alerts-{receiver.name}", daemon=True)

    def offer(self, deliveries: Iterable[Delivery]) -> None:
        with self._cond:
            for d in deliveries:
                heapq.heappush(self._heap, (d.next_attempt_ts, d.id, d))
            self._cond.notify()

    def num_pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def next_due_ts(self) -> float | None:
        with self._cond:
            return self._heap[0][0] if self._heap else None

    def _pop_due(self, now: float) -> Delivery | None:
        with self._cond:
            if self._heap and self._heap[0][0] <= now:
                return heapq.heappop(self._heap)[2]
        return None

    def deliver_due(self) -> int:
        """Try every delivery that is due now, once each; how many were tried."""
        tried = 0
        now = self._clock()
        while (d := self._pop_due(now)) is not None:
            self._attempt(d)
            tried += 1
        return tried

    def _attempt(self, d: Delivery) -> None:
        r = self.receiver
        error = None
        try:
            status = self._transport(r.endpoint, d.body, r.headers(d.body), self._timeout_s)
            if not 200 <= status < 300:
                error = f"HTTP {status}"
        except Exception as e:  # refused, reset, timed out, or a transport's bug: try again later
            error = describe_error(e)
        now = self._clock()
        attempts = d.attempts + 1
        if error is None:
            self._count(r.name, "delivered")
            self._report(DeliveryResult(d.id, "delivered", attempts, d.next_attempt_ts, None, now))
            return
        error = r.scrub(error)[:MAX_ERROR_CHARS]
        if self._policy.gives_up(attempts=attempts, age_s=now - d.created_ts):
            self._count(r.name, "failed")
            log.error("alert %d to %s (%s) given up after %d attempts: %s", d.id, r.name, redact_url(r.url),
                      attempts, error)
            self._report(DeliveryResult(d.id, "failed", attempts, d.next_attempt_ts, error))
            return
        delay_s = payloads.retry_delay_s(attempts, base_s=self._policy.base_s, cap_s=self._policy.cap_s,
                                       rand=self._rand)
        nxt = Delivery(d.id, d.receiver, d.body, attempts, now + delay_s, d.created_ts)
        self._count(r.name, "retry")
        log.warning("alert %d to %s (%s) not delivered (attempt %d): %s; next try in %.1f s", d.id, r.name,
                    redact_url(r.url), attempts, error, delay_s)
        self._report(DeliveryResult(d.id, "pending", attempts, nxt.next_attempt_ts, error))
        self.offer([nxt])

    # -- the thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def request_stop(self, *, drain: bool = False) -> None:
        """End the thread; with `drain`, after one more try of every delivery due now."""
        with self._cond:
            self._stopping, self._drain = True, drain
            self._cond.notify()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    wait_s = None if not self._heap else self._heap[0][0] - self._clock()
                    if wait_s is not None and wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                stopping, drain = self._stopping, self._drain
            if stopping and not drain:
                return
            try:
                self.deliver_due()
            except Exception:  # a bug: log it, keep the lane (the row stays pending in the table)
                log.exception("alert lane %s failed", self.receiver.name)
                if not stopping:
                    with self._cond:
                        self._cond.wait(1.0)
            if stopping:
                return


class Sender:
    """Every receiver's lane. `report(result)` hands a DeliveryResult to the writer
    (Storage: `submit_intent("outbox", ...)`, which never blocks)."""

    def __init__(self, receivers: Sequence[Receiver], *, report: Callable[[DeliveryResult], None],
                 transport: Transport = urllib_transport, policy: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.time, rand: Callable[[], float] = random.random,
                 timeout_s: float = 5.0, count: Callable[[str, str], None] | None = None) -> None:
        self.lanes = {r.name: Lane(r, report=report, transport=transport, policy=policy, clock=clock, rand=rand,
                                   timeout_s=timeout_s, count=count) for r in receivers}
        self._unknown_logged: set[str] = set()

    def offer(self, deliveries: Iterable[Delivery]) -> None:
        """Queue deliveries (from the writer thread after a commit, or at start): cheap."""
        by_lane: dict[str, list[Delivery]] = {}
        for d in deliveries:
            by_lane.setdefault(d.receiver, []).append(d)
        for name, ds in by_lane.items():
            lane = self.lanes.get(name)
            if lane is not None:
                lane.offer(ds)
            elif name not in self._unknown_logged:
                self._unknown_logged.add(name)
                log.warning("%d pending alert(s) for %s stay pending: no such receiver is configured now",
                            len(ds), name)

    def deliver_due(self) -> int:
        """Every lane's due deliveries, tried once each on this thread (tests)."""
        return sum(lane.deliver_due() for lane in self.lanes.values())

    def num_pending(self) -> int:
        return sum(lane.num_pending() for lane in self.lanes.values())

    def start(self) -> None:
        for lane in self.lanes.values():
            lane.start()

    def stop(self, timeout_s: float = 10.0, *, drain: bool = False) -> None:
        """Stop every lane, within `timeout_s`: one in a request finishes it (bounded by
        the request timeout); with `drain`, each first tries once what is due now."""
        for lane in self.lanes.values():
            lane.request_stop(drain=drain)
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes.values():
            lane.join(max(0.0, deadline - time.monotonic()))

    def alive(self) -> bool:
        return all(lane.alive() for lane in self.lanes.values())
