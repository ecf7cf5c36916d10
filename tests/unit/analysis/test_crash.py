"""Crashes: heartbeats stop (within 5 s), or the launcher reports the exit (at once); never a clean end."""

from analysis import Analyzer, Frames
from analysis.frames import events_frame, heartbeats_frame
from tests.unit.analysis.sim import Crash, Layout, Sim, feed, last_of, opened

LAYOUT = Layout(dp=2, tp=2, nodes=2)


def crash_run(**kw):
    sim = Sim(layout=LAYOUT, steps=200, seed=7, finish=False, faults=(Crash(rank=2, step=100, **kw),))
    commits = sim.build()
    findings = feed(Analyzer(), commits, tick_to=sim.truth[-1]["ts"] + 30.0)
    return sim, findings


def test_a_silent_rank_is_a_crash_within_five_seconds_and_its_waiting_peers_are_no_hang():
    sim, findings = crash_run()
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["crash"]
    f = next(iter(first.values()))
    assert (f.rank, f.node) == (2, "node1")
    assert f.ts - sim.truth[-1]["ts"] <= 5.0
    assert f.step_from <= 100 <= f.step_to


def test_the_launchers_report_names_the_rank_at_once():
    sim, findings = crash_run(launcher=True)
    first = opened(findings)
    (f,) = first.values()
    assert f.rank == 2 and f.confidence == 1.0 and f.evidence["exit"]["exit_code"] == 17
    assert f.ts - sim.truth[-1]["ts"] <= 1.0
    assert last_of(findings)[f.key].evidence["num_silent"] == LAYOUT.world  # the others, stopped: same incident


def test_peers_failing_right_after_are_the_same_incident():
    sim, findings = crash_run(cascade=True)
    first = opened(findings)
    (f,) = first.values()
    assert f.rank == 2


def test_a_run_that_finished_normally_is_never_a_crash():
    sim = Sim(layout=LAYOUT, steps=150, seed=8)
    commits = sim.build()
    assert feed(Analyzer(), commits, tick_to=commits[-1][0] + 60.0) == []


def beats(rank, ts, step=5, seq=10):
    return {"run_id": "r", "rank": rank, "ts": ts, "node": f"n{rank}", "pid": 100 + rank, "phase": "train",
            "step": step, "last_seq": seq}


def test_a_rank_whose_agent_closed_cleanly_is_finished_not_crashed():
    a = Analyzer()
    out = []
    for t in range(10):
        rows = [beats(0, float(t), seq=t)] + ([beats(1, float(t), seq=t)] if t < 3 else [])
        ev = events_frame([{"run_id": "r", "rank": 1, "ts": 2.5, "step": 5, "kind": "agent_closed", "data": "{}"}]) \
            if t == 3 else None
        out += a.feed(Frames(heartbeats=heartbeats_frame(rows), events=ev), now=float(t))
    assert out == []


def test_every_rank_silent_without_run_finished_is_one_crash_and_a_restart_resolves_it():
    a = Analyzer()
    for t in range(5):
        a.feed(Frames(heartbeats=heartbeats_frame([beats(r, float(t), seq=t) for r in range(3)])), now=float(t))
    out = []
    for t in range(5, 20):
        out += a.tick(now=float(t))
    assert [(f.kind, f.rank) for f in out] == [("crash", None)]
    assert out[0].ts >= 4.0 + 10.0  # run_silence_s
    back = a.feed(Frames(heartbeats=heartbeats_frame([beats(r, 30.0, seq=1) for r in range(3)])), now=30.0)
    assert [f.resolved for f in back] == [True]


