"""NaN: at its step within a second, naming the origin in data-flow order; one incident per spread."""

from analysis import Analyzer, Frames
from analysis.frames import ranks_frame, runs_frame, steps_frame
from tests.unit.analysis.sim import Layout, Nan, Sim, feed, last_of, opened


def run(sim):
    findings = feed(Analyzer(), sim.build())
    return findings, opened(findings)


def test_origin_on_an_early_stage_is_named_though_later_stages_went_bad_too():
    layout = Layout(dp=2, pp=2, nodes=2)  # rank 1: dp 1, stage 0; rank 3: dp 1, stage 1 (gets its NaN)
    sim = Sim(layout=layout, steps=150, seed=1, faults=(Nan(step=90, rank=1),))
    findings, first = run(sim)
    assert [f.kind for f in first.values()] == ["nan"]
    f = next(iter(first.values()))
    assert (f.rank, f.node, f.step_from) == (1, "node0", 90)
    assert f.evidence["origin"]["phase"] == "forward" and f.evidence["origin"]["pp"] == 0
    assert f.ts - sim.step_end_ts(90) <= 1.0  # the goal: within a second of the step's end
    assert f.confidence >= 0.8
    assert last_of(findings)[f.key].resolved  # finite steps followed


def test_origin_on_the_last_stage():
    sim = Sim(layout=Layout(dp=1, pp=2, nodes=2), steps=120, seed=2, faults=(Nan(step=70, rank=1),))
    _, first = run(sim)
    (f,) = first.values()
    assert (f.rank, f.node) == (1, "node1")


def test_a_nan_that_spread_to_every_rank_is_one_incident():
    layout = Layout(dp=2, tp=2, pp=2, nodes=2)
    sim = Sim(layout=layout, steps=120, seed=3, faults=(Nan(step=80, rank=4),))
    findings, first = run(sim)
    assert len(first) == 1 and len({f.key for f in findings}) == 1
    f = last_of(findings)[next(iter(first))]
    assert f.evidence["num_ranks_nonfinite_first_step"] == layout.world  # the global loss: every rank
    assert f.rank == 4 or f.evidence["candidates"][0] == 4


def test_without_local_signals_one_incident_that_names_no_guess():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=120, seed=4,
              faults=(Nan(step=60, rank=2, local_signals=False),))
    findings, first = run(sim)
    (f,) = first.values()
    assert f.rank is None and f.step_from == 60 and "origin unknown" in f.root_cause
    assert all(g.rank is None for g in findings)  # never a rank that is later withdrawn
    assert f.confidence <= 0.3


def _row(step, rank, **kw):
    return {"run_id": "r", "attempt": 0, "step": step, "rank": rank, "ts": float(step), "loss": 2.0, "grad_norm": 1.0,
            "loss_scale": 1.0, "step_s": 1.0, "fwd_s": 0.3, "bwd_s": 0.6, "opt_s": 0.1, "finite_fwd": 1,
            "finite_bwd": 1, **kw}


def test_a_late_row_of_an_earlier_step_moves_the_origin_back():
    a = Analyzer()
    meta = Frames(runs=runs_frame([{"run_id": "r", "world_size": 4, "mesh": '{"dp": 1, "tp": 1, "pp": 4}'}]),
                  ranks=ranks_frame([{"run_id": "r", "rank": r, "node": f"n{r}", "dp": 0, "tp": 0, "pp": r}
                                     for r in range(4)]))
    a.feed(meta, now=0.0)
    nan = float("nan")
    out = a.feed(Frames(steps=steps_frame([_row(41, 3, loss=nan, finite_fwd=0)])), now=1.0)
    assert [(f.rank, f.step_from) for f in out] == [(3, 41)]
    out = a.feed(Frames(steps=steps_frame([_row(40, 1, loss=nan, finite_fwd=0), _row(40, 2, loss=nan, finite_fwd=0)])),
                 now=1.5)
    assert [(f.key, f.rank, f.step_from, f.step_to) for f in out] == [("nan#1", 1, 40, 41)]


