"""The healing policy: incidents and verdicts in, decisions out, the clock given."""

from __future__ import annotations

import math

import pytest

from analysis.kinds import DONE_IN_PLACE
from analysis.policy import (
    CHECKPOINT,
    ISOLATE,
    REBALANCE,
    REPAIR,
    RESTART,
    ROLLBACK,
    STOP,
    Decision,
    Policy,
    RunPolicy,
    apply_cost_inputs,
)
from analysis.rules import rules_from_dict


def policy(mode: str | None = None, **over) -> Policy:
    """The default rules with `over` applied: `policy=...`, `loss_spike=...` sections."""
    return Policy(rules_from_dict(over), mode=mode)


def run_state(*nodes: str) -> RunPolicy:
    return RunPolicy(run_id="run-1", nodes=list(nodes))


def incident(id: int, kind: str = "nan", *, step: int | None = 40, rank: int | None = 2, node: str | None = "node1",
             **kw) -> dict:
    return {"id": id, "kind": kind, "step_from": step, "rank": rank, "node": node, "status": "open", **kw}


def kinds(decisions: list[Decision]) -> list[tuple[str, str, str | None]]:
    return [(d.kind, d.mode, d.refused) for d in decisions]


# -- rollbacks ---------------------------------------------------------------------

def test_a_nan_calls_for_a_rollback_to_before_its_first_step():
    [d] = policy().on_incident(run_state(), incident(1), now=0.0)
    assert (d.kind, d.run_id, d.incident_id, d.node, d.rank, d.mode, d.refused) == (
        ROLLBACK, "run-1", 1, "node1", 2, "auto", None)
    assert d.args == {"step": 40, "incident_id": 1, "kind": "nan", "skip_batches": 0, "rank": 2}
    assert d.reason == "nan at step 40 on rank 2"
    assert d.detail() == {"reason": d.reason, "args": d.args}


def test_a_rollback_without_a_rank_names_none_and_skips_what_the_rules_say():
    [d] = policy(policy={"skip_batches": 200}).on_incident(run_state(), incident(1, rank=None), now=0.0)
    assert d.args == {"step": 40, "incident_id": 1, "kind": "nan", "skip_batches": 200}
    assert d.reason == "nan at step 40"


@pytest.mark.parametrize("kind, key, min_ratio, level, value", [
    ("loss_spike", "loss_above", 1.5, 2.0, 8.0),   # bar 3, peak 8: sqrt(3 * 8)
    ("loss_spike", "loss_above", 1.5, 2.0, 2.5),   # a peak under the bar: the bar itself
    ("grad_spike", "grad_norm_above", 2.0, 1.0, 50.0),  # bar 2, peak 50: 10
])
def test_a_spike_reproduces_above_the_midpoint_of_the_bar_and_the_peak(kind, key, min_ratio, level, value):
    p = policy(**{kind: {"min_ratio": min_ratio}}, policy={"rollback_on": ["nan", "loss_spike", "grad_spike"]})
    inc = incident(1, kind, evidence={"peak": {"baseline": level, "value": value}})
    [d] = p.on_incident(run_state(), inc, now=0.0)
    bar = level * min_ratio
    assert d.args[key] == pytest.approx(math.sqrt(bar * max(value, bar)), abs=1e-6)
    assert d.args["kind"] == kind
    assert ("grad_norm_above" if key == "loss_above" else "loss_above") not in d.args


def test_the_spike_thresholds_use_the_default_rules():
    [d] = policy(policy={"rollback_on": ["grad_spike"]}).on_incident(run_state(), incident(1, "grad_spike", evidence={"peak": {"baseline": 1.0,
                                                                                          "value": 50.0}}), 0.0)
    assert d.args["grad_norm_above"] == 10.0  # [grad_spike] min_ratio 2.0


@pytest.mark.parametrize("evidence", [
    None, {}, {"peak": None}, {"peak": {"baseline": 2.0}}, {"peak": {"baseline": 0.0, "value": 5.0}},
    {"peak": {"baseline": "x", "value": 5.0}}, {"peak": {"baseline": 2.0, "value": float("nan")}},
])
def test_a_spike_without_a_usable_peak_has_no_threshold(evidence):
    [d] = policy().on_incident(run_state(), incident(1, "loss_spike", evidence=evidence), now=0.0)
    assert d.kind == ROLLBACK and "loss_above" not in d.args


def test_a_nan_ignores_a_peak():
    [d] = policy().on_incident(run_state(), incident(1, evidence={"peak": {"baseline": 1.0, "value": 9.0}}), 0.0)
    assert "loss_above" not in d.args and "grad_norm_above" not in d.args


def test_the_same_incident_is_decided_once():
    p, st = policy(), run_state()
    assert len(p.on_incident(st, incident(1), now=0.0)) == 1
    assert p.on_incident(st, incident(1), now=100.0) == []


def test_the_kinds_named_are_acted_on_and_a_closed_straggler_is_not():
    p, st = policy(policy={"rollback_on": ["nan"]}), run_state()
    assert p.on_incident(st, {**straggler(0.5, id=1), "status": "closed"}, now=0.0) == []
    assert p.on_incident(st, incident(2, "loss_spike"), now=0.0) == []
    assert p.on_incident(st, incident(3, "something_else"), now=0.0) == []
    assert kinds(p.on_incident(st, incident(4), now=0.0)) == [(ROLLBACK, "auto", None)]


def test_a_nan_whose_incident_closed_in_the_pass_that_opened_it_is_still_rolled_back():
    p, st = policy(), run_state()
    assert kinds(p.on_incident(st, {**incident(1), "status": "closed"}, now=0.0)) == [(ROLLBACK, "auto", None)]


def test_an_incident_without_a_step_is_refused():
    [d] = policy().on_incident(run_state(), incident(1, step=None), now=0.0)
    assert (d.kind, d.refused) == (ROLLBACK, "the incident names no step")


