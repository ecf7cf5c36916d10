"""One data-source interface, two implementations: the live collector's HTTP API and
the closed file answer every view, table and SQL query the same (they run the same
read-side functions), and each turns what can go wrong into an error a page shows."""

from __future__ import annotations

import shutil

import pytest

from collector.read.views import VIEWS
from dashboard.source import TABLES, DbSource, HttpSource, SourceError, SqlError
from tests.unit.collector.collector_server import CollectorProcess
from tests.unit.dashboard.synthetic import RUN_ID

pytestmark = pytest.mark.slow  # a real collector process

VIEW_PARAMS = {"overview": {"max_points": 7}, "scalars": {"prefix": "eval/"}, "lineage": {"max_points": 10},
               "grid": {"max_steps": 12, "step_from": 5}, "rank_time": {"step_from": 10, "step_to": 50},
               "rank_rounds": {"step_from": 10, "step_to": 50},
               "comm_ops": {"last_steps": 30}, "comm_latency": {"step_from": 1, "step_to": 60},
               "comm_waits": {}, "mesh": {}, "attempts": {}}


@pytest.fixture(scope="module")
def both(synth_db, tmp_path_factory):
    """(HttpSource on a collector serving a copy of the file, DbSource on the file)."""
    live_path = tmp_path_factory.mktemp("live") / "live.duckdb"
    shutil.copy(synth_db, live_path)
    proc = CollectorProcess(live_path).start()
    http, db = HttpSource(proc.url, proc.token), DbSource(synth_db)
    try:
        yield http, db, proc
    finally:
        db.close()
        proc.stop()


def same(a, b) -> bool:
    """Equal, floats to 1e-9 relative: DuckDB's parallel aggregates may sum in another order."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_view_answers_the_same_live_and_from_the_file(both):
    http, db, _ = both
    assert set(VIEW_PARAMS) == set(VIEWS)
    for name, params in VIEW_PARAMS.items():
        live, closed = http.view(RUN_ID, name, **params), db.view(RUN_ID, name, **params)
        assert same(live, closed), name
        assert closed, f"view {name} is empty on the synthetic run"
    assert len(db.view(RUN_ID, "overview", max_points=7)) == 7
    assert {r["step"] for r in db.view(RUN_ID, "grid", max_steps=12, step_from=5)} >= {5}


def test_tables_runs_and_run_answer_the_same(both):
    http, db, _ = both
    for name in TABLES:
        assert same(http.table(RUN_ID, name), db.table(RUN_ID, name)), name
    assert [r["run_id"] for r in http.runs()] == [r["run_id"] for r in db.runs()] == [RUN_ID]
    assert http.run(RUN_ID)["world_size"] == db.run(RUN_ID)["world_size"] == 4
    assert http.run("nope") is None and db.run("nope") is None
    assert db.table(RUN_ID, "goodput")["goodput"] == pytest.approx(0.8)


def test_sql_answers_and_refusals_are_the_same(both):
    http, db, _ = both
    q = "SELECT rank, count(*) AS n FROM steps WHERE run_id = 'synth' GROUP BY rank ORDER BY rank"
    a, b = http.sql(q), db.sql(q)
    assert a["columns"] == b["columns"] == ["rank", "n"]
    assert a["rows"] == b["rows"] == [[0, 70], [1, 70], [2, 70], [3, 70]]
    for query in ("DELETE FROM runs", "SELECT * FROM read_csv('/etc/passwd')"):
        with pytest.raises(SqlError) as live:
            http.sql(query)
        with pytest.raises(SqlError) as closed:
            db.sql(query)
        assert str(live.value) == str(closed.value) and str(closed.value)


def test_the_report_is_the_postmortem(both):
    http, db, _ = both
    for src in (http, db):
        text = src.report_html(RUN_ID)
        assert "Postmortem: run synth" in text and "loss_spike" in text
    with pytest.raises(SourceError):
        db.report_html("nope")


def test_a_wrong_token_and_a_dead_collector_are_errors_that_say_so(both):
    _, _, proc = both
    with pytest.raises(SourceError, match="read token"):
        HttpSource(proc.url, "wrong-token").runs()
    with pytest.raises(SourceError, match="cannot reach"):
        HttpSource("http://127.0.0.1:9", proc.token, timeout_s=2).runs()


def test_a_missing_or_locked_file_is_an_error(tmp_path, both):
    _, _, proc = both
    with pytest.raises(SourceError, match="no database file"):
        DbSource(tmp_path / "none.duckdb")
    with pytest.raises(SourceError, match="--collector"):
        DbSource(proc.db_path)  # the running collector holds its file
