"""Slow checkpoint writes: a rank's shard writes far slower than its peers' and its own history's are named
with their node; silent on a clean run (and on runs whose events carry no write seconds)."""

import json

import polars as pl

from analysis import Analyzer
from tests.unit.analysis.sim import Layout, Sim, Straggler, feed, last_of, opened


def _writes(commits, *, slow_rank: int | None = None, from_step: int = 0, factor: float = 1.0,
            noise: dict[tuple[int, int], float] | None = None):
    """Give every checkpoint_saved event the write seconds a real rank reports: dp rank 0 ranks write the
    model shard too (2 shards, ~0.12 s), the others their rank file (1 shard, ~0.02 s), a little noise;
    `slow_rank`'s take `factor` times as long from `from_step` on; `noise`: (rank, step) -> a factor
    more for that one write."""
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
                    w *= (noise or {}).get((rank, step), 1.0)
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


def _async_writes(commits, *, world: int, slow_rank: int, from_step: int, write_s: float | None,
                  slow_ranks: tuple[int, ...] = (), only_step: int | None = None, lag: dict[int, float] | None = None):
    """What the trainer sends: `checkpoint_queued` when a save is queued (just after its step), and
    `checkpoint_saved` at the first step boundary after the background write ended, before that
    step's row (trainer/train.py polls there). Dp rank 0 ranks (0, 1) write 2 shards (~0.12 s),
    the others 1 (~0.02 s); `slow_rank`'s (and `slow_ranks`') writes from `from_step` on (only
    that of `only_step`, when given) take `write_s` (None: its writer stalled, it never reports).
    `lag`: rank -> seconds its events reach the collector after their time (its agent's buffer)."""
    step_ts: dict[int, float] = {}
    events = []
    for _, frames in commits:
        if frames.steps is not None:
            for s, ts in frames.steps.group_by("step").agg(pl.col("ts").max()).iter_rows():
                step_ts[int(s)] = float(ts)
        if frames.events is not None:
            events += [e for e in frames.events.iter_rows(named=True) if e["kind"] != "checkpoint_saved"]
    ckpt_steps = sorted({e["step"] for _, f in commits if f.events is not None
                         for e in f.events.iter_rows(named=True) if e["kind"] == "checkpoint_saved"})
    ends = sorted(step_ts.values())
    for s in ckpt_steps:
        for r in range(world):
            two = r in (0, 1)
            t0 = step_ts[s] + 0.01
            events.append({"rank": r, "ts": t0, "step": s, "kind": "checkpoint_queued",
                           "data": json.dumps({"num_shards": 2 if two else 1, "bytes": 5_000_000 if two else 20_000,
                                               "stall_s": 0.01})})
            w = (0.12 if two else 0.02) * (1.0 + 0.05 * ((r * 7 + s) % 3))
            if (r == slow_rank or r in slow_ranks) and s >= from_step and only_step in (None, s):
                if write_s is None:
                    continue
                w = write_s
            done = next((t for t in ends if t >= t0 + w), None)
            if done is not None:
                events.append({"rank": r, "ts": done - 1e-4, "step": s, "kind": "checkpoint_saved",
                               "data": json.dumps({"step": s, "num_shards": 2 if two else 1, "write_s": w,
                                                   "bytes": 5_000_000 if two else 20_000})})
    schema = next(f.events.schema for _, f in commits if f.events is not None)
    template = next(f.events.row(0, named=True) for _, f in commits if f.events is not None and f.events.height)
    lag = lag or {}
    events = sorted(({**template, **e} for e in events), key=lambda e: e["ts"] + lag.get(e["rank"], 0.0))
    out, i = [], 0
    for now, frames in commits:
        mine = []
        while i < len(events) and events[i]["ts"] + lag.get(events[i]["rank"], 0.0) <= now:
            mine.append(events[i])
            i += 1
        out.append((now, type(frames)(**{**frames.tables(), "events": pl.DataFrame(mine, schema=schema) if mine
                                         else None})))
    return out


def test_a_stalled_writer_is_named_before_it_reports():
    """A rank whose writer stalls never sends `checkpoint_saved`: the seconds since its
    `checkpoint_queued`, to its newest step row, are enough to name it within a few steps."""
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=130, seed=21, ckpt_every=20)
    commits = _async_writes(sim.build(), world=layout.world, slow_rank=2, from_step=60, write_s=None)
    first = opened(feed(Analyzer(), commits), "checkpoint_slow")
    assert len(first) == 1, [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert (f.rank, f.node, f.step_from) == (2, "node1", 60)
    assert f.evidence["still_writing"] is True and f.evidence["ratio_vs_peers"] >= 3.0
    assert "still writing after" in f.root_cause
    steps_ts = {s: t for _, fr in commits if fr.steps is not None
                for s, t in fr.steps.group_by("step").agg(pl.col("ts").max()).iter_rows()}
    assert 0 < f.ts - steps_ts[60] < 3.0  # within the commits of a few steps: min_excess_s past its peers'


def test_a_slow_write_is_judged_from_its_bound_before_its_report():
    """A slow write that ends: the incident opens on the bound (still writing), before the report."""
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=130, seed=22, ckpt_every=20)
    commits = _async_writes(sim.build(), world=layout.world, slow_rank=1, from_step=60, write_s=3.0)
    findings = feed(Analyzer(), commits)
    first = opened(findings, "checkpoint_slow")
    assert len(first) == 1 and next(iter(first.values())).rank == 1
    f = next(iter(first.values()))
    assert f.step_from == 60 and f.evidence["still_writing"] is True
    saved_60 = next(e["ts"] for _, fr in commits if fr.events is not None
                    for e in fr.events.iter_rows(named=True)
                    if e["kind"] == "checkpoint_saved" and e["rank"] == 1 and e["step"] == 60)
    assert f.ts < saved_60  # opened before its report came


