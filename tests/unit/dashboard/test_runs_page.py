"""The Runs page on the synthetic file: one run "synth" with goodput 80.0%, its loss
curve and where its wall time went; the default pick and the URL's pick."""

from __future__ import annotations

import pytest
from dash import no_update

from dashboard import state
from dashboard.source import Source, SourceError


@pytest.fixture
def page(db_source):
    state.set_source(db_source)  # what the callbacks read; the builders take the source
    from dashboard.pages import runs

    return runs


class _More(Source):
    """The synthetic file plus runs newer than it that have not reported a step yet."""

    def __init__(self, inner: Source, new_ids: list[str]) -> None:
        self.inner, self.new_ids = inner, new_ids

    def describe(self):
        return "test"

    def runs(self):
        fresh = [{"run_id": r, "status": "running", "world_size": 8, "created_ts": 1e10 - k, "mesh": {"dp": 8},
                  "last_step": None, "last_attempt": None, "num_incidents": 0, "open_incidents": 0,
                  "num_actions": 0} for k, r in enumerate(self.new_ids)]
        return fresh + self.inner.runs()

    def run(self, run_id):
        return self.inner.run(run_id)

    def view(self, run_id, name, **params):
        return self.inner.view(run_id, name, **params)

    def table(self, run_id, name):
        return self.inner.table(run_id, name)

    def sql(self, query, *, max_rows=5000):
        raise SourceError("no")

    def report_html(self, run_id):
        return ""


def test_runs_table_has_synth_with_its_goodput(page, db_source):
    out = page.build(db_source, "synth")
    assert len(out["table"]) == 1
    row = out["table"][0]
    assert (row["run_id"], row["status"], row["world_size"]) == ("synth", "running", 4)
    assert row["mesh"] == "dp2 × pp1 × tp2"
    assert (row["last_step"], row["attempts"], row["incidents"], row["num_actions"]) == (60, 2, "1 / 2", 2)
    assert row["goodput"] == 80.0 and row["wall"] == "37.50 s"


def test_loss_curves_and_goodput_parts_for_the_pick(page, db_source):
    out = page.build(db_source, "synth")
    assert out["picked"] == ["synth"]
    loss = out["loss"].data
    assert [t.name for t in loss] == ["synth"] and len(loss[0].x) == 60 and loss[0].x[0] == 1
    assert loss[0].y[0] == pytest.approx(4.0 * 2.718281828 ** (-1 / 30) + 2.0 + 0.015, rel=1e-3)
    assert any("synth attempt 1" in (a.text or "") for a in out["loss"].layout.annotations)  # the rollback
    parts = {t.name: t.y[0] for t in out["goodput"].data}
    assert parts == {"productive": 30.0, "skipped": 0.0, "superseded": 5.0, "outside steps": 2.5}
    assert out["goodput"].layout.barmode == "stack"
    assert any(a.text == "goodput 80.0%" for a in out["goodput"].layout.annotations)
    assert out["goodput"].layout.yaxis.title.text == "wall time (s)"


def test_default_pick_is_the_newest_three_with_the_header_run(page, db_source):
    src = _More(db_source, ["n1", "n2", "n3"])
    assert page.build(src, None)["picked"] == ["n1", "n2", "n3"]
    out = page.build(src, "synth")
    assert out["picked"] == ["synth", "n1", "n2"]
    assert "the runs picked have no steps" not in (out["loss"].layout.annotations[0].text or "")
    table = {r["run_id"]: r for r in out["table"]}
    assert table["n1"]["goodput"] is None and table["n1"]["attempts"] is None and table["synth"]["goodput"] == 80.0


def test_an_explicit_pick_is_kept_and_unknown_runs_dropped(page, db_source):
    out = page.build(db_source, "synth", picked=["synth", "gone"])
    assert out["picked"] == ["synth"]
    assert page.build(db_source, "synth", picked=[])["goodput"].layout.annotations[0].text.startswith("pick runs")


def test_callback_fills_the_pick_once(page, db_source):
    table, options, value, loss, goodput, message = page.draw(db_source, "synth", None, None)
    assert value == ["synth"] and options == [{"label": "synth", "value": "synth"}] and len(table) == 1
    assert message == ""
    _, options2, value2, _, _, _ = page.draw(db_source, "synth", [], options, triggered="tick")
    assert value2 is no_update and options2 is no_update  # an emptied pick stays empty on a live refresh


def test_layout_reads_the_pick_from_the_url(page):
    lay = page.layout(runs="a,b")
    pick = next(c for c in lay.children if getattr(c, "className", "") == "llmw-controls").children[1]
    assert pick.id == "runs-pick" and pick.value == ["a", "b"]
