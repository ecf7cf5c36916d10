"""Data stalls: a rank whose step waits for its data is named with its node; silent on a clean run and on
a compute straggler (whose measure leaves data_s out), and a data stall does not open a straggler."""

import polars as pl

from analysis import Analyzer, rules_from_dict
from analysis.policy import ISOLATE, Policy, RunPolicy
from tests.unit.analysis.sim import Layout, Sim, Straggler, feed, last_of, opened


def _stall(commits, *, rank: int, start: int, extra_s: float):
    """The rank's data wait grows by `extra_s` from `start` on; every rank's step takes that much longer
    (the others wait for it at the next collective: comm, not compute, not data)."""
    out = []
    for now, frames in commits:
        st = frames.steps
        if st is not None:
            late = pl.col("step") >= start
            st = st.with_columns(
                pl.when(late & (pl.col("rank") == rank)).then(pl.col("data_s") + extra_s)
                .otherwise(pl.col("data_s")).alias("data_s"),
                pl.when(late).then(pl.col("step_s") + extra_s).otherwise(pl.col("step_s")).alias("step_s"))
            frames = type(frames)(**{**frames.tables(), "steps": st})
        out.append((now, frames))
    return out


def test_data_stall_names_rank_and_node_and_no_straggler():
    layout = Layout(dp=2, tp=2, nodes=2)
    onset = 60
    sim = Sim(layout=layout, steps=140, seed=5, eval_every=50, ckpt_every=60)
    findings = feed(Analyzer(), _stall(sim.build(), rank=2, start=onset, extra_s=0.2))
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["data_stall"], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert f.rank == 2 and f.node == layout.node(2) == "node1"
    assert onset <= f.step_to < onset + 12 and f.step_from >= onset - 1
    last = last_of(findings)[f.key]
    assert last.evidence["ranks"] == [2]
    assert 0.1 < last.evidence["cost_s_per_step"] < 0.3  # ~ the 0.2 s extra wait
    assert 0.3 < last.evidence["data_share"] < 0.7  # 0.2 of ~0.4 s


def test_data_stall_resolves_when_data_flows_again():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=140, seed=6)
    commits = _stall(sim.build(), rank=1, start=40, extra_s=0.2)
    commits = [(now, type(fr)(**{**fr.tables(), "steps": fr.steps.with_columns(
        pl.when(pl.col("step") > 80).then(0.001).otherwise(pl.col("data_s")).alias("data_s"))})
        if fr.steps is not None else fr) for now, fr in commits]
    findings = [f for f in feed(Analyzer(), commits) if f.kind == "data_stall"]
    assert findings and findings[-1].resolved and findings[-1].rank == 1
    assert 80 <= findings[-1].step_to < 90


def test_clean_run_opens_nothing():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=7, eval_every=50, ckpt_every=60)
    assert [f.summary() for f in feed(Analyzer(), sim.build())] == []


def test_compute_straggler_does_not_open_data_stall():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=8, faults=(Straggler(rank=3, start=60, factor=1.5),))
    findings = feed(Analyzer(), sim.build())
    assert {f.kind for f in findings} == {"straggler"}


def test_small_waits_below_the_floor_are_not_stalls():
    """A share above min_share of a tiny step is not a stall unless it exceeds the peers by min_excess_s."""
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=120, seed=9)
    findings = feed(Analyzer(rules_from_dict({"data_stall": {"min_excess_s": 0.5}})),
                    _stall(sim.build(), rank=2, start=40, extra_s=0.2))
    assert [f for f in findings if f.kind == "data_stall"] == []


def test_policy_isolates_a_costly_persistent_data_stall_only():
    pol = Policy(rules_from_dict({"policy": {"data_stall_persist_s": 2.0}}))
    nodes = ["node0", "node1"]
    st = RunPolicy(run_id="r", nodes=nodes)
    inc = {"id": 7, "kind": "data_stall", "status": "open", "rank": 2, "node": "node1",
           "evidence": {"cost_s_per_step": 0.2, "share_of_step": 0.5}}
    assert pol.on_incident(st, inc, now=100.0) == []  # costly, not yet for long
    (d,) = pol.on_incident(st, inc, now=102.5)
    assert (d.kind, d.node) == (ISOLATE, "node1") and d.reason.startswith("data stall: rank 2 costs 0.2 s/step")
    cheap = {**inc, "id": 8, "evidence": {"cost_s_per_step": 0.01, "share_of_step": 0.05}}
    st = RunPolicy(run_id="r", nodes=nodes)
    assert pol.on_incident(st, cheap, now=200.0) == [] and pol.on_incident(st, cheap, now=300.0) == []
    slow_ckpt = {"id": 9, "kind": "checkpoint_slow", "status": "open", "rank": 2, "node": "node1", "evidence": {}}
    assert pol.on_incident(st, slow_ckpt, now=400.0) == []  # an alert only: no persist-tier seam
