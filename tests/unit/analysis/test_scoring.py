"""Scoring findings against injected faults: matching, precision, recall, latency, culprit accuracy."""

from analysis import Analyzer, Finding, score, truths_from_rows
from analysis.scoring import incidents
from tests.unit.analysis.sim import Crash, Layout, Nan, Sim, Spike, Straggler, feed


def f(kind, key, step_from, step_to=None, rank=None, node=None, ts=0.0, resolved=False, run_id="r", **ev):
    return Finding(kind=kind, key=key, run_id=run_id, rank=rank, node=node, step_from=step_from,
                   step_to=step_to if step_to is not None else step_from, ts=ts, detected_step=step_from + 1,
                   status="resolved" if resolved else "open", evidence=ev)


def test_truth_rows_of_one_fault_on_every_rank_are_one_truth():
    rows = [{"kind": "spike", "rank": -1, "node": r // 2, "step": 60, "attempt": 0, "ts": 5.0} for r in range(4)]
    rows += [{"kind": "spike", "rank": -1, "node": 0, "step": 60, "attempt": 1, "ts": 9.0, "replay": True}]
    truths = truths_from_rows(rows)
    assert [(t.step, t.attempt, t.node) for t in truths] == [(60, 0, None), (60, 1, None)]


def test_incidents_collapse_findings_by_key():
    incs = incidents([f("straggler", "s#1", 10, rank=None, node="node1", ts=1.0, fired_at_step=12),
                      f("straggler", "s#1", 10, 20, rank=3, node="node1", ts=2.0),
                      f("straggler", "s#1", 10, 25, rank=3, node="node1", ts=3.0, resolved=True)])
    (inc,) = incs
    assert (inc.step_from, inc.step_to, inc.rank) == (10, 25, 3)
    assert (inc.opened_ts, inc.closed_ts, inc.opened_step) == (1.0, 3.0, 12)


def test_precision_recall_latency_and_culprits():
    truths = truths_from_rows([
        {"kind": "straggler", "rank": 3, "node": 1, "step": 30, "ts": 100.0},
        {"kind": "nan", "rank": 2, "node": 1, "step": 50, "ts": 200.0},
        {"kind": "crash", "rank": 0, "node": 0, "step": 80, "ts": 300.0},
        {"kind": "hang", "rank": 1, "node": 0, "step": 90, "ts": 400.0},
    ])
    findings = [
        f("straggler", "s#1", 30, 40, rank=3, node="node1", ts=103.0, fired_at_step=33),
        f("straggler", "s#2", 31, 40, rank=None, node="node0", ts=104.0),  # a second one: FP
        f("nan", "n#1", 50, rank=1, node="node0", ts=200.5),  # right step, wrong origin
        f("crash", "c#1", 77, 80, rank=0, node="node0", ts=303.0),
        f("loss_spike", "l#1", 10, ts=1.0),  # nothing injected there: FP
    ]
    s = score(findings, truths)
    st, nan, crash, hang = (s.by_kind[k] for k in ("straggler", "nan", "crash", "hang"))
    assert (st.precision, st.recall, st.culprit_accuracy, st.latency_s, st.latency_steps) == (0.5, 1.0, 1.0, [3.0], [3])
    assert (nan.recall, nan.culprit_accuracy) == (1.0, 0.0)
    assert (crash.recall, crash.culprit_accuracy, crash.latency_s) == (1.0, 1.0, [3.0])
    assert (hang.recall, hang.precision) == (0.0, None) and [t.kind for t in s.missed] == ["hang"]
    assert sorted(i.kind for i in s.false_positives) == ["loss_spike", "straggler"]
    assert "straggler" in s.table()


def test_a_node_incident_counts_as_the_right_culprit_by_node():
    truths = truths_from_rows([{"kind": "straggler", "rank": 3, "node": "node1", "step": 30}])
    s = score([f("straggler", "s#1", 30, rank=None, node="node1")], truths)
    assert s.by_kind["straggler"].culprit_accuracy == 1.0


def test_scoring_simulated_runs_end_to_end():
    """One run per fault kind, scored together: every fault found once, the right culprit, no false positive."""
    runs = [Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=20, run_id="straggler",
                faults=(Straggler(rank=2, start=70, factor=1.5),)),
            Sim(layout=Layout(dp=2, pp=2, nodes=2), steps=160, seed=21, run_id="nan", faults=(Nan(step=90, rank=1),)),
            Sim(layout=Layout(dp=4, nodes=2), steps=160, seed=22, run_id="spike", faults=(Spike(step=100),)),
            Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=23, run_id="crash", finish=False,
                faults=(Crash(rank=1, step=120),))]
    findings, truths = [], []
    for sim in runs:
        commits = sim.build()
        findings += feed(Analyzer(), commits, tick_to=commits[-1][0] + 10)
        truths += truths_from_rows(sim.truth, run_id=sim.run_id)
    s = score(findings, truths)
    assert not s.false_positives and not s.missed, s.table()
    for kind in ("straggler", "nan", "spike", "crash"):
        k = s.by_kind[kind]
        assert (k.precision, k.recall) == (1.0, 1.0), kind
        assert k.culprit_accuracy in (1.0, None), kind


