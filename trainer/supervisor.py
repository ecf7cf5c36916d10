"""The embedded launcher as a supervisor: the job restarted on the nodes that are left.

`Supervisor.run()` starts one process per rank for the current `Layout`, watches
them, and decides what an ending means:

- every rank exited 0: the job is done;
- every rank exited `EXIT_RESTART` (they carried out an `isolate` command:
  checkpointed, wrote the node into the run's membership file): restart without
  the isolated node;
- the collector marked a node of this layout `isolated` (its policy, for a hang
  whose ranks cannot act on a command, or any isolation): the ranks get
  `isolate_grace_s` to leave by themselves, then are stopped, and the job
  restarts without the node;
- a rank failed (a crash): the others are stopped; the job restarts on the same
  nodes from its last checkpoint, up to `--max-restarts`, unless the collector's
  policy isolates the crashed node (its second crash): then without it. The
  supervisor waits a few seconds for that decision (`CRASH_DECISION_S`). When the
  policy answers with a `stop` (restarts that made no progress: the job crashes
  where it crashed before), the job ends with the policy's reason instead.

A node left out is replaced by a standby node while there is one (`--spare-nodes`:
`replace_nodes`; the spare takes its ranks, and the layout, dp and batch stay);
without one, a restart keeps tp and pp, shrinks dp to the ranks left, and keeps the global
batch by raising micro-batches per replica where it divides (`shrink`); the
checkpoint is resharded on load (trainer/checkpoint.py maps every rank to its
(pp, tp) shard). The run id continues; the new processes start at an attempt
above every earlier one (`ATTEMPT_FLOOR_ENV`). Faults follow their hardware:
each process is told the rank its node and local slot had in the first layout
(`HW_RANK_ENV`), which is what an injection names; a spare's hardware is new (its
index follows the first layout's nodes), and no injection names it. Rank 0 reports
the spares left with the run (`SPARES_ENV`): the collector lists them as `spare`
nodes, and its policy weighs replacing a node against shrinking the job.

With `--policy shadow` or `off`, or without `--telemetry` (no collector, no
policy), nothing is healed: a failed rank ends the job, as it would without this
tool.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from agent.api import ApiClient, ApiError
from trainer.config import JobConfig
from trainer.incident_feed import action_detail
from trainer.membership import EXIT_RESTART, read_membership

HW_RANK_ENV = "LLMWATCH_HW_RANK"
ORIG_WORLD_ENV = "LLMWATCH_ORIG_WORLD"
NODE_NAMES_ENV = "LLMWATCH_NODE_NAMES"
SPARES_ENV = "LLMWATCH_SPARE_NODES"  # the standby nodes left, comma-separated (rank 0 reports them)
ATTEMPT_FLOOR_ENV = "LLMWATCH_ATTEMPT_FLOOR"
RESTART_ROUND_ENV = "LLMWATCH_RESTART_ROUND"
ATTEMPT_FILE = "attempt.json"  # in the run dir: the highest attempt rank 0 has run
CRASH_DECISION_S = 5.0
# the actions a restart completes (analysis/kinds.py ENDED_BY_RESTART; tests/unit/test_kinds.py keeps them equal:
# the trainer imports nothing of analysis)
RESTART_ACTIONS = frozenset({"restart", "isolate"})
NODE_POLL_S = 0.5
# how often a round's processes are polled: fine enough to order a crashed rank before the
# peers its death brings down a few tens of ms later (a collective fails on a closed socket)
EXIT_POLL_S = 0.02
GRACE_S = 5.0

ExitHook = Callable[..., None]  # (rank, returncode, *, cause)


@dataclass(frozen=True, slots=True)
class Layout:
    """The nodes a round of the job runs on, and the batch shape that fits them."""

    nodes: tuple[str, ...]  # names, in rank order
    hw_index: tuple[int, ...]  # each node's index in the first layout: its hardware identity
    per_node: int
    dp: int
    micro_batches: int
    note: str = ""

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.per_node

    def hw_rank(self, rank: int) -> int:
        return self.hw_index[rank // self.per_node] * self.per_node + rank % self.per_node

    def node_of(self, rank: int) -> str:
        return self.nodes[rank // self.per_node]


def first_layout(cfg: JobConfig) -> Layout:
    p = cfg.parallel
    n = p.nodes
    return Layout(nodes=tuple(f"node{i}" for i in range(n)), hw_index=tuple(range(n)), per_node=p.world_size // n,
                  dp=p.dp, micro_batches=p.micro_batches)


def spare_nodes(cfg: JobConfig) -> list[tuple[str, int]]:
    """The standby nodes, (name, hardware index): after the first layout's nodes."""
    n = cfg.parallel.nodes
    return [(f"node{n + i}", n + i) for i in range(cfg.healing.spare_nodes)]


