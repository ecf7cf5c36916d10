"""Pre-flight checks: each node's compute and links timed before the first step.

A node with a slow GPU or a degraded link is otherwise found after it has cost the
first minutes of a run. Before training (`trainer --preflight`, or for any job
`python -m trainer.preflight` under torchrun), every rank of the job takes part:

1. **compute**: each rank times `reps` square matmuls (after one warm-up); a node's
   time is its slowest rank's. Simulated nodes that share one host take turns (timed
   at once they would time each other's contention), and so do their link pairs; each
   takes two turns, the second pass in reverse order, and keeps its faster reading, so
   a burst of the host's load during one turn (a neighbour starting up) cannot make
   that node or pair look slow, or make it the fast one the others are judged by. A
   node `ratio` times the median node's or slower is `slow_compute`.
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

A peer that never answers (a hung GPU, a dead link, a process stuck in its start)
is named, not waited for: the ranks tell each other their results through the job's
c10d store, never by a collective over the world (`Exchange`), and rank 0 waits for
each phase at most `timeout_s` (30 s; each pair's partner as long, then its round's
results twice that). A rank that has not answered by then is `silent`, its node's
verdict is `no_answer`, and the other nodes are still checked and judged (a node whose
partner never came is re-paired in round 2). Each pair's process group is made from
the store for its two ranks alone, with the same timeout. Should rank 0 itself stop
answering, the others raise `PreflightError` naming it. `--inject hang@rank=R,step=0`
makes rank R stop answering after its matmuls.

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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

OK, SLOW_COMPUTE, SLOW_LINK, NO_ANSWER = "ok", "slow_compute", "slow_link", "no_answer"


@dataclass(frozen=True, slots=True)
class Checks:
    matmul_n: int = 384  # the matmul's side: ~1 ms on a CPU core, long enough to time; seconds in all
    reps: int = 7  # timed repetitions of each check (after one warm-up)
    nbytes: int = 4 << 20  # each link op's payload
    ratio: float = 2.0  # this many times the median node (or pair) or slower is slow
    timeout_s: float = 30.0  # a rank that has not answered a phase by then is `no_answer`


def rules_ratio(path: str | os.PathLike | None) -> float | None:
    """The `[preflight] ratio` of a detection rules file (the collector judges the report by
    it), None when the file does not set one. A file that cannot be read is the collector's
    to refuse: None here."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            ratio = tomllib.load(f).get("preflight", {}).get("ratio")
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return None
    return float(ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else None


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


def _pair_group(store, *, key: str, rank: int, device: torch.device, timeout_s: float):
    """A process group of the two ranks of one pair, made straight from the store (not
    `new_group`, which every rank of the world must enter): gloo, or NCCL on a GPU. Its
    timeout bounds the ops of a partner that answered the handshake and then stopped."""
    pg_store = dist.PrefixStore(key, store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pg_store, rank, 2, opts)
    return dist.ProcessGroupGloo(pg_store, rank, 2, timeout)


def _time_link(checks: Checks, pg, device: torch.device, factor: float) -> float:
    n = max(1, checks.nbytes // 4)
    x = torch.ones(n, device=device)
    out = [torch.empty(n, device=device) for _ in range(2)]
    pg.allreduce([x]).wait()  # warm-up (and the pair's connection)
    times = []
    for _ in range(checks.reps):
        t = time.perf_counter()
        pg.allreduce([x]).wait()
        pg.allgather([out], [x]).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _sleep_for(time.perf_counter() - t, factor)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class PreflightError(RuntimeError):
    """The checks could not finish: the coordinator (rank 0) stopped answering."""


class Exchange:
    """What the ranks tell each other during the checks: through the job's c10d store,
    with deadlines, never a collective over the world, which a rank that stopped
    answering would hold up until the process group's timeout (minutes), and then fail
    without saying who it was.

    Each phase, every rank posts its value; the coordinator (rank 0) collects them for
    at most `wait_s` and publishes those it got; every rank reads that, so all agree on
    who answered. A rank that did not is `silent` from then on (no later phase waits for
    it). A coordinator that does not publish in time raises `PreflightError` on the
    others. Waits are polls with a bound (1 to 20 ms apart)."""

    def __init__(self, store, *, rank: int, world: int, timeout_s: float, prefix: str = "llmwatch/preflight",
                 clock=time.monotonic, sleep=time.sleep) -> None:
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.clock, self.sleep = clock, sleep
        self.alive: list[int] = list(range(world))  # the ranks that answered every phase so far
        self.silent: dict[int, str] = {}  # rank -> the first phase it did not answer

    def key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def wait_for(self, keys: list[str], wait_s: float) -> dict[str, Any]:
        """The values of those of `keys` that are set within `wait_s` (all of them, unless
        the wait ran out). One round trip a poll (`check` of them all); never the store's
        own `wait` with a timeout, after which a TCPStore client can misread its next answer."""
        deadline, pause = self.clock() + wait_s, 0.001
        while True:
            if self.store.check(keys):
                present = keys
                break
            if self.clock() >= deadline:
                present = [k for k in keys if self.store.check([k])]
                break
            self.sleep(pause)
            pause = min(0.02, 2 * pause)
        return dict(zip(present, (json.loads(v) for v in self.store.multi_get(present)))) if present else {}

    def gather(self, phase: str, value: Any, wait_s: float | None = None) -> dict[int, Any]:
        """Every alive rank's value of `phase`, by rank (the ranks that did not answer in
        `wait_s`, the timeout by default, are left out, and made silent)."""
        wait_s = self.timeout_s if wait_s is None else wait_s
        self.store.set(self.key(phase, self.rank), json.dumps(value))
        if self.rank == 0:
            want = {self.key(phase, r): r for r in self.alive}
            got = {want[k]: v for k, v in self.wait_for(list(want), wait_s).items()}
            self.store.set(self.key(phase, "all"), json.dumps(sorted(got.items())))
        else:
            # the coordinator's own part of the phase (its link checks) may precede its wait
            published = self.wait_for([self.key(phase, "all")], wait_s + self.timeout_s)
            if not published:
                raise PreflightError(f"preflight: the coordinator (rank 0) did not answer phase {phase!r} "
                                     f"within {wait_s + self.timeout_s:g} s")
            got = {int(r): v for r, v in published[self.key(phase, "all")]}
        for r in self.alive:
            if r not in got:
                self.silent.setdefault(r, phase)
        self.alive = sorted(got)
        return got

    def handshake(self, tag: str) -> bool | None:
        """The two sides of a pair meet, atomically: each adds 1 to the pair's counter; the
        first waits up to the timeout for the second, then closes the counter (compare-and-
        set), unless the second came meanwhile. True: both are here; False: the partner did
        not come; None: this side came after the partner gave up (it is the late one)."""
        key = self.key(tag, "arrived")
        n = self.store.add(key, 1)
        if n != 1:
            return n == 2 or None
        deadline, pause = self.clock() + self.timeout_s, 0.001
        while self.clock() < deadline:
            if self.store.add(key, 0) >= 2:
                return True
            self.sleep(pause)
            pause = min(0.02, 2 * pause)
        return self.store.compare_set(key, "1", str(_CLOSED)) != str(_CLOSED).encode()


_CLOSED = -(1 << 20)  # a pair's counter once its first side gave up: the late side's add stays negative


def _stop_answering() -> None:
    """An injected hang at step 0 (a peer that never answers): the rank stays alive and
    silent until it is stopped."""
    while True:
        time.sleep(3600)


def _round(pairs: list[tuple[str, str]], leader: dict[str, int], ex: Exchange, tag: str, checks: Checks,
           device: torch.device, link_factor: float, shared: bool = False,
           ) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], str]]:
    """Time every pair's link at once (disjoint pairs). When the nodes share a host, one
    pair after the other, twice (the second pass in reverse order), each pair's faster
    time kept. Returns every pair's time, and the pairs whose partner did not come
    (pair -> the node that did not). Every alive rank calls it with the same pairs."""
    times: dict[tuple[str, str], float] = {}
    unanswered: dict[tuple[str, str], str] = {}
    turns = [[p] for p in pairs + pairs[::-1]] if shared else [pairs]
    for i, group in enumerate(turns):
        # a pair whose partner did not come is not waited for again (every rank read the same gather)
        group = [p for p in group if p not in unanswered]
        if not group:
            continue
        mine = None
        for a, b in group:
            if ex.rank not in (leader[a], leader[b]):
                continue
            me, partner = (a, b) if ex.rank == leader[a] else (b, a)
            met = ex.handshake(f"{tag}/{i}/{a}-{b}")
            if not met:  # the partner did not come (False), or came before this side (None)
                mine = [a, b, None, partner if met is False else me]
                continue
            try:
                pg = _pair_group(ex.store, key=ex.key(tag, i, f"{a}-{b}", "pg"), rank=0 if me == a else 1,
                                 device=device, timeout_s=ex.timeout_s)
                mine = [a, b, _time_link(checks, pg, device, link_factor), None]
                del pg
            except RuntimeError:  # the partner came, then stopped answering (DistStoreError, a gloo timeout)
                mine = [a, b, None, partner]
        # a leader may wait out its partner's handshake before it posts
        got = ex.gather(f"{tag}/{i}", mine, wait_s=2 * ex.timeout_s)
        for v in got.values():
            if v is None:
                continue
            a, b, t, missing = v
            if t is not None:
                times[(a, b)] = min(float(t), times.get((a, b), float("inf")))
            else:  # the side that came says who did not (or that it came late itself)
                unanswered.setdefault((a, b), missing)
        for a, b in group:  # neither leader posted: the first silent one is named
            if (a, b) not in times and (a, b) not in unanswered:
                unanswered[(a, b)] = a if leader[a] not in got else b
    return times, unanswered


