"""Fleet memory (analysis/fleet.py, analysis/detectors/node_history.py): a node's record counts
the runs it failed in, within the window; a run that starts on a node with faults in
`flag_runs` runs opens one node_history incident at step 0 naming it, with its record; the
policy hands such a node to a spare, and keeps it without one."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from analysis import Analyzer, Frames
from analysis import fleet as f
from analysis.frames import _frame
from analysis.policy import ISOLATE, Policy, RunPolicy
from analysis.rules import rules_from_dict
from tests.unit.analysis.sim import Layout, Sim, feed, opened

DAY = 86400.0
KINDS = ("straggler", "slow_link", "hang", "crash")


def rows(*items) -> list[dict]:
    """(past run, node, ts, what[, incident id]) -> history rows for run "sim"."""
    return [{"run_id": "sim", "past_run_id": r, "node": n, "ts": ts, "what": w,
             "incident_id": rest[0] if rest else None} for r, n, ts, w, *rest in items]


def test_a_nodes_record_counts_the_runs_it_failed_in_not_its_incidents():
    h = f.history_frame(rows(
        ("r1", "node1", 100.0, "seen"), ("r1", "node1", 110.0, "straggler", 1), ("r1", "node1", 120.0, "straggler", 2),
        ("r1", "node1", 130.0, "straggler", 3),  # one bad run: three incidents, one fault run
        ("r2", "node1", 200.0, "seen"), ("r2", "node1", 210.0, "isolated", 4),  # an isolation is a fault
        ("r3", "node1", 300.0, "seen"), ("r3", "node1", 310.0, "loss_spike", 5),  # not a node's fault
        ("r1", "node0", 100.0, "seen"), ("r2", "node0", 200.0, "seen"), ("r3", "node0", 305.0, "hang", 6),
    ))
    s = {r["node"]: r for r in f.summarize(h, since_ts=0.0, fault_kinds=KINDS).iter_rows(named=True)}
    assert [s["node1"][k] for k in ("runs", "fault_runs", "faults", "isolations")] == [3, 2, 3, 1]
    assert (s["node1"]["last_fault_kind"], s["node1"]["last_fault_run"], s["node1"]["last_fault_ts"]) == (
        "isolated", "r2", 210.0)
    assert [s["node0"][k] for k in ("runs", "fault_runs", "faults", "isolations")] == [3, 1, 1, 0]
    summary = f.summarize(h, since_ts=0.0, fault_kinds=KINDS)
    assert summary["node"].to_list() == ["node1", "node0"]  # the most fault runs first
    assert f.flagged(summary, flag_runs=2)["node"].to_list() == ["node1"]
    # the window and the run itself
    late = f.summarize(h, since_ts=150.0, fault_kinds=KINDS, exclude_run="r2")
    assert {r["node"]: r["fault_runs"] for r in late.iter_rows(named=True)} == {"node1": 0, "node0": 1}
    assert f.summarize(f.history_frame(), since_ts=0.0, fault_kinds=KINDS).height == 0


def test_a_failed_preflight_check_is_a_nodes_fault_by_default_isolated_or_not():
    """Shadow mode (or no spare): the node failed its checks in two runs and was never isolated."""
    h = f.history_frame(rows(("r1", "node1", 100.0, "seen"), ("r1", "node1", 101.0, "preflight", 1),
                             ("r2", "node1", 200.0, "seen"), ("r2", "node1", 201.0, "preflight", 2)))
    kinds = rules_from_dict({}).node_history.fault_kinds
    assert "preflight" in kinds
    summary = f.summarize(h, since_ts=0.0, fault_kinds=kinds)
    assert f.flagged(summary, flag_runs=2)["node"].to_list() == ["node1"]


def test_the_fleet_queries_in_the_docs_count_the_kinds_the_rules_count():
    """docs/fleet.md `nodes_by_fault_runs` and docs/postmortem.md `node_fault_runs` say they count
    what [node_history] counts: their kind lists are the rules' default `fault_kinds`."""
    kinds = set(rules_from_dict({}).node_history.fault_kinds)
    docs = Path(__file__).resolve().parents[3] / "docs"
    for name, query in (("fleet.md", "nodes_by_fault_runs"), ("postmortem.md", "node_fault_runs")):
        text = (docs / name).read_text()
        block = text[text.index(f"### {query}"):]
        block = block[:block.index("```", block.index("```sql") + 6)]
        lists = re.findall(r"i\.kind IN \(([^)]*)\)", block)
        assert lists, f"{name} {query}: no kind list"
        for found in lists:
            assert set(re.findall(r"'([a-z_]+)'", found)) == kinds, (name, query, found)


