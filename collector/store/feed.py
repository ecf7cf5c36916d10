"""Post-commit subscribers: every commit's rows, handed over without waiting.

After each group commit that stored rows, the writer publishes a `Commit`: the
Arrow tables it just committed, by target table (the same objects it inserted:
no copy), the runs they belong to and the commit's time. Every `Subscription`
gets it in its own bounded queue (a number of commits and of bytes: the tables
hold the request bodies' memory while they wait). The writer thread only ever
offers: when a queue is full the commit is dropped for that subscriber and
counted (`llmwatch_collector_subscriber_dropped_commits`), and the subscriber's
next `Delivery` says how many it missed, so it can resync from the read side
(collector/read/queries.py) instead of working on a hole it does not know about.

The one lock a subscription has is held for a deque append or pop, never while
the subscriber works, so an offer costs the writer microseconds whatever the
subscriber does.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter

from collector.ingest.decode import DecodedBatch


@dataclass(frozen=True, slots=True)
class Commit:
    """What one group commit stored."""

    seq: int  # commits published by this writer, counting from 1
    commit_ts: float  # the writer's clock for the commit (the rows' received time)
    run_ids: frozenset[str]
    tables: Mapping[str, pa.Table]  # target table -> the rows committed (steps, collectives, ...)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())


@dataclass(frozen=True, slots=True)
class Delivery:
    """One item of a subscription. `missed`: commits dropped just before this one
    (0: none). A delivery with `commit` None only reports missed commits."""

    commit: Commit | None
    missed: int = 0


def _plain(table: pa.Table) -> pa.Table:
    """Dictionary columns decoded to their value type (to concatenate differing tables)."""
    fields = [pa.field(f.name, f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in table.schema]
    return table.cast(pa.schema(fields))


def committed_tables(tables: Mapping[str, pa.Table], extra: list[tuple[str, pa.Table]]) -> dict[str, pa.Table]:
    """One table per target table: the group's row tables, with the prepared ones
    (OTLP scalars) appended. A table that had one part is passed on as it is."""
    parts: dict[str, list[pa.Table]] = {name: [t] for name, t in tables.items()}
    for name, t in extra:
        parts.setdefault(name, []).append(t)
    return {name: ts[0] if len(ts) == 1 else pa.concat_tables([_plain(t) for t in ts], promote_options="permissive")
            for name, ts in parts.items()}


def merged(commits: list[Commit]) -> Commit:
    """Consecutive commits as one: the rows of each table in commit order, the last one's
    sequence number and time."""
    if len(commits) == 1:
        return commits[0]
    parts: dict[str, list[pa.Table]] = {}
    for c in commits:
        for name, t in c.tables.items():
            parts.setdefault(name, []).append(t)
    tables = {name: ts[0] if len(ts) == 1 else pa.concat_tables([_plain(t) for t in ts], promote_options="permissive")
              for name, ts in parts.items()}
    last = commits[-1]
    return Commit(seq=last.seq, commit_ts=last.commit_ts, run_ids=frozenset().union(*(c.run_ids for c in commits)),
                  tables=tables)


def committed_run_ids(fresh: list[DecodedBatch], extra: list[tuple[str, pa.Table]]) -> frozenset[str]:
    runs = {b.run_id for b in fresh}
    for _, t in extra:
        if "run_id" in t.schema.names:
            runs.update(r for r in pc.unique(t["run_id"]).to_pylist() if r is not None)
    return frozenset(runs)


class Subscription:
    """A subscriber's bounded queue: the writer offers, the subscriber's thread gets."""

    def __init__(self, name: str, *, max_commits: int = 64, max_bytes: int = 256 << 20,
                 dropped: Counter | None = None) -> None:
        if max_commits < 1:
            raise ValueError("a subscription holds at least one commit")
        self.name = name
        self.max_commits, self.max_bytes = max_commits, max_bytes
        self._items: deque[tuple[Commit, int, int]] = deque()  # (commit, missed before it, its bytes)
        self._bytes = 0
        self._missed = 0  # dropped since the last item queued
        self.num_dropped = 0
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._woken = False  # wake(): the next get returns at once
        self._dropped = dropped.labels(name) if dropped is not None else None

    def offer(self, commit: Commit) -> bool:
        """Queue `commit` unless the queue is full (then drop and count it). Never blocks
        beyond the queue's own lock. An empty queue takes any one commit."""
        nbytes = commit.nbytes
        with self._cond:
            if self._closed:
                return False
            if self._items and (len(self._items) >= self.max_commits or self._bytes + nbytes > self.max_bytes):
                self._missed += 1
                self.num_dropped += 1
                dropped = True
            else:
                self._items.append((commit, self._missed, nbytes))
                self._bytes += nbytes
                self._missed = 0
                self._cond.notify()
                dropped = False
        if dropped and self._dropped is not None:
            self._dropped.inc()
        return not dropped

    def get(self, timeout_s: float | None = None) -> Delivery | None:
        """The next delivery; None after `timeout_s` without one, or once closed and empty."""
        with self._cond:
            if not self._ready():
                self._cond.wait_for(self._ready, timeout_s)
            if self._items:
                commit, missed, nbytes = self._items.popleft()
                self._bytes -= nbytes
                return Delivery(commit, missed)
            if self._missed:
                missed, self._missed = self._missed, 0
                return Delivery(None, missed)
            self._woken = False
            return None

    def wake(self) -> None:
        """End a `get` that is waiting (or the next one) at once, with None: news other than
        a commit for the subscriber's thread (the policy's incidents)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def take_queued(self, limit: int) -> list[Commit]:
        """Up to `limit` more commits already queued, without waiting, stopping before one
        that comes after a gap (its delivery reports the gap through `get`)."""
        out = []
        with self._cond:
            while self._items and len(out) < limit and self._items[0][1] == 0:
                commit, _, nbytes = self._items.popleft()
                self._bytes -= nbytes
                out.append(commit)
        return out

    def _ready(self) -> bool:
        return bool(self._items) or bool(self._missed) or self._closed or self._woken

    @property
    def depth(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """No more offers are taken; a waiting `get` returns what is left, then None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Feed:
    """The writer's subscribers. `publish` runs on the writer thread."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._subs: tuple[Subscription, ...] = ()  # replaced, never mutated: publish reads it unlocked
        self._lock = threading.Lock()
        self._seq = 0
        self._dropped = Counter("llmwatch_collector_subscriber_dropped_commits",
                                "Commits a post-commit subscriber's full queue did not take", ["subscriber"],
                                registry=registry) if registry is not None else None

    def subscribe(self, name: str, *, max_commits: int = 64, max_bytes: int = 256 << 20) -> Subscription:
        sub = Subscription(name, max_commits=max_commits, max_bytes=max_bytes, dropped=self._dropped)
        with self._lock:
            self._subs = (*self._subs, sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.close()
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    @property
    def active(self) -> bool:
        return bool(self._subs)

    @property
    def seq(self) -> int:
        """The newest commit published (0: none yet)."""
        return self._seq

    def publish(self, *, commit_ts: float, run_ids: frozenset[str], tables: Mapping[str, pa.Table]) -> Commit:
        self._seq += 1
        commit = Commit(seq=self._seq, commit_ts=commit_ts, run_ids=run_ids, tables=tables)
        for sub in self._subs:
            sub.offer(commit)
        return commit

    def close(self) -> None:
        for sub in self._subs:
            sub.close()
