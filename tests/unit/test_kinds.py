"""analysis/kinds.py is the one place incident and action kinds are declared: these tie it
to what emits, decides, carries out and draws them (the detectors, the policy, the
trainer's handlers and supervisor, the dashboard), so that adding a kind without the
rest fails here, naming what is missing."""

from __future__ import annotations

from analysis import kinds, load_rules
from analysis.policy import CHECKPOINT, ISOLATE, REBALANCE, REPAIR, RESTART, ROLLBACK, STOP, Policy
from analysis.registry import build_detectors


def test_the_detectors_emit_exactly_the_incident_kinds():
    emitted = [k for d in build_detectors(load_rules()) for k in d.kinds]
    assert sorted(emitted) == sorted(kinds.INCIDENT_KINDS)


def test_every_incident_kind_has_a_policy_rule_and_every_rule_a_method():
    assert set(Policy.RULES) == set(kinds.RULES)
    for rule, method in Policy.RULES.items():
        assert callable(getattr(Policy, method, None)), (rule, method)
    assert {i.rule for i in kinds.INCIDENTS.values()} <= set(kinds.RULES)
    assert kinds.rule_of("not-a-kind") == "alert"


def test_the_policy_decides_only_registered_actions():
    assert {ROLLBACK, ISOLATE, STOP, RESTART, REPAIR, CHECKPOINT, REBALANCE} == set(kinds.ACTION_KINDS)


def test_the_ranks_handle_exactly_the_actions_carried_by_the_ranks():
    from trainer.control import default_handlers

    by_ranks = {k for k, a in kinds.ACTIONS.items() if a.carried_by == "ranks"}
    assert set(default_handlers()) == by_ranks


def test_the_supervisor_restarts_for_exactly_the_actions_a_restart_ends():
    from trainer.supervisor import RESTART_ACTIONS

    assert set(RESTART_ACTIONS) == set(kinds.ENDED_BY_RESTART)


def test_the_lifecycles_that_decide_when_an_action_is_done():
    assert kinds.DONE_IN_PLACE == {REPAIR, CHECKPOINT, REBALANCE}
    assert kinds.ENDED_BY_RESTART == {ISOLATE, RESTART}
    assert kinds.ACTIONS[ROLLBACK].lifecycle == kinds.NEW_ATTEMPT and kinds.ACTIONS[STOP].lifecycle == kinds.ENDS_RUN


def test_the_costed_kinds_carry_a_per_step_cost_and_wait_for_it_to_persist():
    rules = load_rules()
    assert set(kinds.COSTED) == {"straggler", "slow_link", "data_stall"}
    for kind in kinds.COSTED:  # the policy's persistence keys exist for each
        for key in ("cost_s", "min_share", "persist_s"):
            assert hasattr(rules.policy, f"{kind}_{key}"), (kind, key)


def test_the_dashboard_draws_a_marker_for_every_action_kind():
    from dashboard.pages.incidents import ACTION_SYMBOLS

    assert set(ACTION_SYMBOLS) == set(kinds.ACTION_KINDS)
