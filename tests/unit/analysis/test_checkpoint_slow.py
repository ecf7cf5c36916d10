"""Slow checkpoint writes: a rank's shard writes far slower than its peers' and its own history's are named
with their node; silent on a clean run (and on runs whose events carry no write seconds)."""

import json

import polars as pl

from analysis import Analyzer
from tests.unit.analysis.sim import Layout, Sim, Straggler, feed, last_of, opened


def _writes(commits, *, slow_rank: int | None = None, from_step: int = 0, factor: float = 1.0):
    """Give every checkpoint_saved event the write seconds a real rank reports: dp rank 0 ranks write the
    model shard too (2 shards, ~0.12 s), the others their rank file (1 shard, ~0.02 s), a little noise;
    `slow_rank`'s take `factor` times as long from `from_step` on."""
    out = []
    for now, frames in commits:
        ev = frames.events
        if ev is not None:
            data = []
            for rank, step, kind, d in zip(ev["rank"], ev["step"], ev["kind"], ev["data"]):
                if kind == "checkpoint_saved":
                    two = rank in (0, 1)
                    w = (0.12 if two else 0.02) * (1.0 + 0.05 * ((rank * 7 + step) % 3))
                    if rank == slow_rank and step >= from_step:
                        w *= factor
                    d = json.dumps({**json.loads(d), "num_shards": 2 if two else 1, "write_s": w,
                                    "bytes": 5_000_000 if two else 20_000})
                data.append(d)
            frames = type(frames)(**{**frames.tables(), "events": ev.with_columns(pl.Series("data", data))})
        out.append((now, frames))
    return out


def test_slow_shard_writes_name_rank_and_node():
    layout = Layout(dp=2, tp=2, nodes=2)  # ranks 0, 1 (dp 0) write the model shards
    sim = Sim(layout=layout, steps=130, seed=11, ckpt_every=20)
    findings = feed(Analyzer(), _writes(sim.build(), slow_rank=1, from_step=60, factor=8.0))
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["checkpoint_slow"], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert f.rank == 1 and f.node == layout.node(1) == "node0" and f.step_from == 60
    last = last_of(findings)[f.key]
    assert last.evidence["ratio_vs_peers"] > 5 and last.evidence["ratio_vs_history"] > 5
    assert last.evidence["checkpoint_step"] >= 60 and last.evidence["cost_s_per_checkpoint"] > 0.5


def test_a_small_writer_is_compared_with_small_writers():
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=130, seed=12, ckpt_every=20)
    findings = feed(Analyzer(), _writes(sim.build(), slow_rank=3, from_step=40, factor=20.0))  # 0.4 s: past min_excess_s
    slow = [f for f in findings if f.kind == "checkpoint_slow"]
    assert slow and {f.rank for f in slow} == {3} and slow[0].node == "node1"


def test_it_resolves_when_writes_are_fast_again():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=13, ckpt_every=20)
    commits = _writes(sim.build(), slow_rank=0, from_step=60, factor=8.0)
    findings = [f for f in feed(Analyzer(), _until(commits, 100)) if f.kind == "checkpoint_slow"]
    assert findings and findings[-1].resolved and findings[-1].rank == 0


def _until(commits, last_slow_step: int):
    """Writes of checkpoints after `last_slow_step` are back to normal (divide the factor out)."""
    out = []
    for now, frames in commits:
        ev = frames.events
        if ev is not None:
            data = []
            for step, kind, d in zip(ev["step"], ev["kind"], ev["data"]):
                if kind == "checkpoint_saved" and step > last_slow_step:
                    x = json.loads(d)
                    if x.get("write_s", 0) > 0.5:
                        x["write_s"] /= 8.0
                    d = json.dumps(x)
                data.append(d)
            frames = type(frames)(**{**frames.tables(), "events": ev.with_columns(pl.Series("data", data))})
        out.append((now, frames))
    return out


def test_clean_runs_and_a_straggler_open_no_checkpoint_slow():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=14, ckpt_every=20)
    assert [f.summary() for f in feed(Analyzer(), _writes(sim.build()))] == []
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=15, ckpt_every=20,
              faults=(Straggler(rank=3, start=60, factor=1.5),))
    assert {f.kind for f in feed(Analyzer(), _writes(sim.build()))} == {"straggler"}
