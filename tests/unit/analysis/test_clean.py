"""Thousands of clean steps across layouts: zero findings.

Realistic noise (+-10% compute jitter, a noisy decaying loss, a noisy grad norm),
slow first steps (compilation), checkpoints and evals with pauses and a rank
slowed after each checkpoint, a pipeline whose stages differ in speed, fp16
calibration backoffs; each run ends normally and the clock runs on past its end.
"""

import pytest

from analysis import Analyzer
from tests.unit.analysis.sim import Layout, Sim, feed

LAYOUTS = {
    "dp4": Layout(dp=4, nodes=2),
    "dp2xtp2": Layout(dp=2, tp=2, nodes=2),
    "dp2xpp2_uneven_stages": Layout(dp=2, pp=2, nodes=2, stage_speed=(1.0, 1.5)),
    "dp2xtp2xpp2": Layout(dp=2, tp=2, pp=2, nodes=2, stage_speed=(1.3, 1.0)),
}


@pytest.mark.parametrize("seed, name", list(enumerate(LAYOUTS)))
def test_no_finding_over_clean_steps(seed, name):
    sim = Sim(layout=LAYOUTS[name], steps=800, seed=100 + seed, eval_every=50, ckpt_every=100)
    commits = sim.build()
    analyzer = Analyzer()
    findings = feed(analyzer, commits, tick_to=commits[-1][0] + 30.0)
    assert [f.summary() for f in findings] == []
    state = analyzer.runs["sim"]
    assert state.assembler.num_forced == 0  # every step was complete by all ranks, none timed out


def test_no_finding_in_fp16_with_calibration_and_rare_backoffs():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=600, seed=11, fp16=True)
    assert feed(Analyzer(), sim.build()) == []


def test_no_finding_with_local_signals_and_without_ranks_rows():
    """Coordinates from the run's mesh only; per-replica local losses and sample windows present."""
    sim = Sim(layout=Layout(dp=2, pp=2, nodes=2, stage_speed=(1.2, 1.0)), steps=400, seed=12, local_signals=True,
              ranks_rows=False)
    analyzer = Analyzer()
    assert feed(analyzer, sim.build()) == []
    assert analyzer.runs["sim"].topo.coords(3) == {"dp": 1, "tp": 0, "pp": 1}


def test_the_exclusions_are_what_keeps_checkpoint_slowdowns_quiet():
    from analysis import rules_from_dict

    # 6 slow steps: a burst of 3 no longer moves the straggler's level (its median over 7 steps)
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=300, seed=13, ckpt_every=60, ckpt_slow_steps=6)
    commits = sim.build()
    assert feed(Analyzer(rules_from_dict({"steps": {"steps_after_checkpoint": 6}})), commits) == []
    loud = feed(Analyzer(rules_from_dict({"steps": {"steps_after_checkpoint": 0}})), commits)
    assert {f.kind for f in loud} == {"straggler"} and {f.rank for f in loud} == {0}
