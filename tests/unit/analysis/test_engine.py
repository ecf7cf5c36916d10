"""The analyzer: one state per run, rows of several runs in one commit, passes without rows."""

import polars as pl

from analysis import Analyzer, Frames
from tests.unit.analysis.sim import Crash, Layout, Sim, Spike, Straggler, feed, opened


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


def test_a_restart_round_closes_the_runs_incidents_and_starts_its_state_over():
    """Rank 0's run_started event of a restart round (a node isolated, the job on fewer
    ranks): the straggler's incident closes saying why, its rank number is no longer
    judged on the old round's history, and new keys number on after the old ones."""
    from analysis.frames import events_frame

    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=120, seed=3, faults=(Straggler(rank=3, start=40, factor=1.6),))
    analyzer = Analyzer()
    findings = []
    commits = sim.build()
    for now, frames in commits:
        findings += analyzer.feed_run(sim.run_id, frames, now=now)
    (key,) = {f.key for f in findings if f.kind == "straggler"}
    assert analyzer.runs[sim.run_id].book.is_open(key)
    old = analyzer.runs[sim.run_id]
    now = commits[-1][0] + 1.0
    restart = events_frame([{"run_id": sim.run_id, "rank": 0, "ts": now, "kind": "run_started",
                             "data": '{"restart": 1}', "attempt": 1}])
    out = analyzer.feed_run(sim.run_id, Frames(events=restart), now=now)
    (closed,) = [f for f in out if f.key == key]
    assert closed.resolved and closed.ts == now
    assert closed.evidence["resolved_because"] == "the job restarted (a new round)"
    new = analyzer.runs[sim.run_id]
    assert new is not old and not new.book.open_keys()
    assert new.book.new_key(key.rsplit("#", 1)[0]) != key  # never reused within the run
    # an event of the first round (restart 0) starts nothing
    first = events_frame([{"run_id": sim.run_id, "rank": 0, "ts": now, "kind": "run_started",
                           "data": '{"restart": 0}', "attempt": 0}])
    analyzer.feed_run(sim.run_id, Frames(events=first), now=now + 1)
    assert analyzer.runs[sim.run_id] is new


def test_a_restart_round_starts_with_its_first_rank_not_again_with_rank_0():
    """Seen on the demo (node1 isolated at step 68, a loss spike at 70 on the one node left):
    rank 1's start and first steps came in a commit before rank 0's. Judged in the old round's
    state, the spike opened; rank 0's start then began the round, closed that incident ("the job
    restarted") and the spike was judged again: two incidents, two rollbacks, two verdicts."""
    from dataclasses import replace

    from analysis.frames import events_frame

    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=200, seed=9, faults=(Spike(step=125, factor=3.0),))
    commits = sim.build()
    cut = sim.step_end_ts(120)
    before, after = [c for c in commits if c[0] <= cut], [c for c in commits if c[0] > cut]

    def started(rank: int, ts: float) -> Frames:
        return Frames(events=events_frame([{"run_id": sim.run_id, "rank": rank, "ts": ts, "kind": "run_started",
                                            "data": '{"restart": 1, "attempt_floor": 1}', "attempt": 1}]))

    a = Analyzer()
    findings = feed(a, before)
    t0 = after[0][0]
    old = a.runs[sim.run_id]
    findings += a.feed(started(1, t0), now=t0)
    new = a.runs[sim.run_id]
    assert new is not old and new.round == 1
    spike_at = next(i for i, (now, _) in enumerate(after) if now >= sim.step_end_ts(126))
    findings += feed(a, after[:spike_at])
    findings += a.feed(replace(after[spike_at][1], events=started(0, after[spike_at][0]).events), now=after[spike_at][0])
    assert a.runs[sim.run_id] is new  # the same round: nothing starts over
    findings += feed(a, after[spike_at + 1:])
    spikes = opened(findings, "loss_spike")
    assert [f.step_from for f in spikes.values()] == [125]
    assert not any((f.evidence or {}).get("resolved_because") == "the job restarted (a new round)" for f in findings
                   if f.kind == "loss_spike")