def test_a_large_jobs_ranks_going_silent_one_node_after_another_are_one_incident():
    """20,000 ranks; the first node's 8 go silent, then the rest of the job within the cascade
    window: one crash, its silent ranks counted and listed in order, the ones that went with
    the first named, and every rank beating again resolves it."""
    import numpy as np

    world = 20_000
    a = Analyzer()
    ranks = np.arange(world)

    def beat(t: float, who: np.ndarray):
        rows = {"run_id": ["r"] * len(who), "rank": who.tolist(), "ts": [t] * len(who),
                "node": [f"n{r // 8}" for r in who.tolist()], "pid": (100 + who).tolist(), "phase": ["train"] * len(who),
                "step": [5] * len(who), "last_seq": [int(t)] * len(who)}
        return a.feed(Frames(heartbeats=heartbeats_frame(rows)), now=t)

    out = []
    for t in range(5):
        out += beat(float(t), ranks)
    out += beat(5.0, ranks[8:])  # node n0 silent from 4 s
    out += beat(5.5, ranks[8:])
    for t in np.arange(6.0, 10.0, 0.5):  # the rest beat at 5.5 s last: silent 0.5 s after the first
        out += a.tick(now=float(t))
    for t in range(10, 20):
        out += a.tick(now=float(t))
    crashes = opened(out)
    assert [f.kind for f in crashes.values()] == ["crash"], [f.summary() for f in out]
    last = last_of(out)[next(iter(crashes))]
    assert last.evidence["num_silent"] == world
    assert last.evidence["silent_ranks"] == list(range(32))
    assert last.evidence["went_silent_together"] and all(r != last.rank for r in last.evidence["went_silent_together"])
    back = beat(30.0, ranks)
    assert [f.resolved for f in back if f.kind == "crash"] == [True]


def test_a_rank_not_yet_at_its_first_step_gets_the_startup_slack_then_is_a_crash():
    # Before step 1 a rank imports, rendezvous and compiles: its heartbeat thread can go
    # without the interpreter for seconds. 5 s of silence there is no crash; 15 s is.
    a = Analyzer()

    def beat(t, ranks):
        rows = [beats(r, float(t), step=None, seq=-1) | {"phase": "init"} for r in ranks]
        return a.feed(Frames(heartbeats=heartbeats_frame(rows)), now=float(t))

    out = beat(0, range(3))
    for t in range(1, 30):
        out += beat(t, [0, 1] + ([2] if 6 <= t < 8 else []))
        if t == 7:
            assert out == []  # rank 2 was silent from 0 s to 6 s: past silence_s, within the start-up slack
    assert [(f.kind, f.rank) for f in opened(out).values()] == [("crash", 2)]
    assert next(f for f in out if f.kind == "crash").ts >= 7.0 + 15.0


def test_a_silent_rank_whose_peers_go_on_past_it_is_late_telemetry_not_a_crash():
    """Rank 1's agent goes quiet for 6 s (its posts time out on an overloaded host and spool)
    while rank 0 keeps reporting steps: rank 0 could not finish step s + 2 without rank 1 through
    step s + 1, so rank 1 is alive. Once rank 0 stops going on (waiting on rank 1 in a collective,
    as it would if rank 1 had died), the silence counts: rank 1 is a crash."""
    from analysis.frames import steps_frame

    def step_row(rank, step, ts):
        return {"run_id": "r", "attempt": 0, "step": step, "rank": rank, "ts": ts, "loss": 2.0, "grad_norm": 1.0,
                "loss_scale": 1.0, "step_s": 0.1, "fwd_s": 0.03, "bwd_s": 0.05, "opt_s": 0.01, "node": f"n{rank}"}

    a = Analyzer()
    out, step = [], 1
    for t in range(3):  # both beat and step
        out += a.feed(Frames(heartbeats=heartbeats_frame([beats(r, float(t), step=step, seq=t) for r in range(2)]),
                             steps=steps_frame([step_row(r, step, float(t)) for r in range(2)])), now=float(t))
        step += 1
    for t in range(3, 9):  # rank 1 silent, rank 0 goes on
        out += a.feed(Frames(heartbeats=heartbeats_frame([beats(0, float(t), step=step, seq=t)]),
                             steps=steps_frame([step_row(0, step, float(t))])), now=float(t))
        step += 1
    assert out == []
    for t in range(9, 16):  # rank 0 stops going on: it waits for rank 1, still beating
        out += a.feed(Frames(heartbeats=heartbeats_frame([beats(0, float(t), step=step, seq=9)])), now=float(t))
    assert [(f.kind, f.rank) for f in opened(out).values()] == [("crash", 1)]
    assert next(f for f in out if f.kind == "crash").ts >= 8.0 + 3.0  # silence_s after rank 0's last step