def test_a_second_rollback_within_the_cooldown_waits_for_it():
    p, st = policy(policy={"cooldown_s": 20.0}), run_state()
    assert kinds(p.on_incident(st, incident(1), now=0.0)) == [(ROLLBACK, "auto", None)]
    assert p.on_incident(st, incident(2), now=5.0) == []
    assert p.waiting(st, incident(2), 5.0) and 2 not in st.acted  # not decided: asked again later
    assert kinds(p.on_incident(st, incident(2), now=20.0)) == [(ROLLBACK, "auto", None)]
    assert not p.waiting(st, incident(2), 20.0)
    assert p.on_incident(st, incident(3), now=30.0) == []  # the cooldown runs from the last one issued


def test_past_max_rollbacks_the_run_is_stopped_instead_of_looping():
    p, st = policy(), run_state()  # max_rollbacks 3 within 600 s
    for i, t in enumerate((0.0, 100.0, 200.0), 1):
        assert kinds(p.on_incident(st, incident(i), now=t)) == [(ROLLBACK, "auto", None)]
    rb, stop = p.on_incident(st, incident(4), now=300.0)
    assert rb.kind == ROLLBACK and rb.refused.startswith("3 rollbacks within 600 s (max_rollbacks 3)")
    assert (stop.kind, stop.mode, stop.refused, stop.incident_id) == (STOP, "auto", None, 4)
    assert stop.args == {"reason": rb.refused}
    assert p.on_incident(st, incident(5), now=701.0) == []  # the run is being stopped: nothing after it
    # the window slides: the first rollback is older than 600 s at 701
    p, st = policy(), run_state()
    for i, t in enumerate((0.0, 100.0, 200.0, 701.0), 1):
        assert kinds(p.on_incident(st, incident(i), now=t)) == [(ROLLBACK, "auto", None)]


def data_verdict(kind: str = "loss_spike", step: int = 40, id: int = 1) -> dict:
    return {"verdict": "data", "incident_id": id, "incident_kind": kind, "rank": None,
            "probe": {"kind": kind, "step": step}, "evidence": "reproduced with a single replica"}


def test_a_rollback_that_comes_back_after_its_skip_stops_the_run():
    """A spike that is the optimizer's, not the data's: rolled back, its samples skipped (a data
    verdict), and it spikes again three steps later. Another rollback would loop until
    max_rollbacks; the run is stopped with the reason at once."""
    p, st = policy(), run_state()
    assert kinds(p.on_incident(st, incident(1, "loss_spike", opened_ts=0.0), now=0.0)) == [(ROLLBACK, "auto", None)]
    assert p.on_verdict(st, data_verdict(), None, now=2.0) == []
    rb, stop = p.on_incident(st, incident(2, "loss_spike", step=43, opened_ts=9.0), now=9.0)
    assert rb.kind == ROLLBACK and rb.refused.startswith("loss_spike at step 43 came back 3 step(s) after the samples "
                                                         "of step 40 were skipped")
    assert (stop.kind, stop.mode, stop.refused, stop.incident_id, stop.args) == (STOP, "auto", None, 2,
                                                                                   {"reason": rb.refused})
    assert not p.waiting(st, incident(3, "loss_spike", step=44, opened_ts=2.5), now=2.5)  # inside the cooldown: now


def test_a_recurrence_counts_from_when_the_verdict_was_reached_not_when_it_was_read():
    """Seen in CI: the collector read the verdict (at 3.0) after it had opened the recurring spike
    (at 2.5), which the trainer reached after the verdict (at 2.0): still a recurrence."""
    p, st = policy(), run_state()
    p.on_incident(st, incident(1, "loss_spike", opened_ts=0.0), now=0.0)
    p.on_verdict(st, data_verdict(), None, now=3.0, at=2.0)
    rb, stop = p.on_incident(st, incident(2, "loss_spike", step=43, opened_ts=2.5), now=3.0)
    assert rb.refused is not None and stop.kind == STOP


@pytest.mark.parametrize("second", [
    incident(2, "loss_spike", step=70, opened_ts=9.0),  # well after the skip: a new spike
    incident(2, "nan", step=43, opened_ts=9.0),  # another kind
    incident(2, "loss_spike", step=43, opened_ts=1.0),  # opened before the verdict: the old attempt's
], ids=["later", "other-kind", "before-the-verdict"])
def test_what_is_not_a_recurrence_is_rolled_back(second):
    p, st = policy(), run_state()
    p.on_incident(st, incident(1, "loss_spike", opened_ts=0.0), now=0.0)
    p.on_verdict(st, data_verdict(), None, now=2.0)
    assert kinds(p.on_incident(st, second, now=9.0)) == [(ROLLBACK, "auto", None)]


def test_recur_within_steps_0_leaves_recurrences_to_max_rollbacks():
    p, st = policy(policy={"recur_within_steps": 0}), run_state()
    p.on_incident(st, incident(1, "loss_spike", opened_ts=0.0), now=0.0)
    p.on_verdict(st, data_verdict(), None, now=2.0)
    assert kinds(p.on_incident(st, incident(2, "loss_spike", step=43, opened_ts=9.0), now=9.0)) == [
        (ROLLBACK, "auto", None)]


def test_shadowed_rollbacks_never_stop_the_run_for_real():
    p, st = policy(policy={"rollback_mode": "shadow"}), run_state()
    for i, t in enumerate((0.0, 100.0, 200.0), 1):
        assert kinds(p.on_incident(st, incident(i), now=t)) == [(ROLLBACK, "shadow", None)]
    rb, stop = p.on_incident(st, incident(4), now=300.0)
    assert rb.refused is not None
    assert (stop.kind, stop.mode) == (STOP, "shadow")  # what it would have done, not done


# -- modes ---------------------------------------------------------------------------

def test_shadow_records_and_off_does_nothing():
    assert kinds(policy("shadow").on_incident(run_state(), incident(1), now=0.0)) == [(ROLLBACK, "shadow", None)]
    assert policy("off").on_incident(run_state(), incident(1), now=0.0) == []
    assert policy("off").on_incident(run_state(), incident(1, "hang"), now=0.0) == []


