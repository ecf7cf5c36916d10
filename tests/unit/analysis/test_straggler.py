"""Stragglers: named within the goal (1.5x in 5 steps, 1.25x in 10), right rank and node, nobody else."""

import math
from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from analysis import Analyzer, score, truths_from_rows
from analysis.rules import load_rules, rules_from_dict
from tests.unit.analysis.sim import Contention, Layout, Rebalance, Sim, Straggler, feed, last_of, opened

CASES = [  # layout, rank, factor, goal (steps from onset)
    ("dp2xtp2", Layout(dp=2, tp=2, nodes=2), 3, 1.5, 5),
    ("dp2xtp2", Layout(dp=2, tp=2, nodes=2), 1, 1.25, 10),
    ("dp4", Layout(dp=4, nodes=2), 0, 1.25, 10),
    ("dp2xpp2_slow_stage", Layout(dp=2, pp=2, nodes=2, stage_speed=(1.0, 1.4)), 2, 1.5, 5),
    ("dp2xpp2_fast_stage", Layout(dp=2, pp=2, nodes=2, stage_speed=(1.0, 1.4)), 1, 1.25, 10),
    ("dp4xpp2", Layout(dp=4, pp=2, nodes=4, stage_speed=(1.2, 1.0)), 6, 1.25, 10),
]


@pytest.mark.parametrize("name, layout, rank, factor, goal", CASES, ids=[f"{c[0]}-r{c[2]}-{c[3]}x" for c in CASES])
def test_straggler_named_within_goal(name, layout, rank, factor, goal):
    onset = 80
    sim = Sim(layout=layout, steps=180, seed=rank + int(10 * factor), eval_every=50, ckpt_every=60,
              faults=(Straggler(rank=rank, start=onset, factor=factor),))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["straggler"], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert f.rank == rank and f.node == layout.node(rank)
    fired = f.evidence["fired_at_step"]
    assert onset <= fired < onset + goal, f"fired at step {fired}, onset {onset}"
    assert f.step_from >= onset - 1
    # the incident is reported within a couple of seconds of that step's end (rows flush every second)
    assert f.ts - sim.step_end_ts(fired) < 2.5
    last = last_of(findings)[f.key]
    cost = last.evidence["cost_s_per_step"]
    assert 0.5 * (factor - 1) * 0.2 < cost < 2.0 * (factor - 1) * 0.2  # ~ (factor - 1) x the 0.2 s compute
    assert 0 < last.evidence["share_of_step"] < 1


def test_waiting_peers_are_not_blamed_and_attribution_agrees():
    """Rank 3's tp peer (rank 2) and dp peer (rank 1) wait for it at every collective: compute is net of
    communication, so only rank 3 is named, and it is the last to enter its collectives."""
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=3, faults=(Straggler(rank=3, start=60, factor=1.5),))
    findings = feed(Analyzer(), sim.build())
    assert {f.rank for f in findings} == {3}
    f = last_of(findings)[findings[0].key]
    assert f.evidence["waited_on"]["last_share"] > 0.8
    assert f.evidence["per_rank"]["3"]["caused_wait_s_per_step"] > 0.05
    assert f.confidence > 0.9


def test_a_slow_rank_nobody_waits_for_is_not_a_straggler():
    """The second witness: the same 1.5x rank, but its peers' collectives say nobody waited for
    it (wait_s 0 everywhere: its slowness fell where no one blocks on it). Its compute alone
    is no incident; with the waits as measured it is one."""
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=3, faults=(Straggler(rank=3, start=60, factor=1.5),))
    commits = sim.build()
    assert {f.rank for f in opened(feed(Analyzer(), commits)).values()} == {3}

    def unwaited(frames):
        c = frames.collectives
        return replace(frames, collectives=None if c is None else c.with_columns(pl.lit(0.0).alias("wait_s")))
    assert opened(feed(Analyzer(), [(ts, unwaited(f)) for ts, f in commits])) == {}


