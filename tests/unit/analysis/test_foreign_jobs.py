"""Jobs we did not write (a plain DDP loop, a Trainer callback): Flight Recorder collectives without
`wait_s`, phase times not net of communication, no global loss, each rank its own replica."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis import Analyzer, Frames
from analysis.attribution import WaitBook
from analysis.frames import collectives_frame, ranks_frame, runs_frame, steps_frame
from tests.unit.analysis.foreign import DdpRun, Delay, ForeignNan, ReplicaSpike
from tests.unit.analysis.sim import Hang, Layout, feed, last_of, opened

NAN = float("nan")


# -- WaitBook: waits inferred from the arrival skew ------------------------------------------------
def _fr(step: int, rank: int, seq: int, gseq: int, start: float, op: str = "all_reduce") -> dict:
    """A Flight Recorder row: no wait_s (not measured)."""
    return {"run_id": "r", "attempt": 0, "step": step, "rank": rank, "seq": seq, "group_seq": gseq, "op": op,
            "axis": "dp", "group_id": 0, "peer": -1, "start_ts": start, "wait_s": None}


def _waits(book: WaitBook, step: int) -> dict[int, float]:
    ranks, waited = book.inferred_waits(0, step)
    return dict(zip(ranks.tolist(), waited.tolist()))


def test_blocking_ops_wait_their_skews_summed():
    """Rank 1 enters each op 30 ms after rank 0, which cannot enter the next before it came."""
    book = WaitBook(alpha=0.5)
    rows = []
    for k in range(3):
        t = 10.0 + k * 0.1
        rows += [_fr(1, 0, k, k, t, "_allgather_base"), _fr(1, 1, k, k, t + 0.03, "_allgather_base")]
    book.add(collectives_frame(rows))
    book.finalize(0, 1)
    assert _waits(book, 1) == pytest.approx({0: 0.09, 1: 0.0})
    assert book.waited_for(0, 1) == pytest.approx(0.5 * 0.09)
    assert book.last_share(np.array([1]))[0] == 1.0


def test_async_buckets_wait_only_the_skew_at_the_last_one():
    """DDP: rank 1 enqueues every bucket 40 ms late, 5 ms apart; rank 0 moved on to its next bucket
    before rank 1 came (async), and waits at the end of backward only: the last bucket's skew."""
    book = WaitBook(alpha=0.5)
    rows = []
    for step in (1, 2):
        t0 = 10.0 * step
        for j in range(4):
            g = (step - 1) * 4 + j
            rows += [_fr(step, 0, g, g, t0 + 0.005 * j), _fr(step, 1, g, g, t0 + 0.005 * j + 0.04)]
    book.add(collectives_frame(rows))
    book.finalize(0, 1)
    assert _waits(book, 1) == pytest.approx({0: 0.04, 1: 0.0})
    assert not book.is_final(0, 2) and book.inferred_waits(0, 2) is None
    book.finalize(0, 2)
    assert book.is_final(0, 2) and _waits(book, 2) == pytest.approx({0: 0.04, 1: 0.0})


def test_a_kind_seen_to_move_on_is_async_and_waits_only_at_its_sync_point():
    """Skews smaller than the buckets' spacing: 'behind by the same lag at every op' reads as blocking
    until the ops are seen to move on; once they are (async), only the step's last one is waited."""
    book = WaitBook(alpha=0.5, async_min_share=0.05)
    rng = np.random.default_rng(0)
    rows, g = [], 0
    for step in range(1, 41):
        t0 = 10.0 * step
        lag = 0.003 if step % 2 else 0.007  # every other step the skew outgrows the 5 ms spacing
        for j in range(4):
            t = t0 + 0.005 * j + rng.uniform(0, 1e-4)
            rows += [_fr(step, 0, g, g, t), _fr(step, 1, g, g, t + lag)]
            g += 1
    book.add(collectives_frame(rows))
    book.finalize(0, 2)
    assert _waits(book, 1)[0] == pytest.approx(4 * 0.003, abs=1e-3)  # not yet known async: the rule's sum
    book.finalize(0, 40)
    assert _waits(book, 39)[0] == pytest.approx(0.003, abs=2e-4)  # async: the last bucket alone
    assert _waits(book, 40)[0] == pytest.approx(0.007, abs=2e-4)
    assert book.footprint()["op_kinds"] == 1 and book.footprint()["inferred_steps"] <= 64


def test_measured_waits_are_taken_as_they_are():
    """Our trainer's rows (wait_s measured): nothing inferred, nothing kept per step."""
    book = WaitBook(alpha=0.5)
    rows = [{**_fr(1, 0, 0, 0, 10.0), "wait_s": 0.01}, {**_fr(1, 1, 0, 0, 10.03), "wait_s": 0.0}]
    book.add(collectives_frame(rows))
    book.finalize(0, 1)
    assert not book.inferring and book.inferred_waits(0, 1) is None
    assert book.waited_for(0, 1) == pytest.approx(0.5 * 0.01)  # min(wait_s, skew)


