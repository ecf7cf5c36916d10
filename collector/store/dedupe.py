"""A batch stored once: the admission every group commit starts with, and the
projection that records the stored keys.

`sort_out` runs first: it says which of the group's batches are new (FRESH),
already stored with the same bytes (DUPLICATE, acknowledged) or already stored
with other bytes (CONFLICT, refused with 409), from the in-memory key set
(collector/store/batchkeys.py) and, for keys that set says are taken, one lookup of
the stored content hashes. Then, as a projection, the fresh batches' rows go into
`batches` inside the transaction and their keys into the set after the commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import duckdb
import pyarrow as pa

from collector.ingest import columns
from collector.ingest.decode import DecodedBatch
from collector.store.batchkeys import BatchKeys, Key
from collector.store.projection import Group, Projection


class BatchKeysProjection(Projection):
    name = "batches"

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