def test_background_jitter_is_no_truth_and_an_overflow_is_found_as_a_collapse():
    rows = [{"kind": "jitter", "rank": -1, "node": r, "step": 1, "ts": 1.0, "pct": 10.0} for r in range(2)]
    rows.append({"kind": "overflow", "rank": 1, "node": 1, "step": 33, "ts": 5.0, "to": 39})
    truths = truths_from_rows(rows)
    assert [t.kind for t in truths] == ["overflow"]
    s = score([f("loss_scale_collapse", "c#1", 33, 37, rank=1, node="node1", ts=6.0)], truths)
    k = s.by_kind["overflow"]
    assert (k.precision, k.recall, k.culprit_accuracy, k.latency_s) == (1.0, 1.0, 1.0, [1.0])
    assert not s.missed and not s.false_positives


def test_the_new_kinds_are_found_as_their_incidents_in_their_windows():
    truths = truths_from_rows([
        {"kind": "slowlink", "rank": 3, "node": "node1", "step": 30, "axis": "dp", "factor": 4.0, "ts": 10.0},
        {"kind": "slowio", "rank": 2, "node": "node1", "step": 40, "what": "data", "factor": 4.0, "ts": 20.0},
        {"kind": "slowio", "rank": 1, "node": "node0", "step": 40, "what": "ckpt", "factor": 30.0, "ts": 20.0},
        {"kind": "bitflip", "rank": 2, "node": "node2", "step": 22, "ts": 30.0},
    ])
    assert sorted(t.label for t in truths) == ["bitflip", "slowio:ckpt", "slowio:data", "slowlink"]
    findings = [
        f("slow_link", "sl#1", 31, 40, rank=3, node="node1", ts=12.0, fired_at_step=37),
        f("data_stall", "ds#1", 39, 48, rank=2, node="node1", ts=21.0),
        f("checkpoint_slow", "cs#1", 48, 48, rank=1, node="node0", ts=25.0),  # the 2nd checkpoint after onset
        f("replica_divergence", "rd#1", 20, 30, rank=2, node="node2", ts=31.0, divergent_ranks=[2], majority=True),
        f("device_health", "dh#1", 5, 9, rank=0, node="node0", cause="memory_pressure"),  # no injection: FP
    ]
    s = score(findings, truths)
    for label in ("slowlink", "slowio:data", "slowio:ckpt", "bitflip"):
        k = s.by_kind[label]
        assert (k.precision, k.recall, k.culprit_accuracy, k.num_culprit_among_suspects) == (1.0, 1.0, 1.0, 0), label
    assert s.by_kind["slowlink"].latency_steps == [7]  # from the step it fired at, as a straggler's
    assert s.by_kind["slowio:data"].latency_steps == [0]  # detected_step: 40
    assert [i.kind for i in s.false_positives] == ["device_health"] and not s.missed
    assert "slowio:ckpt" in s.table()


def test_a_data_stall_does_not_match_a_slow_checkpoint_truth_nor_a_slow_link_a_straggler():
    truths = truths_from_rows([{"kind": "slowio", "rank": 2, "node": "node1", "step": 40, "what": "ckpt"},
                               {"kind": "straggler", "rank": 3, "node": "node1", "step": 30}])
    s = score([f("data_stall", "ds#1", 40, rank=2, node="node1"), f("slow_link", "sl#1", 31, rank=3, node="node1")],
              truths)
    assert s.by_kind["slowio:ckpt"].recall == 0.0 and s.by_kind["straggler"].recall == 0.0
    assert sorted(i.kind for i in s.false_positives) == ["data_stall", "slow_link"]


def test_slowio_data_and_ckpt_at_one_step_are_two_truths():
    rows = [{"kind": "slowio", "rank": 1, "node": 0, "step": 30, "what": w} for w in ("data", "ckpt")]
    assert sorted(t.label for t in truths_from_rows(rows)) == ["slowio:ckpt", "slowio:data"]


def test_a_divergence_without_a_majority_is_right_when_the_flipped_rank_is_among_its_suspects():
    truths = truths_from_rows([{"kind": "bitflip", "rank": 1, "node": "node1", "step": 25}])
    # dp = 2 on two nodes: no rank, no single node, both replicas in the evidence
    both = f("replica_divergence", "rd#1", 20, 30, rank=None, node=None, divergent_ranks=[0, 1], majority=False)
    s = score([both], truths)
    k = s.by_kind["bitflip"]
    assert (k.recall, k.culprit_accuracy, k.num_culprit_among_suspects) == (1.0, 1.0, 1)
    assert s.matches[0][1].suspects == (0, 1)
    wrong = f("replica_divergence", "rd#2", 20, 30, rank=None, node=None, divergent_ranks=[2, 3], majority=False)
    k = score([wrong], truths).by_kind["bitflip"]
    assert (k.recall, k.culprit_accuracy, k.num_culprit_among_suspects) == (1.0, 0.0, 0)
    # with a majority the one rank is named: a wrong one is wrong, whatever the evidence lists
    named = f("replica_divergence", "rd#3", 20, 30, rank=2, node="node2", divergent_ranks=[1, 2], majority=True)
    assert score([named], truths).by_kind["bitflip"].culprit_accuracy == 0.0