# -- stragglers --------------------------------------------------------------------------------------
def _kinds(findings) -> list[tuple]:
    return [(f.kind, f.rank) for f in opened(findings).values()]


@pytest.mark.parametrize("world, waited", [(2, 20), (4, 5)])
def test_a_straggler_from_before_the_first_verdict_is_dated_from_its_onset(world, waited):
    """A rank slow from step 25, before any verdict can come (on inferred waits, not before the
    drift is measured: ~64 steps on two ranks). Its sum has climbed since step 25; the change point
    over the latest judged steps, all of them slow, found none and put the onset at the verdict
    (step 61 for a 2x Hugging Face straggler from step 25, on two shared cores)."""
    onset = 25
    sim = DdpRun(layout=Layout(dp=world, nodes=2), steps=140, seed=11 + world,
                 faults=(Delay(rank=1, start=onset, extra_s=0.040),))
    first = opened(feed(Analyzer(), sim.build()))
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 1)], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert f.evidence["fired_at_step"] > onset + waited  # the verdict waited for the drift (dp2: longest)
    assert onset - 3 <= f.step_from <= onset + 1, f.summary()


@pytest.mark.parametrize("burst_ms", [10, 14])
def test_a_straggler_whose_sum_a_burst_had_lifted_is_dated_from_its_own_onset(burst_ms):
    """Rank 1 runs 1.3-1.4x slow over steps 10-17, then 2x from step 25: its sum left zero at
    10 and never came back before the straggler began (a CI run of a real DDP job: a climb from
    step 23, a straggler from 40, named from 23). The verdict waited for the drift, past the 32
    steps the change point looked over, all of them slow: the onset was put at the climb's start."""
    onset = 25
    sim = DdpRun(layout=Layout(dp=2, nodes=2), steps=160, seed=5,
                 faults=(Delay(rank=1, start=10, end=18, extra_s=burst_ms / 1e3),
                         Delay(rank=1, start=onset, extra_s=0.040)))
    first = opened(feed(Analyzer(), sim.build()))
    assert [(f.kind, f.rank) for f in first.values()] == [("straggler", 1)], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert f.evidence["fired_at_step"] > onset + 32  # past what the old look-back held
    assert onset - 3 <= f.step_from <= onset + 1, f.summary()


@pytest.mark.parametrize("world, rank, broadcast, timings", [
    (2, 1, False, True), (4, 2, False, True), (4, 3, True, True), (4, 0, False, False)],
    ids=["dp2", "dp4", "dp4-broadcast-buffers", "dp4-step-time-only"])
def test_a_slow_ddp_rank_is_named_with_its_cost(world, rank, broadcast, timings):
    """40 ms more forward on one rank of a 35 ms step: every rank's step_s doubles, the peers' bwd_s
    holds the wait, the slow rank enqueues every bucket ~40 ms after them. Named within a few steps,
    cost ~ the delay; a Trainer callback (step_s alone) is judged the same way."""
    onset = 100
    sim = DdpRun(layout=Layout(dp=world, nodes=2), steps=220, seed=world + rank, broadcast_buffers=broadcast,
                 timings=timings, faults=(Delay(rank=rank, start=onset, extra_s=0.040),))
    findings = feed(Analyzer(), sim.build())
    assert _kinds(findings) == [("straggler", rank)], [f.summary() for f in opened(findings).values()]
    f = next(iter(opened(findings).values()))
    assert onset <= f.evidence["fired_at_step"] < onset + 10
    assert onset - 3 <= f.step_from <= onset + 1
    last = last_of(findings)[f.key]
    assert 0.03 < last.evidence["cost_s_per_step"] < 0.05
    assert last.evidence["waited_on"]["last_share"] >= 0.75  # last at every bucket (not at a broadcast)
    assert last.evidence["per_rank"][str(rank)]["caused_wait_s_per_step"] > 0.02


@pytest.mark.parametrize("world, broadcast, timings, seed", [
    (2, False, True, 1), (4, False, True, 2), (4, True, True, 3), (2, True, False, 4)],
    ids=["dp2", "dp4", "dp4-broadcast-buffers", "dp2-step-time-only"])
