"""What one detector pass costs at scale: 10,000 simulated ranks, one commit per step.

Each commit holds what a collector would have committed for one step of a
`dp x tp x pp` run: a steps row and a heartbeat per rank, and every rank's
collectives of the step (TP all-reduces in forward, backward and the norm,
pipeline send/recv, the DP all-reduce, the PP all-reduce, the control
broadcast): ~10 per rank, ~100,000 rows; each op waits for its group's last
member and then transfers for ~2 ms (healthy links). `--summaries`: the
collectives as agent/summary.py's rows instead, as a job of 256 ranks or more
sends them. The tables are built as Arrow tables
with dictionary-encoded strings, as `collector/ingest/columns.py` makes them, before
the clock starts; the timed part is what the detection thread does per commit:
`Frames.from_arrow` (zero copy) and `Analyzer.feed`. One rank is a 1.5x
straggler from step 40, so the incident path is in the measurement too (`--healthy`: none,
the cost of watching a run that goes well).

Printed: the median, p90 and max pass time over the measured steps (and the median CPU
time of a pass, every thread counted: steadier on a shared host), after a
warm-up that fills the baselines. Goal: < 100 ms per pass.

    python bench/bench_detection_cost.py                      # 10,000 ranks
    python bench/bench_detection_cost.py --dp 125 --steps 80  # 2,000 ranks
    python bench/bench_detection_cost.py --dp 6250 --steps 60 --summaries  # 100,000 ranks, summarized
    python bench/bench_detection_cost.py --dp 2 --tp 1 --pp 1 --steps 1200 --warmup 240 --steps-per-commit 12
                                              # a dp2 job at 12 steps/s: one pass a second (the flush grid)

`--steps-per-commit N` commits N steps at once, as a small job's collector does: its
ranks flush once a second together (agent/agent.py's flush grid), so a pass judges a
second's steps. There the cost per step, not per pass, is what the job pays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis import Analyzer, Frames  # noqa: E402
from analysis.frames import SUMMARIES, summarize_ops  # noqa: E402

OPS = ["all_reduce", "send", "recv", "broadcast"]
AXES = ["tp", "pp", "dp", "world"]


def _dict(codes: np.ndarray, values: list[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int16)), pa.array(values))


def op_template(dp: int, tp: int, pp: int) -> dict[str, np.ndarray]:
    """Every rank's ops of one step, flattened: rank, op, axis, group_id, peer, fraction
    of its compute when entered, index among its group's ops in the step, seq in step."""
    world = dp * tp * pp
    r = np.arange(world)
    tp_i, dp_i, pp_i = r % tp, (r // tp) % dp, r // (tp * dp)
    stride = dp * tp
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("rank", "op", "axis", "gid", "peer", "frac", "gidx")}

    def add(mask, op, axis, gid, peer, frac, gidx):
        m = np.flatnonzero(mask)
        for k, v in (("rank", r[m]), ("op", np.full(len(m), op)), ("axis", np.full(len(m), axis)),
                     ("gid", np.broadcast_to(gid, world)[m]), ("peer", np.broadcast_to(peer, world)[m]),
                     ("frac", np.full(len(m), frac)), ("gidx", np.full(len(m), gidx))):
            cols[k].append(np.asarray(v))

    everyone = np.ones(world, bool)
    for i, frac in enumerate((0.1, 0.25, 0.5, 0.75, 0.95)):
        add(everyone & (tp > 1), 0, 0, r - tp_i, -1, frac, i)
    add(pp_i < pp - 1, 1, 1, r, r + stride, 0.3, 0)
    add(pp_i > 0, 2, 1, r - stride, r - stride, 0.02, 0)
    add(everyone & (dp > 1), 0, 2, pp_i * stride + tp_i, -1, 0.9, 0)
    add(everyone & (pp > 1), 0, 1, dp_i * tp + tp_i, -1, 1.0, 0)
    add(everyone, 3, 3, 0, -1, 1.0, 0)
    out = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.lexsort((out["frac"], out["rank"]))
    out = {k: v[order] for k, v in out.items()}
    per_rank = np.bincount(out["rank"], minlength=world)
    first = np.r_[0, np.cumsum(per_rank)[:-1]]
    out["seq_in_step"] = np.arange(len(order)) - first[out["rank"]]
    out["ops_per_step"] = per_rank[out["rank"]]
    return out


