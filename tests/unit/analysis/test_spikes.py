"""Spikes: at the step (within 1.5 s), with the replica whose local loss jumped and its samples."""

from analysis import Analyzer
from tests.unit.analysis.sim import Layout, Sim, Spike, feed, last_of, opened


def test_a_replica_spike_names_the_replica_and_its_sample_window():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=4, local_signals=True,
              faults=(Spike(step=120, replica=1, factor=2.0),))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["loss_spike"]  # the grad-norm spike folded into it
    f = next(iter(first.values()))
    assert f.step_from == 120 and f.ts - sim.step_end_ts(120) <= 1.5
    last = last_of(findings)[f.key]
    assert last.evidence["suspect_replica"] == 1
    lo = (119 * 2 + 1) * 64  # the sim's replica 1 samples of step 120
    assert last.evidence["samples"] == {"epoch": 0, "from": lo, "to": lo + 64}
    assert last.root_cause == f"data: replica 1's samples {lo}-{lo + 63} (epoch 0) at step 120"
    assert "grad_norm" in last.evidence and last.resolved


def test_a_global_batch_spike_without_local_signals():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=5, faults=(Spike(step=90, factor=3.0),))
    findings = feed(Analyzer(), sim.build())
    first = opened(findings)
    (f,) = first.values()
    assert f.kind == "loss_spike" and f.step_from == f.step_to == 90 and f.rank is None
    assert last_of(findings)[f.key].evidence["suspect_replica"] is None


def test_a_grad_norm_spike_alone_is_a_grad_spike():
    sim = Sim(layout=Layout(dp=4, nodes=2), steps=200, seed=6, faults=(Spike(step=100, factor=1.0, grad_factor=6.0),))
    first = opened(feed(Analyzer(), sim.build()))
    assert [(f.kind, f.step_from) for f in first.values()] == [("grad_spike", 100)]


def test_a_small_spike_megatron_would_miss_is_caught():
    """1.3x the loss: far below the 10x-of-the-first-100 rule."""
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=200, seed=7, faults=(Spike(step=150, factor=1.3, grad_factor=1.0),))
    first = opened(feed(Analyzer(), sim.build()))
    assert [(f.kind, f.step_from) for f in first.values()] == [("loss_spike", 150)]


def test_one_spike_is_one_incident_when_a_backlog_brings_it_with_the_steps_that_close_it():
    """Seen live on the demo: steps 70-73 in one commit; the loss spike opened and closed in that
    pass, and the grad-norm spike of the same step, judged after it, opened a second incident."""
    from tests.unit.analysis.sim import backlogged

    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=8, faults=(Spike(step=120, factor=3.0),))
    findings = feed(Analyzer(), backlogged(sim.build(), every_s=4.0))  # steps 109-131 in one pass
    first = opened(findings)
    assert [(f.kind, f.step_from) for f in first.values()] == [("loss_spike", 120)]
    last = last_of(findings)[next(iter(first))]
    assert last.resolved and last.evidence["grad_norm"]["step"] == 120


def test_a_grad_norm_spike_the_step_after_a_loss_spike_is_the_same_cause():
    sim = Sim(layout=Layout(dp=2, nodes=2), steps=200, seed=9,
              faults=(Spike(step=120, factor=3.0, grad_factor=1.0), Spike(step=121, factor=1.0, grad_factor=6.0)))
    first = opened(feed(Analyzer(), sim.build()))
    assert [(f.kind, f.step_from) for f in first.values()] == [("loss_spike", 120)]


def test_a_spike_right_after_a_restart_round_is_judged_against_the_baseline_before_it():
    """Seen on the demo: node1 isolated at step 65, the job restarted on node0, a loss spike at
    step 70. The collector starts the run's analysis over on a restart round (the ranks are
    other hardware now), and a fresh baseline needs 20 steps: the spike went unseen. The
    training curve goes on from the checkpoint, so its baseline carries over."""
    from dataclasses import replace

    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=9, faults=(Spike(step=125, factor=3.0),))
    commits = sim.build()
    cut = sim.step_end_ts(120)
    before, after = [c for c in commits if c[0] <= cut], [c for c in commits if c[0] > cut]
    meta = replace(commits[0][1], steps=None, collectives=None, heartbeats=None, events=None, scalars=None)

    def restarted(carry: bool) -> dict:
        a = Analyzer()
        feed(a, before)
        if carry:
            a.new_round(sim.run_id, now=after[0][0])
        else:
            a.drop_run(sim.run_id)
        return opened(feed(a, [(after[0][0], meta), *after]), "loss_spike")

    assert [f.step_from for f in restarted(True).values()] == [125]
    assert restarted(False) == {}  # what a fresh analysis of the new round missed


def _steep_then_rolled_back(*, back_to: int, steps: int = 90):
    """A steep early loss curve (9.5 at step 1, ~2 by step 60), then a rollback: attempt 1
    replays the steps after `back_to` on the same curve (as a rerun from that checkpoint does)."""
    import numpy as np
    import polars as pl

    sim = Sim(layout=Layout(dp=2, nodes=2), steps=steps, seed=31)
    commits = sim.build()

    def steep(df):
        return df.with_columns((2.0 + 8.0 * np.exp(-df["step"].cast(pl.Float64) / 15.0)).alias("loss"))

    out, replay = [], []
    for now, frames in commits:
        if frames.steps is not None:
            frames = type(frames)(**{**frames.tables(), "steps": steep(frames.steps)})
            replay.append(frames.steps.filter(pl.col("step") > back_to))
        out.append((now, frames))
    rows = pl.concat([r for r in replay if r.height])
    shift = float(rows["ts"].max()) - float(rows["ts"].min()) + 2.0
    rows = rows.with_columns(pl.lit(1, pl.Int32).alias("attempt"), pl.col("ts") + shift)
    last = out[-1][0]
    for i, part in enumerate(rows.partition_by("step", maintain_order=True)):
        out.append((last + shift + 0.1 * i, type(out[0][1])(steps=part)))
    return out