def test_async_reports_of_a_clean_run_open_nothing():
    """Reports sent at the step boundary after the write (a write that ends during a step is
    reported before that step's row): no bound is ever taken for a write that finished."""
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=130, seed=23, ckpt_every=20)
    commits = _async_writes(sim.build(), world=layout.world, slow_rank=0, from_step=10_000, write_s=None)
    assert [f.summary() for f in feed(Analyzer(), commits)] == []


def test_a_checkpoint_slow_for_all_its_small_writers_alike_opens_nothing():
    """Every rank writing one shard (2 and 3, both on node1) is slow at one checkpoint (a starved
    host, busy shared storage): no peer reported while they write, so their bounds wait for the
    reports, which show them as slow as each other."""
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=130, seed=24, ckpt_every=20)
    commits = _async_writes(sim.build(), world=layout.world, slow_rank=2, slow_ranks=(3,), from_step=60,
                            only_step=60, write_s=1.5)
    assert [f.summary() for f in feed(Analyzer(), commits)] == []


def test_a_noisy_peer_at_the_first_slow_checkpoints_does_not_hide_the_slow_rank():
    """Rank 1 writes 8x slower from step 60; at its first two slow checkpoints its peer rank 0 happened
    to be as slow (a starved host). Rank 1's writes enter its history capped, so the later slow writes
    are still slow against it (uncapped, half its history would be slow writes), and the incident opens
    at the next checkpoint."""
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=130, seed=25, ckpt_every=20)
    findings = feed(Analyzer(), _writes(sim.build(), slow_rank=1, from_step=60, factor=8.0, noise={(0, 60): 8.0, (0, 80): 8.0}))
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["checkpoint_slow"], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert (f.rank, f.node, f.step_from) == (1, "node0", 100)


def test_a_slow_report_that_comes_after_its_checkpoint_fell_overdue_is_judged_then():
    """Checkpoints closer together than an agent's flush: rank 1's events reach the collector three
    checkpoints late, so each of its checkpoints falls overdue (judged without rank 1) before its
    report comes. The report is judged when it comes, against the reports that checkpoint had;
    rank 0, which reports only after it finalized (its bound is the slowest rank's write), is not
    blamed."""
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=160, seed=26, ckpt_every=10)
    commits = sim.build()
    ts = sorted({float(t) for _, fr in commits if fr.steps is not None for t in fr.steps["ts"].to_list()})
    lag = 3.5 * 10 * (ts[-1] - ts[0]) / 160  # three and a half checkpoint intervals
    commits = _async_writes(commits, world=layout.world, slow_rank=1, from_step=60, write_s=2.0, lag={1: lag})
    first = opened(feed(Analyzer(), commits), "checkpoint_slow")
    assert len(first) == 1, [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert (f.rank, f.node) == (1, "node0") and f.step_from >= 60
    assert f.evidence["ranks"] == [1] and f.evidence["ratio_vs_peers"] >= 3.0


def test_a_write_whose_only_peer_reports_later_waits_for_that_peer():
    """Rank 0 reports a save only once it finalized it (after every rank's partial manifest), so
    its replica rank 1's report always comes first, and with checkpoints closer than a flush each
    one falls overdue with rank 1's report alone in its shard class. Rank 1 is slow from its third
    checkpoint, while its own history is still short: its write waits for rank 0's report and is
    judged against it, instead of entering the history as its normal."""
    layout = Layout(dp=2, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=160, seed=27, ckpt_every=10)
    commits = sim.build()
    ts = sorted({float(t) for _, fr in commits if fr.steps is not None for t in fr.steps["ts"].to_list()})
    lag = 3.5 * 10 * (ts[-1] - ts[0]) / 160
    commits = _async_writes(commits, world=layout.world, slow_rank=1, from_step=30, write_s=1.5, lag={0: lag})
    findings = feed(Analyzer(), commits)
    first = opened(findings, "checkpoint_slow")
    assert len(first) == 1, [f.summary() for f in first.values()]
    key = next(iter(first))
    f = last_of(findings)[key]
    assert (f.rank, f.node, f.step_from) == (1, "node0", 30) and not f.resolved
    assert f.evidence["ranks"] == [1] and f.evidence["ratio_vs_peers"] >= 3.0
