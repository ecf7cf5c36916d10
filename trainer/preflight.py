"""Pre-flight checks: each node's compute and links timed before the first step.

A node with a slow GPU or a degraded link is otherwise found after it has cost the
first minutes of a run. Before training (`trainer --preflight`, or for any job
`python -m trainer.preflight` under torchrun), every rank of the job takes part:

1. **compute**: each rank times `reps` square matmuls (after one warm-up); a node's
   time is its slowest rank's. Simulated nodes that share one host take turns (timed
   at once they would time each other's contention), and so do their link pairs. A node `ratio` times the median node's or slower is
   `slow_compute`.
2. **links, in rounds** (DLRover's network check): one rank a node (its lowest)
   stands for it. Round 1 pairs the nodes (0-1, 2-3, ...; an odd one out pairs with
   node 0 after the others); each pair times `reps` all-reduces and all-gathers of
   `nbytes` over a process group of its two. A pair `ratio` times the median pair's
   or slower makes both its nodes suspects. Round 2 pairs each suspect with a node
   of a fast pair: a suspect slow again is `slow_link`, one fast now is cleared (its
   first partner was the slow one). Two nodes make one pair, which nothing compares:
   their links are not judged.

Every rank ends with the same report (a dict: per node its ranks, matmul seconds and
ratio, its link times and ratio, its verdict; the pairs of each round; the rounds
and seconds taken). Rank 0 records it as the `preflight` event; the collector's
`preflight` detector opens an incident for each node whose verdict is not `ok`, and
the policy isolates it (a spare takes its place when there is one).

Injected slow-downs that start at step 0 (`--inject straggler@rank=R,from=0,...`,
`slowlink@rank=R,...,from=0,...`) slow the checks of their rank too: its matmuls and
its node's link ops take `factor` times as long (the rank sleeps the difference).

Not built: a peer that never answers. The collectives wait for the process group's
timeout (`--timeout-s`), then the check raises, and the job fails at start as it
would have at its first step.

    torchrun --nnodes 4 --nproc-per-node 8 ... -m trainer.preflight [--ratio 1.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

OK, SLOW_COMPUTE, SLOW_LINK = "ok", "slow_compute", "slow_link"


@dataclass(frozen=True, slots=True)
class Checks:
    matmul_n: int = 384  # the matmul's side: ~1 ms on a CPU core, long enough to time; seconds in all
    reps: int = 7  # timed repetitions of each check (after one warm-up)
    nbytes: int = 4 << 20  # each link op's payload
    ratio: float = 2.0  # this many times the median node (or pair) or slower is slow


def first_pairs(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """Round 1, as sub-rounds of disjoint pairs (a node in one pair at a time): neighbours
    paired (0-1, 2-3, ...), then an odd one out with the first node."""
    out = [[(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]]
    if len(nodes) % 2 and len(nodes) > 1:
        out.append([(nodes[-1], nodes[0])])
    return [sub for sub in out if sub]


def reference(times: dict[tuple[str, str], float]) -> float:
    """The pair time the others are measured against: the median pair's; of two, the faster's."""
    return statistics.median(times.values()) if len(times) >= 3 else min(times.values())


def slow_pairs(times: dict[tuple[str, str], float], ratio: float) -> set[tuple[str, str]]:
    """The pairs `ratio` times the reference or slower (none of fewer than 2 pairs: nothing to
    compare)."""
    if len(times) < 2:
        return set()
    ref = reference(times)
    return {p for p, t in times.items() if t >= ratio * ref}


def second_pairs(suspects: list[str], healthy: list[str]) -> list[list[tuple[str, str]]]:
    """Round 2: each suspect with a healthy node, as sub-rounds of disjoint pairs (a node in
    one pair at a time): as many sub-rounds as suspects per healthy node."""
    if not healthy:
        return []
    out: list[list[tuple[str, str]]] = []
    for start in range(0, len(suspects), len(healthy)):
        out.append([(s, healthy[i]) for i, s in enumerate(suspects[start:start + len(healthy)])])
    return out


def compute_ratios(node_s: dict[str, float]) -> dict[str, float]:
    """Each node's matmul time over the median node's."""
    med = statistics.median(node_s.values())
    return {n: (s / med if med > 0 else 1.0) for n, s in node_s.items()}


def _sleep_for(elapsed: float, factor: float) -> None:
    if factor > 1.0:
        time.sleep(elapsed * (factor - 1.0))


def _time_matmul(checks: Checks, device: torch.device, factor: float) -> float:
    a = torch.randn(checks.matmul_n, checks.matmul_n, device=device)
    b = torch.randn(checks.matmul_n, checks.matmul_n, device=device)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(checks.reps):
        t = time.perf_counter()
        c = torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t
        _sleep_for(dt, factor)
        times.append(time.perf_counter() - t)
    del c
    return statistics.median(times)


def _time_link(checks: Checks, group, device: torch.device, factor: float) -> float:
    n = max(1, checks.nbytes // 4)
    x = torch.ones(n, device=device)
    out = [torch.empty(n, device=device) for _ in range(2)]
    dist.all_reduce(x, group=group)  # warm-up (and the pair's connection)
    times = []
    for _ in range(checks.reps):
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        dist.all_gather(out, x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _sleep_for(time.perf_counter() - t, factor)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _round(pairs: list[tuple[str, str]], leader: dict[str, int], rank: int, checks: Checks, device: torch.device,
           link_factor: float, shared: bool = False) -> dict[tuple[str, str], float]:
    """Time every pair's link at once (disjoint pairs; one after the other when the nodes share
    a host); every rank gets every pair's time. Every rank makes every pair's group (new_group
    is collective), in the same order."""
    groups = [dist.new_group([leader[a], leader[b]]) for a, b in pairs]
    mine = None
    for (a, b), g in zip(pairs, groups):
        if rank in (leader[a], leader[b]):
            mine = ((a, b), _time_link(checks, g, device, link_factor))
        if shared:
            dist.barrier()
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    for g in groups:
        dist.destroy_process_group(g)
    return {tuple(p): t for p, t in (x for x in got if x is not None)}


def run_checks(*, node: str, checks: Checks = Checks(), device: torch.device | None = None,
               compute_factor: float = 1.0, link_factor: float = 1.0) -> dict[str, Any]:
    """The checks above, on the default process group (every rank calls it); the report.
    `compute_factor`, `link_factor`: this rank's injected slow-downs (1: none)."""
    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (rank, node, socket.gethostname(), link_factor))
    ranks: dict[str, list[int]] = {}
    factors: dict[str, float] = {}
    for r, n, _, f in sorted(seen):
        ranks.setdefault(n, []).append(r)
        factors[n] = max(factors.get(n, 1.0), f)
    nodes = sorted(ranks, key=lambda n: ranks[n][0])
    # simulated nodes sharing one host (tests, a laptop) take turns: timed at once they would
    # time each other's contention for the host's cores, not themselves
    shared = len({h for _, _, h, _ in seen}) < len(nodes)
    matmul_s = 0.0
    for turn in nodes if shared else [None]:
        if turn is None or turn == node:
            matmul_s = _time_matmul(checks, device, compute_factor)
        if shared:
            dist.barrier()
    times: list[Any] = [None] * world
    dist.all_gather_object(times, (node, matmul_s))
    node_s: dict[str, float] = {}
    for n, s in times:
        node_s[n] = max(node_s.get(n, 0.0), s)
    leader = {n: ranks[n][0] for n in nodes}
    # the node's link slow-down acts at its leader, whichever of its ranks it was injected on
    my_link = factors[node] if rank == leader[node] else 1.0
    compute_ratio = compute_ratios(node_s)
    rounds: list[dict[tuple[str, str], float]] = []
    link_s: dict[str, list[float]] = {n: [] for n in nodes}
    suspects: list[str] = []
    slow_link: set[str] = set()
    if len(nodes) >= 2:
        first: dict[tuple[str, str], float] = {}
        for sub in first_pairs(nodes):
            first.update(_round(sub, leader, rank, checks, device, my_link, shared))
        rounds.append(first)
        slow = slow_pairs(first, checks.ratio)
        suspects = [n for n in nodes if any(n in p for p in slow)]
        healthy = [n for n in nodes if n not in suspects]
        ref = reference(first)
        if suspects and healthy:
            again: dict[tuple[str, str], float] = {}
            for sub in second_pairs(suspects, healthy):
                again.update(_round(sub, leader, rank, checks, device, my_link, shared))
            rounds.append(again)
            slow_link = {s for (s, _), t in again.items() if t >= checks.ratio * ref}
        for r in rounds:
            for (a, b), t in r.items():
                link_s[a].append(t)
                link_s[b].append(t)
    report_nodes = {}
    for n in nodes:
        verdict = OK
        if compute_ratio[n] >= checks.ratio:
            verdict = SLOW_COMPUTE
        elif n in slow_link:
            verdict = SLOW_LINK
        best = min(link_s[n]) if link_s[n] else None
        report_nodes[n] = {"ranks": ranks[n], "matmul_s": node_s[n], "compute_ratio": compute_ratio[n],
                           "link_s": link_s[n], "suspect": n in suspects, "verdict": verdict,
                           "link_ratio": (max(link_s[n]) / ref) if link_s[n] and len(nodes) >= 3 else None,
                           "best_link_s": best}
    return {"nodes": report_nodes, "rounds": len(rounds), "shared_host": shared,
            "pairs": [[[a, b, t] for (a, b), t in r.items()] for r in rounds],
            "ratio": checks.ratio, "matmul_n": checks.matmul_n, "nbytes": checks.nbytes, "reps": checks.reps,
            "elapsed_s": time.perf_counter() - t0}