def test_slow_ranks_on_one_node_are_one_node_incident():
    layout = Layout(dp=2, tp=2, nodes=2)  # node1 holds ranks 2 and 3
    sim = Sim(layout=layout, steps=160, seed=4, faults=(Straggler(rank=2, start=60, factor=1.5),
                                                        Straggler(rank=3, start=60, factor=1.5)))
    findings = feed(Analyzer(), sim.build())
    keys = {f.key for f in findings}
    assert len(keys) == 1
    last = last_of(findings)[keys.pop()]
    assert last.rank is None and last.node == "node1" and last.evidence["ranks"] == [2, 3]
    assert last.root_cause.startswith("slow node node1")


def test_the_incident_resolves_when_the_rank_recovers():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=5,
              faults=(Straggler(rank=1, start=60, factor=1.5, end=110),))
    findings = feed(Analyzer(), sim.build())
    last = last_of(findings)
    assert len(last) == 1
    f = next(iter(last.values()))
    assert f.resolved and 110 < f.step_to <= 125


def test_scoring_the_straggler_runs():
    truths, findings = [], []
    for i, (_, layout, rank, factor, _) in enumerate(CASES[:3]):
        sim = Sim(layout=layout, steps=150, seed=40 + i, run_id=f"run{i}",
                  faults=(Straggler(rank=rank, start=70, factor=factor),))
        findings += feed(Analyzer(), sim.build())
        truths += truths_from_rows(sim.truth, run_id=sim.run_id)
    s = score(findings, truths).by_kind["straggler"]
    assert (s.precision, s.recall, s.culprit_accuracy) == (1.0, 1.0, 1.0)
    assert max(s.latency_steps) < 12


def _never_under_min_ratio(findings, min_ratio=1.1):
    """No straggler finding names, or lists as a member, a rank whose compute ratio is under min_ratio."""
    for f in findings:
        if f.kind != "straggler":
            continue
        assert f.evidence["compute_ratio"] >= min_ratio, f.summary()
        for r in f.evidence["ranks"]:
            assert f.evidence["per_rank"][str(r)]["compute_ratio"] >= min_ratio, (r, f.summary())


def test_the_culprits_tensor_parallel_partner_waits_for_it_and_is_not_blamed():
    """Seen on the demo (2 cores): rank 3 straggles and its TP partner rank 2, in lockstep with it,
    computes slower too; it enters every TP collective before rank 3 and waits there. The rank
    everyone waits for is the culprit: rank 3 alone, rank 2 listed as its waiter."""
    from tests.unit.analysis.sim import Contention

    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=31,
              faults=(Straggler(rank=3, start=60, factor=1.5), Contention(rank=2, start=60, factor=1.25)))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    assert len(first) == 1, [f.summary() for f in first.values()]
    assert {f.rank for f in findings} == {3}, [f.summary() for f in findings]
    last = last_of(findings)[next(iter(first))]
    assert last.evidence["ranks"] == [3] and last.evidence["onset_step"] >= 59
    assert last.evidence["waited_on"]["waiters"]["2"]["waits_for"] == 3
    _never_under_min_ratio(findings)


def test_a_hiccup_and_two_mildly_slow_steps_open_nothing():
    """Seen on real runs: a healthy rank's one-step pause plus two slightly slow steps opened an
    incident that then reported it at 0.93x with no cost until it closed again."""
    from tests.unit.analysis.sim import Contention

    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=32, jitter=0.02,
              faults=(Contention(rank=1, start=100, end=101, factor=2.5),
                      Contention(rank=1, start=101, end=103, factor=1.15)))
    findings = feed(Analyzer(), sim.build())
    assert [f.summary() for f in findings] == []


def test_a_member_that_calms_down_leaves_the_node_incident():
    layout = Layout(dp=2, tp=2, nodes=2)  # node1 holds ranks 2 and 3
    sim = Sim(layout=layout, steps=170, seed=33, faults=(Straggler(rank=2, start=60, factor=1.5, end=100),
                                                         Straggler(rank=3, start=60, factor=1.5)))
    findings = feed(Analyzer(), sim.build())
    assert len({f.key for f in findings}) == 1
    node_wide = [f for f in findings if f.rank is None]
    assert node_wide and node_wide[0].evidence["ranks"] == [2, 3]
    late = [f for f in findings if f.step_to >= 106]
    assert late and all(f.rank == 3 and f.evidence["ranks"] == [3] for f in late), [f.summary() for f in late]
    _never_under_min_ratio(findings)


