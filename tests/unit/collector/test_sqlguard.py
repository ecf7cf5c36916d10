"""Read-only SQL: ordinary reads work, every escape is refused with a reason."""

from __future__ import annotations

import json
import time

import duckdb
import pytest

from collector.sql import allow
from collector.sql.guard import SqlRefused, check_select, run_select
from collector.storage import connect


@pytest.fixture
def con(tmp_path):
    c = connect(tmp_path / "g.duckdb")
    c.execute("CREATE TABLE steps (run_id VARCHAR, step BIGINT, rank INTEGER, loss DOUBLE)")
    c.execute("INSERT INTO steps SELECT 'r', i // 4, i % 4, 1.0 / (1 + i) FROM range(40) t(i)")
    yield c
    c.close()


def run(con, sql, **kw):
    kw.setdefault("max_rows", 1000)
    kw.setdefault("timeout_s", 5.0)
    return run_select(con.cursor(), sql, **kw)


@pytest.mark.parametrize("sql, num_rows", [
    ("SELECT * FROM steps", 40),
    ("select step, loss from steps where rank = 0 order by step;", 10),
    ("WITH per_step AS (SELECT step, max(loss) AS m FROM steps GROUP BY step) SELECT * FROM per_step", 10),
    ("SELECT step, rank, rank() OVER (PARTITION BY step ORDER BY loss DESC) AS r FROM steps", 40),
    ("SELECT step, avg(loss) OVER (ORDER BY step ROWS BETWEEN 2 PRECEDING AND CURRENT ROW) FROM steps", 40),
    ("FROM steps LIMIT 3", 3),
    ("SELECT * FROM range(5)", 5),
    ("DESCRIBE steps", 4),
    ("SHOW TABLES", 1),
    ("SELECT 1 -- a trailing comment", 1),
    ("SELECT arg_max(rank, loss) AS worst FROM steps", 1),
])
def test_ordinary_reads_work(con, sql, num_rows):
    result = run(con, sql)
    assert len(result.rows) == num_rows and not result.truncated


ESCAPES = [
    ("SELECT * FROM read_csv('/etc/passwd')", "read_csv"),
    ("SELECT * FROM read_csv_auto('/etc/passwd')", "read_csv_auto"),
    ("SELECT * FROM read_parquet('/tmp/x.parquet')", "read_parquet"),
    ("SELECT * FROM read_json('http://example.com/x.json')", "read_json"),
    ("SELECT * FROM read_text('/etc/passwd')", "read_text"),
    ("SELECT * FROM read_blob('/etc/passwd')", "read_blob"),
    ("SELECT * FROM glob('/etc/*')", "glob"),
    ("SELECT * FROM sniff_csv('/etc/passwd')", "sniff_csv"),
    ("SELECT * FROM parquet_metadata('/tmp/x.parquet')", "parquet_metadata"),
    ("WITH x AS (SELECT * FROM read_csv('/etc/passwd')) SELECT * FROM x", "read_csv"),
    ("SELECT (SELECT count(*) FROM read_text('/etc/passwd'))", "read_text"),
    ("SELECT * FROM checkpoint()", "checkpoint"),
    ("SELECT * FROM query('SELECT 1')", "query"),
    ("SELECT * FROM '/etc/passwd'", "files, URLs"),
    ("SELECT * FROM 'https://example.com/data.csv'", "files, URLs"),
    ("COPY steps TO '/tmp/steps.csv'", "COPY"),
    ("COPY (SELECT 1) TO '/tmp/x.csv'", "COPY"),
    ("ATTACH '/tmp/other.duckdb' AS other", "ATTACH"),
    ("DETACH other", "DETACH"),
    ("INSTALL httpfs", "LOAD"),
    ("LOAD httpfs", "LOAD"),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("SET enable_external_access = true", "SET"),
    ("RESET threads", "SET"),
    ("CREATE TABLE x (a INT)", "CREATE"),
    ("CREATE VIEW v AS SELECT * FROM read_csv('/etc/passwd')", "CREATE"),
    ("CREATE MACRO m() AS 1", "CREATE"),
    ("DROP TABLE steps", "DROP"),
    ("ALTER TABLE steps ADD COLUMN x INT", "ALTER"),
    ("INSERT INTO steps VALUES ('r', 1, 1, 1.0)", "INSERT"),
    ("UPDATE steps SET loss = 0", "UPDATE"),
    ("DELETE FROM steps", "DELETE"),
    ("SELECT 1; DROP TABLE steps", "exactly one statement"),
    ("SELECT 1; SELECT 2", "exactly one statement"),
    ("CALL checkpoint()", "CALL"),
    ("CHECKPOINT", "CALL"),
    ("EXPORT DATABASE '/tmp/dump'", "EXPORT"),
    ("VACUUM", "VACUUM"),
    ("BEGIN TRANSACTION", "TRANSACTION"),
    ("EXPLAIN ANALYZE SELECT 1", "EXPLAIN"),
    ("PIVOT steps ON rank USING sum(loss)", "MULTI"),
    ("", "no SQL"),
    ("SELEC 1", "does not parse"),
]