def replace_nodes(layout: Layout, drop: set[str],
                  spares: list[tuple[str, int]]) -> tuple[Layout, dict[str, str], list[tuple[str, int]]]:
    """`layout` with spares in the places of the nodes in `drop`, in rank order while spares
    last: (the layout, {dropped: its spare}, the spares left). The ranks, dp and batch stay."""
    nodes, hw, left, took = list(layout.nodes), list(layout.hw_index), list(spares), {}
    for i, name in enumerate(layout.nodes):
        if name in drop and left:
            spare, index = left.pop(0)
            nodes[i], hw[i], took[name] = spare, index, spare
    return replace(layout, nodes=tuple(nodes), hw_index=tuple(hw)), took, left


def shrink(cfg: JobConfig, layout: Layout, drop: set[str]) -> Layout:
    """`layout` without the nodes in `drop`: tp and pp kept, dp what the ranks left hold,
    the global batch kept where it divides. ValueError when no layout fits."""
    keep = [(name, hw) for name, hw in zip(layout.nodes, layout.hw_index) if name not in drop]
    if not keep:
        raise ValueError("no node is left")
    world = len(keep) * layout.per_node
    model = cfg.parallel.tp * cfg.parallel.pp
    if world % model:
        raise ValueError(f"{world} ranks on {len(keep)} nodes cannot hold whole tp x pp = {model} model replicas")
    dp, micro, note = batch_for(dp=world // model, mbs=cfg.parallel.micro_batch_size,
                                global_samples=layout.dp * layout.micro_batches * cfg.parallel.micro_batch_size,
                                micro_batches=layout.micro_batches)
    return Layout(nodes=tuple(n for n, _ in keep), hw_index=tuple(h for _, h in keep), per_node=layout.per_node,
                  dp=dp, micro_batches=micro, note=note)


def batch_for(*, dp: int, mbs: int, global_samples: int, micro_batches: int) -> tuple[int, int, str]:
    """(dp, micro-batches per replica, note) that keep `global_samples` per step on `dp`
    replicas where it divides; otherwise the per-replica size is kept and the note says so."""
    if global_samples % (dp * mbs) == 0:
        return dp, global_samples // (dp * mbs), ""
    return dp, micro_batches, (f"the global batch of {global_samples} samples does not split over dp={dp} "
                               f"replicas of {mbs}-sample micro-batches: kept {micro_batches} micro-batches per "
                               f"replica ({dp * micro_batches * mbs} samples per step)")


def fit_world(cfg: JobConfig, world: int) -> str:
    """An elastic restart under torchrun on another number of ranks: dp from the ranks
    there are, the configured global batch kept (cfg changed in place). Returns a note
    ("" when nothing changed or it divides); ValueError when tp x pp does not fit."""
    p = cfg.parallel
    if world == p.world_size:
        return ""
    model = p.tp * p.pp
    if world % model:
        raise ValueError(f"{world} ranks cannot hold whole tp x pp = {model} model replicas")
    dp, micro, note = batch_for(dp=world // model, mbs=p.micro_batch_size,
                                global_samples=p.dp * p.micro_batches * p.micro_batch_size,
                                micro_batches=p.micro_batches)
    p.dp, p.micro_batches, p.shares = dp, micro, None  # another split: the even one
    return note or f"dp {dp}, {micro} micro-batches per replica (the same global batch)"


def layout_config(cfg: JobConfig, layout: Layout) -> JobConfig:
    """The job's config for a round on `layout` (a copy)."""
    new = JobConfig.from_dict(cfg.to_dict())
    new.telemetry.alerts = cfg.telemetry.alerts
    same = (layout.dp, layout.micro_batches) == (cfg.parallel.dp, cfg.parallel.micro_batches)
    new.parallel = replace(cfg.parallel, dp=layout.dp, nodes=len(layout.nodes), micro_batches=layout.micro_batches,
                           shares=cfg.parallel.shares if same else None)  # another split: the even one
    return new


