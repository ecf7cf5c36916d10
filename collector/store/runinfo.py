"""What batches say about their run beyond rows: its config and mesh, its nodes,
its checkpoints and how it ended.

A batch may carry the run's description (`run`: config, mesh, world size, node
map, the launcher's spare nodes) and special events (checkpoint_saved, checkpoint_verified, run_finished).
Each becomes a statement on `runs`, `nodes` or `checkpoints`. The plan is the
list of those statements in the order the batches and their events came, so a
later batch wins exactly as it did when each ran on its own; `write` runs them.
It keeps no state: there is nothing to apply.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import duckdb
import pyarrow as pa

from collector.ingest.decode import CheckpointSaved, CheckpointVerified, DecodedBatch, RunFinished, json_text
from collector.store.projection import Group, Projection

# (sql, params, the table registered as __nodes for it or None)
Statement = tuple[str, list[Any], pa.Table | None]

_RUN_INFO = """
    UPDATE runs SET config = coalesce(?, config), mesh = coalesce(?, mesh),
        world_size = coalesce(?, world_size), code_version = coalesce(?, code_version),
        data_version = coalesce(?, data_version), node_map = coalesce(?, node_map),
        started_ts = coalesce(?, started_ts), status = 'running', updated_ts = ?
    WHERE run_id = ?"""
_NODES = """
    INSERT INTO nodes (run_id, node, ranks, status, updated_ts)
    SELECT ?, node, ranks, 'healthy', ? FROM __nodes
    ON CONFLICT (run_id, node) DO UPDATE SET ranks = excluded.ranks, updated_ts = excluded.updated_ts,
        status = CASE WHEN nodes.status = 'spare' THEN 'healthy' ELSE nodes.status END"""
# the launcher's standby nodes: listed as spares until one takes a node's place (it then has ranks)
_SPARES = """
    INSERT INTO nodes (run_id, node, ranks, status, updated_ts)
    SELECT ?, node, NULL, 'spare', ? FROM __nodes
    ON CONFLICT (run_id, node) DO NOTHING"""
# every rank reports the shards it wrote: the row adds them up
_CHECKPOINT_SAVED = """
    INSERT INTO checkpoints (run_id, step, attempt, path, num_shards, bytes, checksums, verified, write_s, ts,
                             num_ranks)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)
    ON CONFLICT (run_id, step, attempt) DO UPDATE SET path = excluded.path,
        num_shards = checkpoints.num_shards + excluded.num_shards,
        bytes = checkpoints.bytes + excluded.bytes,
        checksums = json_merge_patch(coalesce(checkpoints.checksums, '{}'),
                                     coalesce(excluded.checksums, '{}')),
        verified = checkpoints.verified AND excluded.verified,
        write_s = greatest(checkpoints.write_s, excluded.write_s),
        ts = greatest(checkpoints.ts, excluded.ts),
        num_ranks = checkpoints.num_ranks + 1"""
_CHECKPOINT_VERIFIED = "UPDATE checkpoints SET verified = ? WHERE run_id = ? AND step = ?"
_RUN_FINISHED = "UPDATE runs SET status = ?, updated_ts = ? WHERE run_id = ?"


def statements(b: DecodedBatch, now: float) -> list[Statement]:
    """The statements one batch's run info and special events need, in order."""
    out: list[Statement] = []
    if b.run is not None:
        r = b.run
        out.append((_RUN_INFO, [b.run_json["config"], b.run_json["mesh"], r.world_size, r.code_version,
                                r.data_version, b.run_json["node_map"], r.started_ts, now, b.run_id], None))
        if r.node_map:
            by_node: dict[str, list[int]] = defaultdict(list)
            for rank, node in r.node_map.items():  # keys checked to be rank numbers by decode
                by_node[node].append(int(rank))
            nodes = pa.table({  # one statement: executemany costs ~1 ms a row
                "node": pa.array(list(by_node), pa.string()),
                "ranks": pa.array([json_text(sorted(r)) for r in by_node.values()], pa.string())})
            out.append((_NODES, [b.run_id, now], nodes))
        if r.spares:
            out.append((_SPARES, [b.run_id, now], pa.table({"node": pa.array(sorted(set(r.spares)), pa.string())})))
    for e in b.events:
        s = e.special
        if isinstance(s, CheckpointSaved):
            out.append((_CHECKPOINT_SAVED, [b.run_id, s.step, e.attempt or 0, s.path, s.num_shards, s.bytes,
                                            json_text(s.checksums), s.verified, s.write_s, e.ts], None))
        elif isinstance(s, CheckpointVerified):
            out.append((_CHECKPOINT_VERIFIED, [s.verified, b.run_id, s.step], None))
        elif isinstance(s, RunFinished):
            out.append((_RUN_FINISHED, [s.status, now, b.run_id], None))
    return out


class RunInfoProjection(Projection):
    """Run descriptions, nodes, checkpoints and run status from the fresh batches.
    After the liveness projection in the list: it updates `runs` rows that one creates."""

    name = "runinfo"
    writes = ("runs", "nodes", "checkpoints")

    def plan(self, group: Group) -> list[Statement]:
        return [st for b in group.fresh if b.run is not None or b.events for st in statements(b, group.now)]

    def write(self, con: duckdb.DuckDBPyConnection, plan: list[Statement], group: Group) -> None:
        for sql, params, nodes in plan:
            if nodes is None:
                con.execute(sql, params)
                continue
            con.register("__nodes", nodes)
            try:
                con.execute(sql, params)
            finally:
                con.unregister("__nodes")