def _long_steps(commits, times: float):
    """The same commits with every step `times` as long, the rest spent in communication (a slow
    link's run): the compute, its ratios and the collective waits are unchanged."""
    out = []
    for now, frames in commits:
        if frames.steps is not None:
            frames = replace(frames, steps=frames.steps.with_columns(
                (pl.col("step_s") * times).alias("step_s"),
                (pl.col("step_s") * times - pl.col("fwd_s") - pl.col("bwd_s") - pl.col("opt_s"))
                .alias("comm_exposed_s")))
        out.append((now, frames))
    return out


@pytest.mark.parametrize("times, min_share, fires", [(1, None, True), (40, None, False), (40, 0.0, True)],
                         ids=["compute-bound", "a-sliver-of-a-long-step", "min_share-0"])
def test_a_slow_compute_that_is_a_sliver_of_the_step_is_not_a_straggler(tmp_path, times, min_share, fires):
    """A slow link on an oversubscribed host: the slow rank computes 1.2x slower (its partner spins
    while it computes), but its steps are spent in slow transfers, and its compute's excess is ~0.5%
    of the step. Under `min_share` that opens nothing; the same slowdown of a compute-bound step
    (~16% of it) is a straggler, and so is the long step's with the gate at 0."""
    rules = None
    if min_share is not None:
        path = tmp_path / "rules.toml"
        path.write_text(f"[straggler]\nmin_share = {min_share}\n")
        rules = load_rules(path)
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=160, seed=11, faults=(Contention(rank=3, start=60, factor=1.2),))
    findings = feed(Analyzer(rules), _long_steps(sim.build(), times))
    first = opened(findings)
    if not fires:
        assert not first, [f.summary() for f in first.values()]
        return
    assert [(f.kind, f.rank, f.node) for f in first.values()] == [("straggler", 3, "node1")], \
        [f.summary() for f in first.values()]
    share = last_of(findings)[next(iter(first))].evidence["share_of_step"]
    assert (share < 0.02) if times > 1 else (share > 0.1), share


def _drifting_host(steps: int, seed: int) -> tuple:
    """Two ranks sharing two oversubscribed cores, as measured on this project's CI machine: on
    clean dp2 runs one rank or the other computed 1.15-1.3x slower for 8-30 steps at a time (the
    8-step means of the log ratio swung ~3x more than step-to-step noise alone would make them)."""
    rng = np.random.default_rng(seed)
    episodes, step = [], 10
    while step < steps:
        length = int(rng.integers(8, 30))
        episodes.append(Contention(rank=int(rng.integers(0, 2)), start=step, end=step + length,
                                   factor=float(rng.uniform(1.15, 1.3))))
        step += length + int(rng.integers(5, 15))
    return tuple(episodes)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ranks_drifting_apart_on_a_shared_host_are_not_stragglers(seed):
    """The drift (the noise of window_steps-step means) raises the CUSUM's reference and the bar of
    a rank's level: without it (drift_k = 0, level_z = 0, and no swings remembered) the same run opens
    stragglers; with it,
    nothing after the drift is measured, and
    a real 2x straggler on top is still named within 12 steps. (A 1.5x one is not, on this host:
    its level, ~0.4 in log, is ~4-6 sigmas of a drift of ~0.08-0.1, the size of the host's own
    1.3x swings; level_z keeps those quiet.)"""
    layout, steps, onset = Layout(dp=2, nodes=2), 260, 200
    drift = tuple(c for c in _drifting_host(steps, seed) if c.end <= onset - 10)
    learned = 90  # steps until 12 block-mean changes are seen (2 ranks, blocks of 8 steps: ~56) and a margin
    rules = load_rules()
    blind = rules_from_dict({"straggler": {"drift_k": 0.0, "level_z": 0.0, "swing_memory": 0}})
    clean = Sim(layout=layout, steps=onset, seed=seed, jitter=0.05, faults=drift).build()
    late = [f for f in feed(Analyzer(blind), clean) if f.kind == "straggler" and f.step_from >= learned]
    assert late, "the drift alone should open a straggler when it is not measured"
    assert [f.summary() for f in feed(Analyzer(rules), clean) if f.step_from >= learned] == []
    sim = Sim(layout=layout, steps=steps, seed=seed, jitter=0.05,
              faults=drift + (Straggler(rank=1, start=onset, factor=2.0),))
    first = opened([f for f in feed(Analyzer(rules), sim.build()) if f.step_from >= learned])
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 1)], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert onset <= f.evidence["fired_at_step"] < onset + 12
    assert f.evidence["cusum_reference"] > math.log(rules.straggler.min_ratio)  # the drift raised it


