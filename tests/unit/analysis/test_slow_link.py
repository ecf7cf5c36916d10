"""Degraded links: the bus-bandwidth conversion, the `slow_link` detector on synthetic frames
(named with its rank, node and cost; silent on a clean run and on a compute straggler), the
straggler detector silent on a slow link, and the policy's isolation of a costly one."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from analysis import Analyzer
from analysis.detectors.slow_link import _onset, bus_bandwidth, bus_factor
from analysis.frames import Frames, collectives_frame
from analysis.policy import ISOLATE, Policy, RunPolicy
from analysis.rules import rules_from_dict
from tests.unit.analysis.sim import last_of, opened

MiB = 1 << 20


# -- the conversion ---------------------------------------------------------------

@pytest.mark.parametrize("op, n, factor", [("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75),
                                           ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5),
                                           ("broadcast", 4, 1.0), ("send", 2, 1.0), ("recv", 2, 1.0),
                                           ("barrier", 4, 0.0), ("all_reduce", 1, 0.0)])
def test_bus_factors_follow_nccl_tests(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def _row(rank, op, start, duration, nbytes, *, axis="tp", gid=0, gseq=0, peer=-1):
    return {"run_id": "r", "attempt": 0, "step": 1, "rank": rank, "seq": gseq, "group_seq": gseq, "op": op,
            "axis": axis, "group_id": gid, "peer": peer, "start_ts": start, "wait_s": duration,
            "duration_s": duration, "bytes": nbytes}


def test_busbw_of_an_all_reduce_counts_from_the_last_entry():
    # 4 ranks; rank 3 enters 1 s late: the others' 1.01 s are mostly waiting, the transfer is 0.01 s
    rows = [_row(r, "all_reduce", 100.0 + (1.0 if r == 3 else 0.0), 1.01 if r != 3 else 0.01, 8 * MiB)
            for r in range(4)]
    bw = bus_bandwidth(collectives_frame(rows)).sort("rank")
    assert bw["group_size"].to_list() == [4, 4, 4, 4]
    assert bw["transfer_s"].to_numpy() == pytest.approx([0.01] * 4)
    assert bw["algbw"].to_numpy() == pytest.approx([8 * MiB / 0.01] * 4)
    assert bw["busbw"].to_numpy() == pytest.approx([8 * MiB / 0.01 * 1.5] * 4)  # x 2(n-1)/n


def test_busbw_of_gathers_scatters_and_p2p():
    rows = [_row(0, "all_gather", 10.0, 0.5, MiB, axis="dp", gid=0, gseq=1),
            _row(1, "all_gather", 10.0, 0.5, MiB, axis="dp", gid=0, gseq=1),
            _row(0, "reduce_scatter", 20.0, 0.25, MiB, axis="dp", gid=0, gseq=2),
            _row(1, "reduce_scatter", 20.1, 0.15, MiB, axis="dp", gid=0, gseq=2),
            _row(0, "send", 30.0, 0.125, MiB, axis="pp", gid=0, gseq=0, peer=2),
            _row(0, "barrier", 40.0, 0.1, 0, axis="dp", gid=0, gseq=3),  # no bytes: left out
            _row(1, "barrier", 40.0, 0.1, 0, axis="dp", gid=0, gseq=3)]
    bw = bus_bandwidth(collectives_frame(rows)).sort("op", "rank")
    got = {(r["op"], r["rank"]): (r["group_size"], r["transfer_s"], r["busbw"]) for r in bw.iter_rows(named=True)}
    assert set(got) == {("all_gather", 0), ("all_gather", 1), ("reduce_scatter", 0), ("reduce_scatter", 1),
                        ("send", 0)}
    assert got[("all_gather", 0)] == pytest.approx((2, 0.5, MiB / 0.5 * 0.5))
    assert got[("reduce_scatter", 0)] == pytest.approx((2, 0.15, MiB / 0.15 * 0.5))  # from the last entry, 20.1
    assert got[("send", 0)] == pytest.approx((2, 0.125, MiB / 0.125))  # p2p: its own duration, x 1


def test_busbw_of_rows_without_bytes_or_duration_is_empty():
    rows = [_row(r, "all_reduce", 1.0, 0.1, 0) for r in range(2)]
    assert bus_bandwidth(collectives_frame(rows)).height == 0
    rows = [{k: v for k, v in _row(r, "all_reduce", 1.0, 0.1, MiB).items() if k != "duration_s"} for r in range(2)]
    assert bus_bandwidth(collectives_frame(rows)).height == 0


# -- a synthetic dp2 x tp2 run ------------------------------------------------------------

NODES = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}  # ranks: tp innermost, dp = rank // 2
TP_GROUPS = {0: (0, 1), 2: (2, 3)}
DP_GROUPS = {0: (0, 2), 1: (1, 3)}


DP4_NODES = {r: f"node{r}" for r in range(4)}  # a plain data-parallel job: one rank a node, one dp group


def synthetic_run(steps: int = 60, *, seed: int = 0, slow_link: tuple[int, str, int, float] | None = None,
                  straggler: tuple[int, int, float] | None = None, link_factor=None, dp4: bool = False):
    """Commits of a dp2 x tp2 run, one per step: per rank 0.1 s of compute, 8 TP all-reduces of
    1 MiB (~1 ms each) and one DP all-reduce of 4 MiB a step. `slow_link` = (rank, axis, from,
    factor): that rank's transfers on the axis take factor x as long (its partners wait at its
    next entry); `straggler` = (rank, from, factor): its compute does; `link_factor(step, rank,
    axis)`: a further factor on that rank's transfers. `dp4`: a plain dp4 job instead (no tp, one dp
    group of all four ranks, one rank a node)."""
    nodes, tp_groups, dp_groups = (DP4_NODES, {}, {0: (0, 1, 2, 3)}) if dp4 else (NODES, TP_GROUPS, DP_GROUPS)
    rng = np.random.default_rng(seed)
    t = 1000.0
    commits = []
    seqs = {}
    for step in range(1, steps + 1):
        t_rank = {r: t for r in range(4)}
        compute = {r: 0.0 for r in range(4)}
        coll = []

        def slice_of(r, s):
            f = straggler[2] if straggler and straggler[0] == r and step >= straggler[1] else 1.0
            d = s * f * rng.uniform(0.95, 1.05)
            compute[r] += d
            t_rank[r] += d

        def op(axis, gid, members, nbytes, base_s):
            gseq = seqs[(axis, gid)] = seqs.get((axis, gid), -1) + 1
            last_in = max(t_rank[r] for r in members)
            base = base_s * rng.uniform(0.9, 1.1)
            for r in members:
                f = slow_link[3] if slow_link and slow_link[0] == r and slow_link[1] == axis \
                    and step >= slow_link[2] else 1.0
                if link_factor is not None:
                    f *= link_factor(step, r, axis)
                end = last_in + base * f * rng.uniform(0.97, 1.03)
                coll.append({"run_id": "run-1", "attempt": 0, "step": step, "rank": r, "seq": gseq,
                             "group_seq": gseq, "op": "all_reduce", "axis": axis, "group_id": gid, "peer": -1,
                             "start_ts": t_rank[r], "duration_s": end - t_rank[r], "wait_s": end - t_rank[r],
                             "bytes": nbytes})
                t_rank[r] = end

        for _ in range(8):  # forward and backward: a compute slice, then each TP group's all-reduce
            for r in range(4):
                slice_of(r, 0.1 / 9)
            for gid, members in tp_groups.items():
                op("tp", gid, members, MiB, 0.001)
        for r in range(4):
            slice_of(r, 0.1 / 9)
        for gid, members in dp_groups.items():
            op("dp", gid, members, 4 * MiB, 0.004)
        end = max(t_rank.values())
        steps_rows = [{"run_id": "run-1", "attempt": 0, "step": step, "rank": r, "ts": end, "loss": 2.0,
                       "grad_norm": 1.0, "loss_scale": 1.0, "step_s": end - t, "fwd_s": 0.3 * compute[r],
                       "bwd_s": 0.6 * compute[r], "opt_s": 0.1 * compute[r], "node": nodes[r]} for r in range(4)]
        frames = Frames(steps=pl.DataFrame(steps_rows), collectives=collectives_frame(coll))
        if step == 1:
            frames.runs = pl.DataFrame({"run_id": ["run-1"], "world_size": [4], "status": ["running"],
                                        "config": [json.dumps({})],
                                        "mesh": [json.dumps({"dp": 4, "tp": 1, "pp": 1} if dp4 else
                                                            {"dp": 2, "tp": 2, "pp": 1})],
                                        "node_map": [json.dumps({str(r): n for r, n in nodes.items()})]})
            frames.ranks = pl.DataFrame({"run_id": ["run-1"] * 4, "rank": [0, 1, 2, 3],
                                         "node": [nodes[r] for r in range(4)],
                                         "dp": [0, 1, 2, 3] if dp4 else [0, 0, 1, 1],
                                         "tp": [0, 0, 0, 0] if dp4 else [0, 1, 0, 1], "pp": [0, 0, 0, 0]})
        t = end + 0.002
        commits.append((end + 0.01, frames))
    return commits


def run_all(commits):
    a = Analyzer()
    out = []
    for now, frames in commits:
        out.extend(a.feed(frames, now=now))
    return out


@pytest.mark.parametrize("rank, axis, factor", [(3, "tp", 4.0), (1, "dp", 3.0), (0, "tp", 2.0)])
def test_slow_link_named_with_its_rank_node_and_cost(rank, axis, factor):
    onset = 30
    findings = run_all(synthetic_run(slow_link=(rank, axis, onset, factor), seed=rank))
    first = opened(findings)
    assert [f.kind for f in first.values()] == ["slow_link"], [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert (f.rank, f.node) == (rank, NODES[rank])
    assert f.evidence["axis"] == axis
    assert onset <= f.evidence["fired_at_step"] < onset + 8
    assert f.step_from >= onset
    last = last_of(findings)[f.key].evidence
    assert last["busbw_vs_baseline"] < 1 / 1.5 and last["busbw_vs_peer_groups"] < 1 / 1.5
    assert last["link_ratio"] == pytest.approx(factor, rel=0.15)
    # the cost: (factor - 1) x the transfer time of the axis's ops in a step (8 x 1 ms on tp, 4 ms on dp)
    expected = (factor - 1) * (0.008 if axis == "tp" else 0.004)
    assert 0.7 * expected < last["cost_s_per_step"] < 1.3 * expected
    assert 0 < last["share_of_step"] < 1
    assert last["compute_ratio"] < 1.1


def test_the_onset_is_the_latest_run_of_low_steps_bridged_by_a_lone_step_its_link_was_slow_at():
    """What CI and a replay saw on a loaded host: a 4x link from step 20 read 2.1x at step 22 with
    its group's bandwidth not quite low; the run of low steps after it dated the link 24 (23 here).
    A lone slow step, as slow, bridges; a lone noisy low step before a steady one does not count."""
    steps = np.arange(12, 24, dtype=float)
    low = np.zeros(12)
    low[[5, 8, 9, 11]] = 1.0  # steps 17 (noise), 20, 21, 23
    link = np.array([0.0, 0.1, -0.3, 0.2, 0.0, 0.9, 0.1, -0.4, 1.2, 3.2, 0.5, 2.8])
    k = np.log(1.5) / 2
    assert _onset(steps, low, link, k) == 20
    link[10] = 0.1  # step 22 as fast as its partner: the run starts after it
    assert _onset(steps, low, link, k) == 23
    link[10], link[6] = 0.5, 0.5  # step 18, slow-ish, bridges to the noisy 17 only if 19 were low: it is not
    assert _onset(steps, low, link, k) == 20
    low[7] = 1.0  # 17, 18 bridged, 19 low: one run from 17
    assert _onset(steps, low, link, k) == 17
    low[:], link[-1] = 0.0, 0.0  # two steps not low in a row end a run; none low: none
    assert _onset(steps, low, link, k) == -1
    low[[8, 11]] = 1.0
    link[9] = link[10] = 1.0
    assert _onset(steps, low, link, k) == 23


def test_silent_on_a_clean_run():
    assert run_all(synthetic_run(steps=80, seed=7)) == []


@pytest.mark.parametrize("rank", [0, 3])
def test_a_slow_link_in_a_plain_data_parallel_job_is_named_against_its_own_baseline(rank):
    """dp4, one rank a node: the dp axis is one group, with no other group to compare with. Its bus
    bandwidth against its own baseline and the member whose own transfers are slow name it (with a
    lower confidence than where peer groups agree); a clean dp4 run and a dp4 compute straggler open
    none."""
    onset = 30
    first = opened(run_all(synthetic_run(slow_link=(rank, "dp", onset, 4.0), seed=rank, dp4=True)))
    assert [(f.kind, f.rank, f.node) for f in first.values()] == [("slow_link", rank, f"node{rank}")], \
        [f.summary() for f in first.values()]
    f = next(iter(first.values()))
    assert onset <= f.evidence["fired_at_step"] < onset + 8 and f.confidence == 0.6
    assert f.evidence["busbw_vs_peer_groups"] is None
    assert run_all(synthetic_run(steps=80, seed=7, dp4=True)) == []
    assert [x.kind for x in opened(run_all(synthetic_run(straggler=(2, 30, 2.0), seed=5, dp4=True))).values()] \
        in ([], ["straggler"])


def test_a_compute_straggler_is_not_a_slow_link():
    findings = run_all(synthetic_run(steps=80, straggler=(2, 30, 1.5), seed=2))
    assert {f.kind for f in findings} == {"straggler"}
    assert {f.rank for f in findings} == {2}


def test_a_slow_link_is_not_a_straggler():
    findings = run_all(synthetic_run(steps=80, slow_link=(2, "tp", 30, 4.0), seed=3))
    assert {f.kind for f in findings} == {"slow_link"}


def test_it_resolves_when_the_link_recovers():
    commits = synthetic_run(steps=70, slow_link=(3, "tp", 20, 4.0), seed=5)
    healthy = synthetic_run(steps=70, seed=5)
    findings = run_all(commits[:40] + healthy[40:])
    [key] = opened(findings, "slow_link")
    assert last_of(findings)[key].resolved


# -- the policy ------------------------------------------------------------------------

def _incident(cost: float, share: float = 0.2) -> dict:
    return {"id": 9, "kind": "slow_link", "rank": 3, "node": "node1", "status": "open", "step_from": 30,
            "evidence": {"axis": "tp", "cost_s_per_step": cost, "share_of_step": share}}


def test_a_costly_slow_link_isolates_its_node_once_it_persists():
    p, st = Policy(rules_from_dict()), RunPolicy(run_id="run-1", nodes=["node0", "node1"])
    assert p.on_incident(st, _incident(0.05), now=0.0) == []
    assert p.on_incident(st, _incident(0.05), now=3.9) == []
    [d] = p.on_incident(st, _incident(0.05), now=4.0)
    assert (d.kind, d.node, d.rank, d.incident_id) == (ISOLATE, "node1", 3, 9)
    assert d.reason.startswith("slow tp link: rank 3 costs 0.05 s/step")


def test_a_cheap_slow_link_is_left_alone():
    p, st = Policy(rules_from_dict({"policy": {"slow_link_cost_s": 0.02}})), RunPolicy(run_id="run-1")
    assert p.on_incident(st, _incident(0.01), now=0.0) == []
    assert p.on_incident(st, _incident(0.01), now=100.0) == []
    assert p.on_incident(st, _incident(0.05, share=0.01), now=200.0) == []  # a small share of its step
    assert p.on_incident(st, _incident(0.05, share=0.01), now=300.0) == []


def test_a_member_slow_against_its_partner_as_usual_is_not_a_slow_link():
    """Rank 0's dp transfers take 1.6x its partner's on every step (the pp stages' tied-embedding
    all-reduce is like that on shared cores), and for 12 steps its group's transfers all take 4x
    (its group's host busy: both members alike). Its group's bandwidth is low, and against its
    partner rank 0 is over min_ratio all along; against its own usual it is not: nothing opens.
    A real 3x on it, later, still does."""
    def noisy(step, rank, axis):
        busy = axis == "dp" and rank in DP_GROUPS[0] and 30 <= step < 42
        return (1.6 if (rank, axis) == (0, "dp") else 1.0) * (4.0 if busy else 1.0)

    assert [f.summary() for f in run_all(synthetic_run(steps=70, seed=4, link_factor=noisy))] == []
    findings = run_all(synthetic_run(steps=80, seed=4, link_factor=noisy, slow_link=(0, "dp", 50, 3.0)))
    first = opened(findings)
    assert [(f.kind, f.rank) for f in first.values()] == [("slow_link", 0)], [f.summary() for f in first.values()]
    assert next(iter(first.values())).evidence["fired_at_step"] < 50 + 8


def test_a_cheap_slow_link_with_one_huge_step_is_left_alone():
    """Rank 3's dp transfers take 1.6x (low bandwidth, persistently: a cost of ~2% of the step,
    under min_share), and at one step 60x (a rank descheduled as its op ended, on a loaded
    host): the smoothed cost passes min_share for a few steps, the typical step's does not."""
    def spiky(step, rank, axis):
        return 60.0 if (step, rank, axis) == (34, 3, "dp") else 1.0

    findings = run_all(synthetic_run(steps=70, seed=6, slow_link=(3, "dp", 30, 1.6), link_factor=spiky))
    assert [f.summary() for f in findings] == []