def attempt_high_water(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / ATTEMPT_FILE).read_text())["attempt"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def write_attempt(run_dir: Path, attempt: int) -> None:
    """Rank 0 records the attempt it runs, so that a restart starts above it."""
    if attempt <= attempt_high_water(run_dir):
        return
    tmp = run_dir / (ATTEMPT_FILE + ".tmp")
    tmp.write_text(json.dumps({"attempt": attempt}))
    tmp.replace(run_dir / ATTEMPT_FILE)


class NodeWatch:
    """The run's isolated nodes, as the collector's policy marked them: polled from
    `GET /v1/runs/<run>/nodes` (the read token) on a thread of its own."""

    def __init__(self, url: str, token: str, run_id: str, *, interval_s: float = NODE_POLL_S,
                 ca_file: str | None = None) -> None:
        self._api = ApiClient(url, token, timeout_s=2.0, ca_file=ca_file)
        self._nodes_path = ApiClient.run_path(run_id, "nodes")
        self._actions_path = ApiClient.run_path(run_id, "actions")
        self.interval_s = interval_s
        self._isolated: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmwatch-nodewatch", daemon=True)

    def start(self) -> "NodeWatch":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def isolated(self) -> dict[str, str]:
        with self._lock:
            return dict(self._isolated)

    def poll_once(self) -> None:
        try:
            rows = self._api.get_json(self._nodes_path)
        except ApiError:
            return  # the collector is busy or gone: the ranks' own exits still tell us
        if not isinstance(rows, list):
            return
        found = {str(row["node"]): str(row.get("reason") or "") for row in rows
                 if isinstance(row, dict) and row.get("status") == "isolated" and row.get("node")}
        with self._lock:
            self._isolated.update(found)

    def decided_since(self, ts: float, taken: set[int] | frozenset[int] = frozenset()) -> set[int]:
        """The ids of the restarts and isolations the policy has recorded since `ts` (unix s),
        less those in `taken` (already an earlier crash's answer): its answer to a crash."""
        try:
            rows = self._api.get_json(self._actions_path)
        except ApiError:
            return set()
        return {int(a["id"]) for a in self._answers(rows, ts, taken) if a.get("kind") in RESTART_ACTIONS}

    def stopped_since(self, ts: float, taken: set[int] | frozenset[int] = frozenset()) -> tuple[int, str] | None:
        """The policy's `stop` recorded since `ts` (its answer to a crash: another restart would
        loop), as (id, reason); None when there is none."""
        try:
            rows = self._api.get_json(self._actions_path)
        except ApiError:
            return None
        for a in self._answers(rows, ts, taken):
            if a.get("kind") == "stop":
                reason = action_detail(a).get("reason")
                return int(a["id"]), str(reason or "stopped by the collector's policy")
        return None

    @staticmethod
    def _answers(rows, ts: float, taken) -> list[dict]:
        """The actions carried out (not refused, not shadow) since `ts` and not in `taken`."""
        if not isinstance(rows, list):
            return []
        return [a for a in rows if isinstance(a, dict) and isinstance(a.get("id"), int) and a["id"] not in taken
                and a.get("status") not in ("refused", "shadow") and (a.get("requested_ts") or 0) >= ts]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()


@dataclass(slots=True)
class Ended:
    """How a round ended."""

    codes: list[int]
    failed: dict[int, int]  # rank -> exit code of the ranks that failed on their own
    interrupted: bool = False
    isolated: dict[str, str] | None = None  # nodes the collector isolated during the round (name -> reason)
    failed_ts: float | None = None  # when the first failure was seen (unix s)


class Supervisor:
    def __init__(self, cfg: JobConfig, run_dir: Path, *, spawn: Callable[[JobConfig, Layout, int], list],
                 on_exit: ExitHook | None = None, watch: NodeWatch | None = None,
                 on_end: Callable[[str, str], None] | None = None,
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
        """`spawn(cfg, layout, round)` starts the round's rank processes (Popen-like);
        `on_end(status, reason)` reports a job the supervisor ended after a failure (no rank
        is left to report its end): "stopped" for the policy's stop, "failed" when it gave up."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.spawn = spawn
        self.on_exit = on_exit
        self.on_end = on_end
        self.watch = watch
        self.log = log
        # healing is the collector's policy: without telemetry there is none, and a failed
        # rank ends the job as it always did
        self.heal = cfg.healing.policy == "auto" and cfg.telemetry.enabled
        self.layout = first_layout(cfg)
        self.spares = spare_nodes(cfg)  # standby nodes left: (name, hardware index)
        self.restarts = 0
        self.rounds = 0
        self.answers: set[int] = set()  # the policy's actions already taken as a crash's answer
        self.stopped: str | None = None  # the policy's reason when it answered a crash with a stop

    def run(self) -> int:
        cfg = self.cfg
        while True:
            procs = self.spawn(layout_config(cfg, self.layout), self.layout, self.rounds)
            ended = self._watch_round(procs)
            self.rounds += 1
            if ended.interrupted:
                return 130
            if not ended.failed and all(c == 0 for c in ended.codes):
                return 0  # finished (an isolation decided in its last seconds has nothing left to do)
            drop = self._to_drop(ended)
            if not self.heal:
                return 1
            clean = bool(drop) and all(c == EXIT_RESTART for c in ended.codes)  # the ranks left by themselves
            if not clean:
                if self.restarts >= cfg.healing.max_restarts:
                    return self._end("failed", f"{self.restarts} restart(s) done (--max-restarts "
                                               f"{cfg.healing.max_restarts}): giving up")
                self.restarts += 1
                if not drop:
                    drop = self._crash_decision(ended)
                if self.stopped is not None:
                    return self._end("stopped", "the collector's policy stopped the run instead of restarting it: "
                                                f"{self.stopped}")
            if not cfg.ckpt.dir:
                return self._end("failed", "cannot restart without --ckpt-dir: there is nothing to resume from")
            if not drop:
                self.log(f"trainer: restarting on the same {len(self.layout.nodes)} node(s) from the last checkpoint")
                continue
            new, took, spares = replace_nodes(self.layout, set(drop), self.spares)
            rest = set(drop) - set(took)
            if rest:
                try:
                    new = shrink(cfg, new, rest)
                except ValueError as e:
                    return self._end("failed", f"cannot restart without {', '.join(sorted(rest))}: {e}")
                if len(new.nodes) < cfg.healing.min_nodes:
                    return self._end("failed", f"isolating {', '.join(sorted(rest))} would leave {len(new.nodes)} "
                                               f"node(s), fewer than --min-nodes {cfg.healing.min_nodes}: stopping")
            for node in sorted(drop):
                self._on_isolate(node, drop[node])
            for old, spare in sorted(took.items()):
                self.log(f"trainer: spare {spare} takes {old}'s place: {len(new.nodes)} node(s), dp {new.dp} kept "
                         f"({len(spares)} spare(s) left)")
            if rest:
                self.log(f"trainer: restarting without {', '.join(sorted(rest))}: {len(new.nodes)} node(s), "
                         f"dp {self.layout.dp} -> {new.dp}, {new.micro_batches} micro-batches per replica"
                         + (f" ({new.note})" if new.note else ""))
            self.layout, self.spares = new, spares

    def _end(self, status: str, reason: str) -> int:
        """The job ends here after a failure, with no rank left to say so: logged, and reported
        (`on_end`) so that the run is not left `running`."""
        self.log(f"trainer: {reason}")
        if self.on_end is not None:
            try:
                self.on_end(status, reason)
            except Exception as e:  # noqa: BLE001 - a report must never stop the supervision
                self.log(f"trainer: could not report the run's end: {e}")
        return 1

    def rank_env(self, layout: Layout, rank: int, round_: int) -> dict[str, str]:
        """What a rank of this round is told beyond torchrun's variables."""
        return {HW_RANK_ENV: str(layout.hw_rank(rank)), ORIG_WORLD_ENV: str(self.cfg.parallel.world_size),
                NODE_NAMES_ENV: ",".join(layout.nodes), RESTART_ROUND_ENV: str(round_),
                SPARES_ENV: ",".join(name for name, _ in self.spares),
                ATTEMPT_FLOOR_ENV: str(attempt_high_water(self.run_dir) + 1 if round_ else 0)}

    # -- one round ---------------------------------------------------------------
    def _watch_round(self, procs: list) -> Ended:
        failed: dict[int, int] = {}
        reported: set[int] = set()
        isolated_seen: dict[str, str] = {}
        grace_until: float | None = None
        failed_ts: float | None = None
        interrupted = False
        try:
            while True:
                codes = [p.poll() for p in procs]
                for rank, code in enumerate(codes):
                    if code is not None:
                        self._report(reported, rank, code, "exited")
                    if code not in (None, 0, EXIT_RESTART) and rank not in failed and grace_until is None:
                        failed[rank] = code
                        failed_ts = failed_ts or time.time()
                if failed or all(c is not None for c in codes):
                    break
                if self.heal and self.watch is not None:
                    mine = {n: r for n, r in self.watch.isolated().items() if n in self.layout.nodes}
                    if mine and grace_until is None:
                        isolated_seen = mine
                        grace_until = time.monotonic() + self.cfg.healing.isolate_grace_s
                        self.log(f"trainer: the collector isolated {', '.join(sorted(mine))}; the ranks have "
                                 f"{self.cfg.healing.isolate_grace_s:g} s to leave")
                    if grace_until is not None and time.monotonic() >= grace_until:
                        break
                time.sleep(EXIT_POLL_S)
        except KeyboardInterrupt:
            interrupted = True
        if failed or interrupted or grace_until is not None:
            if failed:
                desc = ", ".join(f"rank {r} exited with {describe_exit(c)}" for r, c in sorted(failed.items()))
                self.log(f"trainer: {desc}; stopping the other ranks")
            stopped = stop_all(procs)
            for rank, p in enumerate(procs):
                # after a failure, a rank still running when it was seen went down with the job:
                # stopped by the launcher, or brought down first by its failed collectives
                if p.returncode is not None:
                    self._report(reported, rank, p.returncode,
                                 "stopped" if rank in stopped or failed else "exited")
        return Ended(codes=[p.returncode for p in procs], failed=failed, interrupted=interrupted,
                     isolated=isolated_seen or None, failed_ts=failed_ts)

    def _report(self, reported: set[int], rank: int, code: int, cause: str) -> None:
        if self.on_exit is None or rank in reported:
            return
        reported.add(rank)
        try:
            self.on_exit(rank, code, cause=cause)
        except Exception as e:  # noqa: BLE001 - a report must never stop the supervision
            self.log(f"trainer: could not report rank {rank}'s exit: {e!r}")

    def _to_drop(self, ended: Ended) -> dict[str, str]:
        """Nodes to leave out of the next round: the membership file's (the ranks' own
        isolate) and the collector's, among this layout's nodes."""
        drop = {x["node"]: x.get("reason", "") for x in read_membership(self.run_dir)["isolated"]
                if x.get("node") in self.layout.nodes}
        for node, reason in (ended.isolated or {}).items():
            drop.setdefault(node, reason)
        return drop

    def _crash_decision(self, ended: Ended) -> dict[str, str]:
        """After a crash: the collector's policy answers with a restart, or (a node's second
        crash) an isolation. Wait a bounded time for that answer; none means a restart on
        the same nodes."""
        if self.watch is None:
            return {}
        nodes = {self.layout.node_of(r) for r in ended.failed if 0 <= r < self.layout.world_size}
        # the policy's answer to this crash, not to an earlier one: decided after the failure
        # was seen (less a second: the collector may hear of it first), and not an action an
        # earlier crash took as its answer (a second crash 0.9 s after the first took the first
        # one's restart for its own, and restarted on node1 before the policy isolated it)
        since = (ended.failed_ts or time.time()) - 1.0
        deadline = time.monotonic() + CRASH_DECISION_S
        while time.monotonic() < deadline:
            self.watch.poll_once()
            stop = self.watch.stopped_since(since, self.answers)
            if stop is not None:
                self.answers.add(stop[0])
                self.stopped = stop[1]
                return {}
            found = {n: r for n, r in self.watch.isolated().items() if n in nodes}
            if found:
                self.answers |= self.watch.decided_since(since, self.answers)
                return found
            got = self.watch.decided_since(since, self.answers)
            if got:
                self.answers |= got
                self.watch.poll_once()  # an isolation recorded with it is in nodes by now
                return {n: r for n, r in self.watch.isolated().items() if n in nodes}
            time.sleep(0.2)
        return {}

    def _on_isolate(self, node: str, reason: str) -> None:
        cmd = self.cfg.healing.on_isolate
        if not cmd:
            return
        env = dict(os.environ, LLMWATCH_RUN_ID=str(self.cfg.run_id), LLMWATCH_NODE=node, LLMWATCH_REASON=reason)
        try:
            done = subprocess.run(cmd, shell=True, env=env, timeout=60, capture_output=True, text=True)
            if done.returncode:
                self.log(f"trainer: --on-isolate exited with {done.returncode} for {node}: {done.stderr[-500:]}")
        except (OSError, subprocess.SubprocessError) as e:
            self.log(f"trainer: --on-isolate failed for {node}: {e}")


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def stop_all(procs: list, grace_s: float = GRACE_S) -> set[int]:
    """SIGTERM the processes still running (SIGKILL after `grace_s`); returns their indices."""
    stopped = set()
    for i, p in enumerate(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            stopped.add(i)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return stopped
