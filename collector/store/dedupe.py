"""A batch stored once: the key set the writer keeps, the admission every group
commit starts with, and the projection that records the stored keys.

`BatchKeysProjection.sort_out` runs first: it says which of the group's batches
are new (FRESH), already stored with the same bytes (DUPLICATE, acknowledged) or
already stored with other bytes (CONFLICT, refused with 409), from the in-memory
key set (`BatchKeys`) and, for keys that set says are taken, one lookup of the
stored content hashes. Then, as a projection, the fresh batches' rows go into
`batches` inside the transaction and their keys into the set after the commit.

The key set: which batches are already stored: an in-memory mirror of the `batches` table.

Checking a group's keys against the table with a join costs a scan that grows
with the table; the writer is the only process that adds keys, so it can keep
the set in memory instead. Per (run_id, rank, incarnation) the stored
batch_seqs are kept as sorted, disjoint, inclusive intervals: an agent numbers
its batches 0, 1, 2, ... so the usual case is one interval per sender, and a
replayed spool only fills gaps. Loading is one gaps-and-islands query.
The table's primary key stays the last line of defence.

A key says which batch it is, not what it holds: a sender that reuses a
batch_seq for other rows (a restarted agent that kept its incarnation, a bug)
must be told, not silently dropped. So each stored batch keeps a hash of its
body (`batches.content_hash`), and `sort_out` compares hashes, but only for keys
the intervals say are taken, which is rare (a retry, a spool replay): a copy
inside the same group is compared in memory, a stored one costs the writer one
query for all of a group's repeats. The hashes stay in the table, not here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from collector.ingest import columns
from collector.ingest.decode import DecodedBatch
from collector.store.projection import CONFLICT, DUPLICATE, FRESH, Group, Projection

Sender = tuple[str, int, str]
Key = tuple[str, int, str, int]


_ISLANDS_SQL = """
    SELECT run_id, rank, incarnation, min(batch_seq) AS lo, max(batch_seq) AS hi
    FROM (SELECT run_id, rank, incarnation, batch_seq,
                 batch_seq - row_number() OVER (PARTITION BY run_id, rank, incarnation ORDER BY batch_seq) AS island
          FROM batches)
    GROUP BY run_id, rank, incarnation, island
    ORDER BY run_id, rank, incarnation, lo
"""


class BatchKeys:
    """Set of stored batch keys. Not thread-safe: the writer thread owns it."""

    def __init__(self) -> None:
        self._starts: dict[Sender, list[int]] = {}
        self._ends: dict[Sender, list[int]] = {}

    @classmethod
    def load(cls, con: duckdb.DuckDBPyConnection) -> "BatchKeys":
        keys = cls()
        for run_id, rank, incarnation, lo, hi in con.execute(_ISLANDS_SQL).fetchall():
            sender = (run_id, rank, incarnation)
            keys._starts.setdefault(sender, []).append(lo)
            keys._ends.setdefault(sender, []).append(hi)
        return keys

    def sort_out(self, batches: Sequence[tuple[Key, bytes]],
                 stored_hashes: Callable[[list[Key]], dict[Key, bytes | None]]) -> list[str]:
        """FRESH, DUPLICATE or CONFLICT for each (key, content hash) of a group, in order.

        The first of the group to carry a key not yet stored is FRESH; a later one
        with the same hash is a DUPLICATE, with another a CONFLICT. A key already
        stored is a DUPLICATE when `stored_hashes` (called once, with those keys
        only, and only if there are any) gives the same hash or none (rows from
        before hashes were kept; an empty hash also means unknown), else a CONFLICT.
        Touches nothing but the lookup it is given: the writer calls `add` after the commit."""
        taken = dict.fromkeys(key for key, _ in batches if key in self)
        stored = stored_hashes(list(taken)) if taken else {}
        first: dict[Key, bytes] = {}
        verdicts = []
        for key, digest in batches:
            if key in first:
                known = first[key]
            elif key in taken:
                known = stored.get(key)
            else:
                first[key] = digest
                verdicts.append(FRESH)
                continue
            verdicts.append(DUPLICATE if not known or not digest or known == digest else CONFLICT)
        return verdicts

    def __contains__(self, key: tuple[str, int, str, int]) -> bool:
        starts = self._starts.get(key[:3])
        if not starts:
            return False
        seq = key[3]
        i = bisect.bisect_right(starts, seq) - 1
        return i >= 0 and seq <= self._ends[key[:3]][i]

    def add(self, key: tuple[str, int, str, int]) -> None:
        sender, seq = key[:3], key[3]
        starts = self._starts.setdefault(sender, [])
        ends = self._ends.setdefault(sender, [])
        if ends and ends[-1] == seq - 1:  # the common case: the next batch in order
            ends[-1] = seq
            return
        i = bisect.bisect_right(starts, seq)
        if i > 0 and ends[i - 1] >= seq:
            return  # already present
        joins_left = i > 0 and ends[i - 1] == seq - 1
        joins_right = i < len(starts) and starts[i] == seq + 1
        if joins_left and joins_right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif joins_left:
            ends[i - 1] = seq
        elif joins_right:
            starts[i] = seq
        else:
            starts.insert(i, seq)
            ends.insert(i, seq)


class BatchKeysProjection(Projection):
    name = "batches"
    writes = ("batches",)

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self._con = con
        self.keys = BatchKeys.load(con)

    def sort_out(self, batches: Sequence[DecodedBatch]) -> list[str]:
        """FRESH, DUPLICATE or CONFLICT per batch (see BatchKeys.sort_out). Raises
        duckdb.Error when the stored hashes cannot be read."""
        if not batches:
            return []
        return self.keys.sort_out([(b.key, b.content_hash) for b in batches], self._stored_hashes)

    def _stored_hashes(self, keys: list[Key]) -> dict[Key, bytes | None]:
        """Stored content hashes of `keys` (all in the key set: retries, spool replays).

        DuckDB does not use the composite primary key's index for this, so it is a
        filtered scan; row groups whose batch_seq range misses are skipped (a
        sender's seqs grow with time), which keeps one key at ~1 ms on millions
        of batches. Several keys are one join, whatever their number."""
        if len(keys) == 1:
            rows = self._con.execute(
                "SELECT run_id, rank, incarnation, batch_seq, content_hash FROM batches "
                "WHERE run_id = ? AND rank = ? AND incarnation = ? AND batch_seq = ?", list(keys[0])).fetchall()
        else:
            self._con.register("__keys", pa.table({
                "run_id": pa.array([k[0] for k in keys], pa.string()),
                "rank": pa.array([k[1] for k in keys], pa.int32()),
                "incarnation": pa.array([k[2] for k in keys], pa.string()),
                "batch_seq": pa.array([k[3] for k in keys], pa.int64())}))
            try:
                rows = self._con.execute(
                    "SELECT run_id, rank, incarnation, batch_seq, content_hash FROM batches "
                    "JOIN __keys USING (run_id, rank, incarnation, batch_seq)").fetchall()
            finally:
                self._con.unregister("__keys")
        return {(r, k, i, s): h for r, k, i, s, h in rows}

    def plan(self, group: Group) -> pa.Table | None:
        return columns.batches_table(group.fresh, group.now) if group.fresh else None

    def write(self, con: duckdb.DuckDBPyConnection, plan: pa.Table | None, group: Group) -> None:
        if plan is not None:
            con.register("__batches", plan)
            try:
                con.execute("INSERT INTO batches BY NAME SELECT * FROM __batches")
            finally:
                con.unregister("__batches")

    def apply(self, plan: Any, group: Group) -> None:
        for b in group.fresh:
            self.keys.add(b.key)