@pytest.mark.parametrize("sql, reason", ESCAPES)
def test_escapes_refused_with_a_reason(con, sql, reason):
    with pytest.raises(SqlRefused, match=reason):
        run(con, sql)
    assert con.execute("SELECT count(*) FROM steps").fetchall() == [(40,)]
    assert [t for (t,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()] == ["steps"]


def test_the_database_itself_refuses_files_and_settings(con):
    """The lockdown holds even for statements the guard would not let through."""
    with pytest.raises(duckdb.PermissionException):
        con.execute("SELECT * FROM read_csv('/etc/passwd')")
    with pytest.raises(duckdb.Error, match="lock"):
        con.execute("SET enable_external_access = true")
    with pytest.raises(duckdb.Error):
        con.execute("COPY steps TO '/tmp/llmwatch-guard-test.csv'")


def test_the_file_is_the_only_database_every_cursor_sees(con):
    """A writable file is attached (for its row group size) to an in-memory database that is
    then detached: no scratch database is left that SQL could write to, and a cursor's
    default is the file, named as a plain `duckdb.connect(path)` names it."""
    names = [n for (n,) in con.execute("SELECT database_name FROM duckdb_databases() WHERE NOT internal").fetchall()]
    assert names == ["g"]
    cur = con.cursor()
    assert cur.execute("SELECT current_database(), count(*) FROM steps").fetchall() == [("g", 40)]
    (path, spill), = cur.execute("SELECT path, current_setting('temp_directory') FROM duckdb_databases() "
                                 "WHERE database_name = 'g'").fetchall()
    assert spill == f"{path}.tmp"  # queries spill beside the file, as when it is opened directly


def test_row_limit_and_truncation(con):
    result = run(con, "SELECT * FROM steps ORDER BY step, rank", max_rows=5)
    assert len(result.rows) == 5 and result.truncated
    assert result.columns == ["run_id", "step", "rank", "loss"]
    assert result.types == ["VARCHAR", "BIGINT", "INTEGER", "DOUBLE"]
    arrow = run(con, "SELECT * FROM steps", max_rows=7, fmt="arrow")
    assert arrow.table.num_rows == 7 and arrow.truncated


def test_timeout_interrupts(con):
    with pytest.raises(SqlRefused, match="timed out after 0.3 s"):
        run(con, "SELECT count(*) FROM range(10000000000) a, range(10) b", timeout_s=0.3)


def test_check_select_returns_the_statement(con):
    assert check_select(con, "  SELECT 1;  ") == "SELECT 1"


# -- the allow-list: escapes the deny-list let through --------------------------------
ALLOW_LIST_ESCAPES = [
    # SQL handed over as data ran whatever it held, past any check of the outer statement.
    ("SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT * FROM checkpoint()'))",
     "json_execute_serialized_sql"),
    ("SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT * FROM query(''SELECT 1'')'))",
     "json_execute_serialized_sql"),
    ("SELECT json_serialize_plan('SELECT * FROM checkpoint()')", "json_serialize_plan"),
    ("SELECT * FROM truncate_duckdb_logs()", "truncate_duckdb_logs"),
    ("SELECT * FROM force_checkpoint()", "force_checkpoint"),
    ("SELECT * FROM query_table('steps')", "query_table"),
    ("SELECT * FROM read_blob('g.duckdb')", "read_blob"),  # the database file itself is readable despite the lockdown
    ("SELECT * FROM read_duckdb('g.duckdb')", "read_duckdb"),
    # settings, session state, the catalog
    ("SELECT getenv('HOME')", "getenv"),
    ("SELECT current_setting('memory_limit')", "current_setting"),
    ("SELECT * FROM duckdb_settings()", "duckdb_settings"),
    ("SELECT * FROM pg_catalog.pg_settings", "pg_settings"),
    ("SELECT * FROM duckdb_tables()", "duckdb_tables"),
    ("SELECT * FROM duckdb_logs", "duckdb_logs"),
    ("SELECT * FROM system.main.duckdb_databases", "duckdb_databases"),
    ("SELECT * FROM sqlite_master", "sqlite_master"),
    ("SELECT * FROM pragma_database_size()", "pragma_database_size"),
    ("SELECT * FROM pragma_table_info('steps')", "pragma_table_info"),
    ("SELECT * FROM duckdb_memory()", "duckdb_memory"),
    ("SELECT getvariable('x')", "getvariable"),
    ("SELECT setseed(0.5)", "setseed"),
    ("SELECT write_log('x')", "write_log"),
    ("SELECT version()", "version"),
    ("SHOW memory_limit", "SHOW memory_limit"),
    ("SHOW SETTINGS", "SHOW settings"),
    ("SHOW DATABASES", "SHOW databases"),
    ("SHOW TABLES FROM system.main", "SHOW TABLES FROM system.main"),
    ("DESCRIBE duckdb_logs", "duckdb_logs"),
    ("SUMMARIZE duckdb_logs", "duckdb_logs"),
    # files, with or without a table function
    ("SELECT * FROM sniff_csv('/etc/passwd')", "sniff_csv"),
    ("SELECT * FROM glob('/etc/*')", "glob"),
    ("SELECT * FROM 'steps.csv'", "files, URLs"),
    ("SELECT * FROM steps, LATERAL (SELECT * FROM read_text('/etc/passwd'))", "read_text"),
    ("SELECT * FROM steps WHERE rank IN (SELECT size FROM read_blob('/etc/passwd'))", "read_blob"),
    # a CTE name admits only that CTE, where SQL scoping sees it
    ("WITH duckdb_logs AS (SELECT * FROM duckdb_logs) SELECT * FROM duckdb_logs", "duckdb_logs"),
    ("SELECT * FROM (WITH x AS (SELECT 1) SELECT * FROM x), x", "'x'"),
    ("WITH a AS (SELECT * FROM duckdb_logs), duckdb_logs AS (SELECT 1) SELECT * FROM a", "duckdb_logs"),
    # qualified names, parameters
    ("SELECT main.repeat('a', 10)", "unqualified"),
    ("SELECT system.main.current_setting('threads')", "unqualified"),
    ("SELECT * FROM other.main.steps", "other.main.steps"),
    ("SELECT * FROM steps WHERE rank = $1", "parameter"),
]


@pytest.mark.parametrize("sql, reason", ALLOW_LIST_ESCAPES)
def test_allow_list_refuses_what_the_deny_list_let_through(con, sql, reason):
    with pytest.raises(SqlRefused, match=reason):
        run(con, sql)
    assert con.execute("SELECT count(*) FROM steps").fetchall() == [(40,)]


# One call of these builds its output before DuckDB looks for an interrupt again.
AMPLIFIERS = [
    ("SELECT length(repeat('a', 1000000000))", "repeat"),  # ran 23 s past a 10 s timeout
    ("SELECT repeat('a', 100000000) AS s FROM range(5)", "repeat"),  # a 500 MB answer
    ("SELECT lpad('a', 1000000000, 'b')", "lpad"),
    ("SELECT rpad('a', rank, 'b') FROM steps", "rpad"),
    ("SELECT format('{:>1000000000}', 'a')", "format"),
    ("SELECT format('{:{}}', 'a', 100000000)", "format"),
    ("SELECT printf('%1000000000d', 1)", "printf"),
    ("SELECT printf('%*d', 100000000, 1)", "printf"),
    ("SELECT bar(1, 0, 1, 1000000000)", "bar"),
    ("SELECT range(1000000000)", "FROM range"),
    ("SELECT * FROM unnest(generate_series(1, 1000000000))", "FROM generate_series"),
    ("SELECT list_resize([1], 1000000000)", "list_resize"),
    ("SELECT equi_width_bins(0, 1, 1000000000, false)", "equi_width_bins"),
    ("SELECT to_base(1, 2, 1000000000)", "to_base"),
    ("SELECT replace(replace('aaaa', 'a', 'aaaaaaaaaaaaaaaaaaaaaaa'), 'a', 'bbbbbbbbbbbbbbbbbbbb')", "replace"),
    ("SELECT regexp_replace('abc', '', 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx', 'g')", "regexp_replace"),
    ("SELECT regexp_replace('abc', '(a)', '\\1\\1\\1\\1', 'g')", "regexp_replace"),
    ("SELECT list_transform([1, 2], x -> 'big')", "list_transform"),
    ("SELECT list_aggregate([1], 'bitstring_agg', 0, 1000000000000)", "list_aggregate"),
    ("SELECT bitstring_agg(1, 0, 100000000000)", "bitstring_agg"),
    ("SELECT * FROM repeat_row(1, num_rows := 1000000000)", "repeat_row"),
    ("SELECT approx_top_k(rank, 999999) FROM steps GROUP BY step", "approx_top_k"),
    ("SELECT max(loss, 999999) OVER (PARTITION BY step) FROM steps", "max"),
    ("SELECT arg_max(rank, loss, 999999) FROM steps", "arg_max"),
    ("SELECT levenshtein('a', 'b')", "levenshtein"),
    ("SELECT pg_sleep(100)", "pg_sleep"),
]


@pytest.mark.parametrize("sql, name", AMPLIFIERS)
def test_calls_that_cannot_be_interrupted_are_refused_before_they_run(con, sql, name):
    start = time.monotonic()
    with pytest.raises(SqlRefused, match=name):
        run(con, sql, timeout_s=0.5)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("sql", [
    "SELECT lpad(rank::VARCHAR, 4, '0'), rpad('x', 10, ' '), bar(loss, 0, 1, 20), bar(loss, 0, 1) FROM steps",
    "SELECT format('{} {:>8.3f}', rank, loss), printf('%5.2f%%', loss) FROM steps",
    "SELECT replace(run_id, 'r', 'run-'), regexp_replace(run_id, '[0-9]+', 'N', 'g') FROM steps",
    "SELECT histogram(loss, equi_width_bins(0, 1, 10, true)) FROM steps",
    "SELECT list_aggregate([1, 2], 'sum'), [1, 2, 3][2], list_sort([3, 1]), unnest([1, 2])",
    "SELECT * FROM range(3) a, generate_series(1, 2) b, unnest([1, 2]) c",
    "WITH RECURSIVE t(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM t WHERE n < 3) SELECT * FROM t",
    "WITH steps AS (SELECT * FROM steps WHERE rank = 0) SELECT count(*) FROM steps",
    "WITH a AS (SELECT 1 AS x), b AS (SELECT * FROM a) SELECT * FROM b, (SELECT * FROM a) s",
    "SELECT * FROM g.main.steps a, main.steps b LIMIT 1",
    "SELECT approx_top_k(rank, 3), max(loss, 3), arg_max(rank, loss, 2), min(loss) FROM steps",
    "SELECT max(loss) OVER (), max(loss, 2) OVER (PARTITION BY rank) FROM steps",
    "SELECT median(loss), quantile_cont(loss, 0.9), approx_quantile(loss, 0.5), stddev(loss), "
    "arg_max(rank, loss), histogram(rank), string_agg(DISTINCT run_id, ',') FROM steps",
    "SELECT to_timestamp(step)::DATE, date_trunc('hour', to_timestamp(step)), strftime(to_timestamp(0), '%H') "
    "FROM steps",
    "SELECT '{\"a\": {\"b\": 1}}'::JSON->'a'->>'b', json_extract('{\"a\": 1}', '$.a')",
    "SELECT table_name, column_name FROM information_schema.columns",
    "SHOW ALL TABLES",
    "SHOW steps",
    "SUMMARIZE steps",
    "DESCRIBE SELECT step FROM steps",
])
def test_analysts_sql_passes(con, sql):
    run(con, sql)


def test_relations_follow_the_migrations():
    migrations = [(1, ["CREATE TABLE a (x INT)", "CREATE OR REPLACE VIEW v AS SELECT 1"]),
                  (2, ["ALTER TABLE a RENAME TO b", "CREATE TABLE IF NOT EXISTS c (x INT)", "DROP VIEW v",
                       "ALTER TABLE b ADD COLUMN y INT"])]
    assert allow.project_relations(migrations) == {"b", "c", "schema_version"}
    assert {"steps", "steps_effective", "batches", "step_summary"} <= allow.RELATIONS


# -- the result: rows and bytes, fetched incrementally --------------------------------
def test_result_is_capped_in_bytes(con):
    """The answer stops before its rows' JSON text passes max_bytes (a 500 MB body before)."""
    sql = "SELECT lpad('', 1000, 'x') || i AS s FROM range(1000000) t(i)"
    result = run(con, sql, max_rows=1_000_000, max_bytes=64 << 10)
    assert result.truncated and len(result.rows) == (64 << 10) // (len(json.dumps(result.rows[0])) + 1)
    assert result.num_bytes == sum(len(json.dumps(r)) + 1 for r in result.rows) <= 64 << 10
    arrow = run(con, sql, max_rows=1_000_000, max_bytes=64 << 10, fmt="arrow")
    assert arrow.truncated and 60 <= arrow.table.num_rows <= 66 and arrow.table.nbytes <= 64 << 10
    one = run(con, "SELECT lpad('', 1000, 'x') AS s", max_bytes=100)
    assert one.rows == [] and one.truncated  # a first row past the cap is not sent


def test_rows_encoded_by_the_caller_are_counted_as_encoded(con):
    result = run(con, "SELECT step, loss FROM steps ORDER BY step, rank", max_rows=100, max_bytes=100,
                 encode_row=lambda row: json.dumps(list(row)).encode())
    assert result.rows is None and result.truncated
    assert sum(len(r) + 1 for r in result.rows_json) == result.num_bytes <= 100
    assert json.loads(result.rows_json[0]) == [0, 1.0]


def test_result_is_fetched_incrementally(con):
    """Rows past the cap are never computed: row 200,000 would fail the query."""
    sql = ("SELECT lpad('', 1000, 'x') || CAST(CASE WHEN i < 200000 THEN '1' ELSE 'x' END AS INTEGER) AS s "
           "FROM range(100000000) t(i)")
    with pytest.raises(duckdb.ConversionException):
        con.execute(f"SELECT max(s) FROM ({sql})").fetchall()
    for fmt in ("json", "arrow"):
        result = run(con, sql, max_rows=10_000_000, max_bytes=64 << 10, fmt=fmt)
        assert result.truncated and result.num_bytes <= 64 << 10


def test_exactly_max_rows_is_not_truncated(con):
    assert not run(con, "SELECT * FROM range(5)", max_rows=5).truncated
    assert run(con, "SELECT * FROM range(6)", max_rows=5).truncated
    assert not run(con, "SELECT * FROM range(5)", max_rows=5, fmt="arrow").truncated


@pytest.mark.parametrize("inner", ["SELECT * FROM checkpoint()", "SELECT * FROM query('SELECT 42')",
                                   "SELECT size FROM read_blob('{db}')"])
def test_sql_wrapped_as_data_does_not_run(con, inner):
    """The reported bypass: json_execute_serialized_sql ran what the deny-list refused
    unwrapped, including a read of the database file itself."""
    (db,), = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchall()
    inner = inner.format(db=db).replace("'", "''")
    with pytest.raises(SqlRefused, match="json_execute_serialized_sql"):
        run(con, f"SELECT * FROM json_execute_serialized_sql(json_serialize_sql('{inner}'))")
