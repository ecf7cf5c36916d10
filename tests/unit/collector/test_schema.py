"""Migrations are applied once, in order, each atomically; every contract table exists."""

from __future__ import annotations

import duckdb
import pytest

from collector.schema import MIGRATIONS, current_version, migrate
from collector.storage import Storage, connect

CONTRACT = {"runs", "ranks", "steps", "collectives", "scalars", "heartbeats", "events", "incidents", "actions",
            "checkpoints", "nodes", "commands", "batches", "schema_version"}
VIEWS = {"steps_effective", "steps_history", "step_summary", "collective_summary"}


def test_open_twice_is_idempotent(settings):
    for _ in range(2):
        Storage(settings).close()
    con = connect(settings.db_path, read_only=True)
    try:
        assert con.execute("SELECT version FROM schema_version").fetchall() == [(MIGRATIONS[-1][0],)]
        tables = {t for (t,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        views = {v for (v,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    finally:
        con.close()
    assert tables == CONTRACT
    assert views == VIEWS


def test_only_newer_migrations_run(tmp_path):
    con = connect(tmp_path / "m.duckdb")
    assert migrate(con) == [1]
    extra = MIGRATIONS + [(2, ["CREATE TABLE extra (a INTEGER)", "INSERT INTO extra VALUES (1)"])]
    assert migrate(con, extra) == [2]
    assert migrate(con, extra) == []
    assert con.execute("SELECT count(*) FROM extra").fetchall() == [(1,)]
    assert current_version(con) == 2
    con.close()


def test_a_failing_migration_leaves_nothing_behind(tmp_path):
    con = connect(tmp_path / "m.duckdb")
    migrate(con)
    bad = MIGRATIONS + [(2, ["CREATE TABLE half (a INTEGER)", "THIS IS NOT SQL"])]
    with pytest.raises(duckdb.Error):
        migrate(con, bad)
    assert current_version(con) == 1
    assert con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'half'").fetchall() == [(0,)]
    con.close()
