"""The collector acting on incidents: the policy's decisions carried out and followed.

`analysis/policy.py` decides (pure); `PolicyRunner` is its hands, on a thread of
its own so that ingest never waits for it. What it hears:

- incident changes, in commit order: `IncidentWatch`, an IncidentHook of the
  incidents projection (collector/store/incidents.py), mirrors the open incidents and
  hands each changed row over after its commit;
- the trainer's events and the step rows, through a post-commit subscription
  (collector/store/feed.py): command acks, rerun verdicts, the end of a run, and the
  first new step after an action, which ends it.

What it does with a decision, through the writer (never blocking):

- `refused` (a guard rail) or `shadow`: an `actions` row with that status;
- `auto`: the command (`rollback`, `stop`, `isolate`, `repair`, `checkpoint`) is
  issued, and an `actions` row `issued` records it with its command id; an isolation also
  marks the node `isolated` in `nodes` (the supervisor watches for that, so a
  node whose ranks are stuck is still taken out); a crash's `restart` is the
  supervisor's own, recorded as `issued` without a command.

Then the row follows the action: `acked` when every rank acked the command
(`failed` when one refused it, with its reason), `done` with `recovery_s` when
the first step of the new attempt completes (for a rollback or a stop, of an
attempt after a rank acked it: a restart's new attempt is not the rollback's; a
command the old round received but left without carrying out is delivered again
to the new round, collector/store/commands.py) (`recovery_s`, from the incident's
`opened_ts`: training goes on), and its detail gets `caught_up_s` when the new
lineage passes the last step the abandoned one reached (the replay is the work
the fault cost). A repair or a checkpoint (`DONE_IN_PLACE`, analysis/kinds.py: no new attempt follows)
is `done` when every rank acked it.
Every recorded action is also an alert (the outbox's action hook).

A rerun verdict is also written to its incident's `root_cause`, with the
evidence the trainer gathered, before the policy decides on it.

An incident that taints the weights holds the run's known-good watermark below
its first step (collector/live/watermark.py) until the runner settles it: once it
is closed with nothing decided or only a record (shadow, refused, an alert), else
when the action ends (done, failed, or the run finished first).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from analysis.kinds import COSTED, DONE_IN_PLACE, ENDED_BY_RESTART, NEEDS_RUN_INPUTS
from analysis.policy import ISOLATE, REPAIR, RESTART, Decision, Policy, RunPolicy, apply_cost_inputs
from analysis.rules import Rules, merge_rules
from collector.read import queries
from collector.store.commands import FAILED_ACKS
from collector.store.feed import Subscription
from collector.store.incidents import IncidentPlan
from collector.store.projection import Group
from collector.threads import name_native

log = logging.getLogger("collector.live.policy")

_EVENT_KINDS = ("command_ack", "rerun_verdict", "run_finished", "run_started")
_TICK_S = 0.25  # how often open stragglers and waiting incidents are looked at again without news
_DEFER_MAX_S = 120.0  # an incident still waiting this long after it opened is dropped (logged)
_COST_INPUTS_S = 5.0  # a run's inputs to the cost model are read again at most this often
_REALIZED_STEPS = 20  # a costed action's realized gain: the step time over this many steps after it
_WENT_ON_STEPS = 8  # a crash's restart with this many new steps of its own attempt after it: the job went on


# the kinds whose evidence is the collectives: while one is open on a run, its summarizing agents
# ship op rows (agent/summary.py), so the incident has op-level detail in `collectives`
OPS_KINDS = frozenset({"straggler", "slow_link", "hang"})


class IncidentWatch:
    """An IncidentHook: the open incidents as their rows are now, and after each commit
    the rows it changed, handed to `on_change` (the runner's queue)."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.on_change: Callable[[list[dict[str, Any]]], None] | None = None
        self._open: dict[int, dict[str, Any]] = {}
        cur = con.execute("SELECT * FROM incidents WHERE status = 'open' ORDER BY id")
        names = [d[0] for d in cur.description]
        for row in cur.fetchall():
            self._open[row[0]] = _incident(dict(zip(names, row)))
        self._ops_runs = self._runs_of(OPS_KINDS)

    def _runs_of(self, kinds: frozenset[str]) -> frozenset[str]:
        return frozenset(str(r.get("run_id")) for r in self._open.values() if r.get("kind") in kinds)

    def wants_ops(self, run_id: str) -> bool:
        """An incident whose evidence is the collectives is open on `run_id` (any thread)."""
        return run_id in self._ops_runs

    def open_rows(self) -> list[dict[str, Any]]:
        return list(self._open.values())

    def plan_incidents(self, plan: IncidentPlan, group: Group) -> list[dict[str, Any]]:
        changed: dict[int, dict[str, Any]] = {}
        for row in plan.inserts:
            changed[row["id"]] = _incident(dict(row))
        for iid, values in plan.updates:
            before = changed.get(iid) or self._open.get(iid)
            if before is not None:
                changed[iid] = _incident({**before, **values})
        return list(changed.values())

    def write_incidents(self, con: duckdb.DuckDBPyConnection, rows: list[dict[str, Any]], group: Group) -> None:
        """Nothing of its own to write."""

    def apply_incidents(self, rows: list[dict[str, Any]], group: Group) -> None:
        for row in rows:
            if row.get("status", "open") == "open":
                self._open[row["id"]] = row
            else:
                self._open.pop(row["id"], None)
        if rows:
            self._ops_runs = self._runs_of(OPS_KINDS)  # one reference swapped: readers on other threads
        if rows and self.on_change is not None:
            self.on_change(rows)


def _incident(row: dict[str, Any]) -> dict[str, Any]:
    ev = row.get("evidence")
    if isinstance(ev, str):
        try:
            row["evidence"] = json.loads(ev)
        except ValueError:
            row["evidence"] = None
    return row


@dataclass(slots=True)
class Pending:
    """An action between `issued` and `done`."""

    action_id: int
    run_id: str
    kind: str
    incident_opened_ts: float | None
    attempt: int  # the newest attempt when it was issued: recovery is a step of a later one past the
    # last step the earlier attempts reached (their rows arrive first: the same agents ship in order)
    command_id: int | None = None
    acks: set[int] = field(default_factory=set)
    acked: bool = False
    # isolate and restart end with a new round of processes: only steps after its
    # `run_started` count (the old round may run a few more steps of a later attempt)
    needs_restart: bool = False
    recovered_ts: float | None = None  # done: training went on; pending until it caught up
    incident_id: int | None = None
    requested_ts: float | None = None
    predicted: dict[str, Any] | None = None  # the cost model's (an isolation for a slow-down)
    went_on: set[int] = field(default_factory=set)  # a crash's restart: steps of its own attempt reported after it


class PolicyRunner:
    def __init__(self, storage, policy: Policy, subscription: Subscription, watch: IncidentWatch, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.storage = storage
        self.policy = policy
        self.clock = clock
        self._sub = subscription
        self._watch = watch
        self._incidents: deque[list[dict[str, Any]]] = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # `_pending`: the writer thread's done callbacks add to it
        self._pending: dict[int, Pending] = {}
        self._runs: dict[str, RunPolicy] = {}
        self._reached: dict[str, dict[int, int]] = {}  # run -> attempt -> highest step seen
        self._world: dict[str, int] = {}
        self._node_map: dict[str, dict[int, str]] = {}
        self._deferred: dict[int, dict[str, Any]] = {}  # incidents the policy will decide on later (waiting)
        self._costs: dict[str, tuple[float, dict[str, Any]]] = {}  # run -> (read at, queries.cost_inputs)
        # the cost model's isolations that caught up: action id -> (pending, first step past, when)
        self._realizing: dict[int, tuple[Pending, dict[str, Any], float]] = {}
        # incidents with an action under way: (run_id, cause_key), whose watermark hold the action's end releases
        self._acting_on: dict[int, tuple[str, str | None]] = {}
        # runs with an action that may be decided any moment (Policy.watching): the ingest answers to
        # their rank 0 ask for a follow-up (read by the event loop: replaced whole, never mutated)
        self._watching: frozenset[str] = frozenset()
        self._thread = threading.Thread(target=self._run, name="llmwatch-policy", daemon=True)
        watch.on_change = self._offer

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        for row in self._watch.open_rows():  # what a restarted collector finds open
            self._incidents.append([row])
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._sub is not None:
            self._sub.wake()
        self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _offer(self, rows: list[dict[str, Any]]) -> None:  # on the writer thread: a deque append
        self._incidents.append(rows)
        if self._sub is not None:
            self._sub.wake()

    def _run(self) -> None:
        """Woken by a commit, an incident (`_offer`) or the tick: a wait of 50 ms polled 20
        times a second, and cost the embedded collector 2.5 ms of CPU a second doing it."""
        name_native("lw-policy")
        last_tick = 0.0
        while not self._stop.is_set():
            wait_s = max(0.0, last_tick + _TICK_S - self.clock()) if not self._incidents else 0.0
            delivery = self._sub.get(timeout_s=min(wait_s, _TICK_S))
            try:
                if delivery is not None:
                    self._commit(delivery.commit.tables)
                while self._incidents:
                    for row in self._incidents.popleft():
                        self._incident(row)
                now = self.clock()
                if now - last_tick >= _TICK_S:
                    last_tick = now
                    self._tick()
                watching = frozenset(r for r, st in self._runs.items() if self.policy.watching(st))
                if watching != self._watching:
                    self._watching = watching
            except Exception:  # noqa: BLE001 - the policy must outlive one bad input
                log.exception("policy pass failed")

    def watching(self, run_id: str) -> bool:
        """Whether an action may be decided for `run_id` any moment (any thread)."""
        return run_id in self._watching

    def _tick(self) -> None:
        """Without news: the open stragglers' persist timers, and the incidents the policy
        is waiting to decide on (`Policy.waiting`: a NaN settling for its culprit, an
        action held back by the cooldown, a replica_divergence's repair among them)."""
        for row in self._watch.open_rows():
            if row.get("kind") in COSTED:  # persist timers
                self._incident(row)
        for row in list(self._deferred.values()):
            self._incident(row)

    # -- inputs ------------------------------------------------------------------
    def _state(self, run_id: str) -> RunPolicy:
        st = self._runs.get(run_id)
        if st is None:
            st = self._runs[run_id] = RunPolicy(run_id=run_id)
            st.mode_cap = self._refresh_run(run_id)
            nodes = self.storage.read(_nodes_of, run_id)
            st.nodes = sorted(set(self._node_map.get(run_id, {}).values()) | set(nodes["all"]))
            st.isolated = set(nodes["isolated"])
            st.finished = nodes["finished"]
        reached = self._reached.get(run_id)
        if reached:  # the highest step the run reached: whether restarts make progress
            st.reached = max(reached.values())
        return st

    def _refresh_layout(self, run_id: str) -> dict[str, Any]:
        info = self.storage.read(_run_layout, run_id)
        self._world[run_id] = info["world_size"] or 0
        self._node_map[run_id] = info["node_map"]
        return info

    def _refresh_run(self, run_id: str) -> str | None:
        """A run the runner meets for the first time: its layout and how far it got, and
        the policy the run itself asked for at most (its config's `policy`: "shadow" or
        "off"; llmwatch-instrument asks for shadow unless the job opts in). The
        database may be ahead of the feed here; later, only the feed moves `_reached`
        (a pending action must be judged against rows in the order they were committed)."""
        info = self._refresh_layout(run_id)
        reached = self._reached.setdefault(run_id, {})
        for attempt, step in info["reached"].items():
            reached[attempt] = max(reached.get(attempt, 0), step)
        return info.get("policy")

    def _incident(self, row: dict[str, Any]) -> None:
        st = self._state(row["run_id"])
        if row.get("kind") in NEEDS_RUN_INPUTS:  # the cost model's, or a spare's: the run's side of its inputs
            apply_cost_inputs(st, self._cost_inputs(row["run_id"]))
        now = self.clock()
        decisions = self.policy.on_incident(st, row, now)
        waiting = self.policy.waiting(st, row, now) and now - (row.get("opened_ts") or now) < _DEFER_MAX_S
        if waiting:
            self._deferred[row["id"]] = row  # the newest row: an update may have named the culprit
        else:
            self._deferred.pop(row["id"], None)
        for d in decisions:
            self._carry_out(d, row)
        with self._lock:
            acting = row["id"] in self._acting_on
        if not waiting and not acting and row.get("status", "open") != "open":
            # closed, decided, and nothing under way (while open, a decision may still come: a
            # spike's rollback waits for the evidence of its complete step)
            self._release(row["run_id"], row.get("cause_key"))

    def _cost_inputs(self, run_id: str) -> dict[str, Any]:
        """queries.cost_inputs, read again at most every _COST_INPUTS_S: an open straggler is looked
        at every tick, and the run's checkpoints and restarts change far less often (its first
        step's time is a scan of its steps)."""
        now = time.monotonic()
        had = self._costs.get(run_id)
        if had is None or now - had[0] >= _COST_INPUTS_S:
            had = self._costs[run_id] = (now, self.storage.read(queries.cost_inputs, run_id))
        return had[1]

    def _release(self, run_id: str, key: str | None) -> None:
        marks = self.storage.watermarks
        if marks is not None:
            marks.release(run_id, key)

    def _action_ended(self, incident_id: int | None) -> None:
        """An action's end (done, failed, or the run's): its incident no longer holds the watermark."""
        with self._lock:
            got = self._acting_on.pop(incident_id, None) if incident_id is not None else None
        if got is not None:
            self._release(*got)

    def _commit(self, tables: Mapping[str, pa.Table]) -> None:
        """Events first (a restart's run_started before the new round's steps), then the
        steps, then the run's end (its last steps may share the commit)."""
        events = tables.get("events")
        ends = []
        if events is not None and events.num_rows:
            mask = pc.is_in(events["kind"], value_set=pa.array(_EVENT_KINDS))
            for ev in events.filter(mask).to_pylist():
                if ev["kind"] == "run_finished":
                    ends.append(ev)
                else:
                    self._event(ev)
        steps = tables.get("steps")
        if steps is not None and steps.num_rows:
            self._steps(steps)
        for ev in ends:
            self._event(ev)

    def _event(self, ev: dict[str, Any]) -> None:
        data = ev.get("data")
        data = json.loads(data) if isinstance(data, str) else (data or {})
        run_id, kind = ev["run_id"], ev["kind"]
        if kind == "command_ack":
            self._ack(run_id, int(ev["rank"]), data, ev.get("ts"))
        elif kind == "rerun_verdict":
            self._verdict(run_id, data, ev.get("ts"))
        elif kind == "run_finished":
            self.policy.on_finished(self._state(run_id))
            self._settle_at_end(run_id, stopped=data.get("status") == "stopped")
        elif kind == "run_started" and int(ev.get("rank", -1)) == 0 and int(data.get("restart") or 0) > 0:
            self._refresh_layout(run_id)  # a restart on fewer nodes: another world size and node map
            # the new round starts above every attempt of the old one (trainer/supervisor.py)
            floor = int(data.get("attempt_floor") or 0)
            with self._lock:
                for p in self._pending.values():
                    if p.run_id == run_id and p.needs_restart:
                        p.needs_restart, p.attempt = False, max(p.attempt, floor - 1)
                    elif p.run_id == run_id and _carried_by_ranks(p) and not p.acks:
                        # the old round left without carrying it out: the new round gets it again
                        # (collector/store/commands.py), and its own attempt comes after the round's
                        p.attempt = max(p.attempt, floor)

    def _ack(self, run_id: str, rank: int, data: dict[str, Any], ts: float | None) -> None:
        try:
            command_id = int(data.get("command_id"))
        except (TypeError, ValueError):
            return
        with self._lock:
            p = next((p for p in self._pending.values() if p.command_id == command_id and p.run_id == run_id), None)
        if p is None:
            return
        status = data.get("status")
        if status in FAILED_ACKS:
            with self._lock:
                self._pending.pop(p.action_id, None)
            self.storage.update_action(p.action_id, status="failed",
                                       detail={"failed_rank": rank, "ack": status, "failure": data.get("detail")})
            self._action_ended(p.incident_id)
            return
        if status != "done" or p.acked:
            return
        p.acks.add(rank)
        world = self._world.get(run_id) or 0
        if world and len(p.acks) >= world and p.kind in DONE_IN_PLACE:
            # a repair or a checkpoint starts no new attempt: done when every rank has carried it out
            with self._lock:
                self._pending.pop(p.action_id, None)
            outcome = ("every rank repaired its replica in place" if p.kind == REPAIR
                       else f"every rank carried out the {p.kind}")
            self.storage.update_action(p.action_id, status="done", started_ts=ts, finished_ts=ts,
                                       detail={"outcome": outcome})
            self._action_ended(p.incident_id)
            if p.predicted:  # a rebalance the cost model chose: its gain is measured on the steps after it
                attempt, step = max((self._reached.get(run_id) or {0: 0}).items())
                at = float(ts) if isinstance(ts, (int, float)) else self.clock()
                self._realizing[p.action_id] = (p, {"attempt": attempt, "step": step + 1}, at)
            return
        if world and len(p.acks) >= world:
            p.acked = True
            # the first new step may have been seen first (the same commit): done stays done
            self.storage.update_action(p.action_id, started_ts=ts,
                                       **({"status": "acked"} if p.recovered_ts is None else {}))

    def _settle_at_end(self, run_id: str, *, stopped: bool = False) -> None:
        """The run finished: an action it never carried out failed; one it carried out
        without a new step after it is done, with no recovery time to show; a stop is done
        when the run ended stopped (a crashed job's launcher carries it out: no rank acks)."""
        with self._lock:
            ending = [p for p in self._pending.values() if p.run_id == run_id]
            for p in ending:
                self._pending.pop(p.action_id, None)
            for iid in [i for i, (r, _) in self._acting_on.items() if r == run_id]:
                del self._acting_on[iid]
        if self.storage.watermarks is not None:
            self.storage.watermarks.release_run(run_id)  # nothing more will be done about them
        self._realize(run_id, {}, final=True)  # over the steps the new lineage ran
        for p in ending:
            if p.recovered_ts is not None:
                continue  # done; the run ended before it caught up
            # acked by some rank (the others' acks may be a commit behind the end): carried out
            if p.acked or p.acks or (p.kind in ENDED_BY_RESTART and not p.needs_restart) or (
                    stopped and p.kind == "stop"):
                self.storage.update_action(p.action_id, status="done",
                                           detail={"outcome": "the run finished before a new step"})
            else:
                self.storage.update_action(p.action_id, status="failed",
                                           detail={"outcome": "the run finished before it acted"})

    def _verdict(self, run_id: str, data: dict[str, Any], ts: float | None = None) -> None:
        iid = data.get("incident_id")
        verdict = data.get("verdict")
        if iid is not None and verdict in ("data", "device", "transient"):
            confidence = 0.9 if verdict != "transient" else 0.7
            self.storage.update_incident(int(iid), root_cause=f"{verdict}: {data.get('evidence', '')}",
                                         confidence=confidence, settled=True)
        rank = data.get("rank")
        incident = (self.storage.read(_incident_row, int(iid)) if iid is not None else None) or {
            "id": iid, "run_id": run_id}
        # the verdict's rank, else the incident's culprit as it stands now
        node = self._node_map.get(run_id, {}).get(int(rank)) if rank is not None else incident.get("node")
        at = float(ts) if isinstance(ts, (int, float)) and math.isfinite(ts) else None
        for d in self.policy.on_verdict(self._state(run_id), data, node, self.clock(), at=at):
            self._carry_out(d, incident)

    def _steps(self, steps: pa.Table) -> None:
        """Follow the run's lineage. A pending action is done at the first step of a later
        attempt (training goes on: `recovery_s`); it has caught up when the new lineage
        passes every step the earlier attempts reached (`caught_up_s`, in its detail:
        the replayed steps are the work the fault cost)."""
        with self._lock:
            waiting = list(self._pending.values())
        for run_id in pc.unique(steps["run_id"]).to_pylist():
            rows = steps.filter(pc.equal(steps["run_id"], run_id)).select(["attempt", "step", "ts"])
            reached = self._reached.setdefault(run_id, {})
            for g in rows.group_by("attempt").aggregate([("step", "max")]).to_pylist():
                reached[g["attempt"]] = max(reached.get(g["attempt"], 0), g["step_max"])
            if self._realizing:
                self._realize(run_id, reached)
            for p in (p for p in waiting if p.run_id == run_id and p.needs_restart and p.kind == RESTART):
                self._went_on(p, rows)
            for p in (p for p in waiting if p.run_id == run_id and not p.needs_restart):
                if _carried_by_ranks(p) and not p.acks:
                    continue  # a later attempt the command did not make (a restart's): not done yet
                past = max((s for a, s in reached.items() if a <= p.attempt), default=0)
                later = rows.filter(pc.greater(rows["attempt"], p.attempt))
                if not later.num_rows:
                    continue
                if p.recovered_ts is None:
                    self._done(p, _first(later), past)
                ahead = later.filter(pc.greater(later["step"], past))
                if ahead.num_rows:
                    self._caught_up(p, _first(ahead), past)

    def _went_on(self, p: Pending, rows: pa.Table) -> None:
        """A crash's restart whose job went on without one: `_WENT_ON_STEPS` new steps of the
        attempt it was decided in, reported after the decision. No rank had exited (ranks that
        stalled long enough to look dead came back): the restart is not pending any more, or
        the next real restart would be taken for it (and its recovery counted from this one)."""
        if p.requested_ts is None:
            return
        same = rows.filter(pc.and_(pc.equal(rows["attempt"], p.attempt), pc.greater(rows["ts"], p.requested_ts)))
        p.went_on.update(same["step"].to_pylist())
        if len(p.went_on) < _WENT_ON_STEPS:
            return
        with self._lock:
            if self._pending.pop(p.action_id, None) is None:
                return
        self._action_ended(p.incident_id)
        self.storage.update_action(p.action_id, status="failed", finished_ts=self.clock(), detail={
            "outcome": f"not needed: no rank exited, and the job went on in attempt {p.attempt} without a "
                       f"restart (its ranks had stalled, not died)"})
        log.info("action %s (restart) not needed: run %s went on in attempt %s", p.action_id, p.run_id, p.attempt)

    def _done(self, p: Pending, first: dict[str, Any], past: int) -> None:
        at = first["ts"] if first["ts"] is not None else self.clock()
        p.recovered_ts = at
        self._action_ended(p.incident_id)  # a new attempt goes on: its own watermark
        recovery = at - p.incident_opened_ts if p.incident_opened_ts is not None else None
        self.storage.update_action(p.action_id, status="done", attempt=first["attempt"], finished_ts=at,
                                   recovery_s=round(recovery, 3) if recovery is not None else None,
                                   detail={"first_step": first["step"], "attempt": first["attempt"],
                                           "past_step": past})
        log.info("action %s (%s) done: step %s of attempt %s, %.2f s after the incident", p.action_id, p.kind,
                 first["step"], first["attempt"], recovery if recovery is not None else float("nan"))

    def _caught_up(self, p: Pending, first: dict[str, Any], past: int) -> None:
        with self._lock:
            if self._pending.pop(p.action_id, None) is None:
                return
        at = first["ts"] if first["ts"] is not None else self.clock()
        caught = at - p.incident_opened_ts if p.incident_opened_ts is not None else None
        self.storage.update_action(p.action_id, detail={"caught_up_step": first["step"], "past_step": past,
                                                        "caught_up_s": round(caught, 3) if caught is not None
                                                        else None})
        if p.predicted:  # what it saved is measured once the job has run _REALIZED_STEPS steps past this
            self._realizing[p.action_id] = (p, first, at)

    def _realize(self, run_id: str, reached: dict[int, int], *, final: bool = False) -> None:
        """Record `realized` for the cost model's actions of `run_id` whose lineage is
        _REALIZED_STEPS steps past the step it caught up at (an isolation's new round) or past
        the step every rank carried it out (a rebalance, in place), or all of them at the run's end."""
        for aid, (p, first, at) in list(self._realizing.items()):
            if p.run_id != run_id:
                continue
            if not final and reached.get(int(first["attempt"]), 0) < int(first["step"]) + _REALIZED_STEPS:
                continue
            del self._realizing[aid]
            self.storage.update_action(aid, detail={"realized": self._realized(p, first, at)})

    def _realized(self, p: Pending, first: dict[str, Any], at: float) -> dict[str, Any]:
        """What an action the cost model chose saved: its step time before (the model's input)
        and after (the median of the steps from `first` on: the new attempt's, or the attempt's
        after a rebalance), and the time to finish projected from
        them (the seconds from the decision to catching up, then the steps left at the new step
        time), against keeping the node (`steps_left x step_s`): `gain_s` is comparable with the
        predicted one."""
        inputs = p.predicted.get("inputs") or {}
        before, left, at_step = inputs.get("step_s"), inputs.get("steps_left"), p.predicted.get("at_step")
        after = self.storage.read(_median_step_s, p.run_id, int(first["attempt"]), int(first["step"]))
        out: dict[str, Any] = {"step_s_before": before, "step_s_after": round(after, 6) if after else None,
                               "recovery_s": round(at - p.requested_ts, 3) if p.requested_ts is not None else None}
        if None not in (before, left, at_step, after, p.requested_ts):
            done = max(0, int(first["step"]) - int(at_step))  # steps of the run's left made since the decision
            projected = (at - p.requested_ts) + max(0, left - done) * after
            out["gain_s"] = round(left * before - projected, 3)
        return out

    # -- carrying out ------------------------------------------------------------
    def _carry_out(self, d: Decision, incident: dict[str, Any]) -> None:
        d = replace(d, args=self._args(d))
        common = dict(mode=d.mode, incident_id=d.incident_id, node=d.node, rank=d.rank, detail=d.detail())
        if d.refused is not None or d.mode == "shadow":
            status = "refused" if d.refused is not None else "shadow"
            log.info("policy %s: %s for run %s (%s)", status, d.kind, d.run_id, d.refused or d.reason)
            self.storage.record_action(d.run_id, d.kind, status, **common)
            return
        attempt = max(self._reached.get(d.run_id, {}), default=0)
        opened = incident.get("opened_ts")
        if d.incident_id is not None:
            with self._lock:
                self._acting_on[d.incident_id] = (d.run_id, incident.get("cause_key"))
        if d.kind == ISOLATE:
            self.storage.set_node_status(d.run_id, d.node, "isolated", d.reason, incident_id=d.incident_id)
        # The supervisor restarts a crashed job by itself, and leaves a crashed node out when
        # it sees the node isolated: no command (the job's ranks are down); recorded, followed.
        if d.kind == RESTART or (d.kind == ISOLATE and incident.get("kind") == "crash"):
            self.storage.record_action(d.run_id, d.kind, "issued", **common,
                                       done=self._follow(d, None, opened, attempt))
            return

        def issued(row: Any, error: BaseException | None) -> None:  # on the writer thread: submit only
            if error is not None:
                self.storage.record_action(d.run_id, d.kind, "failed",
                                           **{**common, "detail": {**d.detail(), "error": str(error)}})
                self._action_ended(d.incident_id)
                return
            self.storage.record_action(d.run_id, d.kind, "issued", command_id=row["id"], **common,
                                       done=self._follow(d, row["id"], opened, attempt))

        log.info("policy: %s for run %s (%s)", d.kind, d.run_id, d.reason)
        self.storage.issue_command(d.run_id, d.kind, d.args, None, done=issued)

    def _args(self, d: Decision) -> dict[str, Any]:
        """The command's arguments: a rollback also carries the known-good watermark (the
        checkpoint it restores is the newest at or below it: collector/live/watermark.py)."""
        marks = self.storage.watermarks
        mark = marks.get(d.run_id) if marks is not None and d.kind == "rollback" else None
        if mark is None or not isinstance(d.args.get("step"), int) or mark["step"] >= d.args["step"]:
            return d.args
        return {**d.args, "known_good_step": mark["step"]}

    def _follow(self, d: Decision, command_id: int | None, opened: float | None,
                attempt: int) -> Callable[[Any, BaseException | None], None]:
        requested = self.clock()

        def recorded(action_id: Any, error: BaseException | None) -> None:
            if error is not None:
                log.error("policy: the %s action for run %s was not recorded: %s", d.kind, d.run_id, error)
                return
            with self._lock:
                self._pending[int(action_id)] = Pending(action_id=int(action_id), run_id=d.run_id, kind=d.kind,
                                                        incident_opened_ts=opened, attempt=attempt,
                                                        command_id=command_id, incident_id=d.incident_id,
                                                        needs_restart=d.kind in ENDED_BY_RESTART,
                                                        requested_ts=requested, predicted=d.predicted or None)
        return recorded


def _carried_by_ranks(p: Pending) -> bool:
    """A command the ranks carry out and ack (rollback, stop), not one the job's restart
    completes (isolate, restart)."""
    return p.command_id is not None and p.kind not in ENDED_BY_RESTART


def _first(rows: pa.Table) -> dict[str, Any]:
    """The row of the smallest step."""
    return rows.take([pc.index(rows["step"], pc.min(rows["step"])).as_py()]).to_pylist()[0]


def _incident_row(cur: duckdb.DuckDBPyConnection, incident_id: int) -> dict[str, Any] | None:
    cur = cur.execute("SELECT * FROM incidents WHERE id = ?", [incident_id])
    row = cur.fetchone()
    return _incident(dict(zip([d[0] for d in cur.description], row))) if row else None


def _nodes_of(cur: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    rows = cur.execute("SELECT node, status FROM nodes WHERE run_id = ?", [run_id]).fetchall()
    (status,) = cur.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]).fetchone() or (None,)
    return {"all": [n for n, s in rows if s != "spare"], "isolated": [n for n, s in rows if s == "isolated"],
            "finished": status in ("completed", "stopped", "failed")}


def _run_layout(cur: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    row = cur.execute("SELECT world_size, node_map::VARCHAR, json_extract_string(config, '$.policy') FROM runs "
                      "WHERE run_id = ?", [run_id]).fetchone()
    world, node_map, policy = row if row else (None, None, None)
    try:
        nodes = {int(k): str(v) for k, v in json.loads(node_map).items()} if node_map else {}
    except (ValueError, AttributeError):
        nodes = {}
    reached = dict(cur.execute("SELECT attempt, max(step) FROM steps WHERE run_id = ? GROUP BY attempt",
                               [run_id]).fetchall())
    return {"world_size": world, "node_map": nodes, "reached": reached,
            "policy": policy if policy in ("shadow", "off") else None}


def _median_step_s(cur: duckdb.DuckDBPyConnection, run_id: str, attempt: int, from_step: int = 0) -> float | None:
    """The median step time (its slowest rank's) of one attempt's steps so far, from `from_step` on."""
    (m,), = cur.execute("SELECT median(s) FROM (SELECT max(step_s) AS s FROM steps WHERE run_id = ? AND attempt = ? "
                        "AND step >= ? GROUP BY step)", [run_id, attempt, from_step]).fetchall()
    return float(m) if m is not None else None


def policy_for(rules: Rules, *, mode: str | None = None, min_nodes: int | None = None) -> Policy:
    """The healing policy (analysis/policy.py) of `collector serve`: the rules' [policy],
    `--policy` and `--min-nodes` over it."""
    if min_nodes is not None:
        rules = Rules(merge_rules(rules.as_dict(), {"policy": {"min_nodes": int(min_nodes)}}), source=rules.source)
    return Policy(rules, mode=mode)
