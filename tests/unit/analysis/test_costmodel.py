"""The cost model: which action finishes the run first, on the issue's cases."""

from __future__ import annotations

import pytest

from analysis.costmodel import (
    KEEP,
    REBALANCE,
    REPLACE,
    SHRINK,
    Situation,
    balanced_shares,
    predict,
    rebalanced_step_s,
    regret_s,
)


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


# -- rebalance in place ------------------------------------------------------------------------------------------


def test_a_15x_straggler_on_two_nodes_is_rebalanced_not_kept_and_not_shrunk():
    """dp 2, 8 micro-batches in the global batch (4 each), the slow replica 1.5x per micro-batch: a
    healthy micro-batch takes 0.12 / (4 x 0.5) = 0.06 s; 3 to the slow one and 5 to the other end
    together at 5 healthy micro-batches' time instead of 6: 0.06 s a step saved, no restart."""
    s = situation(dp=2, micro_batches=8, ratio=1.5)
    assert balanced_shares(8, [1.5, 1.0]) == (3, 5)
    assert rebalanced_step_s(s) == pytest.approx(1.12 - 0.06)
    p = predict(s)
    assert p.best == REBALANCE and p.seconds[REBALANCE] == pytest.approx(10_000 * 1.06)
    assert p.gain_s == pytest.approx(600.0) and p.seconds[SHRINK] > p.seconds[KEEP]


def test_a_rebalance_needs_micro_batches_to_move_and_a_compute_ratio():
    assert rebalanced_step_s(situation(dp=2, micro_batches=2, ratio=1.5)) is None  # 1 each: nothing to move
    assert rebalanced_step_s(situation(dp=1, micro_batches=8, ratio=1.5)) is None  # one replica
    assert rebalanced_step_s(situation(dp=2, micro_batches=8)) is None  # ratio 1: not a compute straggler
    assert REBALANCE not in predict(situation()).seconds


def test_an_8x_straggler_on_two_replicas_of_two_micro_batches_shrinks_rather_than_rebalances():
    """Over a long run the grain is too coarse: the slow replica keeps one micro-batch (8 healthy ones'
    time) while one node doing all 4 takes 4, and the restart is paid once: shrinking wins. With 145
    steps left and a 5 s restart (the e2e straggler scenario's) the restart outweighs it: rebalance."""
    s = situation(step_s=0.9, excess_s=0.7, dp=2, micro_batches=4, ratio=8.0, restart_s=10.0)
    assert balanced_shares(4, [8.0, 1.0]) == (1, 3)
    p = predict(s)
    assert REBALANCE in p.seconds and p.best == SHRINK
    short = predict(situation(steps_left=145, step_s=0.136, excess_s=0.113, dp=2, micro_batches=4, ratio=7.0,
                              restart_s=5.1, redo_steps=15))
    assert short.best == REBALANCE and short.seconds[REBALANCE] < short.seconds[SHRINK]


def test_the_policy_splits_the_micro_batches_as_the_trainer_does():
    """analysis and trainer share no code (DESIGN.md's import rules): the two copies of the rule
    must agree, or the policy would predict one split and the trainer carry out another."""
    from trainer.data import balanced_shares as trainer_shares

    for total in range(2, 17):
        for dp in range(1, min(total, 5) + 1):
            for slow in (1.0, 1.1, 1.3, 1.5, 2.0, 3.0, 8.0):
                for at in range(dp):
                    slowness = [slow if i == at else 1.0 for i in range(dp)]
                    assert balanced_shares(total, slowness) == trainer_shares(total, slowness), (total, slowness)
    assert balanced_shares(8, [1.0, 1.0]) == (4, 4) and balanced_shares(5, [1.0, 1.0]) == (3, 2)


def test_what_an_action_costs_if_the_slow_down_ends_as_it_is_taken():
    """regret_s: a replacement's restart and the steps since the checkpoint run again; a shrink's, and
    the rest of the run on one node fewer; a rebalance's split until its undo; keeping costs nothing."""
    s = Situation(steps_left=1000, step_s=2.0, excess_s=1.0, nodes=4, restart_s=3.0, redo_steps=10, spares=1,
                  dp=4, micro_batches=16, ratio=3.0)
    assert regret_s(s, REPLACE) == pytest.approx(3.0 + 10 * 1.0)
    assert regret_s(s, SHRINK) == pytest.approx(3.0 + 10 * 4 / 3 + 1000 * 1.0 / 3)
    # 4 micro-batches a replica, a healthy one 1.0 / (4 x 2) s; split 1/5/5/5 for 3x: the busiest do one more
    assert balanced_shares(16, [3.0, 1.0, 1.0, 1.0]) == (1, 5, 5, 5)
    assert regret_s(s, REBALANCE, undo_steps=8) == pytest.approx(8 * 0.125 * (5 - 4))
    assert regret_s(s, KEEP) == 0.0
    assert regret_s(Situation(steps_left=10, step_s=1.0, excess_s=0.5, nodes=1, restart_s=3.0), SHRINK) == 0.0