def test_a_nodes_record_lists_its_faults_by_kind_and_its_latest_first():
    h = f.history_frame(rows(("r1", "node1", 100.0, "seen"), ("r1", "node1", 110.0, "straggler", 7),
                             ("r2", "node1", 200.0, "seen"), ("r2", "node1", 210.0, "hang", 9),
                             ("r2", "node1", 220.0, "isolated", 9)))
    rec = f.node_record(h, "node1", since_ts=0.0, fault_kinds=KINDS, max_faults=2)
    assert rec["by_kind"] == {"hang": 1, "isolated": 1, "straggler": 1} and rec["fault_runs"] == 2
    assert [(x["run_id"], x["what"], x["incident_id"]) for x in rec["latest_faults"]] == [
        ("r2", "isolated", 9), ("r2", "hang", 9)]
    assert f.node_record(h, "node9", since_ts=0.0, fault_kinds=KINDS) == {
        "node": "node9", "by_kind": {}, "latest_faults": [], "past_names": []}


def test_a_node_is_its_hardware_where_both_know_it_else_its_hostname():
    h = f.history_frame([
        *rows(("r1", "old7", 100.0, "seen"), ("r1", "old7", 110.0, "hang", 1),
              ("r2", "old7", 200.0, "seen"), ("r2", "old7", 210.0, "crash", 2)),
    ])
    h = h.with_columns(pl.lit("GPU-1").alias("hw_id"))
    # renamed since: the hardware keeps its record, under today's name, with the old one
    rec = f.node_record(h, "node1", since_ts=0.0, fault_kinds=KINDS, hw_ids=["GPU-1"])
    assert (rec["node"], rec["fault_runs"], rec["past_names"]) == ("node1", 2, ["old7"])
    # the same hostname on new hardware (its GPU replaced): a new record
    assert f.node_record(h.with_columns(pl.lit("old7").alias("node")), "old7", since_ts=0.0, fault_kinds=KINDS,
                         hw_ids=["GPU-9"]).get("fault_runs", 0) == 0
    # hardware unknown on either side: the hostname
    assert f.node_record(h, "old7", since_ts=0.0, fault_kinds=KINDS)["fault_runs"] == 2
    no_hw = h.with_columns(pl.lit(None, pl.String).alias("hw_id"))
    assert f.node_record(no_hw, "old7", since_ts=0.0, fault_kinds=KINDS, hw_ids=["GPU-1"])["fault_runs"] == 2


def _with_history(commits, history_rows, *, at: int = 0):
    """The commits with the history given beside the `at`-th one, as the collector gives it with a run's meta."""
    out = list(commits)
    now, frames = out[at]
    out[at] = (now, Frames(**{**frames.tables(), "node_history": f.history_frame(history_rows)}))
    return out


def test_a_run_on_a_node_that_failed_in_two_runs_opens_one_incident_at_step_0():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=60, seed=3)
    start = sim.start_ts
    history = rows(("r1", "node1", start - 3 * DAY, "seen"), ("r1", "node1", start - 3 * DAY + 50, "straggler", 4),
                   ("r2", "node1", start - DAY, "seen"), ("r2", "node1", start - DAY + 60, "crash", 2),
                   ("r0", "node1", start - 30 * DAY, "hang", 1),  # past the 7-day window
                   ("r1", "node0", start - 3 * DAY, "seen"), ("r2", "node0", start - DAY + 5, "slow_link", 3))
    findings = feed(Analyzer(), _with_history(sim.build(), history))
    got = opened(findings, "node_history")
    assert len(got) == 1, [x.summary() for x in findings]
    inc = next(iter(got.values()))
    assert (inc.node, inc.rank, inc.step_from, inc.step_to, inc.severity) == ("node1", 1, 0, 0, "warning")
    ev = inc.evidence
    assert (ev["runs"], ev["fault_runs"], ev["by_kind"]) == (2, 2, {"crash": 1, "straggler": 1})
    assert [x["run_id"] for x in ev["latest_faults"]] == ["r2", "r1"] and ev["flag_runs"] == 2
    assert "node1 had faults in 2 of its 2 runs in the last 7 days" in inc.root_cause
    assert not [x for x in findings if x.kind == "node_history" and x.resolved]  # open while the node is in the run
    assert {x.kind for x in findings} == {"node_history"}  # and nothing else on a clean run


def test_nothing_without_history_or_below_the_threshold():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=40, seed=4)
    assert not [x for x in feed(Analyzer(), sim.build()) if x.kind == "node_history"]
    one = rows(("r1", "node1", sim.start_ts - DAY, "seen"), ("r1", "node1", sim.start_ts - DAY + 9, "hang", 1),
               ("r1", "node1", sim.start_ts - DAY + 19, "isolated", 1))  # two faults, one run
    assert not [x for x in feed(Analyzer(), _with_history(sim.build(), one)) if x.kind == "node_history"]
    own = rows(*[(r, "node1", sim.start_ts - DAY + i, "hang", i) for i, r in enumerate(("sim", "sim"))],
               ("r1", "node1", sim.start_ts - DAY, "crash", 7))  # its own run's rows never count
    assert not [x for x in feed(Analyzer(), _with_history(sim.build(), own)) if x.kind == "node_history"]
    stricter = Analyzer(rules_from_dict({"node_history": {"flag_runs": 1}}))
    assert [x.node for x in feed(stricter, _with_history(sim.build(), one)) if x.kind == "node_history"] == ["node1"]


