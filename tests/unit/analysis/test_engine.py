"""The analyzer: one state per run, rows of several runs in one commit, passes without rows."""

import polars as pl

from analysis import Analyzer, Frames
from tests.unit.analysis.sim import Crash, Layout, Sim, Straggler


def merged(*sims):
    """The commits of several runs interleaved as one collector would commit them."""
    by_now: dict[float, list[Frames]] = {}
    for sim in sims:
        for now, frames in sim.build():
            by_now.setdefault(round(now, 3), []).append(frames)
    out = []
    for now in sorted(by_now):
        parts = by_now[now]
        tables = {}
        for name in ("steps", "collectives", "heartbeats", "events", "ranks", "runs", "scalars"):
            dfs = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            if dfs:
                tables[name] = pl.concat(dfs, how="diagonal_relaxed")
        out.append((now, Frames(**tables)))
    return out


def test_two_runs_in_one_commit_stream_keep_their_own_state_and_findings():
    a = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=150, seed=1, run_id="a",
            faults=(Straggler(rank=3, start=60, factor=1.5),))
    b = Sim(layout=Layout(dp=4, nodes=2), steps=150, seed=2, run_id="b", finish=False,
            faults=(Crash(rank=0, step=100),))
    analyzer = Analyzer()
    findings = []
    commits = merged(a, b)
    for now, frames in commits:
        findings += analyzer.feed(frames, now=now)
    for t in range(1, 20):
        findings += analyzer.tick(now=commits[-1][0] + t)
    assert sorted(analyzer.runs) == ["a", "b"]
    got = {(f.run_id, f.kind, f.rank) for f in findings if f.status == "open"}
    assert got == {("a", "straggler", 3), ("b", "crash", 0)}
    analyzer.drop_run("a")
    assert list(analyzer.runs) == ["b"]
