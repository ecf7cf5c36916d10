"""The detectors on collectives summarized per step (agent/summary.py) name what they name on op rows.

A summarizing agent ships one row per (step, op, axis, group, peer) instead of a row per op;
analysis/frames.py turns each into its mean op (`ops_from_summaries`). The same simulated runs
are fed to the analyzer twice, op rows and summaries, and must give the same incidents: the
straggler (who waits for whom, its witness) and the slow link (each member's transfer time)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from agent import summary, wire
from analysis import Analyzer
from analysis.frames import Frames, ops_from_summaries, summarize_ops, with_summaries
from tests.unit.agent.test_summary import AXES, OP_NAMES, _ops
from tests.unit.analysis.sim import Layout, Sim, Straggler, feed, last_of, opened
from tests.unit.analysis.test_slow_link import run_all, synthetic_run


def summarized(commits: list[tuple[float, Frames]]) -> list[tuple[float, Frames]]:
    """The same commits as a summarizing agent would send them: each (rank, step)'s ops as
    summaries, in the commit that held the step's last op row of that rank (the agent ships a
    step whole, once finished)."""
    rows = [(i, f.collectives) for i, (_, f) in enumerate(commits) if f.collectives is not None]
    coll = pl.concat([c.with_columns(pl.lit(i).alias("_c"), pl.col("op").cast(pl.String),
                                     pl.col("axis").cast(pl.String)) for i, c in rows], how="diagonal_relaxed")
    where = coll.group_by("rank", "step").agg(pl.col("_c").max())
    summ = summarize_ops(coll.drop("_c")).join(where, on=["rank", "step"])
    out = []
    for i, (now, f) in enumerate(commits):
        mine = summ.filter(pl.col("_c") == i).drop("_c")
        f2 = Frames(**f.tables())
        f2.collectives = with_summaries(None, mine) if mine.height else None
        out.append((now, f2))
    return out


def test_the_collectors_summaries_are_the_agents():
    rows = _ops(range(1, 6), 30, seed=1)
    _, cols, n, _, _ = summary.summarize(rows, raw_step=lambda s: False)
    names = [c.name for c in wire.RECORDED[wire.COLLECTIVE]]
    ops = pl.DataFrame([dict(zip(names, r)) for r in rows]).with_columns(
        pl.col("op").replace_strict(dict(enumerate(OP_NAMES))), pl.col("axis").replace_strict(dict(enumerate(AXES))),
        pl.lit("r").alias("run_id"), pl.lit(0).alias("rank"))
    got = summarize_ops(ops).sort("step", "op", "axis", "group_id", "peer")
    agent = pl.DataFrame({k: list(v) for k, v in cols.items()}).with_columns(
        pl.col("op").replace_strict(dict(enumerate(OP_NAMES))),
        pl.col("axis").replace_strict(dict(enumerate(AXES)))).sort("step", "op", "axis", "group_id", "peer")
    assert got.height == n == agent.height
    for c in agent.columns:
        a, b = agent[c].to_list(), got[c].to_list()
        if isinstance(a[0], float):
            assert np.allclose(a, b, rtol=1e-12, atol=1e-9), c
        else:
            assert a == b, c


def test_a_summary_of_one_op_reads_as_that_op():
    rows = _ops([7], 1, seed=2)
    names = [c.name for c in wire.RECORDED[wire.COLLECTIVE]]
    op = pl.DataFrame([dict(zip(names, r)) for r in rows]).with_columns(
        pl.col("op").replace_strict(dict(enumerate(OP_NAMES))), pl.col("axis").replace_strict(dict(enumerate(AXES))),
        pl.lit("r").alias("run_id"), pl.lit(3).alias("rank"))
    back = ops_from_summaries(summarize_ops(op))
    for c in ("step", "rank", "seq", "group_seq", "op", "axis", "group_id", "peer", "bytes"):
        assert back[c].to_list() == op[c].to_list(), c
    for c in ("start_ts", "duration_s", "wait_s"):
        assert math.isclose(back[c][0], op[c][0], rel_tol=1e-12, abs_tol=1e-12), c
    assert back["num_ops"].to_list() == [1]


def test_sampled_op_rows_and_summaries_meet_as_summaries():
    """A summarizing agent's op rows (a sampled step, or while an incident asks) are read as the
    summaries of their steps, so a step looks the same to the detectors whichever way it came."""
    rows = _ops([4, 5], 6, seed=5)
    names = [c.name for c in wire.RECORDED[wire.COLLECTIVE]]
    ops = pl.DataFrame([dict(zip(names, r)) for r in rows]).with_columns(
        pl.col("op").replace_strict(dict(enumerate(OP_NAMES))), pl.col("axis").replace_strict(dict(enumerate(AXES))),
        pl.lit("r").alias("run_id"), pl.lit(0).alias("rank"))
    sampled = ops.filter(pl.col("step") == 4).with_columns(pl.lit(1, pl.Int8).alias("sampled"))
    plain = ops.filter(pl.col("step") == 5)  # an agent that ships every op: left as it is
    both = with_summaries(pl.concat([sampled, plain.with_columns(pl.lit(None, pl.Int8).alias("sampled"))]),
                          summarize_ops(ops.filter(pl.col("step") == 5)))
    assert both.filter(pl.col("num_ops").is_null())["step"].to_list() == [5] * 6
    summed = both.filter(pl.col("num_ops").is_not_null())
    assert summed.group_by("step").agg(pl.col("num_ops").sum()).sort("step").rows() == [(4, 6), (5, 6)]


@pytest.mark.parametrize("layout, rank, factor", [(Layout(dp=2, tp=2, nodes=2), 3, 1.5), (Layout(dp=4, nodes=2), 0, 1.25),
                                                  (Layout(dp=2, pp=2, nodes=2, stage_speed=(1.0, 1.4)), 2, 1.5)],
                         ids=["dp2xtp2", "dp4", "dp2xpp2"])
def test_a_straggler_is_named_from_summaries_as_from_op_rows(layout, rank, factor):
    onset = 80
    sim = Sim(layout=layout, steps=180, seed=rank + int(10 * factor), eval_every=50, ckpt_every=60,
              faults=(Straggler(rank=rank, start=onset, factor=factor),))
    commits = sim.build()
    raw, summ = opened(feed(Analyzer(), commits)), feed(Analyzer(), summarized(commits))
    first = opened(summ)
    assert [(f.kind, f.rank) for f in first.values()] == [(f.kind, f.rank) for f in raw.values()] == [
        ("straggler", rank)], [f.summary() for f in first.values()]
    f, r = next(iter(first.values())), next(iter(raw.values()))
    assert abs(f.evidence["fired_at_step"] - r.evidence["fired_at_step"]) <= 3, (f.summary(), r.summary())
    assert onset - 1 <= f.step_from <= onset + 3
    cost, raw_cost = last_of(summ)[f.key].evidence["cost_s_per_step"], last_of(feed(Analyzer(), commits))[
        r.key].evidence["cost_s_per_step"]
    assert cost == pytest.approx(raw_cost, rel=0.25)


@pytest.mark.parametrize("rank, axis, factor", [(3, "tp", 4.0), (1, "dp", 3.0), (0, "tp", 2.0)])
def test_a_slow_link_is_named_from_summaries_as_from_op_rows(rank, axis, factor):
    onset = 30
    commits = synthetic_run(slow_link=(rank, axis, onset, factor), seed=rank)
    raw = run_all(commits)
    summ = run_all(summarized(commits))
    first, first_raw = opened(summ), opened(raw)
    assert [(f.kind, f.rank, f.evidence["axis"]) for f in first.values()] == [
        (f.kind, f.rank, f.evidence["axis"]) for f in first_raw.values()] == [("slow_link", rank, axis)], \
        [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert onset <= f.evidence["fired_at_step"] < onset + 8
    last, last_raw = last_of(summ)[f.key].evidence, last_of(raw)[next(iter(first_raw))].evidence
    assert last["link_ratio"] == pytest.approx(last_raw["link_ratio"], rel=0.1)
    assert last["cost_s_per_step"] == pytest.approx(last_raw["cost_s_per_step"], rel=0.2)


def test_a_clean_run_stays_clean_from_summaries():
    sim = Sim(layout=Layout(dp=2, tp=2, pp=2, nodes=4), steps=160, seed=11, eval_every=50, ckpt_every=60)
    assert opened(feed(Analyzer(), summarized(sim.build()))) == {}
