"""Excluded steps: a skipped or non-finite step and the few after it say nothing about speed."""

from __future__ import annotations

import math

import polars as pl
import pytest

from analysis.frames import Frames, steps_frame
from analysis.marks import RunMarks
from analysis.topology import Topology


def _row(step: int, rank: int, **kw) -> dict:
    row = {"run_id": "r", "attempt": 0, "step": step, "rank": rank, "ts": float(step), "loss": 2.0,
           "grad_norm": 1.0, "loss_scale": 1.0, "step_s": 0.1, "fwd_s": 0.03, "bwd_s": 0.05, "opt_s": 0.01}
    row.update(kw)
    return row


@pytest.mark.parametrize("skipped_dtype", [pl.Boolean, pl.Int8])  # the table's BOOLEAN, the wire's int8
def test_a_skipped_or_nonfinite_step_and_the_steps_after_it_are_not_judged(skipped_dtype):
    marks = RunMarks(steps_after_start=1, steps_after_checkpoint=0, steps_after_eval=0, steps_after_skip=3)
    rows = [_row(s, r) for s in range(1, 41) for r in (0, 1)]
    rows[2 * (10 - 1) + 1] = _row(10, 1, skipped=True)  # one rank's optimizer step skipped
    rows[2 * (25 - 1)] = _row(25, 0, loss=math.nan)  # a NaN loss, not (yet) marked skipped
    rows[2 * (33 - 1)] = _row(33, 0, loss=None)  # unknown is not odd
    steps = steps_frame(rows).with_columns(pl.col("skipped").cast(skipped_dtype))
    marks.update(Frames(steps=steps), now=0.0)
    topo = Topology()
    excluded = [s for s in range(3, 41) if marks.is_excluded(0, s, topo)]
    assert excluded == [10, 11, 12, 13, 25, 26, 27, 28]


def test_a_rebalanced_step_and_the_steps_around_it_are_not_judged():
    """The split of the global batch changed at step 183: the step before it, it, and steps_after_start after
    it say nothing about a rank's speed (the ranks switch shares at a boundary they reach at different times)."""
    from analysis.frames import events_frame

    marks = RunMarks(steps_after_start=5, steps_after_checkpoint=0, steps_after_eval=0, steps_after_skip=0)
    ev = events_frame([{"run_id": "r", "ts": 1.0, "rank": r, "step": 183, "attempt": 0, "kind": "rebalanced",
                        "data": '{"shares": [3, 3], "previous": [5, 1]}'} for r in (0, 1)])
    marks.update(Frames(events=ev), now=0.0)
    topo = Topology()
    assert [s for s in range(170, 200) if marks.is_excluded(0, s, topo)] == list(range(182, 189))


def test_the_odd_rows_are_the_polars_check_s():
    """`_odd_rows` (numpy on three columns) marks exactly the rows the polars check did: NULL is
    never odd, NaN and inf are, `skipped` as bool or int8 (NULL: not skipped)."""
    import numpy as np

    from analysis.marks import _odd_rows

    rng = np.random.default_rng(7)
    values = [2.0, None, math.nan, math.inf, -math.inf]
    for _ in range(300):
        n = int(rng.integers(1, 5))
        rows = [_row(1, r, loss=values[int(rng.choice(5, p=[.6, .1, .1, .1, .1]))],
                     grad_norm=values[int(rng.choice(5, p=[.6, .1, .1, .1, .1]))],
                     skipped=[False, None, True][int(rng.choice(3, p=[.8, .1, .1]))]) for r in range(n)]
        steps = steps_frame(rows)
        if rng.random() < 0.5:
            steps = steps.with_columns(pl.col("skipped").cast(pl.Int8))
        odd = (~(pl.col("loss").is_finite() & pl.col("grad_norm").is_finite())).fill_null(False) \
            | (pl.col("skipped").cast(pl.Int8) != 0).fill_null(False)
        assert _odd_rows(steps).tolist() == steps.select(odd).to_series().to_list(), rows
