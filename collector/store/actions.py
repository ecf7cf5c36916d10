"""Actions: what the healing policy did about an incident, through the writer.

The policy (collector/live/policy.py) turns incidents into actions (roll back, isolate a
node, restart). Every decision is an `actions` row, whatever came of it:

    shadow    `--policy shadow`: recorded what it would have done, did nothing
    refused   a guard rail said no (cooldown, rollback cap, min nodes: detail says which)
    issued    its command is stored (command_id) -> acked (the trainer took it,
              started_ts) -> done or failed (finished_ts; attempt, recovery_s when known)

`mode` says how it was taken ('auto' or 'shadow'; `dry_run` is mode = 'shadow').
A terminal status (done, failed, refused, shadow) sets finished_ts, unless given.

`ActionsProjection` takes three intents, planned before the commit and applied
after it like every projection (collector/store/projection.py):

- `RecordAction`: insert a row; answered with its id (ids from `Ids`, like commands);
- `UpdateAction`: set some of UPDATE_FIELDS; answered with the row as it is after.
  A detail object is merged into the row's (its keys win), so the decision's
  reason stays beside what came of it; any other detail replaces it;
- `SetNodeStatus`: upsert the node's `nodes` row (healthy, suspect, isolated);
  'isolated' sets isolated_ts (kept while it stays isolated, and after);
- `MarkKnownGood`: the run's checkpoints of an attempt at or below the known-good
  watermark get `known_good` (collector/live/watermark.py; the detection runner sends
  it when the watermark moves, or a checkpoint was reported). Answered with None.

A malformed intent (unknown status, an id that is no action, a detail that is no
JSON) is answered with its error, and the rest of its group commits as usual.

Hooks (`ActionHook`: the alert outbox, collector/alerts/outbox.py) see every plan's changes
and write their rows in the same transaction, so the alert about an action commits
(or rolls back) with it.

`BadBatchesProjection` stores the samples a rollback skipped: each rank's trainer
reports `batch_skipped` events (data: epoch, sample_from, sample_to, step,
incident_id, verdict); their window becomes one `bad_batches` row, in the
transaction of the events themselves. A malformed one stays an event only.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import duckdb
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from collector.ingest.decode import INT32_MAX, INT64_MAX, Int64, json_text
from collector.store.commands import KIND_RE
from collector.store.projection import Group, Ids, Projection

log = logging.getLogger("collector.store.actions")

STATUSES = ("shadow", "issued", "acked", "done", "failed", "refused")
TERMINAL = frozenset({"done", "failed", "refused", "shadow"})
LEGACY_STATUSES = ("requested", "running")  # rows and callers from before schema v7: still accepted
MODES = ("auto", "shadow")
NODE_STATUSES = ("healthy", "suspect", "isolated")
UPDATE_FIELDS = ("status", "command_id", "attempt", "started_ts", "finished_ts", "recovery_s", "detail")


@dataclass(frozen=True, slots=True)
class RecordAction:
    """Intent: insert an action. Answered with its id."""

    run_id: str
    kind: str
    status: str
    mode: str = "auto"
    incident_id: int | None = None
    command_id: int | None = None
    node: str | None = None
    rank: int | None = None
    detail: Any = None


@dataclass(frozen=True, slots=True)
class UpdateAction:
    """Intent: set `fields` (some of UPDATE_FIELDS) of an action (a detail object is merged
    into the row's). Answered with its row after."""

    action_id: int
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SetNodeStatus:
    """Intent: a node's status (NODE_STATUSES), why, and the incident behind it. Answered with None."""

    run_id: str
    node: str
    status: str
    reason: str | None = None
    incident_id: int | None = None


@dataclass(frozen=True, slots=True)
class MarkKnownGood:
    """Intent: checkpoints of `run_id`'s `attempt` at or below `step` are known-good."""

    run_id: str
    attempt: int
    step: int


@dataclass(slots=True)
class ActionPlan:
    inserts: list[dict[str, Any]] = field(default_factory=list)  # full rows (detail as an object)
    updates: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (id, columns to set)
    # per inserted or updated action, in intent order: (the row before, None for an insert; the row after)
    changes: list[tuple[dict[str, Any] | None, dict[str, Any]]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)  # nodes rows to upsert, in order
    known_good: list[MarkKnownGood] = field(default_factory=list)
    next_id: int = 0
    results: list[Any] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)  # each ActionHook's plan, in order