def test_latency_bound_ops_are_not_judged():
    """The same 4x slow tp transfers, of 12-byte ops (a scalar all-reduce across stages): their
    time is latency, not bandwidth; under `min_bytes` nothing is judged, nothing opens."""
    commits = synthetic_run(steps=70, slow_link=(3, "tp", 20, 4.0), seed=5)
    for _, frames in commits:
        frames.collectives = frames.collectives.with_columns(
            pl.when(pl.col("axis") == "tp").then(pl.lit(12)).otherwise(pl.col("bytes")).cast(pl.Int64).alias("bytes"))
    assert [f.summary() for f in run_all(commits)] == []


def test_the_compute_of_a_pass_s_steps_is_each_step_s_own_even_share():
    """The slow-link detector reads a pass's compute columns once for all its steps; each step's
    compute is still its own `compute_at_even_share` (a rebalanced step scaled, an even or unknown
    split as it is), and the state it leaves is the per-step loop's."""
    from analysis.detectors.slow_link import SlowLinkDetector
    from analysis.frames import StepColumns, compute_at_even_share, iter_steps, steps_frame
    from analysis.rules import load_rules

    rng = np.random.default_rng(11)
    rows = []
    for step in range(1, 31):
        split = step % 3
        for rank in range(4):
            share = (3 if rank == 0 else 5) if split == 1 else 4
            lo = rank * 8
            rows.append({"run_id": "r", "attempt": 0, "step": step, "rank": rank, "ts": float(step),
                         "loss": 2.0, "grad_norm": 1.0, "loss_scale": 1.0,
                         "step_s": float(rng.uniform(0.08, 0.12)) if rng.random() > 0.1 else None,
                         "fwd_s": float(rng.uniform(0.02, 0.04)), "bwd_s": float(rng.uniform(0.04, 0.06)),
                         "opt_s": float(rng.uniform(0.005, 0.01)),
                         "sample_from": None if split == 2 else lo, "sample_to": None if split == 2 else lo + share})
    rel = steps_frame(rows).sort("attempt", "step", "rank")
    det = SlowLinkDetector(load_rules())
    got, want = det.new_state(), det.new_state()
    det._computes(got, StepColumns(rel))
    for _, _, step_rows in iter_steps(rel):
        step_s = step_rows["step_s"].to_numpy().astype(float)
        det._compute(want, step_rows["rank"].to_numpy().astype(np.int64), compute_at_even_share(step_rows), step_s)
    assert np.array_equal(got.compute_ratio, want.compute_ratio)
    assert np.array_equal(got.compute_excess, want.compute_excess)
    assert got.step_s == want.step_s and list(got.recent_step_s) == list(want.recent_step_s)
    assert not np.allclose(got.compute_ratio, 1.0)  # the steps were judged


