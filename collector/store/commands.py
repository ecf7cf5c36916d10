"""Control commands: issued through the writer, delivered in ingest answers, acked.

`CommandBook` is the writer thread's in-memory view of recent commands, so that
answering an ingest request costs a dict lookup, not a query. Its changes are
planned before a group commit (`plan`) and applied only after the commit
succeeded (`apply`): a rolled-back transaction delivers nothing.
`CommandsProjection` puts it in the writer's list of projections: it inserts the
commands issued in the group (`IssueCommand` intents), updates the delivered and
acked ones, and gives each ingest request the commands it delivers.

Issuing never waits for the writer: `Storage.issue_command` queues an intent and
returns a future (or calls `done` after the commit), so detection and the policy
may issue from any thread, the writer's own included.

Targets: a list of ranks, or None for every rank of the run. A command for
every rank is resolved to range(world_size) when the run's size is known; if not,
it is delivered to each rank that reports while the command is young.

A restart round gets again what the old round received and none of its ranks acked
(`CommandBook.plan`).

Statuses: pending (not yet delivered to every target) -> delivered -> acked
(every delivered rank acked) or failed (some rank reported failed/error/
rejected). Nothing is delivered after `ttl_s`; a command still pending then is
marked expired (when its run next reports) and forgotten by the book.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb

from analysis.kinds import ENDED_BY_RESTART
from collector.ingest.decode import CommandAck, json_text
from collector.store.projection import Group, Ids, Projection

KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,49}$")
FAILED_ACKS = frozenset({"failed", "error", "rejected"})
# ENDED_BY_RESTART (analysis/kinds.py): commands the job's restart completes, not its ranks: never
# given again to a restart round (an isolate's new round, without that node, rejected it: "not a
# node of this job").


@dataclass(slots=True)
class Command:
    id: int
    run_id: str
    kind: str
    args: dict[str, Any]
    ranks: list[int] | None  # None: every rank of the run
    issued_ts: float
    status: str = "pending"
    delivered: list[int] = field(default_factory=list)
    acks: dict[int, dict[str, Any]] = field(default_factory=dict)
    updated_ts: float = 0.0

    def message(self) -> dict[str, Any]:
        """What a rank receives in its ingest response."""
        return {"id": self.id, "kind": self.kind, "args": self.args, "issued_ts": self.issued_ts}

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "run_id": self.run_id, "kind": self.kind, "args": self.args, "ranks": self.ranks,
            "issued_ts": self.issued_ts, "status": self.status, "delivered": self.delivered,
            "acks": {str(k): v for k, v in self.acks.items()}, "updated_ts": self.updated_ts,
        }

    def targets(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def _settle(self) -> None:
        complete = self.ranks is None or set(self.ranks) <= set(self.delivered)
        if any(a["status"] in FAILED_ACKS for a in self.acks.values()):
            self.status = "failed"
        elif self.delivered and complete and all(r in self.acks for r in self.delivered):
            self.status = "acked"
        elif self.delivered and complete:
            self.status = "delivered"


def validate_request(kind: str, args: Any, ranks: Any) -> None:
    """Raise ValueError with a reason when a command request is malformed."""
    if not isinstance(kind, str) or not KIND_RE.match(kind):
        raise ValueError("kind must be a lowercase identifier such as 'rollback', 'stop', 'isolate'")
    if not isinstance(args, dict):
        raise ValueError("args must be an object")
    if ranks is not None and (not isinstance(ranks, list) or not ranks
                              or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 2**31 for r in ranks)):
        raise ValueError("ranks must be null (every rank) or a non-empty list of rank numbers")


@dataclass(slots=True)
class CommandPlan:
    """Changes one group commit would make: per request, the commands it delivers."""

    deliveries: list[list[dict[str, Any]]]
    changed: dict[int, Command]  # updated copies (and the new commands), by id
    new: list[int] = field(default_factory=list)  # ids of the commands issued in this group
    results: list[Any] = field(default_factory=list)  # per IssueCommand intent: its Command or an error


class CommandBook:
    """Recent commands by run. Owned by the writer thread (no locking)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_run: dict[str, dict[int, Command]] = {}

    def add(self, cmd: Command) -> None:
        self._by_run.setdefault(cmd.run_id, {})[cmd.id] = cmd

    def get(self, run_id: str, command_id: int) -> Command | None:
        return self._by_run.get(run_id, {}).get(command_id)

    @classmethod
    def load(cls, con: duckdb.DuckDBPyConnection, ttl_s: float, now: float) -> "CommandBook":
        """The book of a database's commands younger than `ttl_s`."""
        book = cls(ttl_s)
        rows = con.execute("""
            SELECT id, run_id, kind, args, ranks, issued_ts, status, delivered, acks, updated_ts
            FROM commands WHERE issued_ts > ?""", [now - ttl_s]).fetchall()
        for cid, run_id, kind, args, ranks, issued_ts, status, delivered, acks, updated_ts in rows:
            book.add(Command(
                id=cid, run_id=run_id, kind=kind, args=json.loads(args) if args else {},
                ranks=json.loads(ranks) if ranks else None, issued_ts=issued_ts, status=status,
                delivered=json.loads(delivered) if delivered else [],
                acks={int(k): v for k, v in json.loads(acks).items()} if acks else {}, updated_ts=updated_ts))
        return book

    def plan(self, requests: Iterable[tuple[str, int]], acks: Iterable[tuple[str, int, float, CommandAck]],
             now: float, issued: Sequence[Command] = (), restarted: Iterable[str] = ()) -> CommandPlan:
        """The `issued` commands first (so a request in the same group gets them), then the
        `restarted` runs' redeliveries, then deliveries for each (run_id, rank) request in
        order, then the acks.

        A restart round (rank 0's `run_started` with `restart` > 0) is a new set of
        processes: a command delivered to the old round and acked by none of its ranks
        was never carried out (they left first: an isolation's restart and a rollback
        decided a moment later), so it goes to the new round as if not yet delivered."""
        changed: dict[int, Command] = {}
        new_by_run: dict[str, list[Command]] = {}
        for cmd in issued:
            changed[cmd.id] = cmd
            new_by_run.setdefault(cmd.run_id, []).append(cmd)

        def edit(cmd: Command) -> Command:
            if cmd.id not in changed:
                changed[cmd.id] = copy.deepcopy(cmd)
            return changed[cmd.id]

        for run_id in set(restarted):
            for cmd in self._by_run.get(run_id, {}).values():
                cur = changed.get(cmd.id, cmd)
                if cur.delivered and not cur.acks and cur.status in ("pending", "delivered") \
                        and cur.kind not in ENDED_BY_RESTART and now - cur.issued_ts <= self.ttl_s:
                    cur = edit(cmd)
                    cur.delivered, cur.status, cur.updated_ts = [], "pending", now

        deliveries = []
        for run_id, rank in requests:
            out: list[dict[str, Any]] = []
            deliveries.append(out)
            if rank < 0:  # the launcher's exit reports (rank -1): not a rank, never a command's target
                continue
            known = self._by_run.get(run_id, {}).values()
            for cmd in [*known, *new_by_run[run_id]] if run_id in new_by_run else known:
                cur = changed.get(cmd.id, cmd)
                if now - cur.issued_ts > self.ttl_s:
                    if cur.status == "pending":
                        cur = edit(cmd)
                        cur.status, cur.updated_ts = "expired", now
                    continue
                if not cur.targets(rank) or rank in cur.delivered:
                    continue
                cur = edit(cmd)
                cur.delivered.append(rank)
                cur.updated_ts = now
                cur._settle()
                out.append(cur.message())
        for run_id, rank, ts, ack in acks:
            cmd = self.get(run_id, ack.command_id)
            if cmd is None or rank in changed.get(cmd.id, cmd).acks:
                continue  # unknown, or this rank answered already: every ack is final, the first stands
            cur = edit(cmd)
            cur.acks[rank] = {"status": ack.status, "detail": ack.detail, "ts": ts}
            cur.updated_ts = now
            cur._settle()
        return CommandPlan(deliveries=deliveries, changed=changed, new=[c.id for c in issued])

    def apply(self, plan: CommandPlan, now: float) -> None:
        for cmd in plan.changed.values():
            self.add(cmd)
        for run_id, cmds in list(self._by_run.items()):
            for cid in [c.id for c in cmds.values() if now - c.issued_ts > self.ttl_s]:
                del cmds[cid]
            if not cmds:
                del self._by_run[run_id]


