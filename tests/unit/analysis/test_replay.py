"""Offline: a finished run's whole tables, re-cut into commits, give the incidents the live feed gave."""

import polars as pl

from analysis import Analyzer, Frames, replay_commits, score, truths_from_rows
from tests.unit.analysis.sim import Crash, Layout, Nan, Sim, Spike, Straggler, feed


def whole(commits) -> Frames:
    tables = {}
    for _, f in commits:
        for name, df in f.tables().items():
            tables.setdefault(name, []).append(df)
    return Frames(**{k: pl.concat(v, how="diagonal_relaxed") for k, v in tables.items()})


def test_replay_finds_what_the_live_feed_found():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=220, seed=31, local_signals=True, finish=False,
              faults=(Straggler(rank=3, start=60, factor=1.5, end=120), Spike(step=140, replica=0, factor=2.0),
                      Nan(step=160, rank=1), Crash(rank=2, step=200)))
    commits = sim.build()
    live = feed(Analyzer(), commits, tick_to=commits[-1][0] + 20)
    offline = []
    analyzer = Analyzer()
    for now, frames in replay_commits(whole(commits), window_s=1.0):
        offline += analyzer.feed(frames, now=now)
    kinds = lambda fs: sorted({(f.kind, f.rank, f.step_from) for f in fs if f.status == "open"})  # noqa: E731
    first = lambda fs: {f.key: f for f in reversed(fs)}  # noqa: E731
    assert {(f.kind, f.rank) for f in first(offline).values()} == {(f.kind, f.rank) for f in first(live).values()}
    s = score(offline, truths_from_rows(sim.truth))
    assert not s.missed and not s.false_positives, s.table()
    assert kinds(offline)