def test_a_run_caps_the_mode_it_is_acted_on_in():
    shadowed = run_state()
    shadowed.mode_cap = "shadow"  # llmwatch-instrument's job: decided and recorded, never sent
    assert kinds(policy("auto").on_incident(shadowed, incident(1), now=0.0)) == [(ROLLBACK, "shadow", None)]
    off = run_state()
    off.mode_cap = "off"
    assert policy("auto").on_incident(off, incident(1), now=0.0) == []
    assert policy("off").on_incident(shadowed, incident(2), now=0.0) == []  # a cap never raises the mode


def test_the_flag_overrides_the_rules_mode():
    p = policy("auto", policy={"mode": "shadow"})
    assert kinds(p.on_incident(run_state(), incident(1), now=0.0)) == [(ROLLBACK, "auto", None)]
    assert policy(policy={"mode": "shadow"}).mode == "shadow"
    with pytest.raises(ValueError, match="policy mode 'loud'"):
        policy("loud")


def test_per_action_modes():
    p = policy(policy={"rollback_mode": "off", "isolate_mode": "shadow"})
    st = run_state()
    assert p.on_incident(st, incident(1), now=0.0) == []
    [d] = p.on_incident(st, incident(2, "hang"), now=0.0)
    assert (d.kind, d.mode, d.node) == (ISOLATE, "shadow", "node1")
    assert st.isolated == set()  # a shadow isolation does not take the node out
    assert p.mode_of(RESTART) == "auto" and p.mode_of(STOP) == "auto"
    assert policy("off", policy={"rollback_mode": "auto"}).mode_of(ROLLBACK) == "off"  # off is off
    assert policy("shadow", policy={"isolate_mode": "auto"}).mode_of(ISOLATE) == "auto"


# -- verdicts ------------------------------------------------------------------------

def test_a_device_verdict_isolates_its_node():
    p, st = policy(), run_state("node0", "node1")
    [d] = p.on_verdict(st, {"verdict": "device", "incident_id": 5, "rank": 2, "evidence": "it stayed"}, "node1",
                       now=0.0)
    assert (d.kind, d.node, d.rank, d.incident_id, d.mode, d.refused) == (ISOLATE, "node1", 2, 5, "auto", None)
    assert d.reason == "device: it stayed"
    assert d.args == {"node": "node1", "reason": "device: it stayed", "incident_id": 5}
    assert st.isolated == {"node1"}
    assert p.on_verdict(st, {"verdict": "device", "incident_id": 6}, "node1", now=1.0) == []  # already out


def test_a_device_that_cannot_be_isolated_stops_the_run():
    """min_nodes refuses the isolation: the device fails every step whatever its data, and each
    rollback would replay into it (the e2e run rolled back until max_rollbacks stopped it)."""
    p, st = policy(policy={"min_nodes": 2}), run_state("node0", "node1")
    iso, stop = p.on_verdict(st, {"verdict": "device", "incident_id": 5, "rank": 1}, "node1", now=0.0)
    assert (iso.kind, iso.refused) == (ISOLATE, "min_nodes: isolating node1 would leave 1 healthy node(s), fewer than 2")
    assert (stop.kind, stop.mode, stop.refused, stop.incident_id) == (STOP, "auto", None, 5)
    assert stop.reason.startswith("device: rank 1 on node1 fails whatever its data, and its isolation was refused")
    assert p.on_incident(st, incident(6, step=31, node="node1"), now=10.0) == []  # stopping: no rollback into it
    shadowed, st = policy(policy={"min_nodes": 2, "isolate_mode": "shadow"}), run_state("node0", "node1")
    iso, stop = shadowed.on_verdict(st, {"verdict": "device", "incident_id": 5, "rank": 1}, "node1", now=0.0)
    assert (iso.mode, stop.mode) == ("shadow", "shadow")
    assert kinds(shadowed.on_incident(st, incident(6, step=31, node="node1"), now=10.0)) == [(ROLLBACK, "auto", None)]


def test_a_data_verdict_or_one_without_a_node_does_nothing():
    p, st = policy(), run_state()
    assert p.on_verdict(st, {"verdict": "data", "incident_id": 5}, "node1", now=0.0) == []
    assert p.on_verdict(st, {"verdict": "device", "incident_id": 5}, None, now=0.0) == []


def test_transients_within_the_window_isolate_the_node():
    p, st = policy(), run_state()  # transient_limit 2 within 3600 s
    assert p.on_verdict(st, {"verdict": "transient", "incident_id": 1}, "node1", now=0.0) == []
    assert p.on_verdict(st, {"verdict": "transient", "incident_id": 2}, "node0", now=10.0) == []  # another node
    [d] = p.on_verdict(st, {"verdict": "transient", "incident_id": 3}, "node1", now=3000.0)
    assert (d.kind, d.node) == (ISOLATE, "node1")
    assert d.reason == "2 transient faults within 3600 s"


def test_transients_outside_the_window_do_not():
    p, st = policy(), run_state()
    assert p.on_verdict(st, {"verdict": "transient", "incident_id": 1}, "node1", now=0.0) == []
    assert p.on_verdict(st, {"verdict": "transient", "incident_id": 2}, "node1", now=4000.0) == []
    assert len(st.transients["node1"]) == 1
    p = policy(policy={"transient_limit": 3})
    st = run_state()
    assert [len(p.on_verdict(st, {"verdict": "transient", "incident_id": i}, "node1", now=float(i)))
            for i in range(3)] == [0, 0, 1]


# -- stragglers, hangs, crashes -----------------------------------------------------------

def straggler(cost: float | None, id: int = 7) -> dict:
    return incident(id, "straggler", step=None, evidence={"cost_s_per_step": cost})


def test_a_cheap_straggler_is_left_alone():
    p, st = policy(policy={"straggler_cost_s": 0.02}), run_state()  # 0.02 s/step for 4 s
    assert p.on_incident(st, straggler(0.01), now=0.0) == []
    assert p.on_incident(st, straggler(0.01), now=100.0) == []
    assert p.on_incident(st, straggler(None), now=200.0) == []


