"""The postmortem's pure parts (goodput, straggler cost, evidence highlights, Markdown)
and its read queries, on a tiny DuckDB file built here.

The run: 2 ranks, steps 1-6 of attempt 0 and a rollback that re-ran steps 5-6 as
attempt 1; step 3 skipped (a NaN). Rank 1 is the slow one: step_s 1.0 vs 0.5."""

from __future__ import annotations

import json

import duckdb
import pytest

from collector import postmortem, read, read_views
from collector.schema import migrate

RUN = "tiny"
START_TS = 1000.0


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "tiny.duckdb"
    con = duckdb.connect(str(path))
    migrate(con)
    con.execute("INSERT INTO runs (run_id, created_ts, updated_ts, status, world_size, started_ts, mesh) "
                "VALUES (?, ?, ?, 'completed', 2, ?, '{\"dp\": 2}')", [RUN, START_TS, START_TS, START_TS])
    for rank in (0, 1):
        con.execute("INSERT INTO ranks (run_id, rank, node, dp, tp, pp, first_seen_ts, last_seen_ts) "
                    "VALUES (?, ?, ?, ?, 0, 0, ?, ?)", [RUN, rank, f"node{rank}", rank, START_TS, START_TS])
    rows = []
    for attempt, steps in ((0, range(1, 7)), (1, range(5, 7))):
        for step in steps:
            for rank in (0, 1):
                step_s = 1.0 if rank == 1 else 0.5
                skipped = attempt == 0 and step == 3
                loss = float("nan") if skipped else 3.0 - 0.1 * step
                ts = START_TS + 2 * step + 10 * attempt  # attempt 1 ran later
                rows.append((RUN, attempt, step, rank, ts, loss, 1.0, 1024.0, 0.001, 50, step_s,  # 50 per replica
                             0.2 + 0.5 * rank, 0.2, 0.05, skipped))
    con.executemany("INSERT INTO steps (run_id, attempt, step, rank, ts, loss, grad_norm, loss_scale, lr, tokens, "
                    "step_s, fwd_s, bwd_s, opt_s, skipped) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.execute("INSERT INTO events (run_id, rank, ts, step, attempt, kind, data) "
                "VALUES (?, 0, ?, 6, 1, 'run_finished', '{}')", [RUN, START_TS + 30.0])
    incidents = [
        (1, "straggler", "warning", 1, "node1", 2, 6, START_TS + 5, "open",
         {"cost_s_per_step": 0.25, "share_of_step": 0.25, "compute_ratio": 2.4, "per_rank": {"1": {}}},
         "slow rank 1"),
        (2, "nan", "critical", None, None, 3, 3, START_TS + 7, "closed",
         {"origin": None, "origin_signal": "loss/grad_norm", "num_ranks": 2}, "origin | unknown"),
    ]
    for iid, kind, sev, rank, node, lo, hi, opened, status, evidence, cause in incidents:
        con.execute("INSERT INTO incidents (id, run_id, kind, severity, rank, node, step_from, step_to, opened_ts, "
                    "updated_ts, closed_ts, status, evidence, root_cause) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                    "?, ?)", [iid, RUN, kind, sev, rank, node, lo, hi, opened, opened,
                              opened + 1 if status == "closed" else None, status, json.dumps(evidence), cause])
    con.close()
    return path


@pytest.fixture
def cur(db):
    con = duckdb.connect(str(db), read_only=True)
    yield con
    con.close()


def test_step_time_parts_and_span(cur):
    parts = {(p["effective"], p["skipped"]): p for p in read.step_time_parts(cur, RUN)}
    # 8 (attempt, step) pairs: 1-6 of attempt 0 (5, 6 replaced), 5-6 of attempt 1; each 1.0 s (rank 1)
    assert parts[(True, False)]["num_steps"] == 5 and parts[(True, False)]["step_s"] == pytest.approx(5.0)
    assert parts[(True, True)]["num_steps"] == 1  # step 3
    assert parts[(False, False)]["num_steps"] == 2  # steps 5, 6 of attempt 0
    assert parts[(True, False)]["tokens"] == 500  # two dp replicas of 50 tokens, over 5 steps
    assert read.run_span(cur, RUN) == {"start_ts": START_TS, "end_ts": START_TS + 30.0}


def test_goodput_from_the_tables(cur):
    g = postmortem.goodput(read.step_time_parts(cur, RUN), read.run_span(cur, RUN), straggler_lost_s=1.25)
    assert g.wall_s == pytest.approx(30.0)
    assert (g.productive_s, g.skipped_s, g.superseded_s) == pytest.approx((5.0, 1.0, 2.0))
    assert g.outside_steps_s == pytest.approx(30.0 - 8.0)
    assert g.goodput == pytest.approx(5.0 / 30.0)
    assert g.goodput_without_stragglers == pytest.approx((5.0 - 1.25) / 30.0)
    assert (g.num_steps, g.num_skipped, g.num_superseded, g.useful_tokens) == (5, 1, 2, 500)
    assert g.tokens_per_s == pytest.approx(500 / 30.0)


