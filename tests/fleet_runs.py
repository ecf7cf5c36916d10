"""Earlier runs in a collector's file, for the fleet-memory tests (a node's history across runs):
what a long-lived collector, or the file `collector archive` reads, holds after them."""

from __future__ import annotations

from pathlib import Path

from collector.storage import connect
from collector.store.schema import migrate


def past_run(con, run_id: str, t0: float, nodes: dict[str, list[str]], *, isolated: tuple[str, ...] = (),
             status: str = "completed", hw: dict[str, str] | None = None) -> None:
    """A finished run on `nodes` (node -> its incidents' kinds), two ranks a node, `isolated` taken out;
    `hw`: node -> the hardware id its ranks report."""
    con.execute("INSERT INTO runs (run_id, created_ts, updated_ts, status, world_size) VALUES (?, ?, ?, ?, ?)",
                [run_id, t0, t0 + 600, status, 2 * len(nodes)])
    for i, (node, kinds) in enumerate(nodes.items()):
        for r in (2 * i, 2 * i + 1):
            con.execute("INSERT INTO ranks (run_id, rank, node, first_seen_ts, last_seen_ts, hw_id) "
                        "VALUES (?, ?, ?, ?, ?, ?)", [run_id, r, node, t0 + 1 + i, t0 + 600, (hw or {}).get(node)])
        con.execute("INSERT INTO nodes (run_id, node, status, updated_ts, isolated_ts) VALUES (?, ?, ?, ?, ?)",
                    [run_id, node, "isolated" if node in isolated else "healthy", t0 + 300,
                     t0 + 300 if node in isolated else None])
        for k, kind in enumerate(kinds):
            iid = con.execute("SELECT coalesce(max(id), 0) + 1 FROM incidents").fetchone()[0]
            con.execute("INSERT INTO incidents (id, run_id, kind, severity, rank, node, opened_ts, updated_ts) "
                        "VALUES (?, ?, ?, 'warning', ?, ?, ?, ?)",
                        [iid, run_id, kind, 2 * i, node, t0 + 60 + k, t0 + 60 + k])


def runs_file(path: Path, runs: list[tuple]) -> Path:
    """A collector file holding `runs`: (run_id, t0, nodes[, isolated[, hw]]) each, as `past_run` takes them."""
    con = connect(path)
    try:
        migrate(con)
        for run_id, t0, nodes, *rest in runs:
            past_run(con, run_id, t0, nodes, isolated=tuple(rest[0]) if rest else (), hw=rest[1] if len(rest) > 1 else None)
    finally:
        con.close()
    return path


def fleet_file(path: Path, *, num_runs: int, t0: float, nodes: int = 4, ranks_per_node: int = 2, steps: int = 50,
               slow_node: str = "node2", seed: int = 0) -> Path:
    """A collector file of `num_runs` finished runs, one every 6 hours from `t0`, each on `nodes`
    of the fleet's `nodes + 2` (which ones rotate), with `steps` steps of every rank: `slow_node`
    computes 1.3x when in a run and has a straggler incident there; every third run rolls back 10
    steps at its middle (attempt 1), every fourth has a loss spike (no node) and a hang on its
    first node. Steps are inserted in one statement per run (numpy, not a row at a time)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    fleet = [f"node{i}" for i in range(nodes + 2)]
    con = connect(path)
    try:
        migrate(con)
        for k in range(num_runs):
            run_id, start = f"run{k:03d}", t0 + k * 6 * 3600.0
            mine = [fleet[(k + j) % len(fleet)] for j in range(nodes)]
            kinds = {n: (["straggler"] if n == slow_node else []) for n in mine}
            if k % 4 == 3:
                kinds[mine[0]] = kinds[mine[0]] + ["hang"]
            past_run(con, run_id, start, {n: [] for n in mine}, status="completed")
            world = nodes * ranks_per_node
            order = [(0, s) for s in range(1, steps + 1)]
            if k % 3 == 2:  # a rollback at the middle: attempt 1 reruns the 10 steps before it
                mid = steps // 2
                order = [(0, s) for s in range(1, mid + 1)] + [(1, s) for s in range(mid - 9, steps + 1)]
            n = len(order)
            attempt = np.repeat([a for a, _ in order], world)
            step = np.repeat([s for _, s in order], world)
            rank = np.tile(np.arange(world), n)
            node = np.array([mine[r // ranks_per_node] for r in range(world)])[rank]
            slow = np.where(node == slow_node, 1.3, 1.0)
            compute = 0.3 * slow * rng.uniform(0.95, 1.05, len(rank))
            step_s = np.repeat(0.5 * np.maximum(1.0, compute.reshape(n, world).max(axis=1) / 0.3), world)
            ends = start + 10 + np.cumsum(step_s.reshape(n, world)[:, 0])
            con.register("s", pa.table({
                "run_id": [run_id] * len(rank), "attempt": attempt.astype(np.int32), "step": step.astype(np.int64),
                "rank": rank.astype(np.int32), "ts": np.repeat(ends, world), "step_s": step_s,
                "fwd_s": compute / 3, "bwd_s": compute / 2, "opt_s": compute / 6, "node": node,
                "loss": np.repeat(3.0 - 0.01 * np.arange(n), world)}))
            con.execute("INSERT INTO steps BY NAME SELECT * FROM s")
            con.unregister("s")
            for j, (nd, ks) in enumerate(kinds.items()):
                for kind in ks:
                    iid = con.execute("SELECT coalesce(max(id), 0) + 1 FROM incidents").fetchone()[0]
                    con.execute("INSERT INTO incidents (id, run_id, kind, severity, rank, node, opened_ts, updated_ts) "
                                "VALUES (?, ?, ?, 'warning', ?, ?, ?, ?)",
                                [iid, run_id, kind, j * ranks_per_node, nd, start + 30 + j, start + 30 + j])
            if k % 4 == 3:
                iid = con.execute("SELECT coalesce(max(id), 0) + 1 FROM incidents").fetchone()[0]
                con.execute("INSERT INTO incidents (id, run_id, kind, severity, opened_ts, updated_ts) "
                            "VALUES (?, ?, 'loss_spike', 'critical', ?, ?)", [iid, run_id, start + 40, start + 40])
    finally:
        con.close()
    return path