def test_a_costly_straggler_is_isolated_once_it_persists():
    p, st = policy(), run_state()
    assert p.on_incident(st, straggler(0.05), now=0.0) == []
    assert p.on_incident(st, straggler(0.05), now=3.9) == []
    [d] = p.on_incident(st, straggler(0.05), now=4.0)
    assert (d.kind, d.node, d.incident_id) == (ISOLATE, "node1", 7)
    assert d.reason.startswith("straggler: rank 2 costs 0.05 s/step for 4.0 s")
    assert p.on_incident(st, straggler(0.05), now=10.0) == []


def costed(cost: float, step_s: float, id: int = 7, ratio: float | None = None) -> dict:
    evidence = {"cost_s_per_step": cost, "step_s": step_s, "share_of_step": cost / step_s}
    if ratio is not None:  # the straggler's own (its rank 2's) and the incident's
        evidence.update(compute_ratio=ratio, per_rank={"2": {"compute_ratio": ratio}})
    return incident(id, "straggler", step=None, evidence=evidence)


def weighed(nodes: int, *, cost: float, step_s: float = 1.0, reached: int = 100, total: int | None = 10_100,
            ckpt: int | None = 90, startup_s: float | None = 30.0, persist_steps: int | None = None,
            spares: int = 0, min_nodes: int | None = None, weigh_cost: bool = True, dp: int = 0,
            micro_batches: int = 0, ratio: float | None = None, rebalance: bool = True):
    """The decision for a straggler that persisted 4 s and 20 steps on a run of `nodes` nodes
    (`dp` replicas of the global batch's `micro_batches`, the rank `ratio` x slower per micro-batch)."""
    over = {"persist_steps": persist_steps} if persist_steps is not None else {}
    if not rebalance:
        over["rebalance"] = False
    if min_nodes is not None:
        over["min_nodes"] = min_nodes
    if not weigh_cost:
        over["weigh_cost"] = False
    p, st = policy(policy=over), run_state(*(f"node{i}" for i in range(nodes)))
    st.reached, st.steps_total, st.ckpt_step, st.startup_s = reached, total, ckpt, startup_s
    apply_cost_inputs(st, {"steps_total": total, "startup_s": startup_s, "ckpt_steps": [ckpt] if ckpt else [],
                           "spares": [f"node{nodes + i}" for i in range(spares)], "dp": dp,
                           "micro_batches": micro_batches})
    assert p.on_incident(st, costed(cost, step_s, ratio=ratio), now=0.0) == []
    st.reached += 20
    return p.on_incident(st, costed(cost, step_s, ratio=ratio), now=4.0), st


def test_on_two_nodes_a_straggler_costing_12_percent_is_kept_not_shrunk_to_half():
    out, _ = weighed(2, cost=0.12, step_s=1.12)
    assert out == []  # shrinking would double the step: the incident stays an alert


def test_without_the_cost_model_a_straggler_that_persisted_always_has_its_node_isolated():
    [d], _ = weighed(2, cost=0.12, step_s=1.12, weigh_cost=False)  # the rule before the model: no prediction
    assert (d.kind, d.node, d.refused, d.predicted) == (ISOLATE, "node1", None, {})


def test_on_64_nodes_the_straggler_node_is_isolated_with_the_gain_it_predicts():
    [d], st = weighed(64, cost=0.12, step_s=1.12)
    assert (d.kind, d.node, d.refused) == (ISOLATE, "node1", None)
    assert d.predicted["best"] == "shrink" and d.predicted["gain_s"] > 0
    assert d.predicted["inputs"] == {"steps_left": 9980, "step_s": 1.12, "excess_s": 0.12, "nodes": 64,
                                     "restart_s": 35.0, "redo_steps": 30, "spares": 0,  # start-up + overhead
                                     "dp": 0, "micro_batches": 0, "ratio": 1.0}  # not known: no rebalance
    assert "the job finishes ~" in d.reason and "sooner without its node (shrink)" in d.reason
    assert d.detail()["predicted"] == d.predicted


def test_on_two_nodes_with_a_spare_the_straggler_node_is_replaced_and_min_nodes_allows_it():
    """A spare (the launcher's --spare-nodes, listed by the collector) takes the node's place:
    the job keeps its size, so a 12% straggler that shrinking would not pay for is worth a
    restart; min_nodes 2 does not refuse it (two nodes stay). The spare is then spent."""
    [d], st = weighed(2, cost=0.12, step_s=1.12, spares=1, min_nodes=2)
    assert (d.kind, d.node, d.refused) == (ISOLATE, "node1", None)
    assert d.predicted["best"] == "replace" and d.predicted["inputs"]["spares"] == 1
    assert "with a spare in its node's place (replace)" in d.reason
    assert st.spares == 0
    [refused], _ = weighed(2, cost=2.0, step_s=3.0, min_nodes=2)  # no spare: shrinking pays, but leaves one node
    assert refused.refused.startswith("min_nodes")


def test_a_spare_as_slow_in_the_same_place_stops_the_run_instead_of_looping():
    """node1 (rank 2) was replaced by a spare for its straggler; a straggler at rank 2 again, now
    on node2, is the place's (its data, stage or links), not the node's: the run stops with the
    reason rather than spending spares, or shrinking, on it. A straggler elsewhere is weighed."""
    p = policy()
    [d], st = weighed(4, cost=0.12, step_s=1.12, spares=1)
    assert d.predicted["best"] == "replace" and st.replaced == {("straggler", 2): "node1"}
    again = incident(8, "straggler", step=None, node="node2", evidence={"cost_s_per_step": 0.12, "step_s": 1.12,
                                                                        "share_of_step": 0.11})
    assert p.on_incident(st, again, now=10.0) == []  # it must persist first, as any slow-down
    st.reached += 20
    [stop] = p.on_incident(st, again, now=14.0)
    assert (stop.kind, stop.mode, stop.refused, stop.node) == (STOP, "auto", None, "node2")
    assert "node2 took node1's place and is as slow there" in stop.reason and "stopping the run" in stop.reason
    elsewhere = incident(9, "straggler", step=None, rank=5, node="node3",  # costly enough to shrink for
                         evidence={"cost_s_per_step": 2.0, "step_s": 3.0, "share_of_step": 0.67})
    _, st2 = weighed(4, cost=0.12, step_s=1.12, spares=1)
    assert p.on_incident(st2, elsewhere, now=10.0) == []
    st2.reached += 20
    assert [x.kind for x in p.on_incident(st2, elsewhere, now=20.0)] == [ISOLATE]