def test_goodput_of_a_run_without_rows():
    g = postmortem.goodput([], {"start_ts": None, "end_ts": None})
    assert g.wall_s == 0 and g.goodput is None and g.goodput_without_stragglers is None


def test_straggler_cost_comes_from_the_evidence(cur):
    (s,) = postmortem.straggler_costs(read.incidents(cur, RUN))
    assert (s["rank"], s["node"], s["steps"], s["num_steps"]) == (1, "node1", "2-6", 5)
    assert s["lost_s"] == pytest.approx(0.25 * 5)


def test_highlights_put_the_kind_keys_first():
    ev = {"per_rank": {"1": {}}, "window_steps": 8, "share_of_step": 0.25, "compute_ratio": 2.4444444}
    assert postmortem.highlights("straggler", ev) == "compute_ratio=2.444, share_of_step=0.25, window_steps=8"
    assert postmortem.highlights("nan", None) == ""


def test_highlights_of_the_new_kinds_come_from_their_detectors_evidence():
    link = {"group_id": 0, "axis": "dp", "link_ratio": 3.912, "busbw_vs_baseline": 0.26, "cost_s_per_step": 0.0412,
            "share_of_step": 0.31, "step_s": 0.13}
    assert postmortem.highlights("slow_link", link) == ("axis=dp, link_ratio=3.912, busbw_vs_baseline=0.26, "
                                                        "cost_s_per_step=0.0412, share_of_step=0.31")
    flip = {"dp": 3, "shard": "pp0-tp0", "divergent_ranks": [2], "majority": True, "caught_within_steps": 10,
            "why": "2 of 3 replicas agree; rank 2 differs from the majority"}
    assert postmortem.highlights("replica_divergence", flip) == (
        "shard=pp0-tp0, divergent_ranks=[2], majority=true, caught_within_steps=10, "
        "why=2 of 3 replicas agree; rank 2 differs...")
    assert postmortem.highlights("device_health", {"ecc_at_start": 0, "cause": "ecc", "new_errors": 2},
                                 limit=2) == "cause=ecc, new_errors=2"
    assert postmortem.highlights("data_stall", {"step_s": 0.2, "data_share": 0.61, "cost_s_per_step": 0.12},
                                 limit=2) == "data_share=0.61, cost_s_per_step=0.12"


def test_window_and_grid_queries(cur):
    rows = read.step_window(cur, RUN, step_from=1, step_to=6)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    (nan,) = [r for r in rows if r["num_nonfinite"]]
    assert nan["step"] == 3 and nan["loss"] is None and nan["skipped"]  # no mean of NaNs to draw
    assert rows[4]["loss"] == pytest.approx(2.5)  # attempt 1's step 5
    grid = read_views.step_grid(cur, RUN)
    assert len(grid) == 12 and {g["rank"] for g in grid} == {0, 1}
    assert [g["compute_s"] for g in grid if g["rank"] == 1] == pytest.approx([0.95] * 6)
    assert len(read_views.step_grid(cur, RUN, max_steps=2)) == 4  # 2 buckets of 3 steps x 2 ranks


def test_markdown_report(cur):
    text = postmortem.render_markdown(postmortem.gather(cur, RUN))
    assert text.startswith("# Postmortem: run tiny\n")
    assert "| goodput | 16.7% |" in text and "| goodput without stragglers | 12.5% |" in text
    assert "| steps replaced by a rollback | 2 (2.00 s) |" in text
    straggler = next(line for line in text.splitlines() if line.startswith("| 1 | straggler |"))
    assert "| 2-6 | 1 | node1 |" in straggler and "compute_ratio=2.4" in straggler and "| open |" in straggler
    nan = next(line for line in text.splitlines() if line.startswith("| 2 | nan |"))
    assert "origin \\| unknown" in nan and "| closed |" in nan  # a pipe in a cell is escaped
    assert "| 1 | 1 | node1 | 2-6 | 0.2500 | 25.0% | 5 | 1.25 |" in text
    assert "HTML report" in text and "<" not in text.replace("<-", "")


def test_html_report_embeds_its_charts(cur):
    text = postmortem.render_html(postmortem.gather(cur, RUN))
    assert '<script src="http' not in text
    assert text.count('class="incident-chart"') == 2 and 'class="heatmap"' in text
    assert "Postmortem: run tiny" in text


def test_an_unknown_run_is_refused(cur):
    with pytest.raises(LookupError):
        postmortem.gather(cur, "nope")