def test_an_fp16_overflow_is_not_a_nan():
    a = Analyzer()
    rows = [_row(s, r, loss_scale=65536.0 / (2 if s == 30 else 1), grad_norm=float("inf") if s == 30 else 1.0)
            for s in range(1, 40) for r in range(2)]
    out = a.feed(Frames(steps=steps_frame(rows).drop("finite_fwd", "finite_bwd")), now=100.0)
    assert [f for f in out if f.kind == "nan"] == []
    bad = steps_frame([_row(41, 0, loss=float("nan"), loss_scale=65536.0)])
    assert [f.kind for f in a.feed(Frames(steps=bad), now=101.0)] == ["nan"]


def test_two_nans_that_a_backlog_brings_in_one_pass_are_two_incidents():
    """Seen live: a pass held steps 26-51 of a run with NaNs at 26 and 51; they became one
    incident spanning both although 24 finite steps lay between them."""
    from tests.unit.analysis.sim import backlogged

    sim = Sim(layout=Layout(dp=2, pp=2, nodes=2), steps=200, seed=41,
              faults=(Nan(step=100, rank=3), Nan(step=112, rank=0)))
    findings = feed(Analyzer(), backlogged(sim.build(), every_s=8.0))  # ~35 steps per pass
    first = opened(findings, "nan")
    assert sorted((f.step_from, f.rank) for f in last_of(findings).values()) == [(100, 3), (112, 0)], \
        [f.summary() for f in first.values()]
    assert all(f.resolved for f in last_of(findings).values())


def test_a_rollbacks_rerun_that_reproduces_the_nan_is_its_verdict_not_a_new_incident():
    """A device NaN at step 30 on rank 1: the rollback to step 25 reruns step 30 (attempt 1) and
    rank 1 fails again. That is the diagnosis (the trainer's rerun_verdict: device), not a second
    incident: opened as one, it was rolled back again and again until max_rollbacks stopped the run.
    A NaN at a step that is no rerun is still one."""
    from analysis.frames import events_frame

    a = Analyzer()
    meta = Frames(runs=runs_frame([{"run_id": "r", "world_size": 2, "mesh": '{"dp": 2, "tp": 1, "pp": 1}'}]),
                  ranks=ranks_frame([{"run_id": "r", "rank": r, "node": f"n{r}", "dp": r, "tp": 0, "pp": 0}
                                     for r in range(2)]))
    a.feed(meta, now=0.0)
    nan = float("nan")
    rows = [_row(s, r, **({"loss": nan, "finite_fwd": 0} if (s, r) == (30, 1) else {}))
            for s in range(1, 36) for r in range(2)]
    out = a.feed(Frames(steps=steps_frame(rows)), now=40.0)
    assert [(f.kind, f.rank, f.step_from) for f in out if not f.resolved][:1] == [("nan", 1, 30)]
    started = events_frame([{"run_id": "r", "rank": r, "ts": 41.0, "step": 25, "attempt": 1, "kind": "rollback_started",
                             "data": '{"attempt": 1, "suspect_step": 30, "diagnose": true, "to_step": 25}'}
                            for r in range(2)])
    rerun = [{**_row(s, r, **({"loss": nan, "finite_fwd": 0} if (s, r) == (30, 1) else {})), "attempt": 1,
              "ts": 41.0 + s} for s in range(26, 60) for r in range(2)]
    out = a.feed(Frames(events=started, steps=steps_frame(rerun)), now=100.0)
    assert [f.key for f in out if f.kind == "nan" and not f.resolved] == []
    later = [{**_row(61, r, **({"loss": nan, "finite_fwd": 0} if r == 1 else {})), "attempt": 1} for r in range(2)]
    out = a.feed(Frames(steps=steps_frame(later)), now=101.0)
    assert [(f.kind, f.rank, f.step_from) for f in out] == [("nan", 1, 61)]