def _reference_link_figures(final: pl.DataFrame, min_bytes: int):
    """The figures as the detector computed them with polars window expressions (until the
    numpy pass replaced them): per member and per group, in the same order."""
    bw = final.filter(~pl.col("op").is_in(["send", "recv"]) & (pl.col("bytes") >= min_bytes))
    bw = bus_bandwidth(bw)
    key = ["attempt", "step", "axis", "group_id", "group_seq"]
    ops = bw.with_columns(
        pl.col("axis").cast(pl.String), pl.col("transfer_s").sum().over(key).alias("_sum"),
        pl.len().over(key).alias("_n"), (pl.col("busbw") * pl.col("transfer_s")).alias("_bus_bytes"),
        pl.col("transfer_s").max().over(key).alias("_op_s"), pl.col("transfer_s").median().over(key).alias("_med"))
    ops = ops.with_columns(pl.when(pl.col("_n") <= 2).then((pl.col("_sum") - pl.col("transfer_s")) / (pl.col("_n") - 1))
                           .otherwise(pl.col("_med")).alias("_others"))
    times = pl.col("num_ops").fill_null(1) if "num_ops" in ops.columns else pl.lit(1)
    ops = ops.with_columns((pl.col("transfer_s") / pl.col("_others")).log().alias("_lr"),
                           ((pl.col("transfer_s") - pl.col("_others")).clip(lower_bound=0.0) * times).alias("_excess"))
    per_rank = ops.group_by("attempt", "step", "axis", "group_id", "rank").agg(
        pl.col("_lr").median(), pl.col("_excess").sum()).sort("attempt", "step", "axis", "group_id", "rank")
    groups = ops.unique(subset=key, keep="first", maintain_order=True).group_by("attempt", "step", "axis", "group_id") \
        .agg((pl.col("_bus_bytes").sum() / pl.col("_op_s").sum()).log().alias("lbw")) \
        .sort("attempt", "step", "axis", "group_id")
    return per_rank, groups