def test_clean_ddp_runs_open_nothing(world, broadcast, timings, seed):
    """+-20% jitter on every phase of every rank, skews of a few ms either way, 1 ms clock error."""
    sim = DdpRun(layout=Layout(dp=world, nodes=2), steps=450, seed=seed, broadcast_buffers=broadcast,
                 timings=timings)
    commits = sim.build()
    analyzer = Analyzer()
    findings = feed(analyzer, commits, tick_to=commits[-1][0] + 10.0)
    assert [f.summary() for f in findings] == []
    st = analyzer.runs["sim"].detectors["straggler"]
    assert st.num_steps_judged > 400 and st.num_unjudged_steps == 0
    assert max(analyzer.runs["sim"].footprint()["straggler.held_steps"], 0) <= 64


# -- loss spikes without a global loss ---------------------------------------------------------------
@pytest.mark.parametrize("world, rank", [(8, 0), (4, 0), (2, 1)])
def test_one_replicas_poisoned_batch_is_named_against_its_peers(world, rank):
    """1.7x on one replica: the mean moves 1.09x (of 8), 1.18x (of 4), 1.35x (of 2). Named at its step,
    with its local loss and the peers' median."""
    step = 150
    sim = DdpRun(layout=Layout(dp=world, nodes=2), steps=220, seed=world, loss_noise=0.03,
                 faults=(ReplicaSpike(rank=rank, step=step, factor=1.7),))
    findings = feed(Analyzer(), sim.build())
    assert _kinds(findings) == [("loss_spike", rank)], [f.summary() for f in opened(findings).values()]
    f = next(iter(opened(findings).values()))
    assert f.step_from == step and f.ts - sim.step_end_ts(step) < 2.5
    last = last_of(findings)[f.key]
    assert last.rank == rank and last.node == sim.layout.node(rank) and last.resolved
    peers = last.evidence["replica_vs_peers"]
    assert peers["replica"] == rank and last.evidence["suspect_replica"] == rank
    assert peers["local_loss"] / peers["peers_median"] == pytest.approx(1.7, rel=0.15)
    assert f"replica {rank} (rank {rank})" in last.root_cause and last.evidence["samples"] is None


@pytest.mark.parametrize("step", [40, 150])
def test_with_a_global_loss_the_spike_names_the_one_replica_far_above_its_peers(step):
    """A Trainer logs the replicas' mean: the global spike is flagged at first sight, and the
    replica is named against its peers even early, while its own baseline still lags the
    falling curve."""
    sim = DdpRun(layout=Layout(dp=2, nodes=2), steps=step + 40, seed=3, global_loss=True,
                 faults=(ReplicaSpike(rank=0, step=step, factor=2.5),))
    findings = feed(Analyzer(detectors=["loss_spike", "grad_spike"]), sim.build())
    assert [f.kind for f in opened(findings).values()] == ["loss_spike"], [f.summary() for f in findings]
    last = next(iter(last_of(findings).values()))  # opened at first sight, the replica named once complete
    assert last.step_from == step and last.evidence["suspect_replica"] == 0 and last.rank == 0, last.summary()


@pytest.mark.parametrize("world, noise, seed", [(2, 0.05, 11), (4, 0.05, 12), (8, 0.03, 13), (16, 0.05, 14)])
def test_replicas_batch_noise_opens_no_spike(world, noise, seed):
    sim = DdpRun(layout=Layout(dp=world, nodes=2), steps=500, seed=seed, loss_noise=noise)
    findings = feed(Analyzer(detectors=["loss_spike", "grad_spike"]), sim.build())
    assert [f.summary() for f in findings] == []


def test_a_replica_that_stays_above_its_peers_is_a_level_shift_not_a_string_of_spikes():
    """One shard 1.6x harder from step 120 on: one incident, closed as that replica's level shift."""
    sim = DdpRun(layout=Layout(dp=4, nodes=2), steps=260, seed=7,
                 faults=(ReplicaSpike(rank=2, step=120, factor=1.6, grad_factor=1.0, end=1 << 20),))
    findings = feed(Analyzer(detectors=["loss_spike", "grad_spike"]), sim.build())
    assert _kinds(findings) == [("loss_spike", 2)], [f.summary() for f in opened(findings).values()]
    last = next(iter(last_of(findings).values()))
    assert last.resolved and last.evidence["resolved_because"] == "replica 2's level shift"
    assert last.step_from == 120 and last.step_to < 120 + 30


def _foreign_row(step: int, rank: int, local: float, **kw) -> dict:
    return {"run_id": "r", "attempt": 0, "step": step, "rank": rank, "ts": float(step), "loss": None,
            "grad_norm": 1.0, "loss_scale": None, "step_s": 0.1, "local_loss": local, "finite_fwd": 1,
            "finite_bwd": 1, **kw}


def _foreign_analyzer(world: int) -> Analyzer:
    a = Analyzer(detectors=["loss_spike", "grad_spike", "nan"])
    meta = Frames(runs=runs_frame([{"run_id": "r", "world_size": world, "mesh": f'{{"dp": {world}}}'}]),
                  ranks=ranks_frame([{"run_id": "r", "rank": r, "node": f"n{r}", "dp": r, "tp": 0, "pp": 0}
                                     for r in range(world)]))
    a.feed(meta, now=0.0)
    return a