@pytest.mark.parametrize("seed", [4, 5])
def test_of_two_ranks_the_one_whose_peer_sped_up_is_not_a_straggler(seed):
    """Seen on clean dp2 runs on 2 shared cores: one rank's compute dropped to ~0.65x for a stretch
    while its peer's stayed put, and the peer, 1.5x "slower" than it, was named. Against a single
    peer a rank must be slower than its own past too; the same ratio from its own compute rising
    (a real straggler) is named."""
    layout, onset = Layout(dp=2, nodes=2), 120
    faster = Sim(layout=layout, steps=180, seed=seed, jitter=0.05,
                 faults=(Contention(rank=0, start=onset, end=onset + 25, factor=0.65),)).build()
    assert [f.summary() for f in feed(Analyzer(), faster)] == []
    slower = Sim(layout=layout, steps=180, seed=seed, jitter=0.05,
                 faults=(Straggler(rank=1, start=onset, factor=1.54),)).build()
    first = opened(feed(Analyzer(), slower))
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 1)], [f.summary() for f in first.values()]
    assert onset <= next(iter(first.values())).evidence["fired_at_step"] < onset + 8


def test_a_level_must_clear_the_runs_swings_by_its_own_sigmas_but_not_its_own_dip():
    """The bar of the run's healthy swings (above_swings): a level over a swing's peak by less
    than swing_margin_z sigmas of itself is no clearer than that swing (a clean Lightning rank 0
    on a loaded host swung to 1.49x for 20 steps, then to 1.6x for 13, and was named); and a
    rank's own climb that touched zero just before this one began is the same slowness, not a
    swing to beat."""
    from analysis.detectors.straggler import StragglerDetector

    det = StragglerDetector(load_rules())
    st = det.new_state()
    st.ensure(2)
    st.swings.append((20, 0.40, 0, 100))  # rank 0: a 20-step swing peaking at log 0.40, its last climbing step 100
    st.onset[:] = 127  # both climbing since step 127: 13 steps at step 139
    ranks, sigma = np.array([0, 1]), np.full(2, 0.09)  # the sigma of their level (levels()' third)
    close = np.full(2, 0.47)
    assert det.above_swings(st, ranks, close, sigma, step=139).tolist() == [False, False]
    clear = 0.40 + det.cfg.swing_margin_z * sigma + 0.02
    assert det.above_swings(st, ranks, clear, sigma, step=139).tolist() == [True, True]
    st.swings.append((30, 0.90, 1, 122))  # rank 1's own climb ended 5 steps before this one began
    assert det.above_swings(st, ranks, clear, sigma, step=139).tolist() == [False, True]
    st.swings.append((30, 0.90, 1, 110))  # one of its own long before is a swing like any other
    assert det.above_swings(st, ranks, clear, sigma, step=139).tolist() == [False, False]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_reference_raised_by_noise_still_lets_a_2x_straggler_climb(seed):
    """On a noisy host the CUSUM's reference rises toward log 1.5 (here through noise_k on
    jittery steps; in the demo the drift did it). A step's log ratio was clipped at log
    max_step_ratio (1.6) alone, so a 2x straggler added ~0.04 a step over such a reference and
    was named 16-18 steps in here (54 in the demo). A step now adds up to log(max_step_ratio /
    min_ratio) above the reference, wherever it is: named within 8 steps, nobody else."""
    rules = rules_from_dict({"straggler": {"noise_k": 2.0}})
    onset = 120
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=seed, jitter=0.25,
              faults=(Straggler(rank=3, start=onset, factor=2.0),))
    first = opened(feed(Analyzer(rules), sim.build()))
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 3)], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert f.evidence["cusum_reference"] > math.log(1.3)  # the noise did raise it
    assert onset <= f.evidence["fired_at_step"] < onset + 8