@pytest.mark.parametrize("seed", range(6))
def test_a_pass_s_link_figures_are_the_window_expressions_ones(seed):
    """The detector's numpy pass over a pass's final ops (members matched, each member's link ratio
    and excess, each group's bus bandwidth) gives the figures the polars window expressions gave:
    several steps, axes and groups of 2, 3 and 5 members, small ops, sends, summaries' num_ops."""
    from analysis.detectors.slow_link import _link_figures, _OpColumns
    from analysis.frames import Interner

    rng = np.random.default_rng(seed)
    rows = []
    for step in range(1, 5):
        for axis, size, groups in (("tp", 2, 3), ("dp", 3, 2), ("pp", 5, 1), ("world", 4, 1)):
            for gid in range(groups):
                for seq in range(int(rng.integers(1, 4))):
                    op = str(rng.choice(["all_reduce", "all_gather", "reduce_scatter", "broadcast"]))
                    nbytes = int(rng.choice([4096, MiB, 8 * MiB]))
                    for m in range(size):
                        rows.append({**_row(gid * 10 + m, op, 100.0 * step + rng.uniform(0, 0.01),
                                            float(rng.uniform(0.005, 0.05)), nbytes, axis=axis, gid=gid,
                                            gseq=100 * step + seq), "step": step,
                                     "num_ops": int(rng.integers(1, 4)) if rng.random() < 0.5 else None})
        rows.append({**_row(0, "send", 100.0 * step, 0.01, MiB, axis="pp", gid=0, gseq=0, peer=1), "step": step})
    final = collectives_frame(rows)
    want_m, want_g = _reference_link_figures(final, 65536)
    ops = _OpColumns.of(final, Interner(), Interner())
    got = _link_figures(ops.take(np.flatnonzero(~ops.is_p2p & (ops.nbytes >= 65536) & (ops.axis >= 0))))
    names = np.array(got.names, dtype=object)
    assert got.m_key.tolist() == ((want_m["attempt"].cast(pl.Int64) * 2**40) + want_m["step"]).to_list()
    assert names[got.m_axis].tolist() == want_m["axis"].to_list()
    assert got.m_gid.tolist() == want_m["group_id"].to_list() and got.m_rank.tolist() == want_m["rank"].to_list()
    assert got.m_lr == pytest.approx(want_m["_lr"].to_numpy(), rel=1e-12, abs=1e-15)
    assert got.m_excess == pytest.approx(want_m["_excess"].to_numpy(), rel=1e-12, abs=1e-15)
    assert names[got.g_axis].tolist() == want_g["axis"].to_list() and got.g_gid.tolist() == want_g["group_id"].to_list()
    assert got.g_lbw == pytest.approx(want_g["lbw"].to_numpy(), rel=1e-12)
    assert len(got.m_key) > 30 and len(got.g_key) > 12  # most ops judged (the 4 KiB ones are not)