class ActionHook(Protocol):
    """Something written with action changes, in their transaction (as IncidentHook
    is for incidents): `plan_actions` is pure (reads `plan.changes`), `write_actions`
    runs inside the transaction after the action rows, `apply_actions` after the commit."""

    def plan_actions(self, plan: ActionPlan, group: Group) -> Any: ...

    def write_actions(self, con: duckdb.DuckDBPyConnection, hook_plan: Any, group: Group) -> None: ...

    def apply_actions(self, hook_plan: Any, group: Group) -> None: ...


# -- validation: ValueError with a reason -------------------------------------------------
def _check_int(name: str, v: Any, lo: int, hi: int) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi):
        raise ValueError(f"{name} must be null or an integer in [{lo}, {hi}]")


def _check_seconds(name: str, v: Any) -> None:
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
        raise ValueError(f"{name} must be null or a finite number of seconds")


def _check_status(status: Any) -> None:
    if status not in STATUSES and status not in LEGACY_STATUSES:
        raise ValueError(f"action status {status!r} is none of {STATUSES}")


def _check_text(name: str, v: Any, *, required: bool = False) -> None:
    if (v is None and required) or (v is not None and (not isinstance(v, str) or not v or len(v) > 200)):
        raise ValueError(f"{name} must be {'' if required else 'null or '}a non-empty string (200 chars at most)")


def check_record(it: RecordAction) -> None:
    _check_text("run_id", it.run_id, required=True)
    if not isinstance(it.kind, str) or not KIND_RE.match(it.kind):
        raise ValueError("action kind must be a lowercase identifier such as 'rollback', 'isolate', 'restart'")
    _check_status(it.status)
    if it.mode not in MODES:
        raise ValueError(f"action mode {it.mode!r} is none of {MODES}")
    _check_int("incident_id", it.incident_id, -INT64_MAX - 1, INT64_MAX)
    _check_int("command_id", it.command_id, -INT64_MAX - 1, INT64_MAX)
    _check_int("rank", it.rank, -1, INT32_MAX)
    _check_text("node", it.node)
    json_text(it.detail)  # ValueError (BatchRejected) for what JSON cannot hold


def check_update(it: UpdateAction) -> None:
    _check_int("action_id", it.action_id, -INT64_MAX - 1, INT64_MAX)
    if it.action_id is None or not isinstance(it.fields, Mapping) or not it.fields:
        raise ValueError("an action update needs an action id and some fields")
    unknown = set(it.fields) - set(UPDATE_FIELDS)
    if unknown:
        raise ValueError(f"unknown action fields {sorted(unknown)}; give some of {UPDATE_FIELDS}")
    f = it.fields
    if "status" in f:
        _check_status(f["status"])
    _check_int("command_id", f.get("command_id"), -INT64_MAX - 1, INT64_MAX)
    _check_int("attempt", f.get("attempt"), 0, INT32_MAX)
    for name in ("started_ts", "finished_ts", "recovery_s"):
        _check_seconds(name, f.get(name))
    json_text(f.get("detail"))


def check_node(it: SetNodeStatus) -> None:
    _check_text("run_id", it.run_id, required=True)
    _check_text("node", it.node, required=True)
    if it.status not in NODE_STATUSES:
        raise ValueError(f"node status {it.status!r} is none of {NODE_STATUSES}")
    if it.reason is not None and not isinstance(it.reason, str):
        raise ValueError("reason must be null or a string")
    _check_int("incident_id", it.incident_id, -INT64_MAX - 1, INT64_MAX)


# -- the projection ----------------------------------------------------------------------
_NODE_UPSERT = """
    INSERT INTO nodes (run_id, node, status, reason, updated_ts, isolated_ts, incident_id)
    VALUES (?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (run_id, node) DO UPDATE SET
        isolated_ts = CASE WHEN excluded.status = 'isolated' AND nodes.status IS DISTINCT FROM 'isolated'
                           THEN excluded.isolated_ts ELSE nodes.isolated_ts END,
        status = excluded.status, reason = excluded.reason, updated_ts = excluded.updated_ts,
        incident_id = excluded.incident_id"""


