"""Read-only SQL: one SELECT over the collector's tables, bounded in rows, bytes and time.

Four fences, from outside in:

1. The database is opened with `enable_external_access=false`, no extension
   auto-install/auto-load, and `lock_configuration=true` (`storage.DUCKDB_LOCKDOWN`):
   no file but the database, no network, no setting changes. (That still lets
   read_blob() read the database file itself, and checkpoint() run: hence 3.)
2. `check_select`: exactly one statement, of type SELECT (CTEs, window functions,
   DESCRIBE/SHOW/SUMMARIZE are SELECTs too). COPY, ATTACH, INSTALL/LOAD, PRAGMA,
   SET, DDL, DML, CALL, EXPORT and multi-statement strings are refused.
3. The allow-list (`collector/sql/allow.py`), checked on DuckDB's own parse tree
   (json_serialize_sql) of the exact text that will run: every function call,
   operator, table function and table reference must be named there. A CTE name
   counts as a table only where SQL scoping makes it visible, so a name cannot be
   smuggled past its CTE to reach the catalog. Anything else is refused, naming it.
4. `run_select`: the statement runs wrapped in `SELECT * FROM (...) LIMIT max_rows + 1`,
   its result is fetched incrementally (fetchmany, or Arrow record batches) and
   stops at `max_rows` rows or `max_bytes` bytes (`truncated` says so), and a timer
   interrupts the cursor at `timeout_s`. DuckDB checks for an interrupt between
   operators, not inside one call: that is why fence 3 keeps out the functions
   whose one call can run for long (repeat('a', 1e9)). Whatever DuckDB does, the
   HTTP answer comes at the deadline (collector/sql/slots.py).

What this does not bound: the memory of values built inside one chunk. A chain of
self-concatenations across CTEs (`s||s||...` ten times per level) grows a value
tenfold per level with allowed functions only; measured here: a 100 MB value took
~1 GB of RSS, a 1 GB value ~6 GB, within 4 s. DuckDB's memory_limit covers its
buffer pool (hash tables, sorts, aggregate states, spilled to disk), not vectors
in flight, and it is one limit for the whole database, shared with the writer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa

from collector.sql import allow

_FIRST_CHUNK_ROWS = 64  # then sized from the bytes per row seen so far
_MAX_CHUNK_ROWS = 2048  # one DuckDB vector
_ARROW_BATCH_ROWS = 1024


class SqlRefused(ValueError):
    """A statement that will not run, or that failed; the message says why."""


@dataclass(slots=True)
class SelectResult:
    columns: list[str]
    types: list[str]
    rows: list[tuple] | None  # format "json" without an encoder
    table: pa.Table | None  # format "arrow"
    truncated: bool  # more rows existed than max_rows, or they would pass max_bytes
    num_bytes: int = 0  # the rows as counted against max_bytes (JSON text + 1 separator each / Arrow buffers)
    rows_json: list[bytes] | None = None  # format "json" with an encoder: each row's JSON text


def _json_row(row: tuple) -> bytes:
    """A row's JSON text as it is counted when the caller gives no encoder."""
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False, default=str).encode()


# -- the check -------------------------------------------------------------------------
def _refuse(what: str, why: str) -> SqlRefused:
    return SqlRefused(f"{what} is not allowed: {why}")


def _literal(expr: Any) -> object:
    """A literal argument's Python value, or allow.VARIES."""
    if not isinstance(expr, dict) or expr.get("class") != "CONSTANT":
        return allow.VARIES
    lit = expr.get("literal")
    if not isinstance(lit, dict):
        return allow.VARIES
    kind, text = lit.get("kind"), lit.get("text", "")
    try:
        if kind == "INTEGER":
            return int(text)
        if kind == "NUMERIC":
            return float(text)
    except ValueError:
        return allow.VARIES
    return text if kind == "STRING" else allow.VARIES


def _arguments(fn: dict) -> list:
    return [a.get("expression") if isinstance(a, dict) and "expression" in a else a
            for a in fn.get("arguments", fn.get("children", []))]


