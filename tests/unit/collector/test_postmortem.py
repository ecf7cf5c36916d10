"""The postmortem's pure parts (goodput, the cost of slow-downs, evidence highlights,
Markdown) and its read queries, on a tiny DuckDB file built here.

The run: 2 ranks, steps 1-6 of attempt 0 and a rollback that re-ran steps 5-6 as
attempt 1; step 3 skipped (a NaN). Rank 1 is the slow one: step_s 1.0 vs 0.5.
A checkpoint after every step (5 and 6 again in attempt 1). The slow-downs, each
with its detector's evidence keys: a straggler (steps 2-6, 0.25 s/step), a slow
link (steps 4-5, 0.1 s/step), a data stall (steps 5-6, 0.15 s/step) and slow
checkpoint writes on rank 1 (steps 2 and 4: 1.2 s against its peer's 0.4 s, 0.8 s
too long; step 3's was not slow; closed by the two calm ones at steps 5 and 6)."""

from __future__ import annotations

import json

import duckdb
import pytest

from collector.offline import postmortem
from collector.read import queries, views
from collector.store.schema import migrate

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
        (3, "slow_link", "warning", 0, "node0", 4, 5, START_TS + 9, "closed",
         {"axis": "dp", "group_id": 0, "link_ratio": 3.9, "busbw_vs_baseline": 0.26, "cost_s_per_step": 0.1,
          "share_of_step": 0.1, "step_s": 1.0, "onset_step": 4}, "slow dp link on rank 0"),
        (4, "data_stall", "warning", 1, "node1", 5, 6, START_TS + 11, "open",
         {"ranks": [1], "data_share": 0.4, "cost_s_per_step": 0.15, "share_of_step": 0.15, "step_s": 1.0,
          "onset_step": 5}, "data stall on rank 1"),
        (5, "checkpoint_slow", "warning", 1, "node1", 2, 6, START_TS + 5.5, "closed",
         {"ranks": [1], "node": "node1", "checkpoint_step": 4, "write_s": 1.2, "peers_median_s": 0.4,
          "ratio_vs_peers": 3.0, "cost_s_per_checkpoint": 0.8, "resolved_because": "its shard writes are fast again"},
         "slow checkpoint writes on rank 1"),
    ]
    for iid, kind, sev, rank, node, lo, hi, opened, status, evidence, cause in incidents:
        con.execute("INSERT INTO incidents (id, run_id, kind, severity, rank, node, step_from, step_to, opened_ts, "
                    "updated_ts, closed_ts, status, evidence, root_cause) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                    "?, ?)", [iid, RUN, kind, sev, rank, node, lo, hi, opened, opened,
                              opened + 1 if status == "closed" else None, status, json.dumps(evidence), cause])
    writes = {1: 0.5, 2: 1.2, 3: 0.4, 4: 1.2, 5: 0.4, 6: 0.4}  # the slowest rank's
    for (step, attempt), write_s in {**{(k, 0): w for k, w in writes.items()}, (5, 1): 0.4, (6, 1): 0.4}.items():
        con.execute("INSERT INTO checkpoints (run_id, step, attempt, num_shards, bytes, verified, write_s, ts, "
                    "num_ranks) VALUES (?, ?, ?, 3, 4096, true, ?, ?, 2)",
                    [RUN, step, attempt, write_s, START_TS + 2 * step + 10 * attempt + 0.5])
    con.close()
    return path


@pytest.fixture
def cur(db):
    con = duckdb.connect(str(db), read_only=True)
    yield con
    con.close()


def test_step_time_parts_and_span(cur):
    parts = {(p["effective"], p["skipped"]): p for p in queries.step_time_parts(cur, RUN)}
    # 8 (attempt, step) pairs: 1-6 of attempt 0 (5, 6 replaced), 5-6 of attempt 1; each 1.0 s (rank 1)
    assert parts[(True, False)]["num_steps"] == 5 and parts[(True, False)]["step_s"] == pytest.approx(5.0)
    assert parts[(True, True)]["num_steps"] == 1  # step 3
    assert parts[(False, False)]["num_steps"] == 2  # steps 5, 6 of attempt 0
    assert parts[(True, False)]["tokens"] == 500  # two dp replicas of 50 tokens, over 5 steps
    assert queries.run_span(cur, RUN) == {"start_ts": START_TS, "end_ts": START_TS + 30.0}


def test_goodput_from_the_tables(cur):
    g = postmortem.goodput(queries.step_time_parts(cur, RUN), queries.run_span(cur, RUN), straggler_lost_s=1.25)
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