def bad_nodes(report: dict[str, Any]) -> dict[str, str]:
    """node -> verdict, of the nodes that did not pass."""
    return {n: r["verdict"] for n, r in report["nodes"].items() if r["verdict"] != OK}


def render(report: dict[str, Any]) -> str:
    lines = [f"preflight: {len(report['nodes'])} node(s), {report['rounds']} link round(s), "
             f"{report['elapsed_s']:.1f} s; slow at {report['ratio']:g}x the median"]
    for n, r in report["nodes"].items():
        links = ", ".join(f"{1e3 * t:.1f}" for t in r["link_s"]) or "-"
        lines.append(f"  {n:<12} {r['verdict']:<13} matmul {1e3 * r['matmul_s']:.2f} ms "
                     f"({r['compute_ratio']:.2f}x)  link ms {links}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: every rank runs the checks; rank 0 prints the report (or `--json`) and,
    with LLMWATCH_URL set, records it as the run's `preflight` event (an agent of its own).
    Exit 0 when every node passed, 3 when one did (`... -m trainer.preflight && torchrun ...`)."""
    ap = argparse.ArgumentParser(prog="python -m trainer.preflight", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=Checks().ratio, help="slow at this many times the median")
    ap.add_argument("--matmul-n", type=int, default=Checks().matmul_n)
    ap.add_argument("--nbytes", type=int, default=Checks().nbytes, help="each link op's payload")
    ap.add_argument("--reps", type=int, default=Checks().reps)
    ap.add_argument("--nodes", type=int, default=0,
                    help="simulated nodes on one host: rank r is on node r // (world / nodes) (default: the "
                         "hostname, or LLMWATCH_NODE)")
    ap.add_argument("--json", action="store_true", help="rank 0 prints the report as JSON")
    ap.add_argument("--inject", action="append", default=[], metavar="SPEC",
                    help="slow a rank down for a test, as trainer --inject does: straggler@rank=R,from=0,factor=F "
                         "(its matmuls), slowlink@rank=R,axis=dp,from=0,factor=F (its node's links)")
    args = ap.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" \
            else torch.device("cpu")
        if args.nodes:
            node = f"node{rank // max(1, world // args.nodes)}"
        else:
            node = os.environ.get("LLMWATCH_NODE") or socket.gethostname()
        compute, link = injected_factors(args.inject, rank=rank, world=world)
        report = run_checks(node=node, device=device, compute_factor=compute, link_factor=link,
                            checks=Checks(matmul_n=args.matmul_n, reps=args.reps, nbytes=args.nbytes, ratio=args.ratio))
        if rank == 0:
            print(json.dumps(report) if args.json else render(report), flush=True)
            _record(report, node)
        return 3 if bad_nodes(report) else 0
    finally:
        dist.destroy_process_group()


def injected_factors(specs: list[str], *, rank: int, world: int) -> tuple[float, float]:
    """(compute, link) slow-downs of `rank` from `--inject` specs that start at step 0
    (trainer/faults.py's syntax; the others do not touch the checks)."""
    from trainer.faults import parse_injections

    compute = link = 1.0
    for inj in parse_injections(specs, world_size=world):
        if inj.step == 0 and inj.rank in (-1, rank):
            if inj.kind == "straggler":
                compute = max(compute, inj.factor)
            elif inj.kind == "slowlink":
                link = max(link, inj.factor)
    return compute, link


def _record(report: dict[str, Any], node: str) -> None:
    """The report as the `preflight` event of the run $LLMWATCH_RUN_ID (the job's, when its
    launcher set it), when a collector is configured ($LLMWATCH_URL)."""
    if not os.environ.get("LLMWATCH_URL"):
        return
    from agent.integrations._common import make_agent

    a = make_agent(run_id=None, rank=0, world_size=dist.get_world_size(), node=node)
    try:
        a.event("preflight", step=0, **report)
    finally:
        a.close()


if __name__ == "__main__":
    sys.exit(main())