def test_on_two_nodes_a_15x_straggler_has_its_replica_rebalanced_and_undone_when_it_recovers():
    """dp 2 with 8 micro-batches in the global batch: a 1.5x straggler costing 12% is not worth halving
    the job for, but moving micro-batches off its replica is (no restart): a `rebalance` with its rank
    and ratio. While it holds, the open incident is not weighed again; once it closes, a rebalance back
    to the job's own split (ratio 1) undoes it."""
    p = policy()
    [d], st = weighed(2, cost=0.12, step_s=1.12, dp=2, micro_batches=8, ratio=1.5)
    assert (d.kind, d.mode, d.refused, d.node, d.rank) == (REBALANCE, "auto", None, "node1", 2)
    assert d.args == {"rank": 2, "ratio": 1.5, "incident_id": 7}
    assert d.predicted["best"] == "rebalance" and d.predicted["gain_s"] > 0
    assert (d.predicted["inputs"]["dp"], d.predicted["inputs"]["micro_batches"]) == (2, 8)
    assert "moved to the others (rebalance, 1.50x slower per micro-batch)" in d.reason
    assert st.rebalanced == {7: 2}
    st.reached += 40
    assert p.on_incident(st, costed(0.12, 1.06, ratio=1.5), now=30.0) == []  # open, rebalanced: nothing more
    closed = {**costed(0.12, 1.06, ratio=1.5), "status": "resolved"}
    [undo] = p.on_incident(st, closed, now=40.0)
    assert (undo.kind, undo.args) == (REBALANCE, {"rank": 2, "ratio": 1.0, "incident_id": 7, "undo": True})
    assert "the rebalance undone" in undo.reason and st.rebalanced == {}
    assert p.on_incident(st, closed, now=41.0) == []  # once


def test_a_rebalanced_straggler_that_gets_much_slower_is_split_again_or_its_node_replaced():
    """Rebalanced for 1.5x (healthy step 1.0 s: 4 micro-batches of 0.25 s a replica), rank 2 goes to 4x: under
    the split in force (3 of 8 micro-batches) its step is 3 s. Weighed again once that persisted: a split for
    4x (1 of 8: 1.75 s a step) beats going on at 3 s and shrinking 2 nodes to 1 (2 s); with a spare, replacing
    its node (the healthy 1 s step after a restart) beats all. At 12x shrinking beats a split (2 s against 3).
    A modest change (1.6x) is not weighed again."""
    def worse(ratio, step_s):  # the straggler's excess at an even share: 4 micro-batches x 0.25 s x (ratio - 1)
        return costed(4 * 0.25 * (ratio - 1), step_s, ratio=ratio)

    for spares, kind, best in ((0, REBALANCE, "rebalance"), (1, ISOLATE, "replace")):
        p = policy()
        [d], st = weighed(2, cost=0.12, step_s=1.12, dp=2, micro_batches=8, ratio=1.5)
        assert d.kind == REBALANCE and st.rebalance_basis[7][0] == 1.5
        st.spares = spares  # a standby came since (a torchrun agent joined the rendezvous's redundancy list)
        assert p.on_incident(st, worse(1.6, 1.1), now=10.0) == []  # under rebalance_retune: not weighed
        assert p.on_incident(st, worse(1.6, 1.1), now=20.0) == [] and st.worse_since == {}
        assert p.on_incident(st, worse(4.0, 3.0), now=30.0) == []  # it must persist first
        st.reached += 20
        [e] = p.on_incident(st, worse(4.0, 3.0), now=35.0)
        assert (e.kind, e.mode, e.refused, e.predicted["best"]) == (kind, "auto", None, best), e
        assert e.predicted["rebalanced_from"] == 1.5 and "got slower under its rebalance (4.00x" in e.reason
        assert e.predicted["seconds"]["keep"] == pytest.approx(3.0 * e.predicted["inputs"]["steps_left"])
        if kind == REBALANCE:
            assert e.args == {"rank": 2, "ratio": 4.0, "incident_id": 7} and st.rebalance_basis[7][0] == 4.0
            assert e.predicted["seconds"]["rebalance"] < e.predicted["seconds"]["shrink"]
            st.reached += 20  # then 12x: one node doing all 8 micro-batches beats any split
            assert p.on_incident(st, worse(12.0, 9.0), now=40.0) == []
            st.reached += 20
            [e2] = p.on_incident(st, worse(12.0, 9.0), now=45.0)
            assert (e2.kind, e2.node, e2.predicted["best"]) == (ISOLATE, "node1", "shrink") and st.rebalanced == {}
        else:
            assert e.node == "node1" and st.rebalanced == {} and st.replaced == {("straggler", 2): "node1"}
            closed = {**worse(4.0, 3.0), "status": "resolved"}
            assert p.on_incident(st, closed, now=60.0) == []  # the restart went back to the job's split