def _restart_round(data_json: str | None) -> bool:
    """A `run_started` of a restart round (the supervisor's `restart` count above 0)."""
    try:
        data = json.loads(data_json) if data_json else {}
        return int(data.get("restart") or 0) > 0
    except (ValueError, TypeError, AttributeError):
        return False


@dataclass(frozen=True, slots=True)
class IssueCommand:
    """An intent for the commands projection: store this command (validated already)."""

    run_id: str
    kind: str
    args: dict[str, Any]
    ranks: list[int] | None


class CommandsProjection(Projection):
    """`commands` rows: the issued ones inserted, the delivered and acked ones updated.
    Its plan also answers ingest requests: `deliveries(plan)`."""

    name = "commands"
    writes = ("commands",)

    def __init__(self, con: duckdb.DuckDBPyConnection, *, ids: Ids, ttl_s: float, now: float) -> None:
        self._con = con
        self._ids = ids
        self.book = CommandBook.load(con, ttl_s, now)

    def _world_sizes(self, run_ids: set[str]) -> dict[str, int | None]:
        """world_size of the known runs among `run_ids`, read before the transaction
        (committed state: a run first seen in this very group is not known yet)."""
        marks = ", ".join("?" * len(run_ids))
        return dict(self._con.execute(f"SELECT run_id, world_size FROM runs WHERE run_id IN ({marks})",
                                      sorted(run_ids)).fetchall())

    def plan(self, group: Group) -> CommandPlan:
        issues: list[IssueCommand] = group.intents.get(self.name, [])
        issued, answers = [], []
        if issues:
            sizes = self._world_sizes({i.run_id for i in issues})
            next_id = self._ids.peek("commands")
            for it in issues:
                if it.run_id not in sizes:
                    answers.append(KeyError(f"unknown run {it.run_id!r}"))
                    continue
                size = sizes[it.run_id]
                targets = sorted(set(it.ranks)) if it.ranks is not None else (list(range(size)) if size else None)
                cmd = Command(id=next_id, run_id=it.run_id, kind=it.kind, args=it.args, ranks=targets,
                              issued_ts=group.now, updated_ts=group.now)
                next_id += 1
                issued.append(cmd)
                answers.append(cmd.id)
        fresh_acks = [(b.run_id, b.rank, e.ts, e.special) for b in group.fresh for e in b.events
                      if e.kind == "command_ack"]
        restarted = [b.run_id for b in group.fresh if b.rank == 0 for e in b.events
                     if e.kind == "run_started" and _restart_round(e.data_json)]
        plan = self.book.plan(group.requests, fresh_acks, group.now, issued, restarted)
        # what the submitter gets: the row as this commit writes it
        plan.results = [a if isinstance(a, BaseException) else plan.changed[a].as_dict() for a in answers]
        return plan

    def write(self, con: duckdb.DuckDBPyConnection, plan: CommandPlan, group: Group) -> None:
        new = set(plan.new)
        for cid in plan.new:
            cmd = plan.changed[cid]
            d = cmd.as_dict()
            con.execute("INSERT INTO commands (id, run_id, kind, args, ranks, issued_ts, status, delivered, acks, "
                        "updated_ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [cmd.id, cmd.run_id, cmd.kind, json_text(cmd.args), json_text(cmd.ranks), cmd.issued_ts,
                         cmd.status, json_text(d["delivered"]), json_text(d["acks"]), cmd.updated_ts])
        for cmd in plan.changed.values():
            if cmd.id not in new:
                d = cmd.as_dict()
                con.execute("UPDATE commands SET status = ?, delivered = ?, acks = ?, updated_ts = ? WHERE id = ?",
                            [cmd.status, json_text(d["delivered"]), json_text(d["acks"]), cmd.updated_ts, cmd.id])

    def apply(self, plan: CommandPlan, group: Group) -> None:
        self.book.apply(plan, group.now)
        if plan.new:
            self._ids.advance("commands", max(plan.new) + 1)

    def results(self, plan: CommandPlan) -> list[Any]:
        return plan.results

    @staticmethod
    def deliveries(plan: CommandPlan) -> list[list[dict[str, Any]]]:
        """Per answered request of the group (Group.requests), the commands it carries back."""
        return plan.deliveries