class _Walk:
    """One pass over a statement's parse tree; raises SqlRefused at the first thing
    not on the allow-list. `scope`: the CTE names visible at a node."""

    def __init__(self, database: str) -> None:
        self.database = database.lower()

    def any(self, node: Any, scope: frozenset[str]) -> None:
        if isinstance(node, list):
            for v in node:
                self.any(v, scope)
        elif isinstance(node, dict):
            if "class" in node:
                self.expression(node, scope)
            elif "cte_map" in node:
                self.query_node(node, scope)
            elif "sample" in node or (isinstance(node.get("type"), str) and node["type"] in allow.TABLE_REFS):
                self.table_ref(node, scope)
            else:
                self.children(node, scope)

    def children(self, node: dict, scope: frozenset[str], skip: tuple[str, ...] = ()) -> None:
        for k, v in node.items():
            if k not in skip and isinstance(v, (dict, list)):
                self.any(v, scope)

    def expression(self, node: dict, scope: frozenset[str]) -> None:
        cls = node["class"]
        if cls not in allow.EXPRESSION_CLASSES:
            raise _refuse(f"a {cls.lower()} expression", "not on the allow-list (collector/sql/allow.py)")
        if cls == "FUNCTION":
            self.function(node)
        elif cls == "WINDOW":
            name = str(node.get("function_name", "")).lower()
            self.unqualified(node, name)
            if name not in allow.WINDOW_FUNCTIONS | allow.AGGREGATES:
                raise _refuse(f"window function {name}()", _why_not(name))
            self.arguments(node, name)
        elif cls == "OPERATOR" and node.get("type") not in allow.OPERATOR_TYPES:
            raise _refuse(f"operator {node.get('type')}", "not on the allow-list (collector/sql/allow.py)")
        elif cls == "PARAMETER":
            raise _refuse("a parameter ($1, ?)", "SQL here takes no parameters; write the value")
        self.children(node, scope)

    def function(self, node: dict) -> None:
        name = str(node.get("function_name", ""))
        lname = name.lower()
        self.unqualified(node, name)
        if node.get("is_operator"):
            if name not in allow.OPERATORS:
                raise _refuse(f"operator {name}", "not on the allow-list (collector/sql/allow.py)")
            return
        if lname not in allow.SCALARS | allow.AGGREGATES:
            raise _refuse(f"function {lname}()", _why_not(lname))
        self.arguments(node, lname)

    @staticmethod
    def unqualified(node: dict, name: str) -> None:
        if node.get("schema") or node.get("catalog"):
            shown = ".".join(str(p) for p in (node.get("catalog"), node.get("schema"), name) if p)
            raise _refuse(f"function {shown}()", "write function names unqualified")

    @staticmethod
    def arguments(node: dict, name: str) -> None:
        rule = allow.ARG_RULES.get(name)
        if rule is not None and (why := rule([_literal(a) for a in _arguments(node)])):
            raise SqlRefused(f"{name}() here: {why}")

    def query_node(self, node: dict, scope: frozenset[str]) -> None:
        if node.get("type") not in allow.QUERY_NODES:
            raise _refuse(f"a {node.get('type')} query", "not on the allow-list (collector/sql/allow.py)")
        visible = set(scope)
        for entry in (node.get("cte_map") or {}).get("map", []):
            self.any(entry.get("value"), frozenset(visible))  # a CTE sees the ones before it
            visible.add(str(entry.get("key", "")).lower())
        if node.get("type") == "RECURSIVE_CTE_NODE":
            visible.add(str(node.get("cte_name", "")).lower())
        self.children(node, frozenset(visible), skip=("cte_map",))

    def table_ref(self, node: dict, scope: frozenset[str]) -> None:
        kind = node.get("type")
        if kind not in allow.TABLE_REFS:
            raise _refuse(f"FROM {kind}", "not on the allow-list (collector/sql/allow.py)")
        if kind == "BASE_TABLE":
            self.base_table(node, scope)
        elif kind == "TABLE_FUNCTION":
            fn = node.get("function") or {}
            name = str(fn.get("function_name", "")).lower()
            if fn.get("class") != "FUNCTION" or fn.get("schema") or fn.get("catalog") \
                    or name not in allow.TABLE_FUNCTIONS:
                raise _refuse(f"table function {name}()", _why_not(name, table=True))
            self.any(_arguments(fn), scope)
            self.children(node, scope, skip=("function",))
            return
        elif kind == "SHOW_REF":
            self.show(node, scope)
        self.children(node, scope)

    def base_table(self, node: dict, scope: frozenset[str]) -> None:
        name = str(node.get("table_name", ""))
        schema, catalog = str(node.get("schema_name", "")).lower(), str(node.get("catalog_name", "")).lower()
        lname = name.lower()
        if not schema and not catalog and lname in scope:
            return  # a CTE of the statement
        if schema == "information_schema" and catalog in ("", "system") and lname in allow.DISCOVERY_RELATIONS:
            return
        if schema in ("", "main") and catalog in ("", self.database) and lname in allow.RELATIONS:
            return
        shown = ".".join(p for p in (catalog, schema, name) if p)
        raise _refuse(f"table {shown!r}", "SQL here reads only the collector's tables and views "
                      f"({', '.join(sorted(allow.RELATIONS))}) and information_schema; "
                      "files, URLs and DuckDB's own catalog are out of reach")

    def show(self, node: dict, scope: frozenset[str]) -> None:
        kind, name = node.get("show_type"), str(node.get("table_name", "")).strip('"').lower()
        if kind in ("DESCRIBE", "SUMMARY") and not name:
            return  # the query described is walked as a child
        if kind in ("DESCRIBE", "SHOW", "SUMMARY") and name in allow.RELATIONS:
            return
        if kind == "SHOW_SPECIAL" and name in allow.SHOW_SPECIALS:
            return
        if kind == "SHOW_FROM" and str(node.get("schema_name", "")).lower() in ("", "main") \
                and str(node.get("catalog_name", "")).lower() in ("", self.database):
            return
        if kind == "SHOW_FROM":
            name = "TABLES FROM " + ".".join(p for p in (node.get("catalog_name"), node.get("schema_name")) if p)
        raise _refuse(f"SHOW {name or kind}", "only SHOW TABLES and DESCRIBE/SUMMARIZE of the collector's "
                      "tables and views (or of a query) are allowed")


