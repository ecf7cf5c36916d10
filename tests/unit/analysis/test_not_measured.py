"""A loop that measures little (agent.record_step with only a loss): the columns it does
not give arrive as NULL, "not measured". The detectors must open nothing on them, and
crash on none, yet still see what was measured (a NaN loss)."""

import polars as pl

from analysis import Analyzer, Frames
from tests.unit.analysis.sim import Layout, Nan, Sim, Straggler, feed, opened

# what a Hugging Face / Lightning callback leaves out (agent/integrations): everything but
# loss, grad norm, lr and step time, and on the steps it did not log the loss and grad norm too
NOT_GIVEN = ("loss_scale", "fwd_s", "bwd_s", "opt_s", "local_loss", "finite_fwd", "finite_bwd", "sample_epoch",
             "sample_from", "sample_to")
LOGGED_EVERY = 5


def measured_little(commits, *, also=(), logged_every: int = LOGGED_EVERY):
    """The commits with NOT_GIVEN (and `also`) NULL, and loss/grad_norm NULL off the logging steps."""
    out = []
    for now, f in commits:
        steps = f.steps
        if steps is not None:
            gone = [c for c in (*NOT_GIVEN, *also) if c in steps.columns]
            steps = steps.with_columns([pl.lit(None, steps.schema[c]).alias(c) for c in gone])
            off_log = pl.col("step") % logged_every != 0
            steps = steps.with_columns([pl.when(off_log).then(None).otherwise(pl.col(c)).alias(c)
                                        for c in ("loss", "grad_norm") if c not in also])
        out.append((now, Frames(**{**{k: getattr(f, k) for k in f.__dataclass_fields__}, "steps": steps})))
    return out


def test_nothing_opens_on_null_columns_over_a_clean_run_with_checkpoints_and_evals():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=400, seed=21, eval_every=50, ckpt_every=100, fp16=True)
    commits = measured_little(sim.build())
    findings = feed(Analyzer(), commits, tick_to=commits[-1][0] + 30.0)
    assert [f.summary() for f in findings] == []


def test_every_step_column_null_but_the_loss_opens_nothing_and_crashes_nothing():
    sim = Sim(layout=Layout(dp=4, nodes=2), steps=200, seed=22)
    commits = measured_little(sim.build(), also=("grad_norm", "step_s", "lr", "tokens", "data_s", "comm_exposed_s",
                                                 "mem_bytes", "skipped"), logged_every=1)
    analyzer = Analyzer()
    assert feed(analyzer, commits, tick_to=commits[-1][0] + 30.0) == []
    assert analyzer.runs["sim"].newest_step == 200  # the steps were seen, not dropped


def test_a_straggler_without_phase_timings_is_not_guessed_from_nulls():
    """Compute (fwd + bwd + opt) not measured: the straggler detector judges nothing, opens nothing."""
    sim = Sim(layout=Layout(dp=4, nodes=2), steps=200, seed=23, faults=(Straggler(rank=2, start=60, factor=2.0),))
    assert feed(Analyzer(), measured_little(sim.build())) == []


def test_a_nan_loss_at_a_logged_step_is_still_found_with_the_rest_null():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=150, seed=24, faults=(Nan(step=90, rank=1, local_signals=False),))
    first = opened(feed(Analyzer(), measured_little(sim.build(), logged_every=10)))
    assert [(f.kind, f.step_from) for f in first.values()] == [("nan", 90)]