def _fast_steps(commits, times: float):
    """The same commits with every duration (`*_s` of the steps and the collectives) `times` as
    long: a faster job, the same ratios and the same waits relative to its steps."""
    out = []
    for now, frames in commits:
        got = {}
        for name in ("steps", "collectives"):
            df = getattr(frames, name)
            if df is not None:
                got[name] = df.with_columns([pl.col(c) * times for c in df.columns
                                             if c.endswith("_s") and df[c].dtype.is_float()])
        out.append((now, replace(frames, **got)))
    return out


@pytest.mark.parametrize("seed", [6, 7])
def test_a_swing_shorter_than_min_persist_s_is_not_a_straggler_and_a_straggler_is_named_after_it(seed):
    """Seen on two shared cores: a clean rank of a fast job (14-25 ms steps) ran 1.3-1.8x its peer
    for 7-17 steps, its own compute up and its peer's not, exactly as a straggler's; it was named.
    The scheduler's swings last a fraction of a second whatever the step: a climb must last
    `min_persist_s` (0.5 s) before it fires. The same swing is named with the gate at 0, and a real
    1.5x straggler of the same job is named once it has lasted 0.5 s."""
    layout, onset, times = Layout(dp=2, nodes=2), 100, 0.1
    swing = (Contention(rank=1, start=onset, end=onset + 12, factor=1.6),)
    built = _fast_steps(Sim(layout=layout, steps=180, seed=seed, jitter=0.05, faults=swing).build(), times)
    step_s = float(pl.concat([fr.steps for _, fr in built if fr.steps is not None])["step_s"].median())
    assert 12 * step_s < 0.5 * 0.8  # the swing lasts well under min_persist_s
    assert [f.summary() for f in feed(Analyzer(), built)] == []
    gate_off = rules_from_dict({"straggler": {"min_persist_s": 0.0}})
    assert [(f.kind, f.rank) for f in opened(feed(Analyzer(gate_off), built)).values()] == [("straggler", 1)]

    slow = Straggler(rank=1, start=onset, factor=1.5)
    built = _fast_steps(Sim(layout=layout, steps=180, seed=seed, jitter=0.05, faults=(slow,)).build(), times)
    first = opened(feed(Analyzer(), built))
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 1)], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    lasted = (f.evidence["fired_at_step"] - onset + 1) * f.evidence["step_s"]
    assert 0.5 <= lasted < 0.5 + 10 * f.evidence["step_s"], (f.evidence["fired_at_step"], f.evidence["step_s"])
    assert onset <= f.step_from <= onset + 2


def test_a_climb_reset_again_and_again_under_the_priors_reference_is_dated_from_its_start():
    """Until a two-rank job's drift is measured the CUSUM's reference is the prior's, higher
    than a loaded host's 1.3x straggler: its sum left zero and came back for good only once
    the reference fell (a dp2 straggler from step 42, at 1.5x on a loaded host, was dated 60).
    The onset is where a sum with today's reference would have left zero."""
    from analysis.detectors.straggler import StragglerDetector

    det = StragglerDetector(load_rules())
    st = det.new_state()
    st.ensure(2)
    rng = np.random.default_rng(4)
    steps = list(range(10, 74))  # the 64 judged steps looked at, oldest first
    lr = np.where(np.array(steps) >= 42, 0.30, 0.0) + rng.normal(0.0, 0.05, len(steps))
    for step, x in zip(steps, lr):
        st.hist_steps.appendleft(step)
        st.lr_hist[1, 1:] = st.lr_hist[1, :-1]
        st.lr_hist[1, 0] = x
    st.kh = (0.15, 1.5)  # today's reference (log 1.16), the drift measured; the prior's was 0.42
    st.onset[1] = 60  # where the sum left zero for good under the prior
    assert 41 <= det._onset(st, 1, 73, det.clip, det.cfg.window_steps, 0.05) <= 43