def _why_not(name: str, *, table: bool = False) -> str:
    if name in allow.WHY_NOT:
        return allow.WHY_NOT[name]
    if table and name in allow.SCALARS:
        return f"not a table function here (table functions: {', '.join(sorted(allow.TABLE_FUNCTIONS))})"
    return "not on the allow-list (collector/sql/allow.py)"


def _statement_text(con: duckdb.DuckDBPyConnection, sql: str) -> str:
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
    return st.query.strip().rstrip(";")


def _check_tree(con: duckdb.DuckDBPyConnection, text: str) -> None:
    """Refuse `text` (one SELECT) unless everything it names is allowed."""
    ast = json.loads(con.execute("SELECT json_serialize_sql(?)", [text]).fetchall()[0][0])
    if ast.get("error"):
        raise SqlRefused(f"statement could not be analysed: {ast.get('error_message', 'unknown error')}")
    (database,), = con.execute("SELECT current_database()").fetchall()
    _Walk(database or "").any(ast.get("statements"), frozenset())


def check_select(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """The text of the one SELECT in `sql`, or SqlRefused with the reason."""
    text = _statement_text(con, sql)
    _check_tree(con, text)
    return text


def _limited(text: str, max_rows: int) -> str:
    """The statement that runs: `text` with a row limit, checked again as a whole
    (so the wrapping cannot change what was checked)."""
    return f"SELECT * FROM (\n{text}\n) LIMIT {int(max_rows) + 1}"


# -- the run ---------------------------------------------------------------------------
def run_select(cursor: duckdb.DuckDBPyConnection, sql: str, *, max_rows: int, timeout_s: float,
               max_bytes: int = 16 << 20, fmt: str = "json",
               encode_row: Callable[[tuple], bytes] | None = None) -> SelectResult:
    """Check and run one SELECT on `cursor` (a connection of its own), fetching at most
    `max_rows` rows and `max_bytes` bytes of them. For "json" the bytes are each row's
    JSON text as `encode_row` writes it, plus one for the comma between rows; given an
    encoder, the result keeps only that text (`rows_json`), so a big answer never exists
    as Python objects all at once. For "arrow" they are the record batches' buffers."""
    text = _limited(_statement_text(cursor, sql), max_rows)
    timer = threading.Timer(timeout_s, cursor.interrupt)
    timer.daemon = True
    try:
        _check_tree(cursor, text)
        timer.start()
        if fmt == "arrow":
            return _fetch_arrow(cursor, text, max_rows=max_rows, max_bytes=max_bytes)
        return _fetch_json(cursor, text, max_rows=max_rows, max_bytes=max_bytes, encode_row=encode_row)
    except duckdb.InterruptException:
        raise SqlRefused(f"query timed out after {timeout_s:g} s") from None
    except duckdb.PermissionException as e:
        raise SqlRefused(f"SQL here may not access files, the network or settings: {e}") from None
    except duckdb.OutOfMemoryException as e:
        raise SqlRefused(f"query needs more memory than the collector allows: {e}") from None
    except duckdb.Error as e:
        raise SqlRefused(f"query failed: {e}") from None
    finally:
        timer.cancel()


def _fetch_json(cursor: duckdb.DuckDBPyConnection, text: str, *, max_rows: int, max_bytes: int,
                encode_row: Callable[[tuple], bytes] | None) -> SelectResult:
    cursor.execute(text)
    names = [d[0] for d in cursor.description]
    types = [str(d[1]) for d in cursor.description]
    encode = encode_row or _json_row
    kept: list = []
    num_bytes, truncated, ask = 0, False, _FIRST_CHUNK_ROWS
    while len(kept) < max_rows:
        chunk = cursor.fetchmany(min(ask, max_rows + 1 - len(kept)))
        if not chunk:
            break
        for row in chunk:
            if len(kept) == max_rows:
                truncated = True
                break
            data = encode(row)
            if num_bytes + len(data) + 1 > max_bytes:  # + its separator in the answer
                truncated = True
                break
            num_bytes += len(data) + 1
            kept.append(data if encode_row is not None else row)
        if truncated:
            break
        per_row = max(1, num_bytes // max(1, len(kept)))  # fetch about what can still fit
        ask = max(1, min(_MAX_CHUNK_ROWS, (max_bytes - num_bytes) // per_row + 1))
    else:
        truncated = bool(cursor.fetchmany(1))  # exactly max_rows kept: was there one more?
    if encode_row is not None:
        return SelectResult(names, types, None, None, truncated, num_bytes, kept)
    return SelectResult(names, types, kept, None, truncated, num_bytes)


def _fetch_arrow(cursor: duckdb.DuckDBPyConnection, text: str, *, max_rows: int, max_bytes: int) -> SelectResult:
    rel = cursor.sql(text)
    names, types = list(rel.columns), [str(t) for t in rel.types]
    reader = rel.to_arrow_reader(_ARROW_BATCH_ROWS)  # streams: a batch is produced when read
    schema = reader.schema
    batches: list[pa.RecordBatch] = []
    num_rows = num_bytes = 0
    truncated = False
    try:
        for batch in reader:
            room_rows = max_rows - num_rows
            if room_rows <= 0:
                truncated = batch.num_rows > 0
                break
            fit = batch.slice(0, room_rows)
            if num_bytes + fit.nbytes > max_bytes:
                fit = _largest_prefix(fit, max_bytes - num_bytes)
            if fit.num_rows:
                batches.append(fit)
                num_rows += fit.num_rows
                num_bytes += fit.nbytes
            if fit.num_rows < batch.num_rows:
                truncated = True
                break
    finally:
        reader.close()
    table = pa.Table.from_batches(batches, schema=schema)
    return SelectResult(names, types, None, table, truncated, num_bytes)


def _largest_prefix(batch: pa.RecordBatch, max_bytes: int) -> pa.RecordBatch:
    """The longest head of `batch` whose buffers fit in `max_bytes` (binary search)."""
    lo, hi = 0, batch.num_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if batch.slice(0, mid).nbytes <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return batch.slice(0, lo)