def test_a_bitflip_is_matched_from_the_last_agreeing_checksum_to_the_first_disagreeing_one():
    truths = truths_from_rows([{"kind": "bitflip", "rank": 0, "node": "node0", "step": 29}])
    assert score([f("replica_divergence", "rd#1", 20, 30, rank=0)], truths).by_kind["bitflip"].recall == 1.0
    # no agreeing checksum before it (flipped before the first comparison): the range is its first disagreeing step
    assert score([f("replica_divergence", "rd#1", 30, 30, rank=0)], truths).by_kind["bitflip"].recall == 1.0
    # all agreed after the flip's step: another fault's divergence
    assert score([f("replica_divergence", "rd#1", 60, 70, rank=0)], truths).by_kind["bitflip"].recall == 0.0


def test_device_health_faults_are_found_by_their_cause_from_their_first_faulty_sample():
    truths = truths_from_rows([
        {"kind": "devhealth", "rank": 1, "node": 0, "step": 60, "what": "ecc", "ts": 10.0},
        {"kind": "devhealth", "rank": 2, "node": 1, "step": 60, "what": "thermal", "ts": 10.0},
        {"kind": "devhealth", "rank": 3, "node": 1, "step": 60, "what": "memory", "ts": 10.0},
    ])
    assert sorted(t.label for t in truths) == ["devhealth:ecc", "devhealth:memory", "devhealth:thermal"]
    findings = [  # two nodes of two ranks: node1 holds ranks 2 and 3
        f("device_health", "dh#ecc", 95, 95, rank=1, node="node0", ts=11.0, cause="ecc", new_errors=2),
        # the throttled samples from the first one after onset; the incident opened a window of seconds later
        f("device_health", "dh#hot", 61, 150, rank=2, node="node1", ts=13.0, cause="thermal_throttle"),
        # memory is the node's: the incident names its lowest reporting rank, not the injected one
        f("device_health", "dh#mem", 62, 110, rank=2, node="node1", ts=12.0, cause="memory_pressure"),
    ]
    s = score(findings, truths)
    for label in ("devhealth:ecc", "devhealth:thermal", "devhealth:memory"):
        k = s.by_kind[label]
        assert (k.precision, k.recall, k.num_truths, k.num_incidents) == (1.0, 1.0, 1, 1), label
    assert [s.by_kind[k].culprit_accuracy for k in ("devhealth:ecc", "devhealth:thermal")] == [1.0, 1.0]
    assert s.by_kind["devhealth:memory"].culprit_accuracy == 1.0  # by node: rank 2 named, rank 3 injected
    assert s.by_kind["devhealth:ecc"].latency_steps == [36]  # detected_step 96: the first sample after onset
    # a rank's fault is the rank's: the lowest rank of the right node is the wrong culprit for a throttled GPU
    hot = score([f("device_health", "dh#hot", 61, 150, rank=3, node="node1", cause="thermal_throttle")], truths)
    assert hot.by_kind["devhealth:thermal"].culprit_accuracy == 0.0
    assert {(t.label, i.key.split("/")[1]) for t, i in s.matches} == {
        ("devhealth:ecc", "dh#ecc"), ("devhealth:thermal", "dh#hot"), ("devhealth:memory", "dh#mem")}
    assert not s.false_positives and not s.missed and "devhealth:memory" in s.table()


def test_a_device_health_incident_of_another_cause_or_before_onset_is_no_match():
    truths = truths_from_rows([{"kind": "devhealth", "rank": 1, "node": 1, "step": 60, "what": "ecc"}])
    power = f("device_health", "dh#1", 70, 80, rank=1, node="node1", cause="power_throttle")
    early = f("device_health", "dh#2", 40, 59, rank=1, node="node1", cause="ecc")  # over before the fault
    late = f("device_health", "dh#3", 211, 220, rank=1, node="node1", cause="ecc")  # past ~3 heartbeats
    for finding in (power, early, late):
        s = score([finding], truths)
        assert s.by_kind["devhealth:ecc"].recall == 0.0 and len(s.false_positives) == 1, finding.key
    # an incident whose cause is not known (a caller that passes none) matches by kind and window
    (inc,) = incidents([f("device_health", "dh#4", 61, 61, rank=1, node="node1")])
    assert inc.cause is None and score([inc], truths).by_kind["devhealth:ecc"].recall == 1.0
    assert incidents([power])[0].cause == "power_throttle" and incidents([f("nan", "n", 1, cause="x")])[0].cause is None