def test_one_rebalance_at_a_time_and_none_without_the_rules_key_or_in_shadow():
    p = policy()
    [d], st = weighed(2, cost=0.12, step_s=1.12, dp=2, micro_batches=8, ratio=1.5)
    assert d.kind == REBALANCE
    other = costed(0.12, 1.12, id=8, ratio=1.5)  # another straggler while the first's split holds
    assert p.on_incident(st, other, now=10.0) == []
    st.reached += 20
    assert p.on_incident(st, other, now=20.0) == []  # kept: the split names one slow replica
    assert weighed(2, cost=0.12, step_s=1.12, dp=2, micro_batches=8, ratio=1.5, rebalance=False)[0] == []
    shadow = policy(mode="shadow")
    st2 = run_state("node0", "node1")
    st2.reached, st2.steps_total, st2.ckpt_step, st2.startup_s, st2.dp, st2.micro_batches = 100, 10_100, 90, 30.0, 2, 8
    assert shadow.on_incident(st2, costed(0.12, 1.12, ratio=1.5), now=0.0) == []
    st2.reached += 20
    [s] = shadow.on_incident(st2, costed(0.12, 1.12, ratio=1.5), now=4.0)
    assert (s.kind, s.mode) == (REBALANCE, "shadow") and st2.rebalanced == {}  # nothing to undo later


def test_a_straggler_near_the_end_of_the_run_is_kept():
    out, _ = weighed(64, cost=0.12, step_s=1.12, total=123)  # 3 steps left
    assert out == []


def test_a_measured_restart_replaces_the_prior_and_an_open_ended_run_has_a_horizon():
    p, st = policy(), run_state(*(f"node{i}" for i in range(8)))
    st.reached, st.ckpt_step, st.startup_s = 100, 100, None  # no start-up known
    st.steps_total = None  # open-ended: horizon_steps (1000) left
    assert p._situation(st, {"step_s": 1.0}, 0.5).restart_s == p.cfg.restart_prior_s
    assert p._situation(st, {"step_s": 1.0}, 0.5).steps_left == 1000
    st.restart_costs = [4.0, 6.0]
    assert p._situation(st, {"step_s": 1.0}, 0.5).restart_s == 5.0
    assert p._situation(st, {}, 0.5) is None  # no step time: the thresholds alone decide


def test_a_spare_that_took_a_nodes_place_counts_among_the_nodes_the_model_weighs():
    """4 nodes and a spare: node2 isolated and replaced. The cost inputs then list the spare (node4)
    among the nodes that hold ranks, and a later slow-down is weighed on 4 healthy nodes, not 3 (the
    bench's slow link was kept 35 s longer, weighed as a shrink of 3 nodes to 2)."""
    p, st = policy(), run_state(*(f"node{i}" for i in range(4)))
    apply_cost_inputs(st, {"nodes": [f"node{i}" for i in range(4)], "spares": ["node4"]})
    st.isolated.add("node2")
    apply_cost_inputs(st, {"nodes": ["node0", "node1", "node2", "node3", "node4"], "spares": []})
    assert p._situation(st, {"step_s": 1.0}, 0.5).nodes == 4 and st.spares == 0


def test_persistence_counts_steps_as_well_as_seconds():
    p, st = policy(), run_state(*(f"node{i}" for i in range(64)))
    st.reached, st.steps_total, st.ckpt_step, st.startup_s = 100, 10_100, 90, 30.0
    assert p.on_incident(st, costed(0.5, 1.5), now=0.0) == []
    st.reached += 3  # 10 s but 3 steps: a slow job's seconds are few steps
    assert p.on_incident(st, costed(0.5, 1.5), now=10.0) == []
    st.reached += 5
    [d] = p.on_incident(st, costed(0.5, 1.5), now=11.0)
    assert d.kind == ISOLATE and "for 11.0 s (8 steps)" in d.reason


def test_a_slow_down_is_acted_on_once_it_has_cost_what_its_action_would_cost_if_it_ended():
    """The ski-rental rule (costmodel.regret_s): a 4x slow-down (3 of every 4 s lost) on 4 nodes with a
    spare and a measured 1.5 s restart, the checkpoint at the step reached: replacing the node costs 1.5 s
    were the slowness to end then, so it is replaced after 2 s watched, not the rules' 4 s. The same
    slow-down weighed for a shrink (no spare: the rest of the run on 3 nodes) waits the whole 4 s."""
    def watch(spares: int) -> list[tuple[float, list[Decision]]]:
        p, st = policy(), run_state(*(f"node{i}" for i in range(4)))
        apply_cost_inputs(st, {"steps_total": 10_100, "startup_s": 30.0, "ckpt_steps": [100],
                               "spares": [f"node{4 + i}" for i in range(spares)], "restart_costs": [1.5]})
        st.reached, out = 100, []
        for now in (0.0, 1.0, 1.9, 2.1, 3.9, 4.1):
            st.reached += 10
            st.ckpt_step = st.reached
            out.append((now, p.on_incident(st, costed(3.0, 4.0), now=now)))
        return out

    acted = [(now, d) for now, ds in watch(1) for d in ds]
    [(now, d)] = acted
    assert now == 2.1 and d.predicted["best"] == "replace", d.predicted
    assert (d.predicted["wait_s"], d.predicted["watched_s"]) == (2.0, 2.1)
    acted = [(now, d) for now, ds in watch(0) for d in ds]
    [(now, d)] = acted
    assert now == 4.1 and d.predicted["best"] == "shrink" and d.predicted["wait_s"] == 4.0


def test_the_run_is_watched_while_a_slow_down_waits_for_its_action():
    """Policy.watching: while a costly slow-down is watched an action may come any moment (the collector
    then has the run's rank 0 fetch its commands more often), and while a rebalance is in force (its undo);
    not before, nor once it was acted on."""
    p, st = policy(), run_state()
    assert not p.watching(st)
    assert p.on_incident(st, straggler(0.05), now=0.0) == [] and p.watching(st)
    assert p.on_incident(st, straggler(0.05), now=4.0) and not p.watching(st)
    [d], st = weighed(2, cost=0.12, step_s=1.12, dp=2, micro_batches=8, ratio=1.5)
    assert d.kind == REBALANCE and p.watching(st)  # its undo comes the moment the incident closes
    [undo] = p.on_incident(st, {**costed(0.12, 1.06, ratio=1.5), "status": "resolved"}, now=40.0)
    assert undo.kind == REBALANCE and not p.watching(st)


