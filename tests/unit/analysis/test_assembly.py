"""A step is complete when every rank reported it, or a bounded time later; late rows are dropped."""

from analysis.assembly import StepAssembler
from analysis.frames import steps_frame


def rows(step, ranks, loss=2.0, attempt=0):
    return steps_frame([{"run_id": "r", "attempt": attempt, "step": step, "rank": r, "loss": loss, "grad_norm": 1.0,
                         "loss_scale": 1.0, "ts": float(step)} for r in ranks])


def test_complete_when_every_rank_reported_across_commits_and_out_of_order():
    a = StepAssembler(complete_timeout_s=3.0, max_open_steps=64)
    first = a.add(rows(2, [0]), now=0.0)
    assert [(s.step, s.num_rows) for s in first] == [(2, 1)]
    assert a.release(0.0, expected_ranks=2) is None
    a.add(rows(1, [1]), now=0.1)  # an older step from another rank
    assert a.add(rows(2, [1]), now=0.2) == []  # not a first sight any more
    out = a.release(0.2, expected_ranks=2)
    assert out["step"].to_list() == [2, 2] and a.num_open_steps == 1


def test_a_missing_rank_releases_the_step_after_the_timeout_and_late_rows_are_dropped():
    a = StepAssembler(complete_timeout_s=3.0, max_open_steps=64)
    a.add(rows(5, [0, 1]), now=10.0)
    assert a.release(12.9, expected_ranks=3) is None
    out = a.release(13.0, expected_ranks=3)
    assert out.height == 2 and a.num_forced == 1
    assert a.add(rows(5, [2]), now=14.0) == [] and a.num_late_rows == 1
    assert a.release(20.0, expected_ranks=3) is None


def test_too_many_open_steps_release_the_oldest():
    a = StepAssembler(complete_timeout_s=100.0, max_open_steps=2)
    for s in range(1, 5):
        a.add(rows(s, [0]), now=0.0)
    out = a.release(0.0, expected_ranks=2)
    assert sorted(set(out["step"].to_list())) == [1, 2] and a.num_open_steps == 2


def test_first_sights_of_a_commit_of_many_interleaved_steps_are_each_of_its_own_rows():
    """A collector behind its job gets tens of steps in one commit, its rows in any order: each
    step's first sight (loss median, last ts, rows) is of that step's rows alone."""
    import numpy as np
    import polars as pl

    rng = np.random.default_rng(2)
    parts = [rows(s, [0, 1, 2], loss=float(s)) for s in range(1, 31)]
    frame = pl.concat(parts)
    frame = frame[rng.permutation(frame.height).tolist()]
    a = StepAssembler(complete_timeout_s=3.0, max_open_steps=64)
    got = {s.step: (s.loss, s.ts, s.num_rows) for s in a.add(frame, now=0.0)}
    assert got == {s: (float(s), float(s), 3) for s in range(1, 31)}