def test_a_renamed_node_is_flagged_by_its_hardware():
    """The agents report each rank's hardware id (its GPU's UUID) with the run's ranks: node1 ran
    as gpu-host-7 in two runs this week and failed in both; today's run names it node1."""
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=40, seed=6)
    start = sim.start_ts
    history = [{**r, "hw_id": "GPU-7"} for r in rows(
        ("r1", "gpu-host-7", start - 2 * DAY, "seen"), ("r1", "gpu-host-7", start - 2 * DAY + 9, "straggler", 1),
        ("r2", "gpu-host-7", start - DAY, "seen"), ("r2", "gpu-host-7", start - DAY + 9, "isolated", 4))]
    commits = _with_history(sim.build(), history)
    now, frames = commits[0]
    ranks = _frame("ranks", [{"run_id": "sim", "rank": r, "node": f"node{r}", "dp": r, "tp": 0, "pp": 0,
                              "hw_id": f"GPU-{7 if r == 1 else 0}"} for r in range(2)])
    commits[0] = (now, Frames(**{**frames.tables(), "ranks": ranks}))
    got = [x for x in feed(Analyzer(), commits) if x.kind == "node_history"]
    assert [(x.node, x.rank) for x in got] == [("node1", 1)]
    ev = got[0].evidence
    assert ev["past_names"] == ["gpu-host-7"] and ev["hw_ids"] == ["GPU-7"] and ev["fault_runs"] == 2
    assert "node node1 (as gpu-host-7) had faults in 2 of its 2 runs" in got[0].root_cause


def test_a_node_is_judged_once_its_ranks_have_reported_their_hardware():
    """Rank 0's run description names every node before the other ranks' first rows come: node1 is
    judged when its rank's row (and its hardware id) is in, not from the node map alone, which would
    have found no record under today's name."""
    history = [{**r, "hw_id": "GPU-7"} for r in rows(
        ("r1", "gpu-host-7", 1000.0 - 2 * DAY, "hang", 1), ("r2", "gpu-host-7", 1000.0 - DAY, "crash", 2))]
    runs = _frame("runs", [{"run_id": "sim", "world_size": 2, "status": "running", "config": "{}",
                            "mesh": '{"dp": 2, "tp": 1, "pp": 1}', "node_map": '{"0": "node0", "1": "node1"}'}])
    rank = lambda r, node, hw: _frame("ranks", [{"run_id": "sim", "rank": r, "node": node, "dp": r, "tp": 0,  # noqa: E731
                                                 "pp": 0, "hw_id": hw}])
    a = Analyzer()
    first = a.feed(Frames(runs=runs, ranks=rank(0, "node0", "GPU-0"), node_history=f.history_frame(history)),
                   now=1000.0)
    assert not [x for x in first if x.kind == "node_history"]  # node1's rank has not reported
    got = a.feed(Frames(ranks=rank(1, "node1", "GPU-7")), now=1001.0)
    assert [(x.node, x.rank, x.evidence["past_names"]) for x in got if x.kind == "node_history"] == [
        ("node1", 1, ["gpu-host-7"])]


def test_history_given_before_the_ranks_is_judged_when_they_come():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=40, seed=5)
    commits = sim.build()
    start = sim.start_ts
    bad = rows(("r1", "node0", start - 2 * DAY, "straggler", 1), ("r2", "node0", start - DAY, "hang", 1))
    first_now = commits[0][0]
    only_history = (first_now - 0.5, Frames(node_history=f.history_frame(bad)))
    got = [x for x in feed(Analyzer(), [only_history, *commits]) if x.kind == "node_history"]
    assert [(x.node, x.rank) for x in got] == [("node0", 0)]


def _policy(**over) -> Policy:
    return Policy(rules_from_dict({"policy": over} if over else {}))


def _flagged(node: str = "node1") -> dict:
    return {"id": 5, "kind": "node_history", "status": "open", "step_from": 0, "rank": 2, "node": node,
            "evidence": {"fault_runs": 3, "runs": 4, "window_days": 7.0}}


def test_a_flagged_node_goes_to_a_spare_and_stays_without_one():
    st = RunPolicy(run_id="run-1", nodes=["node0", "node1"], spares=1)
    d = _policy().on_incident(st, _flagged(), now=10.0)
    assert [(x.kind, x.node, x.refused) for x in d] == [(ISOLATE, "node1", None)]
    assert "had faults in 3 of its 4 runs in the last 7 days" in d[0].reason and "a spare takes its place" in d[0].reason
    assert st.spares == 0 and st.isolated == {"node1"}
    none_left = RunPolicy(run_id="run-1", nodes=["node0", "node1"], spares=0)
    assert _policy().on_incident(none_left, _flagged(), now=10.0) == []
    off = RunPolicy(run_id="run-1", nodes=["node0", "node1"], spares=1)
    assert _policy(replace_flagged_nodes=False).on_incident(off, _flagged(), now=10.0) == []