def _row(names: Sequence[str], values: Sequence[Any]) -> dict[str, Any]:
    row = dict(zip(names, values))
    row["detail"] = json.loads(row["detail"]) if row.get("detail") is not None else None
    return row


class ActionsProjection(Projection):
    """`actions` rows and `nodes` statuses from the policy's intents (and the Storage methods)."""

    name = "actions"

    def __init__(self, con: duckdb.DuckDBPyConnection, *, ids: Ids, hooks: Sequence[ActionHook] = ()) -> None:
        self._con = con
        self._ids = ids
        self.hooks = list(hooks)

    def _committed(self, ids: set[int]) -> dict[int, dict[str, Any]]:
        """The committed rows of `ids` (read before the transaction, like commands' run sizes)."""
        if not ids:
            return {}
        cur = self._con.execute(f"SELECT * FROM actions WHERE id IN ({', '.join('?' * len(ids))})", sorted(ids))
        names = [d[0] for d in cur.description]
        return {r["id"]: r for r in (_row(names, v) for v in cur.fetchall())}

    def plan(self, group: Group) -> ActionPlan | None:
        intents = group.intents.get(self.name)
        if not intents:
            return None
        now = group.now
        plan = ActionPlan(next_id=self._ids.peek("actions"))
        committed = self._committed({i.action_id for i in intents if isinstance(i, UpdateAction)
                                     and isinstance(i.action_id, int) and not isinstance(i.action_id, bool)})
        rows: dict[int, dict[str, Any]] = {}  # this plan's view on top of `committed`
        for it in intents:
            try:
                plan.results.append(self._plan_one(plan, it, rows, committed, now))
            except (ValueError, TypeError, KeyError) as e:
                plan.results.append(e)
        plan.hooks = [h.plan_actions(plan, group) for h in self.hooks]
        return plan

    def _plan_one(self, plan: ActionPlan, it: Any, rows: dict[int, dict[str, Any]],
                  committed: dict[int, dict[str, Any]], now: float) -> Any:
        if isinstance(it, RecordAction):
            check_record(it)
            aid = plan.next_id
            plan.next_id += 1
            row = {"id": aid, "run_id": it.run_id, "incident_id": it.incident_id, "kind": it.kind,
                   "status": it.status, "dry_run": it.mode == "shadow", "requested_ts": now,
                   "finished_ts": now if it.status in TERMINAL else None, "detail": it.detail, "mode": it.mode,
                   "command_id": it.command_id, "node": it.node, "rank": it.rank, "attempt": None,
                   "started_ts": None, "recovery_s": None, "updated_ts": now}
            plan.inserts.append(row)
            rows[aid] = row
            plan.changes.append((None, row))
            return aid
        if isinstance(it, UpdateAction):
            check_update(it)
            before = rows.get(it.action_id) or committed.get(it.action_id)
            if before is None:
                raise KeyError(f"no action {it.action_id}")
            values = {**it.fields, "updated_ts": now}
            if isinstance(values.get("detail"), Mapping) and isinstance(before.get("detail"), Mapping):
                values["detail"] = {**before["detail"], **values["detail"]}  # the decision's why stays
            if values.get("status") in TERMINAL and values.get("finished_ts") is None:
                values["finished_ts"] = now
            after = {**before, **values}
            plan.updates.append((it.action_id, values))
            rows[it.action_id] = after
            plan.changes.append((before, after))
            return dict(after)
        if isinstance(it, SetNodeStatus):
            check_node(it)
            plan.nodes.append({"run_id": it.run_id, "node": it.node, "status": it.status, "reason": it.reason,
                               "updated_ts": now, "isolated_ts": now if it.status == "isolated" else None,
                               "incident_id": it.incident_id})
            return None
        if isinstance(it, MarkKnownGood):
            plan.known_good.append(it)
            return None
        raise TypeError(f"not an action intent: {it!r}")

    def write(self, con: duckdb.DuckDBPyConnection, plan: ActionPlan | None, group: Group) -> None:
        if plan is None:
            return
        for row in plan.inserts:
            names = list(row)
            con.execute(f"INSERT INTO actions ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                        [json_text(row[n]) if n == "detail" else row[n] for n in names])
        for aid, values in plan.updates:
            sets = ", ".join(f"{k} = ?" for k in values)
            con.execute(f"UPDATE actions SET {sets} WHERE id = ?",
                        [*(json_text(v) if k == "detail" else v for k, v in values.items()), aid])
        for n in plan.nodes:
            con.execute(_NODE_UPSERT, [n["run_id"], n["node"], n["status"], n["reason"], n["updated_ts"],
                                       n["isolated_ts"], n["incident_id"]])
        for m in plan.known_good:
            con.execute("UPDATE checkpoints SET known_good = true WHERE run_id = ? AND attempt = ? AND step <= ? "
                        "AND NOT known_good", [m.run_id, m.attempt, m.step])
        for hook, hook_plan in zip(self.hooks, plan.hooks):
            hook.write_actions(con, hook_plan, group)

    def apply(self, plan: ActionPlan | None, group: Group) -> None:
        if plan is not None:
            self._ids.advance("actions", plan.next_id)
            for hook, hook_plan in zip(self.hooks, plan.hooks):
                hook.apply_actions(hook_plan, group)

    def results(self, plan: ActionPlan | None) -> list[Any]:
        return plan.results if plan is not None else []


# -- bad batches: the samples a rollback skipped ----------------------------------------
BATCH_SKIPPED = "batch_skipped"


class BatchSkipped(BaseModel):
    """A `batch_skipped` event's data (the event's own step is the default)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")
    epoch: Int64
    sample_from: Int64
    sample_to: Int64
    step: Int64 | None = None
    incident_id: Int64 | None = None
    verdict: Annotated[str, Field(max_length=200)] | None = None


_BAD_BATCH_COLUMNS = ("run_id", "epoch", "sample_from", "sample_to", "step", "incident_id", "verdict", "ts")
_BAD_BATCH_TYPES = (pa.string(), pa.int64(), pa.int64(), pa.int64(), pa.int64(), pa.int64(), pa.string(),
                    pa.float64())


def bad_batch_rows(group: Group) -> list[tuple[Any, ...]]:
    """The fresh batches' skipped windows, once each (every rank reports the same one:
    the first report counts), in arrival order."""
    out: dict[tuple[str, int, int, int], tuple[Any, ...]] = {}
    for b in group.fresh:
        for e in b.events:
            if e.kind != BATCH_SKIPPED:
                continue
            try:
                data = json.loads(e.data_json) if e.data_json else {}
                s = BatchSkipped.model_validate({"step": e.step, **data} if e.step is not None else data)
            except (ValidationError, ValueError, TypeError) as err:
                log.warning("a batch_skipped event of run %r rank %d is no skipped window (kept as an event "
                            "only): %s", b.run_id, b.rank, str(err).splitlines()[0])
                continue
            if s.sample_to < s.sample_from:
                log.warning("a batch_skipped event of run %r rank %d has sample_to < sample_from: kept as an "
                            "event only", b.run_id, b.rank)
                continue
            key = (b.run_id, s.epoch, s.sample_from, s.sample_to)
            out.setdefault(key, (*key, s.step, s.incident_id, s.verdict, e.ts))
    return list(out.values())


class BadBatchesProjection(Projection):
    """`bad_batches` rows from fresh `batch_skipped` events, in their transaction.
    A window stored already is left as it is (ON CONFLICT DO NOTHING). No state."""

    name = "bad_batches"
    writes = ("bad_batches",)

    def plan(self, group: Group) -> pa.Table | None:
        rows = bad_batch_rows(group)
        if not rows:
            return None
        return pa.table({name: pa.array([r[i] for r in rows], t)
                         for i, (name, t) in enumerate(zip(_BAD_BATCH_COLUMNS, _BAD_BATCH_TYPES))})

    def write(self, con: duckdb.DuckDBPyConnection, plan: pa.Table | None, group: Group) -> None:
        if plan is None:
            return
        con.register("__bad_batches", plan)
        try:
            con.execute(f"INSERT INTO bad_batches ({', '.join(_BAD_BATCH_COLUMNS)}) "
                        "SELECT * FROM __bad_batches ON CONFLICT DO NOTHING")
        finally:
            con.unregister("__bad_batches")