def test_slowdown_costs_come_from_the_evidence(cur):
    costs = postmortem.slowdown_costs(queries.incidents(cur, RUN), queries.checkpoints(cur, RUN))
    by = {c["kind"]: c for c in costs}
    assert [c["id"] for c in costs] == [1, 5, 3, 4]  # in the order they opened; the nan states no cost
    s = by["straggler"]
    assert (s["rank"], s["node"], s["steps"], s["per"], s["num_affected"]) == (1, "node1", "2-6", "step", 5)
    assert (s["cost_s"], s["share_of_step"], s["lost_s"]) == pytest.approx((0.25, 0.25, 0.25 * 5))
    link = by["slow_link"]
    assert (link["rank"], link["node"], link["steps"], link["per"], link["num_affected"]) == (0, "node0", "4-5",
                                                                                              "step", 2)
    assert (link["cost_s"], link["share_of_step"], link["lost_s"]) == pytest.approx((0.1, 0.1, 0.2))
    stall = by["data_stall"]
    assert (stall["steps"], stall["num_affected"]) == ("5-6", 2)
    assert (stall["cost_s"], stall["share_of_step"], stall["lost_s"]) == pytest.approx((0.15, 0.15, 0.3))
    ckpt = by["checkpoint_slow"]
    # steps 2-4's checkpoints: the calm one at step 3 counts too (the detector keeps no count of the
    # slow ones); 5 and 6 (of either attempt) came after its last slow one (checkpoint_step) and closed it
    assert (ckpt["steps"], ckpt["per"], ckpt["num_affected"], ckpt["share_of_step"]) == ("2-6", "checkpoint", 3,
                                                                                         None)
    assert (ckpt["cost_s"], ckpt["lost_s"]) == pytest.approx((0.8, 2.4))


def test_a_slow_checkpoint_without_its_step_counts_to_the_end_of_its_range():
    inc = {"id": 9, "kind": "checkpoint_slow", "step_from": 4, "step_to": 6, "evidence": {"cost_s_per_checkpoint": 2.0}}
    ckpts = [{"step": s, "attempt": a} for s, a in ((2, 0), (4, 0), (6, 0), (8, 0), (4, 1), (6, 1))]
    assert postmortem.num_checkpoints(inc, ckpts) == 2  # steps 4 and 6, each once: rewritten after a rollback
    ((c,),) = [postmortem.slowdown_costs([inc], ckpts)]
    assert c["lost_s"] == pytest.approx(4.0)
    assert postmortem.slowdown_costs([{**inc, "kind": "straggler", "evidence": {"cost_s_per_checkpoint": 2.0}}]) == []


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
    rows = queries.step_window(cur, RUN, step_from=1, step_to=6)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    (nan,) = [r for r in rows if r["num_nonfinite"]]
    assert nan["step"] == 3 and nan["loss"] is None and nan["skipped"]  # no mean of NaNs to draw
    assert rows[4]["loss"] == pytest.approx(2.5)  # attempt 1's step 5
    grid = views.step_grid(cur, RUN)
    assert len(grid) == 12 and {g["rank"] for g in grid} == {0, 1}
    assert [g["compute_s"] for g in grid if g["rank"] == 1] == pytest.approx([0.95] * 6)
    assert len(views.step_grid(cur, RUN, max_steps=2)) == 4  # 2 buckets of 3 steps x 2 ranks


def test_markdown_report(cur):
    text = postmortem.render_markdown(postmortem.gather(cur, RUN))
    assert text.startswith("# Postmortem: run tiny\n")
    assert "| goodput | 16.7% |" in text and "| goodput without stragglers | 12.5% |" in text
    # less the straggler's 1.25 s, the slow link's 0.2 s and the data stall's 0.3 s; the checkpoint writes'
    # 2.4 s are background time, not in the productive 5 s
    assert "| goodput without slow-downs | 10.8% |" in text
    assert "| slow-down cost in steps | 1.75 s |" in text and "| slow checkpoint writes (background) | 2.40 s |" in text
    assert "| steps replaced by a rollback | 2 (2.00 s) |" in text
    straggler = next(line for line in text.splitlines() if line.startswith("| 1 | straggler |"))
    assert "| 2-6 | 1 | node1 |" in straggler and "compute_ratio=2.4" in straggler and "| open |" in straggler
    nan = next(line for line in text.splitlines() if line.startswith("| 2 | nan |"))
    assert "origin \\| unknown" in nan and "| closed |" in nan  # a pipe in a cell is escaped
    assert "## Cost of slow-downs" in text and "Straggler cost" not in text
    assert "| 1 | straggler | 1 | node1 | 2-6 | 0.2500 | step | 25.0% | 5 steps | 1.25 |" in text
    assert "| 3 | slow_link | 0 | node0 | 4-5 | 0.1000 | step | 10.0% | 2 steps | 0.20 |" in text
    assert "| 4 | data_stall | 1 | node1 | 5-6 | 0.1500 | step | 15.0% | 2 steps | 0.30 |" in text
    assert "| 5 | checkpoint_slow | 1 | node1 | 2-6 | 0.8000 | checkpoint | - | 3 checkpoints | 2.40 |" in text
    assert "checkpoint_step" in text  # the notes say how the checkpoints were counted
    assert "HTML report" in text and "<" not in text.replace("<-", "")


def test_html_report_embeds_its_charts(cur):
    text = postmortem.render_html(postmortem.gather(cur, RUN))
    assert '<script src="http' not in text
    assert text.count('class="incident-chart"') == 5 and 'class="heatmap"' in text
    assert "<h2>Cost of slow-downs</h2>" in text and "<td>checkpoint_slow</td><td>1</td><td>node1</td>" in text
    assert "<td>3 checkpoints</td><td>2.40</td>" in text and "<td>goodput without slow-downs</td><td>10.8%</td>" in text
    assert "Postmortem: run tiny" in text


def test_an_unknown_run_is_refused(cur):
    with pytest.raises(LookupError):
        postmortem.gather(cur, "nope")