def build_commits(dp: int, tp: int, pp: int, steps: int, seed: int, straggler: int | None, summaries: bool = False):
    """The commits, one per step, made as they are consumed (a 100,000-rank step is ~1 M op rows).
    `summaries`: each rank's collectives of the step as agent/summary.py's rows (`collectives_rollup`)."""
    rng = np.random.default_rng(seed)
    world = dp * tp * pp
    ranks_per_node = 8
    nodes = [f"node{i}" for i in range(world // ranks_per_node + 1)]
    node_code = np.arange(world) // ranks_per_node
    tmpl = op_template(dp, tp, pp)
    n_ops = len(tmpl["rank"])
    tp_i, dp_i, pp_i = np.arange(world) % tp, (np.arange(world) // tp) % dp, np.arange(world) // (tp * dp)
    t0 = 1_000_000.0
    t = t0
    gseq_per_step = {0: 5 if tp > 1 else 0}
    ranks = pa.table({"run_id": pa.array(["bench"] * world), "rank": pa.array(np.arange(world, dtype=np.int32)),
                      "node": _dict(node_code, nodes), "dp": pa.array(dp_i.astype(np.int32)),
                      "tp": pa.array(tp_i.astype(np.int32)), "pp": pa.array(pp_i.astype(np.int32))})
    runs = pa.table({"run_id": ["bench"], "world_size": pa.array([world], pa.int32()), "status": ["running"],
                     "config": ['{"eval_every": 0, "ckpt": {"every": 0}}'],
                     "mesh": [f'{{"dp": {dp}, "tp": {tp}, "pp": {pp}}}'], "node_map": [None]})
    for k in range(steps):
        step = k + 1
        compute = 0.5 * rng.uniform(0.9, 1.1, world)
        if straggler is not None and step >= 40:
            compute[straggler] *= 1.5
        dur = compute.max() + 0.05
        end = t + dur
        c = compute
        steps_tbl = pa.table({
            "run_id": _dict(np.zeros(world), ["bench"]), "attempt": pa.array(np.zeros(world, np.int32)),
            "step": pa.array(np.full(world, step, np.int64)), "rank": pa.array(np.arange(world, dtype=np.int32)),
            "ts": pa.array(end + rng.uniform(0, 0.01, world)),
            "loss": pa.array(np.full(world, 3.0 + 5 * np.exp(-step / 50))),
            "grad_norm": pa.array(np.full(world, 1.0 * np.exp(rng.normal(0, 0.1)))),
            "loss_scale": pa.array(np.ones(world)), "lr": pa.array(np.full(world, 1e-4)),
            "tokens": pa.array(np.full(world, 4096, np.int64)), "step_s": pa.array(np.full(world, dur)),
            "fwd_s": pa.array(0.3 * c), "bwd_s": pa.array(0.6 * c), "opt_s": pa.array(0.1 * c),
            "data_s": pa.array(np.full(world, 0.001)), "comm_exposed_s": pa.array(dur - c),
            "mem_bytes": pa.array(np.full(world, 1 << 30, np.int64)), "skipped": pa.array(np.zeros(world, bool)),
            "node": _dict(node_code, nodes)})
        start = t + tmpl["frac"] * c[tmpl["rank"]]
        per_group = np.where(tmpl["axis"] == 0, gseq_per_step[0], 1)
        # each op waits for its group's last member, then moves its bytes in ~2 ms (a send or receive: no
        # wait, its duration is its transfer): what real links do, so the slow-link detector sees a job
        # with healthy links, not noise
        instance = ((tmpl["axis"].astype(np.int64) * (world + 1) + tmpl["gid"]) * 8 + tmpl["gidx"]) * 2 + \
            (tmpl["peer"] >= 0)
        inst, at = np.unique(instance, return_inverse=True)
        last_in = np.full(len(inst), -np.inf)
        np.maximum.at(last_in, at, start)
        p2p = tmpl["peer"] >= 0
        wait = np.where(p2p, 0.0, last_in[at] - start)
        transfer = 0.002 * rng.uniform(0.95, 1.05, n_ops)
        coll = pa.table({
            "run_id": _dict(np.zeros(n_ops), ["bench"]), "attempt": pa.array(np.zeros(n_ops, np.int32)),
            "step": pa.array(np.full(n_ops, step, np.int64)), "rank": pa.array(tmpl["rank"].astype(np.int32)),
            "seq": pa.array((k * tmpl["ops_per_step"] + tmpl["seq_in_step"]).astype(np.int64)),
            "group_seq": pa.array((k * per_group + tmpl["gidx"]).astype(np.int64)),
            "op": _dict(tmpl["op"], OPS), "axis": _dict(tmpl["axis"], AXES),
            "group_id": pa.array(tmpl["gid"].astype(np.int32)), "peer": pa.array(tmpl["peer"].astype(np.int32)),
            "bytes": pa.array(np.full(n_ops, 1 << 20, np.int64)), "start_ts": pa.array(start),
            "duration_s": pa.array(wait + transfer), "wait_s": pa.array(wait)})
        hb = pa.table({
            "run_id": _dict(np.zeros(world), ["bench"]), "rank": pa.array(np.arange(world, dtype=np.int32)),
            "ts": pa.array(end + rng.uniform(0, 0.5, world)), "node": _dict(node_code, nodes),
            "pid": pa.array(np.arange(world, dtype=np.int64) + 1000), "phase": _dict(np.zeros(world), ["train"]),
            "step": pa.array(np.full(world, step, np.int64)),
            "last_seq": pa.array(((k + 1) * np.bincount(tmpl["rank"], minlength=world) - 1).astype(np.int64))})
        tables = {"steps": steps_tbl, "collectives": coll, "heartbeats": hb}
        if summaries:
            del tables["collectives"]
            tables[SUMMARIES] = summarize_ops(pl.from_arrow(coll)).to_arrow()
        if k == 0:
            tables.update(ranks=ranks, runs=runs)
        yield end + 0.5, tables
        t = end + 0.002


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=625)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=30, help="steps not measured (baselines fill)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--healthy", action="store_true", help="no straggler: the cost of a run that goes well")
    ap.add_argument("--steps-per-commit", type=int, default=1,
                    help="steps per commit (a small job's ranks flush once a second: a pass judges a second's steps)")
    ap.add_argument("--summaries", action="store_true",
                    help="the collectives as a summarizing agent sends them (agent/summary.py), not a row per op")
    args = ap.parse_args(argv)
    world = args.dp * args.tp * args.pp
    straggler = None if args.healthy else (world // 2 + 3) % world
    analyzer = Analyzer()
    times, cpus, findings, build_s = [], [], [], 0.0
    commits = build_commits(args.dp, args.tp, args.pp, args.steps, args.seed, straggler, args.summaries)
    per = max(1, args.steps_per_commit)
    for i in range(0, args.steps, per):
        t_build = time.perf_counter()
        batch = [next(commits) for _ in range(min(per, args.steps - i))]
        now = batch[-1][0]
        tables = {name: pa.concat_tables([t[name] for _, t in batch if name in t], promote_options="default")
                  for name in {n for _, t in batch for n in t}}
        build_s += time.perf_counter() - t_build
        if i == 0:
            rows = sum(t.num_rows for t in tables.values())
            print(f"{world} ranks (dp {args.dp} x tp {args.tp} x pp {args.pp}), {rows:,} rows per commit of "
                  f"{len(batch)} step(s) ({'summaries' if args.summaries else 'a row per op'})")
        t0, c0 = time.perf_counter(), time.process_time()
        out = analyzer.feed(Frames.from_arrow(tables), now=now)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i >= args.warmup:
            times.append(dt / len(batch))
            cpus.append(cpu / len(batch))
        findings.extend(out)
    times_ms = sorted(1e3 * t for t in times)
    p90 = times_ms[int(0.9 * (len(times_ms) - 1))]
    opened = {f.key: f for f in findings}
    print(f"detector pass per step{'' if per == 1 else ' (a pass over ' + str(per) + ' steps, divided)'}: median {statistics.median(times_ms):.1f} ms, p90 {p90:.1f} ms, "
          f"max {times_ms[-1]:.1f} ms over {len(times_ms)} passes (goal < 100 ms at 10,000 ranks, < 1 s at "
          f"100,000); the commits took {build_s:.1f} s to make")
    # CPU seconds of the pass (every thread: polars works on a pool): steadier than wall time on a shared host
    print(f"detector CPU per step: median {1e3 * statistics.median(cpus):.1f} ms")
    for f in list(opened.values())[:10]:
        print(f"  {f.summary()}")
    named = [f for f in opened.values() if f.kind == "straggler" and f.rank == straggler]
    print(("no fault injected" if straggler is None else f"straggler rank {straggler}: "
           f"{'found' if named else 'NOT found'}") + "; other incidents: "
          f"{len([f for f in opened.values() if f not in named])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
