"""Migrations are applied once, in order, each atomically; every contract table exists."""

from __future__ import annotations

import duckdb
import pytest

from agent import wire
from collector.ingest.decode import decode
from collector.settings import Settings, WriterSettings
from collector.storage import Storage, connect
from collector.store.schema import MIGRATIONS, SchemaTooNew, current_version, migrate
from tests.unit.collector.collector_batches import make_batch, steps_section

CONTRACT = {"runs", "ranks", "steps", "collectives", "scalars", "heartbeats", "events", "incidents", "actions",
            "checkpoints", "nodes", "commands", "batches", "alert_outbox", "bad_batches", "schema_version",
            "collectives_rollup", "collective_waits_rollup", "device_health"}
VIEWS = {"steps_effective", "steps_history", "step_summary", "collective_summary", "goodput"}


def test_open_twice_is_idempotent(settings):
    for _ in range(2):
        Storage(settings).close()
    con = connect(settings.db_path, read_only=True)
    try:
        assert con.execute("SELECT version FROM schema_version ORDER BY version").fetchall() == [
            (v,) for v, _ in MIGRATIONS]
        tables = {t for (t,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        views = {v for (v,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    finally:
        con.close()
    assert tables == CONTRACT
    assert views == VIEWS


LATEST = MIGRATIONS[-1][0]


def test_only_newer_migrations_run(tmp_path):
    con = connect(tmp_path / "m.duckdb")
    assert migrate(con) == [v for v, _ in MIGRATIONS]
    extra = MIGRATIONS + [(LATEST + 1, ["CREATE TABLE extra (a INTEGER)", "INSERT INTO extra VALUES (1)"])]
    assert migrate(con, extra) == [LATEST + 1]
    assert migrate(con, extra) == []
    assert con.execute("SELECT count(*) FROM extra").fetchall() == [(1,)]
    assert current_version(con) == LATEST + 1
    con.close()


def test_a_file_from_a_newer_collector_is_refused_untouched(tmp_path, capsys):
    """An older collector must not write into a newer file: it could not fill the
    columns the newer one reads. `collector serve` says so and exits 2."""
    from collector.cli import main
    path = tmp_path / "new.duckdb"
    con = connect(path)
    newer = MIGRATIONS + [(LATEST + 1, ["CREATE TABLE from_the_future (a INTEGER)"])]
    migrate(con, newer)
    with pytest.raises(SchemaTooNew, match=f"schema version {LATEST + 1}, newer than this collector's {LATEST}"):
        migrate(con)
    assert current_version(con) == LATEST + 1
    con.close()
    assert main(["serve", "--db", str(path), "--port", "0", "--token", "t" * 32]) == 2
    assert "newer than this collector's" in capsys.readouterr().err


def test_a_failing_migration_leaves_nothing_behind(tmp_path):
    con = connect(tmp_path / "m.duckdb")
    migrate(con)
    bad = MIGRATIONS + [(LATEST + 1, ["CREATE TABLE half (a INTEGER)", "THIS IS NOT SQL"])]
    with pytest.raises(duckdb.Error):
        migrate(con, bad)
    assert current_version(con) == LATEST
    assert con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'half'").fetchall() == [(0,)]
    con.close()


def test_v2_adds_batch_hashes_to_a_v1_file_and_its_old_batches_stay_duplicates(tmp_path):
    """A file written before content hashes: its batches get NULL, and a batch sent
    again under one of their keys is still acknowledged as a duplicate (unknown
    content counts as the same), whatever its bytes."""
    path = tmp_path / "v1.duckdb"
    con = connect(path)
    assert migrate(con, MIGRATIONS[:1]) == [1]
    con.execute("INSERT INTO batches VALUES ('old', 0, 'inc0', 0, 1.0, 1)")
    con.close()
    storage = Storage(Settings(db_path=path, writer=WriterSettings(linger_s=0.0)))
    try:
        with storage.cursor() as cur:
            assert cur.execute("SELECT max(version) FROM schema_version").fetchall() == [(LATEST,)]
            assert cur.execute("SELECT content_hash FROM batches").fetchall() == [(None,)]
        again = storage.ingest_blocking(decode(make_batch("old", 0, 0, sections={wire.STEP: steps_section([5])})))
        assert again.duplicate and again.accepted == 0
        new = storage.ingest_blocking(decode(make_batch("old", 0, 1, sections={wire.STEP: steps_section([6])})))
        assert not new.duplicate
        with storage.cursor() as cur:
            (digest,), = cur.execute("SELECT content_hash FROM batches WHERE batch_seq = 1").fetchall()
        assert len(digest) == 16
    finally:
        storage.close()
