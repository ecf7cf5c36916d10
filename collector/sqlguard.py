"""Read-only SQL: one SELECT, no files, no network, a row limit and a timeout.

Three fences, from outside in:

1. The database itself is opened with `enable_external_access=false`, no
   extension auto-install/auto-load, and `lock_configuration=true` (see
   `storage.DUCKDB_LOCKDOWN`): whatever a statement is, DuckDB refuses to touch a
   file other than the database, the network, or a setting.
2. `check_select`: exactly one statement, of type SELECT (CTEs, window
   functions, DESCRIBE/SHOW/SUMMARIZE are SELECTs too). COPY, ATTACH,
   INSTALL/LOAD, PRAGMA, SET, DDL, DML, CALL, EXPORT and multi-statement strings
   are refused before anything runs.
3. Table functions that read files or act on the database (read_*, glob,
   checkpoint, query, ...) are refused by name from the parsed statement, so the
   user gets a clear reason instead of a permission error.

`run_select` wraps the statement in `SELECT * FROM (...) LIMIT max_rows + 1`, so a
huge result is never materialised, and interrupts the cursor from a timer.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa

_DENIED_PREFIXES = ("read_", "parquet_", "iceberg_", "delta_", "sqlite_", "postgres_", "mysql_", "glob", "sniff_")
_DENIED_NAMES = frozenset({
    "checkpoint", "force_checkpoint", "query", "query_table", "duckdb_secrets", "which_secret",
    "arrow_scan", "arrow_scan_dumb", "python_map_function", "seq_scan", "index_scan", "load_aws_credentials",
})


class SqlRefused(ValueError):
    """A statement that will not run, or that failed; the message says why."""


@dataclass(slots=True)
class SelectResult:
    columns: list[str]
    types: list[str]
    rows: list[tuple] | None  # format "json"
    table: pa.Table | None  # format "arrow"
    truncated: bool


def _table_functions(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        if node.get("type") == "TABLE_FUNCTION" and isinstance(node.get("function"), dict):
            out.add(str(node["function"].get("function_name", "")).lower())
        for v in node.values():
            _table_functions(v, out)
    elif isinstance(node, list):
        for v in node:
            _table_functions(v, out)


def check_select(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """The text of the one SELECT in `sql`, or SqlRefused with the reason."""
    if not isinstance(sql, str) or not sql.strip():
        raise SqlRefused("no SQL given")
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise SqlRefused(f"SQL does not parse: {e}") from None
    if len(statements) != 1:
        raise SqlRefused(f"exactly one statement is allowed, got {len(statements)}")
    st = statements[0]
    if st.type != duckdb.StatementType.SELECT:
        kind = str(st.type).rsplit(".", 1)[-1]
        raise SqlRefused(f"only SELECT is allowed (read-only SQL); this is a {kind} statement")
    text = st.query.strip().rstrip(";")
    ast = json.loads(con.execute("SELECT json_serialize_sql(?)", [text]).fetchall()[0][0])
    if ast.get("error"):
        raise SqlRefused(f"statement could not be analysed: {ast.get('error_message', 'unknown error')}")
    functions: set[str] = set()
    _table_functions(ast.get("statements"), functions)
    for name in sorted(functions):
        if name in _DENIED_NAMES or name.startswith(_DENIED_PREFIXES) or name.endswith("_scan"):
            raise SqlRefused(f"table function {name}() is not allowed: SQL here may read only the database's tables")
    return text


def run_select(cursor: duckdb.DuckDBPyConnection, sql: str, *, max_rows: int, timeout_s: float,
               fmt: str = "json") -> SelectResult:
    """Check and run one SELECT on `cursor` (a connection of its own)."""
    text = check_select(cursor, sql)
    timer = threading.Timer(timeout_s, cursor.interrupt)
    timer.daemon = True
    timer.start()
    try:
        rel = cursor.sql(f"SELECT * FROM (\n{text}\n) LIMIT {int(max_rows) + 1}")
        names, types = list(rel.columns), [str(t) for t in rel.types]
        if fmt == "arrow":
            table = rel.to_arrow_table()
            return SelectResult(names, types, None, table.slice(0, max_rows), table.num_rows > max_rows)
        rows = rel.fetchall()
        return SelectResult(names, types, rows[:max_rows], None, len(rows) > max_rows)
    except duckdb.InterruptException:
        raise SqlRefused(f"query timed out after {timeout_s:g} s") from None
    except duckdb.PermissionException as e:
        raise SqlRefused(f"SQL here may not access files, the network or settings: {e}") from None
    except duckdb.Error as e:
        raise SqlRefused(f"query failed: {e}") from None
    finally:
        timer.cancel()
