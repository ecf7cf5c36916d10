"""Hangs: within max(5 s, 3 step intervals) of the last progress, naming the rank that never entered
the collective its group waits in, and that collective."""

import pytest

from analysis import Analyzer
from tests.unit.analysis.sim import Hang, Layout, Sim, _group_index, _ops, feed, opened


def hang_run(layout, rank, step=100, seed=0, **kw):
    sim = Sim(layout=layout, steps=200, seed=seed, finish=False, faults=(Hang(rank=rank, step=step),), **kw)
    commits = sim.build()
    last_progress = sim.step_end_ts(step - 1)
    analyzer = Analyzer()
    findings = feed(analyzer, commits, until=last_progress + 20.0)
    return sim, analyzer, findings, last_progress


@pytest.mark.parametrize("name, layout, rank", [
    ("dp2xtp2", Layout(dp=2, tp=2, nodes=2), 1),
    ("dp4", Layout(dp=4, nodes=2), 2),
    ("dp2xpp2", Layout(dp=2, pp=2, nodes=2, stage_speed=(1.0, 1.3)), 3),
    ("dp2xtp2xpp2", Layout(dp=2, tp=2, pp=2, nodes=2), 5),
])
def test_hang_names_the_rank_and_the_collective(name, layout, rank):
    sim, analyzer, findings, last_progress = hang_run(layout, rank)
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["hang"], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert (f.rank, f.node, f.step_from) == (rank, layout.node(rank), 100)
    interval = analyzer.runs["sim"].clock.interval_s
    assert f.ts - last_progress <= max(5.0, 3 * interval)
    # the collective: the culprit's first op of step 100, with its group_seq
    op, axis, gid, peer, _ = _ops(layout, rank)[0]
    gseq = 99 * _group_index(_ops(layout, rank))["per_step"][0]
    c = f.evidence["collective"]
    assert (c["op"], c["axis"], c["group_id"], c["group_seq"]) == (op, axis, gid, gseq)
    assert f.evidence["num_waiting"] >= 1 and str(rank) not in f.evidence["waiting"]


def test_the_collective_from_heartbeats_when_the_agent_sends_it():
    layout = Layout(dp=2, tp=2, nodes=2)
    sim, _, findings, _ = hang_run(layout, 1, hb_ops=True)
    (f,) = opened(findings).values()
    c = f.evidence["collective"]
    assert c["source"] == "heartbeats"
    assert (c["op"], c["axis"], c["group_id"], c["group_seq"]) == ("all_reduce", "tp", 0, 495)


def test_long_checkpoints_and_evals_are_not_hangs():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=300, seed=7, eval_every=40, ckpt_every=50, pause_s=8.0)
    assert feed(Analyzer(), sim.build()) == []


def test_the_hang_resolves_when_the_run_finishes():
    from analysis import Frames
    from analysis.frames import events_frame

    sim, analyzer, findings, last_progress = hang_run(Layout(dp=2, nodes=2), 0)
    assert opened(findings)
    out = analyzer.feed(Frames(events=events_frame([{"run_id": "sim", "rank": 1, "ts": 1.0, "step": 100,
                                                     "kind": "run_finished", "data": "{}"}])), now=last_progress + 21)
    assert [f.resolved for f in out] == [True]


