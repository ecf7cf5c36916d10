"""The cost model: which action finishes the run first, on the issue's cases."""

from __future__ import annotations

import pytest

from analysis.costmodel import KEEP, REPLACE, SHRINK, Situation, predict


def situation(**kw) -> Situation:
    base = dict(steps_left=10_000, step_s=1.12, excess_s=0.12, nodes=2, restart_s=60.0, redo_steps=50)
    return Situation(**{**base, **kw})


def test_two_nodes_and_no_spare_keep_rather_than_halve_the_job_to_save_12_percent():
    p = predict(situation())
    assert p.best == KEEP and p.gain_s == 0.0
    assert p.seconds[SHRINK] == pytest.approx(60.0 + 10_050 * 1.0 * 2)  # the node left does both halves
    assert p.seconds[KEEP] == pytest.approx(11_200.0)


def test_with_a_spare_the_node_is_replaced():
    p = predict(situation(nodes=3, spares=1))
    assert p.best == REPLACE
    assert p.gain_s == pytest.approx(11_200.0 - (60.0 + 10_050 * 1.0))


def test_on_64_nodes_shrinking_is_right():
    p = predict(situation(nodes=64))
    assert p.best == SHRINK
    assert p.seconds[SHRINK] == pytest.approx(60.0 + 10_050 * 64 / 63)
    assert p.gain_s > 0.05 * p.seconds[KEEP]


def test_three_steps_before_the_end_keep():
    assert predict(situation(nodes=64, steps_left=3)).best == KEEP


def test_a_slow_down_that_costs_more_than_the_node_does_shrinks_even_two_nodes():
    # a 3x straggler on 2 nodes: every step waits 2 healthy steps for it; one node does both halves in 2
    p = predict(situation(step_s=3.0, excess_s=2.0, redo_steps=5, restart_s=10.0))
    assert p.best == SHRINK and p.gain_s == pytest.approx(30_000 - (10 + 10_005 * 2))


def test_a_bare_win_is_not_worth_a_restart():
    # on 11 nodes shrinking costs 10% a step; a 10.5% straggler gains ~0.5%, below min_gain_share
    p = predict(situation(nodes=11, step_s=1.105, excess_s=0.105, redo_steps=0, restart_s=0.0))
    assert p.seconds[SHRINK] < p.seconds[KEEP] and p.best == KEEP
    assert predict(situation(nodes=11, step_s=1.105, excess_s=0.105, redo_steps=0, restart_s=0.0),
                   min_gain_share=0.0).best == SHRINK


def test_one_node_has_nothing_to_shrink_to_and_the_detail_says_what_was_weighed():
    p = predict(situation(nodes=1))
    assert set(p.seconds) == {KEEP} and p.best == KEEP
    d = predict(situation(nodes=64)).detail(situation(nodes=64))
    assert d["best"] == SHRINK and set(d["seconds"]) == {KEEP, SHRINK} and d["inputs"]["nodes"] == 64
