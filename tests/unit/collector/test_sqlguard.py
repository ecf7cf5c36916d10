"""Read-only SQL: ordinary reads work, every escape is refused with a reason."""

from __future__ import annotations

import duckdb
import pytest

from collector.sqlguard import SqlRefused, check_select, run_select
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
    ("SELECT * FROM '/etc/passwd'", "does not exist"),
    ("SELECT * FROM 'https://example.com/data.csv'", "files, the network"),
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
