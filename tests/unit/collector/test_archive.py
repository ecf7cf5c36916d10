"""`collector archive` (collector/offline/archive.py): finished runs as hive-partitioned Parquet
that answers the same queries as the live file, replaced (not doubled) on a re-run,
with running runs skipped and no secrets."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import polars as pl
import pytest

from collector.cli import main
from collector.offline import archive
from collector.storage import connect
from tests.unit.collector.test_retention import fill_run

QUERIES = {  # name -> SQL over {steps}, {incidents}, ... (a table or its archive)
    "step_time_percentiles": """
        SELECT rank, count(*) AS n, quantile_cont(step_s, 0.5) AS p50, quantile_cont(step_s, 0.9) AS p90,
               quantile_cont(step_s, 0.99) AS p99, max(step_s) AS max_s, sum(tokens) AS tokens
        FROM {steps} WHERE run_id = 'done1' GROUP BY rank ORDER BY rank""",
    "incidents": """SELECT id, run_id, kind, severity, rank, node, step_from, step_to, opened_ts, status,
                           evidence::VARCHAR AS evidence FROM {incidents} ORDER BY id""",
    "collective_counts": """SELECT run_id, attempt, axis, op, count(*) AS n, sum(bytes) AS bytes, sum(duration_s) AS d
                            FROM {collectives} GROUP BY ALL ORDER BY ALL""",
    "checkpoints": "SELECT run_id, step, attempt, num_shards, bytes, verified FROM {checkpoints} ORDER BY ALL",
    "heartbeats_per_rank": "SELECT run_id, rank, count(*), max(ts), min(ts) FROM {heartbeats} GROUP BY ALL ORDER BY ALL",
    "runs": "SELECT run_id, status, world_size, mesh::VARCHAR FROM {runs} ORDER BY run_id",
}
TABLES = ("steps", "incidents", "collectives", "checkpoints", "heartbeats", "runs")


def _archived(root: Path, table: str) -> str:
    return (f"read_parquet('{root}/{table}/**/*.parquet', hive_partitioning = true, "
            f"hive_types = {{'run_id': VARCHAR}})")


def answer(con, name: str, source) -> list[tuple]:
    return con.execute(QUERIES[name].format(**{t: source(t) for t in TABLES})).fetchall()


def assert_same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, float):
                assert v == pytest.approx(u, rel=1e-9, abs=1e-12)
            else:
                assert u == v


@pytest.fixture
def closed_db(storage) -> Path:
    fill_run(storage, "done1")
    fill_run(storage, "live", num_steps=5, rollback_at=None, finished=False)
    storage.close()
    return storage.settings.db_path


def test_archive_answers_like_the_live_file(closed_db, tmp_path, capsys):
    out = tmp_path / "archive"
    assert main(["archive", "--db", str(closed_db), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "archived done1" in printed and "skipped live: still running" in printed
    # the hive layout: table / run / UTC day (the run crosses midnight)
    days = sorted(p.name for p in (out / "steps" / "run_id=done1").iterdir())
    assert days == ["day=2022-01-07", "day=2022-01-08"]
    assert not (out / "steps" / "run_id=live").exists()
    assert not (out / "alert_outbox").exists()

    db = connect(closed_db, read_only=True)
    pq = duckdb.connect()
    try:
        for name in QUERIES:
            live = answer(db, name, lambda t: f"(SELECT * FROM {t} WHERE run_id = 'done1')")
            assert live, name
            assert_same(live, answer(pq, name, lambda t: _archived(out, t)))
        # every column of every archived table comes back, with the partitions as columns
        for table in archive.ARCHIVED:
            cols = [c for (c,) in db.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?",
                                             [table]).fetchall()]
            n_live = db.execute(f"SELECT count(*) FROM {table} WHERE run_id = 'done1'").fetchone()[0]
            if not n_live:
                assert not (out / table / "run_id=done1").exists(), table
                continue
            got = pq.execute(f"SELECT * FROM {_archived(out, table)} LIMIT 0")
            assert {d[0] for d in got.description} == set(cols) | {"day"}, table
            assert pq.execute(f"SELECT count(*) FROM {_archived(out, table)}").fetchone()[0] == n_live, table
    finally:
        db.close()
        pq.close()
    # polars reads the same layout
    frame = pl.read_parquet(out / "steps" / "**" / "*.parquet", hive_partitioning=True)
    assert frame.height == 4 * 50 and set(frame["run_id"].unique()) == {"done1"}


def test_rearchiving_replaces_and_force_takes_a_running_run(closed_db, tmp_path, capsys):
    out = tmp_path / "archive"
    assert main(["archive", "--db", str(closed_db), "--out", str(out), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["archived"] == ["done1"] and "live" in first["skipped"]
    assert main(["archive", "--db", str(closed_db), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == first["rows"]
    pq = duckdb.connect()
    try:
        assert pq.execute(f"SELECT count(*) FROM {_archived(out, 'steps')}").fetchone()[0] == 4 * 50
        assert main(["archive", "--db", str(closed_db), "--out", str(out), "--run", "live"]) == 1
        assert "skipped live" in capsys.readouterr().out
        assert main(["archive", "--db", str(closed_db), "--out", str(out), "--run", "live", "--force"]) == 0
        per_run = pq.execute(f"SELECT run_id, count(*) FROM {_archived(out, 'steps')} GROUP BY 1 ORDER BY 1").fetchall()
        assert per_run == [("done1", 4 * 50), ("live", 4 * 5)]
    finally:
        pq.close()
    assert not list(out.glob(".staging-*")) and not list(out.glob("*/.old-*"))


def test_every_table_with_runs_is_archived_or_excluded_and_none_holds_secrets(closed_db):
    con = connect(closed_db, read_only=True)
    try:
        tables = {t for (t,) in con.execute("SELECT DISTINCT table_name FROM duckdb_columns() "
                                            "WHERE column_name = 'run_id'").fetchall()}
        assert tables - {"steps_effective", "steps_history", "step_summary", "collective_summary", "goodput"} == \
            set(archive.ARCHIVED) | {"alert_outbox"}
        assert archive._tables(con) == list(archive.ARCHIVED)
    finally:
        con.close()
    raw = duckdb.connect()
    raw.execute("CREATE TABLE runs (run_id VARCHAR, created_ts DOUBLE, status VARCHAR, token VARCHAR)")
    with pytest.raises(archive.ArchiveError, match="secrets"):
        archive._tables(raw)
    raw.execute("CREATE TABLE mystery (run_id VARCHAR)")
    with pytest.raises(archive.ArchiveError, match="neither archived nor excluded"):
        archive._tables(raw)
    raw.close()


def test_a_run_id_with_slashes_gets_its_own_partition(storage, tmp_path):
    fill_run(storage, "team/a b", num_steps=5, rollback_at=None)
    storage.close()
    out = tmp_path / "archive"
    result = archive.archive(storage.settings.db_path, out)
    assert result.archived == ["team/a b"]
    assert (out / "steps" / archive.partition_name("team/a b")).is_dir()
    pq = duckdb.connect()
    assert pq.execute(f"SELECT DISTINCT run_id FROM {_archived(out, 'steps')}").fetchall() == [("team/a b",)]
    pq.close()