def test_a_step_without_a_global_loss_is_judged_when_complete_not_at_first_sight():
    a = _foreign_analyzer(4)
    rng = np.random.default_rng(3)
    for step in range(1, 41):
        rows = [_foreign_row(step, r, 3.0 * math.exp(rng.normal(0, 0.02))) for r in range(4)]
        assert a.feed(Frames(steps=steps_frame(rows)), now=float(step)) == []
    out = a.feed(Frames(steps=steps_frame([_foreign_row(41, 0, 5.1)])), now=41.0)  # the poisoned replica first
    assert out == []
    out = a.feed(Frames(steps=steps_frame([_foreign_row(41, r, 3.0) for r in (1, 2, 3)])), now=41.5)
    assert [(f.kind, f.rank, f.step_from) for f in out] == [("loss_spike", 0, 41)]
    assert out[0].evidence["replica_vs_peers"]["peers_median"] == pytest.approx(3.0)


# -- NaN: the origin rank from its own signals -------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_a_nan_on_one_rank_is_named_there_though_every_ranks_gradients_went_bad(world):
    """Rank 1: local loss NaN, finite_fwd 0 at step 30; every rank's finite_bwd 0 and grad norm NaN
    from step 30 (DDP reduced them), every rank's local loss NaN from 31."""
    sim = DdpRun(layout=Layout(dp=world, nodes=2), steps=60, seed=5, faults=(ForeignNan(rank=1, step=30),))
    findings = feed(Analyzer(), sim.build())
    assert _kinds(findings) == [("nan", 1)], [f.summary() for f in opened(findings).values()]
    assert {f.rank for f in findings} == {1}  # never another rank on the way
    f = next(iter(opened(findings).values()))
    assert f.step_from == 30 and f.evidence["origin"]["phase"] == "forward"
    assert f.ts - sim.step_end_ts(30) <= 1.0


def test_reduced_gradient_flags_arriving_first_name_no_rank():
    """Rank 0's row of the step (its grads NaN after the all-reduce, its own loss finite) is in
    before rank 1's: no rank is named for it; rank 1's finite_fwd 0 names rank 1."""
    a = _foreign_analyzer(2)
    bad_bwd = {"finite_bwd": 0, "grad_norm": NAN}
    out = a.feed(Frames(steps=steps_frame([_foreign_row(30, 0, 3.0, **bad_bwd)])), now=1.0)
    assert [(f.kind, f.rank) for f in out] == [("nan", None)]
    assert "origin unknown" in out[0].root_cause
    out = a.feed(Frames(steps=steps_frame([_foreign_row(30, 1, NAN, finite_fwd=0, **bad_bwd)])), now=1.2)
    assert [(f.kind, f.rank, f.step_from) for f in out] == [("nan", 1, 30)]


# -- hangs: the rank that never entered the collective ----------------------------------------------
@pytest.mark.parametrize("world, broadcast", [(2, True), (4, True), (2, False), (4, False)],
                         ids=["dp2-broadcast", "dp4-broadcast", "dp2-buckets", "dp4-buckets"])
def test_a_hang_names_the_rank_and_the_collective_it_never_entered(world, broadcast):
    """Rank 1 never starts step 300's forward (heartbeat at step 299, last_seq its last completed
    row); its peers enter step 300 and block: in the forward's broadcast (one op pending), or
    after enqueuing all four bucket all-reduces (the first is the one rank 1 never entered)."""
    hang = 300
    sim = DdpRun(layout=Layout(dp=world, nodes=2), steps=400, seed=world, finish=False,
                 broadcast_buffers=broadcast, faults=(Hang(rank=1, step=hang),))
    commits = sim.build()
    last_progress = sim.step_end_ts(hang - 1)
    analyzer = Analyzer()
    findings = feed(analyzer, commits, until=last_progress + 20.0)
    assert _kinds(findings) == [("hang", 1)], [f.summary() for f in opened(findings).values()]
    f = next(iter(opened(findings).values()))
    assert f.step_from == hang
    interval = analyzer.runs["sim"].clock.interval_s
    assert f.ts - last_progress <= max(5.0, 3 * interval)
    per_step = 5 if broadcast else 4
    op = "broadcast" if broadcast else "all_reduce"
    c = f.evidence["collective"]
    assert (c["op"], c["axis"], c["group_id"], c["group_seq"]) == (op, "dp", 0, (hang - 1) * per_step)
    assert f.evidence["num_waiting"] == world - 1
    assert f"rank 1 never entered {op} on dp group 0 (group_seq {(hang - 1) * per_step})" in f.root_cause
