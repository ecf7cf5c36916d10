"""The Incidents page on the synthetic run: the straggler on rank 3 / node1 (open), the
loss spike blamed on data and rolled back, the actions and what they cost."""

from __future__ import annotations

import pytest
from dash import no_update

from dashboard import state
from dashboard.source import Source, SourceError


@pytest.fixture
def page(db_source):
    state.set_source(db_source)  # what the callbacks read; the builders take the source
    from dashboard.pages import incidents

    return incidents


class _Extra(Source):
    """The synthetic run plus incidents added later: what a live collector shows next."""

    live = False

    def __init__(self, inner: Source) -> None:
        self.inner, self.extra = inner, []

    def describe(self):
        return "test"

    def runs(self):
        return self.inner.runs()

    def run(self, run_id):
        return self.inner.run(run_id)

    def view(self, run_id, name, **params):
        return self.inner.view(run_id, name, **params)

    def table(self, run_id, name):
        rows = self.inner.table(run_id, name)
        return rows + self.extra if name == "incidents" else rows

    def sql(self, query, *, max_rows=5000):
        return self.inner.sql(query, max_rows=max_rows)

    def report_html(self, run_id):
        return ""


class _Down(_Extra):
    def table(self, run_id, name):
        raise SourceError("cannot reach the collector at http://x: refused")


def test_incident_table_names_the_straggler_and_the_data_spike(page, db_source):
    out = page.build(db_source, "synth")
    by_kind = {r["kind"]: r for r in out["incidents"]}
    straggler, spike = by_kind["straggler"], by_kind["loss_spike"]
    assert (straggler["rank"], straggler["node"], straggler["steps"], straggler["status"]) == (3, "node1", "20–40",
                                                                                              "open")
    assert "compute_ratio=1.5" in straggler["evidence"] and "cost_s_per_step=0.1" in straggler["evidence"]
    assert (spike["root_cause"], spike["severity"], spike["steps"], spike["status"]) == ("data", "critical", "35",
                                                                                        "closed")
    assert spike["node"] == "run-wide" and spike["evidence"] == "z=9.1"
    assert out["summary"].startswith("2 incidents (1 open) · 2 actions · 0 skipped")


def test_actions_table_has_the_rollback_and_its_recovery(page, db_source):
    rows = {r["kind"]: r for r in page.build(db_source, "synth")["actions"]}
    rollback, isolate = rows["rollback"], rows["isolate"]
    assert (rollback["status"], rollback["recovery"], rollback["incident_id"], rollback["attempt"]) == (
        "done", "2.50 s", 2, 1)
    assert rollback["reason"] == "data" and rollback["mode"] == "auto"
    assert (isolate["target"], isolate["status"], isolate["recovery"]) == ("node1", "done", "–")


def test_timeline_bars_by_kind_and_action_markers(page, db_source):
    fig = page.build(db_source, "synth")["timeline"]
    bars = [t for t in fig.data if t.type == "bar"]
    assert {t.name for t in bars} == {"warning", "critical"}
    assert sorted(y for t in bars for y in t.y) == ["loss_spike", "straggler"]
    warning = next(t for t in bars if t.name == "warning")
    assert warning.customdata[0][2] == "rank 3 on node1" and warning.customdata[0][4] == "open"
    assert warning.marker.color == "#f0a30a" and all(x > 0 for x in warning.x)  # an instant incident still shows
    markers = {t.name: t for t in fig.data if t.type == "scatter"}
    assert set(markers) == {"action: rollback", "action: isolate"}
    assert list(markers["action: rollback"].customdata[0][2:4]) == ["done", "2.50 s"]
    assert markers["action: rollback"].marker.symbol == "triangle-left"
    assert fig.layout.xaxis.type == "date" and fig.layout.xaxis.title.text == "wall time (UTC)"
    assert list(fig.layout.yaxis.categoryarray) == ["actions", "loss_spike", "straggler"]


def test_empty_states(page):
    fig = page.timeline_figure([], [], [], now_ts=None)
    assert fig.layout.annotations[0].text == page.NO_INCIDENTS
    assert page.incident_rows([]) == [] and page.action_rows([]) == []


def test_callback_fills_the_tables_report_link_and_skips_unchanged(page, db_source):
    out = page._draw("synth", None, None)
    fig, incidents, actions, bad, bad_style, summary, inc_empty, act_empty, bad_empty, href, drawn = out
    assert len(incidents) == 2 and len(actions) == 2 and bad == [] and bad_style == {"display": "none"}
    assert inc_empty == "" and bad_empty == "no sample windows were skipped"
    assert href.href == "/report/synth" and href.target == "_blank" and "postmortem report" in href.children
    assert page._draw("synth", 1, drawn) == (no_update,) * 11  # nothing changed: nothing redrawn


def test_a_new_incident_shows_on_the_next_tick(page, db_source):
    src = _Extra(db_source)
    state.set_source(src)
    drawn = page._draw("synth", 0, None)[-1]
    src.extra.append({"id": 3, "kind": "hang", "severity": "critical", "status": "open", "rank": 1, "node": "node0",
                      "step_from": 61, "step_to": None, "opened_ts": 1_800_000_040.0, "updated_ts": 1_800_000_041.0,
                      "closed_ts": None, "evidence": {"op": "all_reduce", "stuck_s": 30.0}, "root_cause": None})
    out = page._draw("synth", 1, drawn)
    rows = {r["id"]: r for r in out[1]}
    assert rows[3]["kind"] == "hang" and rows[3]["status"] == "open" and "op=all_reduce" in rows[3]["evidence"]
    assert "hang" in [y for t in out[0].data if t.type == "bar" for y in t.y]


def test_source_error_is_shown(page, db_source):
    state.set_source(_Down(db_source))
    out = page._draw("synth", None, None)
    assert "cannot reach the collector" in out[0].layout.annotations[0].text
    assert "cannot reach the collector" in out[5].children and out[5].className == "llmw-error"
