"""Opening a collector's file no collector holds (the offline commands: archive, rollup,
compact, nodes), with the error a user can act on."""

from __future__ import annotations

from pathlib import Path

import duckdb


def open_closed(path: str | Path, what: str, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """`path` opened; SystemExit naming `collector <what>` when it is missing or held (a running
    collector holds its file: DuckDB lets no second process open it)."""
    if not Path(path).exists():
        raise SystemExit(f"collector {what}: no such file: {path}")
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as e:
        hint = " (a running collector holds it: stop it, or work on a copy)" if "lock" in str(e).lower() else ""
        raise SystemExit(f"collector {what}: cannot open {path}: {e}{hint}") from None
