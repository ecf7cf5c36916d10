"""Control commands for a run's ranks: issue, deliver once per rank, record acks.

A command (rollback, skip, rerun, isolate, stop, ...) is stored in `commands`
and handed to each target rank in the response to that rank's next ingest
request, once. The rank acknowledges with an event of kind "command_ack"
({command_id, status, detail}), which updates the command's row.

`CommandBook` is the writer thread's in-memory view of recent commands, so that
answering an ingest request costs a dict lookup, not a query. Its changes are
planned before a group commit (`plan`) and applied only after the commit
succeeded (`apply`): a rolled-back transaction delivers nothing.

Targets: a list of ranks, or None for every rank of the run. A command for
every rank is resolved to range(world_size) when the run's size is known; if not,
it is delivered to each rank that reports while the command is young.

Statuses: pending (not yet delivered to every target) -> delivered -> acked
(every delivered rank acked) or failed (some rank reported failed/error/
rejected). Nothing is delivered after `ttl_s`; a command still pending then is
marked expired (when its run next reports) and forgotten by the book.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collector.decode import CommandAck

if TYPE_CHECKING:
    from collector.storage import Storage

KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,49}$")
FAILED_ACKS = frozenset({"failed", "error", "rejected"})


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
        raise ValueError("kind must be a lowercase identifier such as 'rollback', 'skip', 'isolate'")
    if not isinstance(args, dict):
        raise ValueError("args must be an object")
    if ranks is not None and (not isinstance(ranks, list) or not ranks
                              or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 2**31 for r in ranks)):
        raise ValueError("ranks must be null (every rank) or a non-empty list of rank numbers")


@dataclass(slots=True)
class CommandPlan:
    """Changes one group commit would make: per request, the commands it delivers."""

    deliveries: list[list[dict[str, Any]]]
    changed: dict[int, Command]  # updated copies, by id


class CommandBook:
    """Recent commands by run. Owned by the writer thread (no locking)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_run: dict[str, dict[int, Command]] = {}

    def add(self, cmd: Command) -> None:
        self._by_run.setdefault(cmd.run_id, {})[cmd.id] = cmd

    def get(self, run_id: str, command_id: int) -> Command | None:
        return self._by_run.get(run_id, {}).get(command_id)

    def plan(self, requests: Iterable[tuple[str, int]], acks: Iterable[tuple[str, int, float, CommandAck]],
             now: float) -> CommandPlan:
        """Deliveries for each (run_id, rank) request in order, then the acks."""
        changed: dict[int, Command] = {}

        def edit(cmd: Command) -> Command:
            if cmd.id not in changed:
                changed[cmd.id] = copy.deepcopy(cmd)
            return changed[cmd.id]

        deliveries = []
        for run_id, rank in requests:
            out: list[dict[str, Any]] = []
            deliveries.append(out)
            for cmd in self._by_run.get(run_id, {}).values():
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
            if cmd is None:
                continue
            cur = edit(cmd)
            cur.acks[rank] = {"status": ack.status, "detail": ack.detail, "ts": ts}
            cur.updated_ts = now
            cur._settle()
        return CommandPlan(deliveries=deliveries, changed=changed)

    def apply(self, plan: CommandPlan, now: float) -> None:
        for cmd in plan.changed.values():
            self.add(cmd)
        for run_id, cmds in list(self._by_run.items()):
            for cid in [c.id for c in cmds.values() if now - c.issued_ts > self.ttl_s]:
                del cmds[cid]
            if not cmds:
                del self._by_run[run_id]


def issue(storage: "Storage", run_id: str, kind: str, *, args: dict[str, Any] | None = None,
          ranks: list[int] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    """Store a command for a run and return it once committed (blocking).

    The detection/healing code calls this; HTTP clients use
    POST /v1/runs/{run_id}/commands, which ends up in the same writer call."""
    return storage.issue_command(run_id, kind, {} if args is None else args, ranks).result(timeout_s)


def list_for_run(storage: "Storage", run_id: str) -> list[dict[str, Any]]:
    return storage.commands(run_id)