def test_a_straggler_that_recovers_starts_over():
    p, st = policy(policy={"straggler_cost_s": 0.02}), run_state()
    assert p.on_incident(st, straggler(0.05), now=0.0) == []
    assert p.on_incident(st, straggler(0.01), now=3.0) == []  # cheap again: the clock restarts
    assert p.on_incident(st, straggler(0.05), now=5.0) == []
    assert p.on_incident(st, straggler(0.05), now=8.0) == []
    assert kinds(p.on_incident(st, straggler(0.05), now=9.0)) == [(ISOLATE, "auto", None)]


def test_a_hang_isolates_the_culprits_node():
    p, st = policy(), run_state()
    [d] = p.on_incident(st, incident(1, "hang", step=None, rank=3, node="node2"), now=0.0)
    assert (d.kind, d.node, d.rank) == (ISOLATE, "node2", 3)
    assert d.reason == "hang: rank 3 stopped entering collectives"
    assert policy(policy={"isolate_on_hang": False}).on_incident(run_state(), incident(1, "hang"), 0.0) == []
    [d] = policy().on_incident(run_state(), incident(2, "hang", node=None), now=0.0)
    assert (d.kind, d.refused) == (ISOLATE, "no node to isolate")


def test_a_first_crash_restarts_and_a_second_on_the_node_isolates_it():
    p, st = policy(), run_state("node0", "node1", "node2")
    [d] = p.on_incident(st, incident(1, "crash", step=None), now=0.0)
    assert (d.kind, d.node, d.refused, d.mode) == (RESTART, "node1", None, "auto")
    assert kinds(p.on_incident(st, incident(2, "crash", step=None, node="node2"), now=1.0)) == [
        (RESTART, "auto", None)]  # another node's first; no cooldown on restarts
    [d] = p.on_incident(st, incident(3, "crash", step=None), now=2.0)
    assert (d.kind, d.node) == (ISOLATE, "node1") and d.reason == "crash #2 on node1"
    assert st.isolated == {"node1"}
    [d] = p.on_incident(st, incident(4, "crash", step=None, node=None), now=3.0)
    assert d.kind == RESTART and d.node is None


def test_restarts_that_make_no_progress_stop_the_run():
    """A job that crashes where it crashed before (a software bug): two restarts in a row that got
    it no further than it was before them, and the third crash stops the run. A restart after
    which it went further resets the count."""
    p, st = policy(policy={"crashes_to_isolate": 9}), run_state("node0", "node1", "node2")
    st.reached = 29
    assert kinds(p.on_incident(st, incident(1, "crash", step=None), now=0.0)) == [(RESTART, "auto", None)]
    assert kinds(p.on_incident(st, incident(2, "crash", step=None), now=1.0)) == [(RESTART, "auto", None)]
    out = p.on_incident(st, incident(3, "crash", step=None, node="node2"), now=2.0)
    assert kinds(out)[0][:2] == (RESTART, "auto") and out[0].refused.startswith("2 restart(s) in a row made no")
    assert out[1].kind == STOP and out[1].mode == "auto" and "the run got no further than step 29" in out[1].reason
    assert out[1].node == "node2" and st.stopping

    p, st = policy(policy={"crashes_to_isolate": 9}), run_state("node0", "node1")
    st.reached = 29
    p.on_incident(st, incident(1, "crash", step=None), now=0.0)
    st.reached = 35  # the restart got the job past where it had been
    p.on_incident(st, incident(2, "crash", step=None), now=1.0)
    assert kinds(p.on_incident(st, incident(3, "crash", step=None), now=2.0)) == [(RESTART, "auto", None)]
    assert kinds(p.on_incident(st, incident(4, "crash", step=None), now=3.0))[-1] == (STOP, "auto", None)


def test_isolations_count_as_restarts_and_without_a_watermark_nothing_stops():
    p, st = policy(), run_state("node0", "node1", "node2")  # crashes_to_isolate 2
    st.reached = 10
    assert kinds(p.on_incident(st, incident(1, "crash", step=None), now=0.0)) == [(RESTART, "auto", None)]
    assert kinds(p.on_incident(st, incident(2, "crash", step=None), now=1.0)) == [(ISOLATE, "auto", None)]
    # the same crash now on the node that took over its rank: two restarts, no progress
    assert [d.kind for d in p.on_incident(st, incident(3, "crash", step=None, node="node2"), now=2.0)] == [
        RESTART, STOP]
    p, st = policy(policy={"crashes_to_isolate": 9}), run_state("node0", "node1")  # reached None
    for i in range(4):
        assert kinds(p.on_incident(st, incident(i, "crash", step=None), now=float(i))) == [(RESTART, "auto", None)]
    p, st = policy(policy={"crashes_to_isolate": 9, "restarts_without_progress": 0}), run_state("node0")
    st.reached = 5
    for i in range(4):
        assert kinds(p.on_incident(st, incident(i, "crash", step=None), now=float(i))) == [(RESTART, "auto", None)]


def test_isolation_never_leaves_fewer_than_min_nodes():
    p, st = policy(policy={"min_nodes": 2}), run_state("node0", "node1", "node2")
    assert kinds(p.on_incident(st, incident(1, "hang", node="node1"), now=0.0)) == [(ISOLATE, "auto", None)]
    [d] = p.on_incident(st, incident(2, "hang", node="node2"), now=1.0)
    assert d.refused == "min_nodes: isolating node2 would leave 1 healthy node(s), fewer than 2"
    assert st.isolated == {"node1"}
    # without the run's node list there is nothing to count against
    assert kinds(p.on_incident(run_state(), incident(3, "hang"), now=0.0)) == [(ISOLATE, "auto", None)]


def test_a_finished_run_gets_nothing():
    p, st = policy(), run_state()
    p.on_finished(st)
    assert p.on_incident(st, incident(1), now=0.0) == []
    assert p.on_incident(st, incident(2, "crash"), now=0.0) == []
    assert p.on_verdict(st, {"verdict": "device", "incident_id": 1}, "node1", now=0.0) == []


