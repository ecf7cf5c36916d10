"""replica_divergence on synthetic frames: checksums of the dp replicas of each shard."""

from __future__ import annotations

import json

import polars as pl

from analysis import Analyzer
from analysis.frames import Frames, ranks_frame, runs_frame, scalars_frame
from analysis.policy import ISOLATE, REPAIR, ROLLBACK, Policy, RunPolicy
from analysis.rules import rules_from_dict


def _layout(dp: int, tp: int):
    """Ranks of a dp x tp run (tp innermost), two ranks per node."""
    world = dp * tp
    nodes = {r: f"node{r // 2}" for r in range(world)}
    runs = runs_frame([{"run_id": "r", "world_size": world, "status": "running", "config": "{}",
                        "mesh": json.dumps({"dp": dp, "tp": tp, "pp": 1}),
                        "node_map": json.dumps({str(r): n for r, n in nodes.items()})}])
    ranks = ranks_frame([{"run_id": "r", "rank": r, "node": nodes[r], "dp": (r // tp) % dp, "tp": r % tp, "pp": 0}
                         for r in range(world)])
    return world, nodes, runs, ranks


def synthetic(dp: int, tp: int = 1, *, steps: int = 60, every: int = 10, flip: tuple[int, int] | None = None,
              repair_at: int | None = None):
    """One commit per checksum step. `flip` = (rank, step): that rank's checksum differs from
    the first checksum after `step` on; `repair_at`: from this step on it agrees again."""
    world, nodes, runs, ranks = _layout(dp, tp)
    commits = []
    for step in range(every, steps + 1, every):
        rows = []
        for r in range(world):
            value = 1_000_000 + 7 * step + (r % tp)  # the same on every replica of a shard
            if flip and r == flip[0] and step > flip[1] and (repair_at is None or step < repair_at):
                value += 1 << 22
            rows.append({"run_id": "r", "attempt": 0, "step": step, "rank": r,
                         "name": f"checksum/pp00-tp{r % tp:02d}", "value": float(value)})
        frames = Frames(scalars=scalars_frame(rows))
        if step == every:
            frames.runs, frames.ranks = runs, ranks
        commits.append((1000.0 + step, frames))
    return commits, nodes


def run(commits):
    a = Analyzer(detectors=["replica_divergence"])
    out = []
    for now, frames in commits:
        out.extend(a.feed(frames, now=now))
    return out


def test_dp3_names_the_rank_that_disagrees_with_the_majority():
    commits, nodes = synthetic(3, flip=(2, 23))
    found = [f for f in run(commits) if f.kind == "replica_divergence"]
    assert len(found) == 1
    f = found[0]
    assert (f.rank, f.node, f.step_from, f.step_to) == (2, nodes[2], 20, 30)
    ev = f.evidence
    assert ev["majority"] is True and ev["divergent_ranks"] == [2] and ev["healthy_ranks"] == [0, 1]
    assert (ev["shard"], ev["pp"], ev["tp"], ev["src_dp"]) == ("pp00-tp00", 0, 0, 0)
    assert (ev["last_agreeing_step"], ev["first_disagreeing_step"]) == (20, 30)
    assert (ev["caught_within_steps"], ev["checksum_every"]) == (10, 10)
    assert not f.resolved


def test_dp3_tp2_names_the_shard_and_its_rank():
    commits, nodes = synthetic(3, 2, flip=(3, 41))  # rank 3: dp 1, tp 1
    (f,) = [f for f in run(commits) if f.kind == "replica_divergence"]
    assert (f.rank, f.node, f.step_to) == (3, nodes[3], 50)
    assert f.evidence["shard"] == "pp00-tp01" and f.evidence["healthy_ranks"] == [1, 5]


def test_dp2_names_both_replicas_and_says_why():
    commits, nodes = synthetic(2, 2, flip=(2, 15))  # ranks 0 and 2 hold tp 0
    (f,) = [f for f in run(commits) if f.kind == "replica_divergence"]
    ev = f.evidence
    assert f.rank is None and ev["majority"] is False
    assert ev["divergent_ranks"] == [0, 2] and ev["healthy_ranks"] == [] and ev["src_dp"] is None
    assert ev["suspect_nodes"] == sorted({nodes[0], nodes[2]})
    assert "no majority" in ev["why"] and "dp = 2" in ev["why"]
    assert (f.step_from, f.step_to) == (10, 20)


def test_a_clean_run_is_silent():
    for dp, tp in ((2, 1), (3, 1), (3, 2), (4, 2)):
        commits, _ = synthetic(dp, tp)
        assert run(commits) == []


def test_it_resolves_when_the_replicas_agree_again():
    commits, _ = synthetic(3, flip=(1, 23), repair_at=40)
    found = [f for f in run(commits) if f.kind == "replica_divergence"]
    assert [f.resolved for f in found] == [False, True]
    assert found[-1].evidence["agreeing_again_step"] == 40


def test_waits_for_every_replica_before_judging():
    commits, _ = synthetic(3, flip=(2, 23), steps=30)
    last_now, last = commits[-1]
    sc = last.scalars
    split = [(last_now, Frames(scalars=sc.filter(pl.col("rank") < 2))), (last_now + 1, Frames(scalars=sc.filter(pl.col("rank") == 2)))]
    a = Analyzer(detectors=["replica_divergence"])
    for now, frames in commits[:-1]:
        assert a.feed(frames, now=now) == []
    assert a.feed(split[0][1], now=split[0][0]) == []  # two of three replicas: not judged yet
    (f,) = a.feed(split[1][1], now=split[1][0])
    assert f.rank == 2


def _inc(**ev):
    base = {"shard": "pp00-tp00", "majority": True, "src_dp": 0, "divergent_ranks": [2], "caught_within_steps": 10,
            "checksum_every": 10, "suspect_nodes": ["node1"], "first_disagreeing_step": 30}
    return {"id": 7, "run_id": "r", "kind": "replica_divergence", "status": "open", "rank": 2, "node": "node1",
            "step_from": 20, "step_to": 30, "evidence": {**base, **ev}}


def test_policy_repairs_in_place_when_caught_at_the_first_checksum():
    pol = Policy(rules_from_dict())
    st = RunPolicy(run_id="r", nodes=["node0", "node1"])
    (d,) = pol.on_incident(st, _inc(), now=100.0)
    assert d.kind == REPAIR and d.args == {"src_dp": 0, "ranks": [2], "incident_id": 7, "step": 30}
    assert d.node == "node1" and len(st.transients["node1"]) == 1  # the fault counts against the node


def test_policy_rolls_back_without_a_majority_or_when_caught_late():
    pol = Policy(rules_from_dict())
    for inc in (_inc(majority=False, src_dp=None, suspect_nodes=["node0", "node1"]),
                _inc(caught_within_steps=30)):
        st = RunPolicy(run_id="r", nodes=["node0", "node1", "node2"])
        out = pol.on_incident(st, inc, now=100.0)
        assert out[0].kind == ROLLBACK and out[0].args["step"] == 20 and out[0].args["diagnose"] is False
        assert all(len(st.transients[n]) == 1 for n in inc["evidence"]["suspect_nodes"])


def test_repeated_corruption_on_a_node_isolates_it():
    pol = Policy(rules_from_dict({"policy": {"cooldown_s": 0.0}}))
    st = RunPolicy(run_id="r", nodes=["node0", "node1"])
    assert [d.kind for d in pol.on_incident(st, _inc(), now=100.0)] == [REPAIR]
    out = pol.on_incident(st, {**_inc(), "id": 8}, now=200.0)
    assert [d.kind for d in out] == [REPAIR, ISOLATE] and out[1].node == "node1"


def test_policy_waits_out_the_cooldown_for_an_open_divergence_then_decides():
    pol = Policy(rules_from_dict({"policy": {"cooldown_s": 5.0}}))
    st = RunPolicy(run_id="r", nodes=["node0", "node1", "node2"])
    assert [d.kind for d in pol.on_incident(st, _inc(), now=100.0)] == [REPAIR]
    late = {**_inc(), "id": 8}
    assert pol.on_incident(st, late, now=101.0) == [] and pol.waiting(st, late, now=101.0)
    assert not pol.waiting(st, {**late, "status": "closed"}, now=101.0)  # healed meanwhile: nothing to wait for
    (d,) = [d for d in pol.on_incident(st, late, now=105.5) if d.kind == REPAIR]
    assert d.incident_id == 8 and not pol.waiting(st, late, now=105.5)
    # a rollback's cooldown holds a dp = 2 divergence the same way; a repair's does not
    assert "node1" in st.isolated  # its second fault within the window
    dp2 = {**_inc(majority=False, src_dp=None, suspect_nodes=["node0", "node2"]), "id": 9, "rank": None,
           "node": None}
    assert pol.waiting(st, dp2, now=106.0) is False  # no rollback issued yet: decided at once
    assert [d.kind for d in pol.on_incident(st, dp2, now=106.0)] == [ROLLBACK]
    other = {**dp2, "id": 10}
    assert pol.waiting(st, other, now=107.0) and pol.on_incident(st, other, now=107.0) == []


def test_policy_counts_the_fault_in_the_actions_detail():
    pol = Policy(rules_from_dict())
    st = RunPolicy(run_id="r", nodes=["node0", "node1", "node2"])
    (d,) = pol.on_incident(st, _inc(majority=False, src_dp=None, suspect_nodes=["node0", "node1"]), now=100.0)
    assert d.kind == ROLLBACK and d.faults == {"node0": 1, "node1": 1} and d.detail()["faults"] == d.faults


def test_a_lost_checksum_makes_a_late_catch_and_the_policy_rolls_back():
    """The flip after step 23; rank 2's checksum of step 30 never arrives: the divergence is
    first seen at step 40, 20 steps after the last agreeing one. The lost checksum does not
    hold back the verdict (every replica reported step 40), does not widen the interval
    (still 10), and a catch later than the interval is rolled back, not repaired."""
    commits, nodes = synthetic(3, flip=(2, 23))
    now, frames = commits[2]  # step 30
    commits[2] = (now, Frames(scalars=frames.scalars.filter(pl.col("rank") != 2)))
    found = [f for f in run(commits) if f.kind == "replica_divergence"]
    assert len(found) == 1
    f = found[0]
    assert (f.rank, f.node, f.step_from, f.step_to) == (2, nodes[2], 20, 40)
    assert (f.evidence["caught_within_steps"], f.evidence["checksum_every"]) == (20, 10)
    inc = {"id": 3, "run_id": "r", "kind": f.kind, "status": "open", "rank": f.rank, "node": f.node,
           "step_from": f.step_from, "step_to": f.step_to, "evidence": f.evidence}
    st = RunPolicy(run_id="r", nodes=sorted(set(nodes.values())))
    out = Policy(rules_from_dict()).on_incident(st, inc, now=100.0)
    assert out[0].kind == ROLLBACK and out[0].args["step"] == 20 and out[0].args["diagnose"] is False
    assert out[0].faults == {nodes[2]: 1}


def test_the_interval_leaves_out_a_repairs_extra_check():
    """A repair's check the step after it (31) is not the interval: a second flip caught at
    the next regular checksum is still within it (a repair, not a rollback)."""
    world, nodes, runs, ranks = _layout(3, 1)
    bad = {30: 2, 50: 1}  # step -> the rank whose checksum differs (31: repaired, 40 agrees)
    commits = []
    for i, step in enumerate((10, 20, 30, 31, 40, 50)):
        rows = [{"run_id": "r", "attempt": 0, "step": step, "rank": r, "name": "checksum/pp00-tp00",
                 "value": float(1_000 + step + (1 << 22 if bad.get(step) == r else 0))} for r in range(world)]
        frames = Frames(scalars=scalars_frame(rows))
        if i == 0:
            frames.runs, frames.ranks = runs, ranks
        commits.append((1000.0 + step, frames))
    found = [f for f in run(commits) if f.kind == "replica_divergence"]
    assert [(f.resolved, f.step_to) for f in found] == [(False, 30), (True, 30), (False, 50)]
    assert (found[2].evidence["caught_within_steps"], found[2].evidence["checksum_every"]) == (10, 10)
    assert found[2].rank == 1 and found[2].evidence["last_agreeing_step"] == 40
