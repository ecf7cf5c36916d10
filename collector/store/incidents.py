"""Incidents: one row per cause, opened, updated and closed through the writer.

The analysis (analysis/findings.py `Finding`) reports findings; the detection
runner (collector/live/detection.py) hands them to the writer as a `RecordFindings`
intent, and this projection turns them into rows. One incident per cause: a cause
is (run_id, key), the key naming the cause within the run ("straggler:node1#1");
a manual incident's is `default_key` ("kind:rank:node"). For a cause:

- nothing open: a finding opens an incident (status 'open', step range, evidence);
- open: a finding updates it (step range widened, severity, evidence, root cause and
  confidence replaced by the newest given), and a resolved finding closes it
  (status 'closed', closed_ts).

Times: opened_ts and closed_ts are the finding's `ts` (the `now` of the pass
that found it) when it has one (> 0), else the commit's time.

The key is stored (`incidents.cause_key`), so after a restart `OpenIncidents`
reloads the open rows under their causes and a finding about the same cause
updates its incident rather than opening a second one.

`OpenIncidents` is the pure part, the writer's index of the open rows, owned by
the writer thread: plan against it, apply after the commit. (The analysis's own
`IncidentBook` is on the other side: per run, what its detectors last reported,
so that only a change is emitted.) Manual writes (`OpenIncident`,
`UpdateIncident`: the Storage methods) take the same path, so the index never
goes stale behind them.

Hooks (`IncidentHook`: the alert outbox, collector/alerts/outbox.py) see every plan's
inserts and updates and write their own rows in the same transaction, so what
reports an incident change commits (or rolls back) with the change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import duckdb

from analysis.findings import Finding
from collector.ingest.decode import json_text
from collector.store.projection import Group, Ids, Projection

INCIDENT_FIELDS = ("kind", "severity", "rank", "node", "step_from", "step_to", "status", "evidence",
                   "root_cause", "confidence")
_JSON_FIELDS = frozenset({"evidence"})
Cause = tuple[str, str]  # run_id, key


def default_key(kind: str, rank: int | None, node: str | None) -> str:
    return f"{kind}:{'-' if rank is None else rank}:{node or '-'}"


@dataclass(frozen=True, slots=True)
class RecordFindings:
    """Intent: one detector pass's findings for one run. Answered with, per finding,
    the id of the incident it opened, updated or closed (None: nothing to close)."""

    run_id: str
    findings: tuple[Finding, ...]


@dataclass(frozen=True, slots=True)
class OpenIncident:
    """Intent: insert an incident as given (fields: INCIDENT_FIELDS). Answered with its id."""

    run_id: str
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class UpdateIncident:
    """Intent: change fields of an incident by id; a status other than 'open' closes it."""

    incident_id: int
    values: dict[str, Any]
    # a rerun's verdict: this root cause (and confidence) stands; detectors' later
    # updates of the incident keep their evidence but no longer replace it
    settled: bool = False


@dataclass(slots=True)
class OpenRow:
    """What the book knows of an open incident."""

    id: int
    cause: Cause
    step_from: int | None
    step_to: int | None


@dataclass(slots=True)
class IncidentPlan:
    inserts: list[dict[str, Any]] = field(default_factory=list)  # full rows
    updates: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (id, columns to set)
    opened: dict[Cause, OpenRow] = field(default_factory=dict)  # open after the commit
    closed: set[int] = field(default_factory=set)  # ids closed by the commit
    settled: set[int] = field(default_factory=set)  # ids whose root cause a verdict settled in the commit
    next_id: int = 0
    results: list[Any] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)  # each IncidentHook's plan, in order


class IncidentHook(Protocol):
    """Something written with incident changes, in their transaction. The same
    contract as a Projection: `plan_incidents` is pure (reads `plan.inserts` and
    `plan.updates`, changes nothing), `write_incidents` runs inside the transaction
    after the incident rows, `apply_incidents` after the commit."""

    def plan_incidents(self, plan: IncidentPlan, group: Group) -> Any: ...

    def write_incidents(self, con: duckdb.DuckDBPyConnection, hook_plan: Any, group: Group) -> None: ...

    def apply_incidents(self, hook_plan: Any, group: Group) -> None: ...


def _widen(lo: int | None, hi: int | None, f: Finding) -> tuple[int | None, int | None]:
    los = [v for v in (lo, f.step_from) if v is not None]
    his = [v for v in (hi, f.step_to, f.step_from) if v is not None]
    return (min(los) if los else None), (max(his) if his else None)


class OpenIncidents:
    """The open incidents by cause. Owned by the writer thread (no locking)."""

    def __init__(self) -> None:
        self._open: dict[Cause, OpenRow] = {}
        self._cause_of: dict[int, Cause] = {}
        self._settled: set[int] = set()  # root cause settled by a verdict: findings keep off it

    @classmethod
    def load(cls, con: duckdb.DuckDBPyConnection) -> "OpenIncidents":
        book = cls()
        rows = con.execute("SELECT id, run_id, kind, rank, node, step_from, step_to, cause_key FROM incidents "
                           "WHERE status = 'open' ORDER BY id").fetchall()
        for iid, run_id, kind, rank, node, lo, hi, key in rows:
            book._add(OpenRow(iid, (run_id, key or default_key(kind, rank, node)), lo, hi))
        return book

    def _add(self, row: OpenRow) -> None:
        self._open.setdefault(row.cause, row)  # two open rows for one cause (manual): the first counts
        self._cause_of[row.id] = row.cause

    def open_for(self, cause: Cause) -> OpenRow | None:
        return self._open.get(cause)

    def plan(self, intents: Sequence[Any], *, now: float, next_id: int) -> IncidentPlan:
        """Rows to insert and update for `intents` in order, against the book and
        what the earlier intents of the same plan did. Changes nothing."""
        plan = IncidentPlan(next_id=next_id)
        opened: dict[Cause, OpenRow | None] = {}  # this plan's view on top of the book: None = closed

        def current(cause: Cause) -> OpenRow | None:
            return opened[cause] if cause in opened else self._open.get(cause)

        def unsettled(iid: int, values: dict[str, Any]) -> dict[str, Any]:
            if iid in self._settled or iid in plan.settled:
                return {k: v for k, v in values.items() if k not in ("root_cause", "confidence")}
            return values

        def insert(run_id: str, values: dict[str, Any], cause_key: str) -> int:
            iid = plan.next_id
            plan.next_id += 1
            plan.inserts.append({"id": iid, "run_id": run_id, "opened_ts": now, "updated_ts": now,
                                 "status": "open", **values, "cause_key": cause_key})
            return iid

        for intent in intents:
            if isinstance(intent, RecordFindings):
                ids = []
                for f in intent.findings:
                    cause = (intent.run_id, f.key)
                    row = current(cause)
                    at = f.ts if f.ts and f.ts > 0 else now
                    if f.resolved:
                        if row is not None:
                            plan.updates.append((row.id, unsettled(row.id, _closing(f, at, now))))
                            plan.closed.add(row.id)
                            opened[cause] = None
                        ids.append(row.id if row is not None else None)
                    elif row is None:
                        iid = insert(intent.run_id, {**_finding_columns(f), "opened_ts": at}, f.key)
                        opened[cause] = OpenRow(iid, cause, f.step_from, f.step_to if f.step_to is not None
                                                else f.step_from)
                        ids.append(iid)
                    else:
                        lo, hi = _widen(row.step_from, row.step_to, f)
                        opened[cause] = OpenRow(row.id, cause, lo, hi)
                        plan.updates.append((row.id, unsettled(row.id, _updating(f, lo, hi, now))))
                        ids.append(row.id)
                plan.results.append(ids)
            elif isinstance(intent, OpenIncident):
                values = dict(intent.values)
                key = default_key(values["kind"], values.get("rank"), values.get("node"))
                iid = insert(intent.run_id, values, key)
                if values.get("status", "open") == "open":
                    cause = (intent.run_id, key)
                    if current(cause) is None:
                        opened[cause] = OpenRow(iid, cause, values.get("step_from"), values.get("step_to"))
                plan.results.append(iid)
            elif isinstance(intent, UpdateIncident):
                values = {**intent.values, "updated_ts": now}
                if intent.values.get("status", "open") != "open":
                    values["closed_ts"] = now
                    plan.closed.add(intent.incident_id)
                    cause = self._cause_of.get(intent.incident_id)
                    if cause is not None and (row := current(cause)) is not None and row.id == intent.incident_id:
                        opened[cause] = None
                if intent.settled:
                    plan.settled.add(intent.incident_id)
                plan.updates.append((intent.incident_id, values))
                plan.results.append(None)
            else:
                plan.results.append(TypeError(f"not an incident intent: {intent!r}"))
        plan.opened = {c: r for c, r in opened.items() if r is not None}
        return plan

    def apply(self, plan: IncidentPlan) -> None:
        self._settled |= plan.settled
        for iid in plan.closed:
            cause = self._cause_of.pop(iid, None)
            if cause is not None and cause in self._open and self._open[cause].id == iid:
                del self._open[cause]
        for cause, row in plan.opened.items():
            self._open[cause] = row
            self._cause_of[row.id] = cause


def _finding_columns(f: Finding) -> dict[str, Any]:
    return {"kind": f.kind, "severity": f.severity, "rank": f.rank, "node": f.node, "step_from": f.step_from,
            "step_to": f.step_to if f.step_to is not None else f.step_from, "evidence": f.evidence,
            "root_cause": f.root_cause, "confidence": f.confidence}


def _updating(f: Finding, lo: int | None, hi: int | None, now: float) -> dict[str, Any]:
    """An open incident seen again: the range widened, the newest severity and culprit
    (a detector reports its whole current view of a cause: a slow rank that turns out
    to be a slow node names the node and no longer one rank), and, where given, the
    newest evidence, root cause and confidence."""
    values: dict[str, Any] = {"severity": f.severity, "rank": f.rank, "node": f.node, "step_from": lo,
                              "step_to": hi, "updated_ts": now}
    for name in ("evidence", "root_cause", "confidence"):
        if _given(getattr(f, name)):
            values[name] = getattr(f, name)
    return values


def _closing(f: Finding, at: float, now: float) -> dict[str, Any]:
    values: dict[str, Any] = {"status": "closed", "closed_ts": at, "updated_ts": now}
    for name in ("evidence", "root_cause"):
        if _given(getattr(f, name)):
            values[name] = getattr(f, name)
    return values


def _given(value: Any) -> bool:
    """A finding's field that says something: not None, "" or {} (Finding's defaults)."""
    return value is not None and value != "" and value != {}


def check_fields(values: Mapping[str, Any], *, required: Sequence[str] = ()) -> None:
    """ValueError unless `values` are INCIDENT_FIELDS (and hold `required`)."""
    unknown = set(values) - set(INCIDENT_FIELDS)
    if unknown:
        raise ValueError(f"unknown incident fields {sorted(unknown)}; give some of {INCIDENT_FIELDS}")
    missing = [k for k in required if values.get(k) is None]
    if missing:
        raise ValueError(f"an incident needs {missing}")


class IncidentsProjection(Projection):
    """`incidents` rows from findings and manual intents."""

    name = "incidents"

    def __init__(self, con: duckdb.DuckDBPyConnection, *, ids: Ids, hooks: Sequence[IncidentHook] = ()) -> None:
        self._ids = ids
        self.book = OpenIncidents.load(con)
        self.hooks = list(hooks)

    def plan(self, group: Group) -> IncidentPlan | None:
        intents = group.intents.get(self.name)
        if not intents:
            return None
        plan = self.book.plan(intents, now=group.now, next_id=self._ids.peek("incidents"))
        plan.hooks = [h.plan_incidents(plan, group) for h in self.hooks]
        return plan

    def write(self, con: duckdb.DuckDBPyConnection, plan: IncidentPlan | None, group: Group) -> None:
        if plan is None:
            return
        for row in plan.inserts:
            names = list(row)
            con.execute(f"INSERT INTO incidents ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                        [json_text(row[n]) if n in _JSON_FIELDS else row[n] for n in names])
        for iid, values in plan.updates:
            sets = ", ".join(f"{k} = ?" for k in values)
            con.execute(f"UPDATE incidents SET {sets} WHERE id = ?",
                        [*(json_text(v) if k in _JSON_FIELDS else v for k, v in values.items()), iid])
        for hook, hook_plan in zip(self.hooks, plan.hooks):
            hook.write_incidents(con, hook_plan, group)

    def apply(self, plan: IncidentPlan | None, group: Group) -> None:
        if plan is not None:
            self.book.apply(plan)
            self._ids.advance("incidents", plan.next_id)
            for hook, hook_plan in zip(self.hooks, plan.hooks):
                hook.apply_incidents(hook_plan, group)

    def results(self, plan: IncidentPlan | None) -> list[Any]:
        return plan.results if plan is not None else []