@pytest.mark.parametrize("rank", [0, 3])
def test_a_pipelines_stages_moving_together_leave_a_13x_straggler_clear(rank):
    """On two shared cores each dp2 x pp2 replica's compute swung between 0.05 and 0.1 s from one step
    to the next, its two stages together and each replica its own way: against every other rank a
    1.3x straggler's log ratio (0.26) sat under a noise of ~0.25, and half the bench's were missed.
    Against its own pipeline's other stage (each stage's level taken out) the swing cancels: it is
    named within 10 steps, dated from its onset, at about its 1.3x, and nobody else is, with the same
    noise and no straggler nothing opens. Its stage's level is not its own: the straggler's sum climbs,
    and in a stage of two its slowness would otherwise be half that level after 16 steps."""
    layout, onset, steps = Layout(dp=2, pp=2, nodes=2), 80, 200
    noisy = {"jitter": 0.03, "pipeline_jitter": 0.35, "eval_every": 50, "ckpt_every": 60}
    clean = Sim(layout=layout, steps=steps, seed=11 + rank, **noisy).build()
    assert [f.summary() for f in feed(Analyzer(), clean)] == []
    sim = Sim(layout=layout, steps=steps, seed=11 + rank, faults=(Straggler(rank=rank, start=onset, factor=1.3),),
              **noisy)
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", rank)], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert onset <= f.evidence["fired_at_step"] < onset + 10
    assert onset - 1 <= f.step_from <= onset + 2
    last = last_of(findings)[f.key]
    assert last.status == "open" and last.step_to >= steps - 2  # still slow at the end
    assert 1.2 < last.evidence["compute_ratio"] < 1.4, last.evidence["compute_ratio"]


def test_a_rebalanced_straggler_stays_one_until_it_recovers_and_its_peers_are_not_blamed():
    """A 2x straggler's replica hands micro-batches to the other (shares 1/3 of 4, trainer/control.py's
    rebalance): its compute per step drops to ~0.55 of its peer's, the peer's rises by half. Judged at
    an even share of the samples (frames.compute_at_even_share) it is still 2x slower per micro-batch:
    its incident stays open, nobody else is named, and it closes once the rank recovers (the policy's
    cue to undo the split)."""
    layout, onset, rebalanced, recovered, steps = Layout(dp=2, nodes=2), 60, 100, 170, 260
    sim = Sim(layout=layout, steps=steps, seed=5, local_signals=True,
              faults=(Straggler(rank=1, start=onset, factor=2.0, end=recovered),
                      Rebalance(start=rebalanced, shares=(3, 1))))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 1)], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert f.evidence["fired_at_step"] < rebalanced
    last = last_of(findings)[f.key]
    assert last.status == "resolved" and recovered <= last.step_to < recovered + 40, last.summary()
    before_recovery = [x for x in findings if x.key == f.key and rebalanced + 10 <= (x.step_to or 0) < recovered]
    assert before_recovery and all(x.status == "open" for x in before_recovery)
    assert all(1.7 < x.evidence["compute_ratio"] < 2.3 for x in before_recovery), \
        [x.evidence["compute_ratio"] for x in before_recovery]


def test_the_replicas_carrying_a_rebalanced_straggler_s_micro_batches_are_not_blamed_for_them():
    """Under a split, compute is not linear in the micro-batches on shared cores: once the rebalanced rank
    recovered (and competed for the cores again: an injected straggler sleeps), its peer carrying 5
    micro-batches against its 1 computed 1.15-1.3x of it per micro-batch, and 1.15x its own compute of
    before, until the split was undone (the e2e rebalance scenario: 1.14x named at steps 155-193). A rank
    carrying more than an even share is judged against its like only; with none (two replicas), not until
    the undo."""
    layout, onset, rebalanced, recovered, undone, steps = Layout(dp=2, nodes=2), 60, 100, 170, 200, 260
    sim = Sim(layout=layout, steps=steps, seed=5, local_signals=True,
              faults=(Straggler(rank=1, start=onset, factor=3.0, end=recovered),
                      Rebalance(start=rebalanced, shares=(5, 1), end=undone, exponent=1.16),
                      Contention(rank=0, start=recovered, end=undone, factor=1.15)))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 1)], [f.summary() for f in first.values()]
    last = last_of(findings)[next(iter(first))]
    assert last.status == "resolved" and recovered <= last.step_to < undone, last.summary()


