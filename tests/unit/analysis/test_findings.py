"""Findings: JSON-able numbers, one incident per key, emitted only when the row changes."""

import json
import math

from analysis.findings import RESOLVED, Finding, IncidentBook, json_number


def test_json_number_carries_non_finite_values_as_strings():
    assert json_number(float("nan")) == "NaN"
    assert json_number(float("inf")) == "Infinity"
    assert json_number(-math.inf) == "-Infinity"
    assert json_number(1.23456789, 4) == 1.235
    assert json_number(3) == 3 and json_number(None) is None
    json.dumps([json_number(x) for x in (float("nan"), 1.0, 2)], allow_nan=False)


def test_book_emits_on_change_only_and_never_reuses_a_key():
    book = IncidentBook("r")
    out = []
    key = book.new_key("nan")
    f = Finding(kind="nan", key=key, run_id="r", step_from=3, step_to=3, evidence={"a": 1})
    book.report(f, out)
    book.report(f, out)  # the same row: nothing
    assert len(out) == 1 and book.is_open(key)
    book.report(Finding(kind="nan", key=key, run_id="r", step_from=3, step_to=4, evidence={"a": 1}), out)
    assert len(out) == 2 and out[-1].step_to == 4
    book.resolve(key, out, ts=9.0, detected_step=5)
    assert out[-1].status == RESOLVED and out[-1].ts == 9.0 and not book.is_open(key)
    book.resolve(key, out, ts=10.0)  # already closed: nothing
    assert len(out) == 3
    assert book.new_key("nan") != key


def test_summary_and_incident_columns():
    f = Finding(kind="hang", key="hang#1", run_id="r", rank=1, node="node0", step_from=7, step_to=7,
                root_cause="rank 1 never entered all_reduce")
    assert "hang" in f.summary() and "rank 1" in f.summary() and "node0" in f.summary()
    cols = f.incident_columns()
    assert cols["status"] == "open" and cols["rank"] == 1 and cols["kind"] == "hang"
