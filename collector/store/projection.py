"""What one group commit is made of, as its projections see it.

The writer (collector/store/writer.py) is an engine. Per group commit it asks the
admission (collector/store/dedupe.py) which batches are new, builds the row tables
(collector/ingest/columns.py), and then runs every projection in its list, in order:

    plan(group)              before the transaction. Pure: computed from the group
                             and the projection's in-memory state (reads are fine,
                             writes and state changes are not), so a rolled-back
                             transaction leaves nothing to undo and a retry plans
                             again from scratch.
    write(con, plan, group)  inside the one transaction, after the row tables.
    apply(plan, group)       after the commit: the in-memory state catches up.

Besides ingest batches a group carries intents: requests addressed to one
projection by name (issue a command, record detection findings). They commit in
the same transaction as the rows around them, and `results(plan)` says, per
intent and in order, what its submitter gets back (a value, or an exception to
raise). So a new concern (incidents, actions, the webhook outbox) is one more
projection in the list, and the engine does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from collector.ingest.decode import DecodedBatch

# Tables whose rows get ids from the writer, not from the senders.
ID_TABLES = ("commands", "incidents", "actions")


# What the admission (collector/store/dedupe.py) says of each batch of a group: store
# it, acknowledge it as stored already, or refuse it (409: its key holds other bytes).
FRESH, DUPLICATE, CONFLICT = "fresh", "duplicate", "conflict"


@dataclass(slots=True)
class Group:
    """One group commit's input. `batches` and `verdicts` are in arrival order."""

    now: float  # the writer's clock for this commit (unix s): every row's *_ts
    batches: list[DecodedBatch] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)  # FRESH, DUPLICATE or CONFLICT per batch
    fresh: list[DecodedBatch] = field(default_factory=list)  # the batches whose rows this commit stores
    tables: dict[str, pa.Table] = field(default_factory=dict)  # row tables built from `fresh`
    extra: list[tuple[str, pa.Table]] = field(default_factory=list)  # prepared tables (OTLP scalars)
    intents: dict[str, list[Any]] = field(default_factory=dict)  # by projection name, in submission order

    @property
    def requests(self) -> list[tuple[str, int]]:
        """(run_id, rank) of every batch that is answered (fresh or duplicate), in order.
        A conflicting batch is refused, so it gets no commands."""
        return [(b.run_id, b.rank) for b, v in zip(self.batches, self.verdicts) if v != CONFLICT]


class Projection:
    """A part of the database the writer keeps current, with its in-memory mirror.

    Subclasses override what they need; `name` addresses intents to them."""

    name: str = ""
    # The tables its writes touch (collector/store/writer.py `generation`: what a conditional
    # GET compares). None: any table, so a commit whose plan `wrote` anything counts as a
    # change of every table (a projection that does not say what it writes is never missed).
    writes: tuple[str, ...] | None = None

    def plan(self, group: Group) -> Any:
        return None

    def wrote(self, plan: Any) -> bool:
        """Whether `plan` wrote anything (its `writes` changed). By default: a plan that is
        not None nor empty. A projection whose plan is always an object says it itself."""
        if plan is None:
            return False
        try:
            return len(plan) > 0
        except TypeError:
            return True

    def write(self, con: duckdb.DuckDBPyConnection, plan: Any, group: Group) -> None:
        pass

    def apply(self, plan: Any, group: Group) -> None:
        pass

    def results(self, plan: Any) -> list[Any]:
        """What each of the group's intents for this projection is answered, in order:
        a value, or a BaseException that its submitter gets raised."""
        return []


class Ids:
    """Next row id per ID_TABLES table. Owned by the writer thread.

    A plan reads `peek` and numbers its rows from there; its `apply` calls
    `advance`. A rolled-back transaction therefore reuses the same ids on the retry,
    and two projections never share a table."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self._next = {t: con.execute(f"SELECT coalesce(max(id), 0) + 1 FROM {t}").fetchall()[0][0]
                      for t in ID_TABLES}

    def peek(self, table: str) -> int:
        return self._next[table]

    def advance(self, table: str, next_id: int) -> None:
        self._next[table] = max(self._next[table], next_id)

    def take(self, table: str) -> int:
        """One id at once, for a `submit_call` function (which runs alone)."""
        i = self._next[table]
        self._next[table] = i + 1
        return i