def run_checks(*, node: str, store, rank: int, world: int, checks: Checks = Checks(),
               device: torch.device | None = None, compute_factor: float = 1.0, link_factor: float = 1.0,
               hang: bool = False, node_of: dict[int, str] | None = None) -> dict[str, Any]:
    """The checks above, every rank of the job calling it with the job's c10d store
    (trainer/worker.py's, or torchrun's); the report, the same on every rank that answered.
    No collective over the world is used: a rank that never answers (`checks.timeout_s`)
    has its node judged `no_answer`, and the rest are still judged.
    `compute_factor`, `link_factor`: this rank's injected slow-downs (1: none); `hang`:
    this rank stops answering before the link checks (an injected hang at step 0);
    `node_of`: every rank's node where the launcher knows it (names a rank silent from the start)."""
    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    ex = Exchange(store, rank=rank, world=world, timeout_s=checks.timeout_s)
    seen = ex.gather("hello", [node, socket.gethostname(), link_factor])
    node_by_rank = {r: n for r, (n, _, _) in seen.items()}
    node_by_rank.update({r: n for r, n in (node_of or {}).items() if r in ex.silent})
    ranks: dict[str, list[int]] = {}
    for r, n in sorted(node_by_rank.items()):
        ranks.setdefault(n, []).append(r)
    factors: dict[str, float] = {}
    for n, _, f in seen.values():
        factors[n] = max(factors.get(n, 1.0), f)
    # simulated nodes sharing one host (tests, a laptop) take turns: timed at once they would
    # time each other's contention for the host's cores, not themselves
    shared = len({h for _, h, _ in seen.values()}) < len(ranks)
    turns = sorted(ranks, key=lambda n: ranks[n][0])
    matmul_s = float("inf")
    passes = turns + turns[::-1] if shared else [None]  # two turns each: a burst of load spoils one
    for i, turn in enumerate(passes):
        if turn is None or turn == node:
            matmul_s = min(matmul_s, _time_matmul(checks, device, compute_factor))
        if shared and i < len(passes) - 1:
            ex.gather(f"turn/{i}", None)
    times = ex.gather("compute", matmul_s)
    if hang:
        _stop_answering()
    node_s: dict[str, float] = {}
    for r, s in times.items():
        n = node_by_rank[r]
        node_s[n] = max(node_s.get(n, 0.0), s)
    compute_ratio = compute_ratios(node_s) if node_s else {}
    unanswered: list[tuple[int, tuple[str, str], str]] = []  # (round, pair, the node that did not come)

    def silent_nodes() -> set[str]:
        return {node_by_rank[r] for r in ex.silent if r in node_by_rank} | {who for _, _, who in unanswered}

    nodes = [n for n in turns if n not in silent_nodes()]  # the nodes whose links are checked
    leader = {n: ranks[n][0] for n in nodes}
    # the node's link slow-down acts at its leader, whichever of its ranks it was injected on
    my_link = factors.get(node, 1.0) if rank == leader.get(node) else 1.0
    rounds: list[dict[tuple[str, str], float]] = []
    link_s: dict[str, list[float]] = {n: [] for n in ranks}
    suspects: list[str] = []
    slow_link: set[str] = set()
    ref = None

    def run_round(no: int, subs: list[list[tuple[str, str]]]) -> dict[tuple[str, str], float]:
        # every alive rank takes part in every gather, in a pair or not
        out: dict[tuple[str, str], float] = {}
        for j, sub in enumerate(subs):
            t, missed = _round(sub, leader, ex, f"round{no}/{j}", checks, device, my_link, shared)
            out.update(t)
            unanswered.extend((no, pair, who) for pair, who in missed.items())
        return out

    if len(nodes) >= 2:
        first = run_round(1, first_pairs(nodes))
        rounds.append(first)
        slow = slow_pairs(first, checks.ratio)
        gone = silent_nodes()
        # a node whose partner did not come has no time yet: it is re-paired, as a suspect is
        suspects = [n for n in nodes if n not in gone and (any(n in p for p in slow) or not any(n in p for p in first))]
        healthy = [n for n in nodes if n not in suspects and n not in gone]
        ref = reference(first) if first else None
        if suspects and healthy and ref is not None:
            again = run_round(2, second_pairs(suspects, healthy))
            rounds.append(again)
            slow_link = {s for (s, _), t in again.items() if t >= checks.ratio * ref}
        for r in rounds:
            for (a, b), t in r.items():
                link_s[a].append(t)
                link_s[b].append(t)
    gone = silent_nodes()
    report_nodes = {}
    for n in turns:
        verdict = OK
        if n in gone:
            verdict = NO_ANSWER
        elif compute_ratio.get(n, 0.0) >= checks.ratio:
            verdict = SLOW_COMPUTE
        elif n in slow_link:
            verdict = SLOW_LINK
        entry = {"ranks": ranks[n], "matmul_s": node_s.get(n), "compute_ratio": compute_ratio.get(n),
                 "link_s": link_s[n], "suspect": n in suspects, "verdict": verdict,
                 "link_ratio": (max(link_s[n]) / ref) if link_s[n] and ref and len(nodes) >= 3 else None,
                 "best_link_s": min(link_s[n]) if link_s[n] else None}
        if verdict == NO_ANSWER:
            entry["silent_ranks"] = sorted(r for r in ex.silent if r in ranks[n])
            entry["silent_in"] = sorted({ex.silent[r].split("/")[0] for r in entry["silent_ranks"]} |
                                        {f"round{k}" for k, _, who in unanswered if who == n})
        report_nodes[n] = entry
    return {"nodes": report_nodes, "rounds": len(rounds), "shared_host": shared,
            "pairs": [[[a, b, t] for (a, b), t in r.items()] for r in rounds],
            "unanswered": [[k, a, b, who] for k, (a, b), who in unanswered],
            "silent_ranks": sorted(ex.silent), "timeout_s": checks.timeout_s,
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
        matmul = (f"matmul {1e3 * r['matmul_s']:.2f} ms ({r['compute_ratio']:.2f}x)" if r.get("matmul_s") is not None
                  else "matmul -")
        line = f"  {n:<12} {r['verdict']:<13} {matmul}  link ms {links}"
        if r["verdict"] == NO_ANSWER:
            line += (f"  (silent in {', '.join(r.get('silent_in') or ['?'])} for {report.get('timeout_s', 0):g} s"
                     + (f": rank {', '.join(map(str, r['silent_ranks']))}" if r.get("silent_ranks") else "") + ")")
        lines.append(line)
    unknown = [r for r in report.get("silent_ranks") or [] if not any(r in x["ranks"] for x in report["nodes"].values())]
    if unknown:
        lines.append(f"  rank(s) {', '.join(map(str, unknown))} never said which node they are on")
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
    ap.add_argument("--timeout-s", type=float, default=Checks().timeout_s,
                    help="a rank that has not answered a phase by then is no_answer (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="rank 0 prints the report as JSON")
    ap.add_argument("--inject", action="append", default=[], metavar="SPEC",
                    help="fault a rank for a test, as trainer --inject does: straggler@rank=R,from=0,factor=F "
                         "(its matmuls), slowlink@rank=R,axis=dp,from=0,factor=F (its node's links), "
                         "hang@rank=R,step=0 (it stops answering)")
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's store (served by node 0's agent): no process group over the world is made,
    # so none can be held up by a rank that never answers
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world,
                                       timeout=timedelta(seconds=max(60.0, 4 * args.timeout_s))))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.nodes:
        node = f"node{rank // max(1, world // args.nodes)}"
    else:
        node = os.environ.get("LLMWATCH_NODE") or socket.gethostname()
    compute, link, hang = injected_faults(args.inject, rank=rank, world=world)
    try:
        report = run_checks(node=node, store=store, rank=rank, world=world, device=device, compute_factor=compute,
                            link_factor=link, hang=hang,
                            checks=Checks(matmul_n=args.matmul_n, reps=args.reps, nbytes=args.nbytes,
                                          ratio=args.ratio, timeout_s=args.timeout_s))
    except PreflightError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 3
    if rank == 0:
        print(json.dumps(report) if args.json else render(report), flush=True)
        _record(report, node, world)
    return 3 if bad_nodes(report) else 0


def injected_faults(specs: list[str], *, rank: int, world: int) -> tuple[float, float, bool]:
    """(compute, link, hang) of `rank` from `--inject` specs at step 0 (trainer/faults.py's
    syntax; the others do not touch the checks): its matmul and link slow-downs, and
    whether it stops answering."""
    from trainer.faults import parse_injections

    compute = link = 1.0
    hang = False
    for inj in parse_injections(specs, world_size=world):
        if inj.step == 0 and inj.rank in (-1, rank):
            if inj.kind == "straggler":
                compute = max(compute, inj.factor)
            elif inj.kind == "slowlink":
                link = max(link, inj.factor)
            elif inj.kind == "hang":
                hang = True
    return compute, link, hang


def _record(report: dict[str, Any], node: str, world: int) -> None:
    """The report as the `preflight` event of the run $LLMWATCH_RUN_ID (the job's, when its
    launcher set it), when a collector is configured ($LLMWATCH_URL)."""
    if not os.environ.get("LLMWATCH_URL"):
        return
    from agent.integrations._common import make_agent

    a = make_agent(run_id=None, rank=0, world_size=world, node=node)
    try:
        a.event("preflight", step=0, **report)
    finally:
        a.close()


if __name__ == "__main__":
    sys.exit(main())