def test_an_isolated_nodes_incidents_get_no_rollback():
    p, st = policy(), run_state()
    st.isolated.add("node1")
    assert p.on_incident(st, incident(1), now=0.0) == []
    assert kinds(p.on_incident(st, incident(2, node="node0"), now=0.0)) == [(ROLLBACK, "auto", None)]


def test_a_straggler_costing_a_small_share_of_its_step_is_host_noise_not_a_node_to_lose():
    p, st = policy(), run_state()
    noisy = incident(9, "straggler", step=None, evidence={"cost_s_per_step": 0.05, "share_of_step": 0.03})
    assert p.on_incident(st, noisy, now=0.0) == [] and p.on_incident(st, noisy, now=100.0) == []
    real = {**noisy, "evidence": {"cost_s_per_step": 0.05, "share_of_step": 0.2}}
    assert p.on_incident(st, real, now=100.0) == []
    [d] = p.on_incident(st, real, now=105.0)
    assert d.kind == "isolate" and "20% of its step" in d.reason


def test_a_nan_naming_no_rank_waits_for_its_culprit_then_goes_without():
    p, st = policy(), run_state()  # nan_settle_s 1
    early = incident(5, rank=None, node=None, opened_ts=100.0)
    assert p.on_incident(st, early, now=100.2) == [] and p.settling(early, 100.2)
    named = {**early, "rank": 1, "node": "node1"}  # the culprit's rows came in: the incident names it
    [d] = p.on_incident(st, named, now=100.4)
    assert d.args["rank"] == 1 and not p.settling(named, 100.4)
    late = incident(6, rank=None, node=None, opened_ts=200.0)
    [d] = p.on_incident(run_state(), late, now=201.5)  # it never came: decided without one
    assert d.kind == ROLLBACK and "rank" not in d.args


def test_a_lone_grad_spike_is_an_alert_not_a_rollback_by_default():
    assert policy().on_incident(run_state(), incident(1, "grad_spike"), now=0.0) == []


# -- device health -------------------------------------------------------------------

def device_health(id: int, cause: str, **evidence) -> dict:
    return incident(id, "device_health", step=60, rank=1, node="node1", evidence={"cause": cause, **evidence})


def test_ecc_errors_isolate_the_node_once():
    p, st = policy(), run_state("node0", "node1")
    [d] = p.on_incident(st, device_health(1, "ecc", new_errors=2), now=0.0)
    assert (d.kind, d.node, d.rank, d.incident_id, d.mode, d.refused) == (ISOLATE, "node1", 1, 1, "auto", None)
    assert d.reason == "ecc: rank 1's GPU reported 2 new uncorrectable ECC error(s): its memory corrupts data"
    assert d.args == {"node": "node1", "reason": d.reason, "incident_id": 1}
    assert st.isolated == {"node1"}
    # the incident stays open and is updated with each new error: decided once
    assert p.on_incident(st, device_health(1, "ecc", new_errors=3), now=1.0) == []
    [d] = policy().on_incident(run_state("node1"), device_health(2, "ecc", new_errors=1), now=0.0)  # its only node
    assert d.refused == "min_nodes: isolating node1 would leave 0 healthy node(s), fewer than 1"


def test_without_isolate_on_ecc_the_errors_count_against_the_node():
    p, st = policy(policy={"isolate_on_ecc": False}), run_state("node0", "node1")  # transient_limit 2
    assert p.on_incident(st, device_health(1, "ecc", new_errors=2), now=0.0) == []
    assert p.on_incident(st, device_health(1, "ecc", new_errors=5), now=1.0) == []  # the same incident: one fault
    assert len(st.transients["node1"]) == 1 and st.isolated == set()
    [d] = p.on_verdict(st, {"verdict": "transient", "incident_id": 2}, "node1", now=10.0)  # a second fault there
    assert (d.kind, d.node, d.reason) == (ISOLATE, "node1", "2 transient faults within 3600 s")
    assert policy("off", policy={"isolate_on_ecc": False}).on_incident(run_state(), device_health(3, "ecc"), 0.0) == []


def test_memory_pressure_checkpoints_now():
    p, st = policy(), run_state("node0", "node1")
    [d] = p.on_incident(st, device_health(1, "memory_pressure", mem_available_share=0.0123), now=0.0)
    assert (d.kind, d.node, d.incident_id, d.mode, d.refused) == (CHECKPOINT, "node1", 1, "auto", None)
    assert d.reason == "memory_pressure: node node1's memory available is 1.2%: checkpoint before an OOM kill"
    assert d.args == {"incident_id": 1, "reason": d.reason}
    assert p.on_incident(st, device_health(1, "memory_pressure"), now=1.0) == []  # decided once
    # another node's within the cooldown waits for it, then checkpoints
    other = {**device_health(2, "memory_pressure"), "node": "node0"}
    assert p.on_incident(st, other, now=2.0) == []
    [d] = p.on_incident(st, other, now=5.0)
    assert (d.kind, d.node) == (CHECKPOINT, "node0") and d.reason.endswith("is low: checkpoint before an OOM kill")
    assert policy(policy={"checkpoint_on_memory_pressure": False}).on_incident(
        run_state(), device_health(3, "memory_pressure"), 0.0) == []
    assert kinds(policy("shadow").on_incident(run_state(), device_health(4, "memory_pressure"), 0.0)) == [
        (CHECKPOINT, "shadow", None)]


@pytest.mark.parametrize("cause", ["thermal_throttle", "power_throttle", None])
def test_throttling_is_an_alert_only(cause):
    p, st = policy(), run_state("node0", "node1")
    assert p.on_incident(st, device_health(1, cause, throttle_reasons=0x40), now=0.0) == []
    assert p.on_incident(st, device_health(1, cause), now=100.0) == [] and st.acted == set()


def test_a_closed_device_health_incident_gets_nothing():
    p = policy()
    assert p.on_incident(run_state(), {**device_health(1, "memory_pressure"), "status": "closed"}, 0.0) == []
    assert CHECKPOINT in DONE_IN_PLACE and REPAIR in DONE_IN_PLACE and ISOLATE not in DONE_IN_PLACE
