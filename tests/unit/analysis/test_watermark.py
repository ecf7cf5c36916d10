"""The clean-through watermark (analysis/watermark.py): judged, clean, and checked."""

from __future__ import annotations

import polars as pl

from analysis import Analyzer, Frames
from analysis.frames import scalars_frame
from tests.unit.analysis.sim import Layout, Nan, Sim, Spike


def _marks(sim, commits):
    """Feed the commits; after each, (newest step seen, the watermark, open taint kinds)."""
    a = Analyzer()
    out = []
    for now, frames in commits:
        findings = a.feed_run(sim.run_id, frames, now=now)
        state = a.runs[sim.run_id]
        newest = state.assembler.newest
        out.append((newest[1] if newest else None, a.clean_through(sim.run_id), findings))
    return a, out


def test_a_clean_run_is_vouched_for_up_to_the_steps_it_has_judged():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=120, seed=3)
    a, marks = _marks(sim, sim.build())
    got = [w for _, w, _ in marks if w is not None]
    assert got and all(w.attempt == 0 and w.judged >= w.step for w in got)
    steps = [w.step for w in got]
    assert steps == sorted(steps)  # monotone
    assert all(w[1] <= newest for newest, w, _ in marks if w is not None)  # never past what arrived
    assert steps[-1] >= 118  # and close behind it at the end


def test_an_open_spike_holds_the_watermark_before_its_step_until_it_closes():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=200, seed=9, faults=(Spike(step=120, factor=3.0),))
    a, marks = _marks(sim, sim.build())
    opened = closed = None
    for i, (_, w, findings) in enumerate(marks):
        for f in findings:
            if f.kind == "loss_spike" and opened is None:
                opened = i
            if f.kind == "loss_spike" and f.resolved:
                closed = i
    assert opened is not None and closed is not None and closed > opened
    held = [w[1] for _, w, _ in marks[opened:closed]]
    assert held and max(held) == 119  # the newest known-good step is the one before the spike
    assert marks[-1][1][1] >= 190  # once closed (no action taken: policy off here) it goes on


def test_a_nan_holds_it_too_and_a_new_attempt_starts_from_its_checkpoint():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=80, seed=5, faults=(Nan(rank=1, step=50),))
    commits = sim.build()
    a, marks = _marks(sim, commits)
    first = next(i for i, (_, _, fs) in enumerate(marks) if any(f.kind == "nan" for f in fs))
    ended = next((i for i, (_, _, fs) in enumerate(marks) if any(f.kind == "nan" and f.resolved for f in fs)),
                 len(marks))
    assert max(w[1] for _, w, _ in marks[:ended] if w is not None) == 49  # up to the NaN's step, not past it while it is open
    assert all(w[1] <= 49 for _, w, _ in marks[first:ended])
    # a rollback to step 40: attempt 1's first rows are step 41; its watermark is its own
    steps = next(f.steps for _, f in commits if f.steps is not None and f.steps.height)
    rows = steps.filter(pl.col("step") == steps["step"].min()).with_columns(
        pl.lit(1, pl.Int64).alias("attempt"), pl.lit(41, pl.Int64).alias("step"))
    now = commits[-1][0] + 1.0
    a.feed_run(sim.run_id, Frames(steps=rows.head(1)), now=now)  # one rank of two: step 41 still open
    assert a.clean_through(sim.run_id) == (1, 40, 40)


def test_checksums_vouch_only_for_the_updates_before_the_last_agreeing_one():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=60, seed=7)
    commits = sim.build()
    a = Analyzer()
    for now, frames in commits:
        a.feed_run(sim.run_id, frames, now=now)
    assert a.clean_through(sim.run_id)[1] >= 58
    now = commits[-1][0]
    rows = [{"run_id": sim.run_id, "rank": r, "attempt": 0, "step": 25, "ts": now, "name": "checksum/pp0-tp0",
             "value": 7.0} for r in (0, 1)]
    a.feed_run(sim.run_id, Frames(scalars=scalars_frame(rows)), now=now + 0.1)
    mark = a.clean_through(sim.run_id)
    assert mark[:2] == (0, 24)  # the updates of steps 25 and on are not checked yet
    assert mark.judged >= 58  # but judged: the end of a run waits for this one