def test_a_rollback_into_the_steep_early_curve_is_not_a_spike():
    """The replay of steps 41-90 after a rollback is judged against the curve as it was
    before step 41, not against the lower level the run had reached by step 90 (that
    opened a loss_spike, and a rollback answered it: a loop)."""
    assert [f.summary() for f in feed(Analyzer(), _steep_then_rolled_back(back_to=40))] == []


def _spiked_replay(commits, step: int, factor: float) -> list:
    """The commits with the replay's (attempt 1) `step` loss `factor` times as high."""
    import polars as pl

    hit = [i for i, (_, fr) in enumerate(commits) if fr.steps is not None and fr.steps.height
           and fr.steps["attempt"][0] == 1 and fr.steps["step"][0] == step]
    assert len(hit) == 1
    now, frames = commits[hit[0]]
    commits[hit[0]] = (now, type(frames)(steps=frames.steps.with_columns(pl.col("loss") * factor)))
    return commits


def test_a_spike_in_the_replay_is_still_caught():
    commits = _spiked_replay(_steep_then_rolled_back(back_to=40), 70, 3.0)
    first = opened(feed(Analyzer(), commits))
    assert [(f.kind, f.step_from) for f in first.values()] == [("loss_spike", 70)]


def test_a_spike_in_a_replay_from_further_back_than_the_window_is_caught():
    """A rollback from step 150 to 37 (the known-good watermark keeps the checkpoint however far
    back): the window's 50 values are all after 37, and the replay was judged from an empty
    baseline after a warm-up of 20 steps; a spike at 43 went unseen. The baseline is rebuilt
    from the lineage's history before 37."""
    commits = _spiked_replay(_steep_then_rolled_back(back_to=36, steps=150), 43, 1.7)
    first = opened(feed(Analyzer(), commits))
    assert [(f.kind, f.step_from) for f in first.values()] == [("loss_spike", 43)]


def test_the_rollbacks_rerun_of_the_spiked_step_is_its_verdict_not_a_second_spike():
    """The replay's step 70 spiked, and a rollback to step 60 reruns it to diagnose: the rerun
    spikes again (a device, or the same data on one replica). That is the verdict on the first
    incident (rerun_verdict), not a second loss_spike: opened as one it was rolled back again."""
    import polars as pl

    from analysis.frames import events_frame

    commits = _steep_then_rolled_back(back_to=40)
    hit = next(i for i, (_, fr) in enumerate(commits) if fr.steps is not None and fr.steps.height
               and fr.steps["attempt"][0] == 1 and fr.steps["step"][0] == 70)
    now, frames = commits[hit]
    commits[hit] = (now, type(frames)(steps=frames.steps.with_columns(pl.col("loss") * 3.0)))
    rerun = [(t, fr) for t, fr in commits[hit - 9:hit + 20]]  # steps 61-89 of attempt 1 again, as attempt 2
    end = commits[-1][0]
    started = events_frame([{"run_id": commits[hit][1].steps["run_id"][0], "rank": r, "ts": end + 0.5, "step": 60,
                             "attempt": 2, "kind": "rollback_started",
                             "data": '{"attempt": 2, "suspect_step": 70, "diagnose": true}'} for r in (0, 1)])
    again = [(end + 1.0, type(frames)(events=started))]
    for i, (_, fr) in enumerate(rerun):
        again.append((end + 1.1 + 0.1 * i, type(fr)(steps=fr.steps.with_columns(pl.lit(2, pl.Int32).alias("attempt")))))
    first = opened(feed(Analyzer(), commits + again))
    assert [(f.kind, f.step_from) for f in first.values()] == [("loss_spike", 70)]


def test_a_baseline_older_than_its_window_warms_up_again():
    """Seen in CI: a device NaN from step 30 on; every step to 94 was skipped, then the job
    restarted without the device and resumed step-29 weights at step 95's data and learning rate,
    twice as noisy. A 1.18x step 12 steps in, judged against steps 1-29, opened a loss spike (and
    its one-replica rerun called it data). A baseline whose newest value is more than
    `window_steps` before the step judged warms up again; a spike after that warm-up is caught."""
    import polars as pl

    sim = Sim(layout=Layout(dp=2, nodes=2), steps=160, seed=12)
    commits = sim.build()
    out = []
    for now, frames in commits:
        if frames.steps is None or not frames.steps.height:
            out.append((now, frames))
            continue
        steps = frames.steps.filter((pl.col("step") <= 29) | (pl.col("step") >= 95))  # 30-94 never clean
        factor = pl.when(pl.col("step") == 107).then(1.18).when(pl.col("step") == 130).then(3.0).otherwise(1.0)
        steps = steps.with_columns(pl.when(pl.col("step") >= 95).then(1).otherwise(0).cast(pl.Int32).alias("attempt"),
                                   pl.col("loss") * factor)
        out.append((now, type(frames)(**{**frames.tables(), "steps": steps})))
    assert [f.step_from for f in opened(feed(Analyzer(), out), "loss_spike").values()] == [130]