def test_a_run_shut_down_after_a_hang_is_no_second_hang():
    """Seen live: the run interrupted after its hang; the hung rank's agent closed first, and the
    peers still waiting for it were taken for a second hang on another rank."""
    from analysis import Frames
    from analysis.frames import events_frame

    layout = Layout(dp=2, tp=2, nodes=2)
    sim, analyzer, findings, last_progress = hang_run(layout, 2, step=80)
    assert [f.rank for f in opened(findings).values()] == [2]
    t = last_progress + 20.0
    closes = [(t + 0.2, 2), (t + 1.4, 0), (t + 1.5, 3), (t + 2.0, 1)]  # the launcher stops them one by one
    hb = [c for now, c in sim.build() if t < now <= t + 2.0 and c.heartbeats is not None]
    for now, rank in closes:
        ev = events_frame([{"run_id": "sim", "rank": rank, "ts": now, "step": 80, "kind": "agent_closed",
                            "data": "{}"}])
        beats = [c.heartbeats for c in hb if c.heartbeats["ts"].max() <= now]
        findings += analyzer.feed(Frames(events=ev, heartbeats=beats[-1] if beats else None), now=now)
    for k in range(40):
        findings += analyzer.tick(now=t + 2.0 + 0.25 * k)
    hangs = opened(findings, "hang")
    assert [f.rank for f in hangs.values()] == [2], [f.summary() for f in hangs.values()]


def test_the_heartbeats_ops_are_each_rank_s_latest_however_they_were_folded():
    """The op each rank's latest heartbeat names: the same whether read after every commit or
    after many (they are folded in when read, or when unread rows pile up), and the rows held
    stay bounded by the ranks' count."""
    import numpy as np
    import polars as pl

    from analysis.detectors.hang import _HB_FOLD_ROWS, _State
    from analysis.frames import heartbeats_frame

    rng = np.random.default_rng(4)
    every, seldom, frames = _State(), _State(), []
    for commit in range(300):
        ranks = rng.choice(16, size=int(rng.integers(1, 8)), replace=False)
        frames.append(heartbeats_frame([{"run_id": "r", "rank": int(r), "ts": commit + 0.01 * i, "last_seq": commit,
                                         "step": commit, "pid": 1, "phase": "step", "last_op": "all_reduce",
                                         "last_axis": ["dp", "tp"][int(r) % 2], "last_group_id": int(r) // 4,
                                         "last_group_seq": commit * 10 + int(r)} for i, r in enumerate(ranks)]))
        every.add_heartbeats(frames[-1])
        seldom.add_heartbeats(frames[-1])
        every.hb_ops  # read every commit: folded each time, nothing left unfolded
        assert every.footprint()["hb_ops_rows"] <= 16  # one row per rank
        assert seldom.footprint()["hb_ops_rows"] <= 16 + max(_HB_FOLD_ROWS, 32) + 8
    want = pl.concat(frames).sort("ts").unique(subset="rank", keep="last").sort("rank")
    for st in (every, seldom):
        got = st.hb_ops.sort("rank")
        assert got["rank"].to_list() == want["rank"].to_list()
        assert got["last_group_seq"].to_list() == want["last_group_seq"].to_list()
        assert got["last_axis"].to_list() == want["last_axis"].cast(pl.String).to_list()


def test_a_hang_among_ranks_that_beat_every_30_s_is_found_over_three_of_their_beats():
    """0.2 steps/s, heartbeats every 30 s that say so: the learned timeout (2 step intervals, ~11 s)
    is shorter than a beat, so a healthy rank's `last_seq` would look stuck between beats; the
    culprit is judged over 3 beats instead, and named with its step."""
    layout = Layout(dp=4, tp=2, nodes=2)
    sim = Sim(layout=layout, steps=60, seed=3, base_s=5.0, flush_s=30.0, hb_interval=True, finish=False,
              faults=(Hang(rank=2, step=20),))
    commits = sim.build()
    last_progress = sim.step_end_ts(19)
    assert opened(feed(Analyzer(), commits, until=last_progress, tick_s=1.0)) == {}  # healthy until then
    findings = feed(Analyzer(), commits, tick_s=1.0)
    (f,) = opened(findings).values()
    assert (f.kind, f.rank, f.step_from) == ("hang", 2, 20), f.summary()
    assert 3 * 30.0 <= f.ts - last_progress <= 3 * 30.0 + 2 * 30.0, f.ts - last_progress
    assert f.evidence["timeout_s"] == 90.0 and "(timeout 90.0 s)" in f.root_cause  # 3 beats, not the learned ~11 s