def test_a_rebalanced_rank_whose_incident_closed_opens_no_new_one_before_the_split_is_undone():
    """Between its incident's close and the undo reaching the ranks (a second or so), the rebalanced rank
    still carries 1 of 6 micro-batches, and its reading per micro-batch is not linear either: scaled to an
    even share, its step's fixed costs count 3 times (CI: a second straggler incident in the e2e rebalance
    run, after the first had closed). It opens no new incident while it carries less than an even share;
    once the split is undone it is judged as every rank, so a real relapse is named then."""
    layout, onset, rebalanced, recovered, undone, steps = Layout(dp=2, nodes=2), 60, 100, 170, 215, 330
    sim = Sim(layout=layout, steps=steps, seed=5, local_signals=True,
              faults=(Straggler(rank=1, start=onset, factor=3.0, end=recovered),
                      Rebalance(start=rebalanced, shares=(5, 1), end=undone, exponent=1.16),
                      Contention(rank=1, start=195, end=undone, factor=1.5),
                      Straggler(rank=1, start=260, factor=1.5)))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    got = sorted((f.rank, f.step_from) for f in first.values())
    assert [r for r, _ in got] == [1, 1], [f.summary() for f in first.values()]
    closed = last_of(findings)[next(iter(first))]
    assert closed.status == "resolved" and recovered <= closed.step_to < 195, closed.summary()
    assert 255 <= got[1][1] <= 262, got  # the relapse after the undo: named, from its own onset


def test_a_second_straggler_among_the_replicas_carrying_more_is_named_under_the_split():
    """Four replicas, the slow one's micro-batches split over the others (4, 4, 3, 1): ranks 0 and 1 carry
    more and are judged against each other, so rank 0 slowing down 1.5x under the split is named, and the
    rebalanced rank 3 stays the first incident's."""
    layout, steps = Layout(dp=4, nodes=4), 260
    sim = Sim(layout=layout, steps=steps, seed=7, local_signals=True,
              faults=(Straggler(rank=3, start=40, factor=3.0), Rebalance(start=80, shares=(4, 4, 3, 1), exponent=1.16),
                      Straggler(rank=0, start=150, factor=1.5)))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    got = sorted((f.rank, f.step_from) for f in first.values())
    assert [r for r, _ in got] == [0, 3], [f.summary() for f in first.values()]
    assert 148 <= dict(got)[0] <= 152, got


@pytest.mark.parametrize("seed", range(4))
def test_a_straggler_after_a_milder_slow_stretch_is_dated_from_its_own_rise(seed):
    """On a loaded host a rank ran 1.1-1.15x its peers for eleven steps before a 1.5x straggler was injected
    into it (CI dated the dp2 x tp2 scenario's straggler from 52 at 41). The stretch alone made no verdict;
    the verdict is for the larger rise that followed, and that is where the incident starts. A stretch
    that made its own verdict (1.3x here, named before the fault) is dated from where it began."""
    layout, onset = Layout(dp=2, tp=2, nodes=2), 52
    for pre, dated in ((1.1, onset), (1.15, None), (1.3, 41)):
        sim = Sim(layout=layout, steps=85, seed=seed, jitter=0.05,
                  faults=(Straggler(rank=2, start=onset, factor=1.5), Contention(rank=2, start=41, end=onset, factor=pre)))
        (f,) = opened(feed(Analyzer(), sim.build())).values()
        assert f.rank == 2
        fired = f.evidence["fired_at_step"]
        want = dated if dated is not None else (onset if fired >= onset else 41)
        assert f.step_from == want, (pre, fired, f.step_from)


def test_the_per_rank_columns_are_newest_first_across_the_buffers_wrap():
    """A step's column goes to the left of the last one in a buffer twice as wide, moved back
    once every `width` steps: the view reads as if every row were shifted each step."""
    from analysis.detectors.straggler import _Columns

    cols = _Columns(4)
    cols.ensure(3)
    shifted = np.full((3, 4), np.nan)
    for step in range(11):  # past two wraps
        rows = np.array([0, 2]) if step % 2 else np.array([1])
        values = 10.0 * step + rows
        cols.push(rows, values)
        shifted[:, 1:] = shifted[:, :-1]
        shifted[:, 0] = np.nan
        shifted[rows, 0] = values
        np.testing.assert_array_equal(cols.view, shifted)
    cols.ensure(5)  # more ranks: their rows NaN, the others kept
    assert cols.view.shape[0] >= 5 and cols.view.shape[1] == 4 and np.isnan(cols.view[3:]).all()
    np.testing.assert_array_equal(cols.view[:3], shifted)