def test_the_culprit_failing_again_before_it_beat_is_a_new_crash():
    """A rank exits once a round: its second failed exit is the restarted job's crash, even when it
    came before the rank's first heartbeat of that round (half a second in). It was folded into the
    first incident, and the policy never saw it."""
    import json

    sim = Sim(layout=LAYOUT, steps=200, seed=7, finish=False, faults=(Crash(rank=2, step=100, launcher=True),))
    commits = sim.build()
    t = sim.truth[-1]["ts"] + 2.0
    again = events_frame([{"run_id": sim.run_id, "rank": -1, "ts": t, "step": -1, "kind": "rank_exited",
                           "data": json.dumps({"rank": 2, "exit_code": 17, "signal": None, "cause": "exited"})}])
    a = Analyzer()
    out = feed(a, commits)
    out += a.feed(Frames(events=again), now=t + 0.1)
    crashes = [f for f in opened(out, "crash").values()]
    assert [f.rank for f in crashes] == [2, 2], [(f.key, f.rank) for f in crashes]
    first = last_of(out)[crashes[0].key]
    assert first.status == "resolved" and first.evidence["resolved_because"] == "the job restarted, and the rank failed again"
    assert crashes[1].evidence["exit"]["ts"] == t


# A 100,000-rank job's shape at a small size: 0.2 steps/s, each agent flushing and beating every 30 s.
SLOW_BEATS = dict(layout=Layout(dp=4, tp=2, nodes=2), steps=40, seed=3, base_s=5.0, flush_s=30.0)


def test_ranks_that_beat_every_30_s_and_say_so_are_not_silent_between_beats():
    """Each agent says its heartbeat interval: silence is 3 of them, not `silence_s`. The same
    heartbeats without it read as one crash after another (every rank is quiet for 30 s at a time)."""
    said = Sim(**SLOW_BEATS, hb_interval=True).build()
    assert feed(Analyzer(), said, tick_to=said[-1][0] + 60.0, tick_s=1.0) == []
    unsaid = Sim(**SLOW_BEATS).build()
    crashes = opened(feed(Analyzer(), unsaid, tick_to=unsaid[-1][0] + 60.0, tick_s=1.0), "crash")
    assert len(crashes) >= 3, [f.summary() for f in crashes.values()]


def test_a_rank_that_beats_every_30_s_is_named_when_three_of_its_beats_are_missed():
    sim = Sim(**SLOW_BEATS, hb_interval=True, finish=False, faults=(Crash(rank=2, step=20),))
    commits = sim.build()
    findings = feed(Analyzer(), commits, tick_to=commits[-1][0] + 300.0, tick_s=1.0)
    (f,) = opened(findings).values()
    assert (f.kind, f.rank, f.node) == ("crash", 2, LAYOUT_SLOW_NODE), f.summary()
    assert f.evidence["silence_s"] == 90.0 and f.evidence["culprit"]["heartbeat_interval_s"] == 30.0
    died = sim.truth[-1]["ts"]
    # never before 3 beats of silence (its last beat came at most one interval before it died), and
    # within two more beats' time of them: its peers' steps past it vouch for it until they stop
    assert 90.0 - 30.0 <= f.ts - died <= 90.0 + 2 * 30.0, f.ts - died
    assert f.evidence["culprit"]["silent_for_s"] >= 90.0


LAYOUT_SLOW_NODE = SLOW_BEATS["layout"].node(2)
