"""Earlier runs in a collector's file, for the fleet-memory tests (a node's history across runs):
what a long-lived collector, or the file `collector archive` reads, holds after them."""

from __future__ import annotations

from pathlib import Path

from collector.storage import connect
from collector.store.schema import migrate


def past_run(con, run_id: str, t0: float, nodes: dict[str, list[str]], *, isolated: tuple[str, ...] = (),
             status: str = "completed") -> None:
    """A finished run on `nodes` (node -> its incidents' kinds), two ranks a node, `isolated` taken out."""
    con.execute("INSERT INTO runs (run_id, created_ts, updated_ts, status, world_size) VALUES (?, ?, ?, ?, ?)",
                [run_id, t0, t0 + 600, status, 2 * len(nodes)])
    for i, (node, kinds) in enumerate(nodes.items()):
        for r in (2 * i, 2 * i + 1):
            con.execute("INSERT INTO ranks (run_id, rank, node, first_seen_ts, last_seen_ts) VALUES (?, ?, ?, ?, ?)",
                        [run_id, r, node, t0 + 1 + i, t0 + 600])
        con.execute("INSERT INTO nodes (run_id, node, status, updated_ts, isolated_ts) VALUES (?, ?, ?, ?, ?)",
                    [run_id, node, "isolated" if node in isolated else "healthy", t0 + 300,
                     t0 + 300 if node in isolated else None])
        for k, kind in enumerate(kinds):
            iid = con.execute("SELECT coalesce(max(id), 0) + 1 FROM incidents").fetchone()[0]
            con.execute("INSERT INTO incidents (id, run_id, kind, severity, rank, node, opened_ts, updated_ts) "
                        "VALUES (?, ?, ?, 'warning', ?, ?, ?, ?)",
                        [iid, run_id, kind, 2 * i, node, t0 + 60 + k, t0 + 60 + k])


def runs_file(path: Path, runs: list[tuple]) -> Path:
    """A collector file holding `runs`: (run_id, t0, nodes[, isolated]) each, as `past_run` takes them."""
    con = connect(path)
    try:
        migrate(con)
        for run_id, t0, nodes, *isolated in runs:
            past_run(con, run_id, t0, nodes, isolated=tuple(isolated[0]) if isolated else ())
    finally:
        con.close()
    return path
