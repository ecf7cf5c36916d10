"""The SQL console on the synthetic run: a SELECT returns rows and a chart, a write is
refused with the collector's reason, and the editor follows the run while unedited."""

from __future__ import annotations

import datetime as dt
import decimal

import pytest
from dash import no_update

from dashboard import state


@pytest.fixture
def page(db_source):
    state.set_source(db_source)  # what the callbacks read; the builders take the source
    from dashboard.pages import sql

    return sql


def test_default_query_finds_the_slowest_rank(page, db_source):
    out = page.build(db_source, "synth")
    assert not out["error"] and out["message"] == "4 rows"
    names = [c["name"] for c in out["columns"]]
    assert names == ["rank", "node", "compute_s", "exposed_comm_s", "step_s"]
    first = dict(zip(names, out["rows"][0].values()))
    assert (first["rank"], first["node"], first["compute_s"]) == (3, "node1", pytest.approx(0.4025))
    types = {c["name"]: c.get("type") for c in out["columns"]}
    assert types["compute_s"] == "numeric" and types["node"] is None
    bars = out["chart"].data
    assert [t.name for t in bars] == ["compute_s", "exposed_comm_s", "step_s"] and bars[0].type == "bar"


def test_a_write_is_refused_with_the_collectors_reason(page, db_source):
    out = page.build(db_source, "synth", query="DELETE FROM runs")
    assert out["error"] and out["rows"] == []
    assert out["message"] == "only SELECT is allowed (read-only SQL); this is a DELETE statement"
    _, _, msg, fig = page._run(1, None, "DELETE FROM runs", "synth")
    assert msg.className == "llmw-error" and "only SELECT is allowed" in msg.children
    assert db_source.sql("SELECT count(*) FROM runs")["rows"] == [[1]]  # still there


def test_truncated_results_say_so(page, db_source):
    out = page.build(db_source, "synth", query="SELECT range AS i, range * 2 AS twice FROM range(5000)")
    assert out["message"] == f"{page.MAX_ROWS} rows (truncated)" and len(out["rows"]) == page.MAX_ROWS
    assert out["chart"].data[0].type == "scatter" and out["chart"].data[0].name == "twice"  # many rows: lines


def test_every_example_runs_on_the_run(page, db_source):
    for name in page.EXAMPLES:
        out = page.build(db_source, "synth", query=page.example_query(name, "synth"))
        assert not out["error"], (name, out["message"])
        assert out["rows"], name


def test_chart_empty_states_and_cells(page):
    assert "no numeric column" in page.chart_figure(["a", "b"], ["VARCHAR", "VARCHAR"],
                                                    [["x", "y"]]).layout.annotations[0].text
    assert "nothing to chart" in page.chart_figure(["a"], ["INTEGER"], [[1]]).layout.annotations[0].text
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    assert page._cell(when) == "2026-01-02 03:04:05+00:00"
    assert page._cell(decimal.Decimal("1.50")) == 1.5 and page._cell([1, 2]) == "[1, 2]"
    assert page._cell(True) == "true" and page._cell(float("nan")) == "nan" and page._cell(None) is None


def test_query_in_the_url_fills_the_editor(page):
    def find(node, id_):
        if getattr(node, "id", None) == id_:
            return node
        kids = getattr(node, "children", None)
        for k in (kids if isinstance(kids, list) else [kids] if kids is not None else []):
            hit = find(k, id_)
            if hit is not None:
                return hit
        return None

    lay = page.layout(q="SELECT 1 AS one", run="synth")
    assert find(lay, "sql-text").value == "SELECT 1 AS one"
    assert find(page.layout(run="synth"), "sql-text").value == page.example_query(page.DEFAULT_EXAMPLE, "synth")


def test_editor_follows_the_run_while_unedited(page):
    auto = {"example": page.DEFAULT_EXAMPLE, "text": page.example_query(page.DEFAULT_EXAMPLE, "a")}
    text, new_auto = page.refill(False, "b", None, auto["text"], auto)
    assert "run_id = 'b'" in text and new_auto["text"] == text
    assert page.refill(False, "b", None, "SELECT 42", auto) == (no_update, no_update)  # the user's own query stays
    text, new_auto = page.refill(True, "b", "heartbeat_gaps", "SELECT 42", auto)  # an example replaces it
    assert "FROM heartbeats" in text and new_auto == {"example": "heartbeat_gaps", "text": text}
    assert "run_id = 'it''s'" in page.example_query("comm_by_axis", "it's")  # a run id is quoted
