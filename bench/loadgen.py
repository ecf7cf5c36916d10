"""Load generator: many simulated ranks posting real wire batches to a collector.

Batches are built with `agent.wire.encode_batch`, exactly as an agent sends
them. Column data comes from a template made once per batch shape; per batch
only `step`, `ts` and `start_ts` are rewritten (numpy, no per-row Python), so
the generator spends its CPU on HTTP, not on making data up.

Two schedules:

- `throughput`: `--connections` keep-alive connections post back to back, rank
  after rank, `--steps-per-batch` steps of `--collectives` collectives each.
- `ranks`: `--ranks` ranks each doing `--step-hz` steps per second with
  `--collectives` collectives per step and flushing every `--flush-s` seconds
  (staggered), for `--duration` seconds; reports whether the offered rate held.

`--summaries K`: a step's collectives as K summary rows (agent/summary.py: what an
agent of a large job sends), not a row per op.

`--per-node K` (ranks mode): each node's K ranks flush together through the node's
relay (collector/relay.py), as one bundle to /v1/ingest/bundle: what the collector
sees of a job whose nodes run `collector relay` (the relays themselves run on the
nodes, not here).

The HTTP client is a minimal HTTP/1.1 keep-alive client on asyncio streams
(one write per request, head and body together). `--ack-log` appends
"rank batch_seq rows duplicate" per acknowledged batch; `--retry` resends a batch
until acknowledged (connection errors, 503), like the agent's spool replay.

    python bench/loadgen.py --url http://127.0.0.1:8428 --token T throughput --duration 10
    python bench/loadgen.py --url ... ranks --ranks 10000 --flush-s 1 --duration 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent import wire  # noqa: E402

OPS = ["all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast"]
AXES = ["dp", "tp", "pp", "embed", "world"]


# -- batch synthesis ------------------------------------------------------------
def _template(kind: str, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    cols = {}
    for col in wire.SCHEMA[kind]:
        if not col.recorded:  # `sampled`: set by a summarizing agent only (left out: NULL)
            continue
        dt = np.dtype(col.numpy_dtype)
        if col.dict_encoded:
            size = {"op": len(OPS), "axis": len(AXES)}.get(col.name, 1)
            cols[col.name] = rng.integers(0, size, n).astype(dt)
        elif dt.kind == "f":
            cols[col.name] = rng.random(n).astype(dt)
        else:
            cols[col.name] = rng.integers(0, 1000, n).astype(dt)
    # the values a healthy job sends where random ones would read as faults: finite gradients
    # (a random flag is 0, "not finite", on some rank every few steps: the NaN detector opened an
    # incident every ~90 steps of a 64-rank run), a measured local loss, and a peer only for sends
    # and receives (any peer >= 0 makes an op point to point)
    for flag in ("finite_fwd", "finite_bwd", "local_loss_valid"):
        if flag in cols:
            cols[flag][:] = 1
    if kind == wire.STEP:  # a step of ~1 s, ~1% of it waiting for data, a loss and a gradient that wobble
        jitter = 1.0 + 0.02 * rng.standard_normal(n)
        for name, value in (("step_s", 1.0), ("fwd_s", 0.3), ("bwd_s", 0.6), ("opt_s", 0.05), ("data_s", 0.01),
                            ("comm_exposed_s", 0.04), ("loss", 2.5), ("local_loss", 2.5), ("grad_norm", 1.0)):
            cols[name] = (value * jitter).astype(cols[name].dtype)
        cols["loss_scale"][:], cols["lr"][:], cols["tokens"][:] = 65536.0, 3e-4, 4096
    if "peer" in cols:
        p2p = np.isin(cols["op"], [OPS.index("send"), OPS.index("recv")])
        cols["peer"] = np.where(p2p, cols["peer"], -1).astype(cols["peer"].dtype)
    return cols


@dataclass
class BatchMaker:
    """Makes batches of `steps` steps x `collectives` collectives for any rank/seq."""

    run_id: str
    steps: int
    collectives: int
    heartbeat: bool = False
    # the heartbeat interval the batches' heartbeats say (one a batch: the flush period), as the
    # agent's do; the collector reads a rank as silent after a few of them
    heartbeat_s: float = 1.0
    attempt: int = 0
    incarnation: str = "inc-0"
    seed: int = 0
    # > 0: the collectives of a step as this many summary rows (agent/summary.py), not a row per op
    summaries: int = 0
    _step: dict = field(init=False)
    _coll: dict = field(init=False)
    _hb: dict = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self._step = _template(wire.STEP, self.steps, rng)
        self._step["attempt"][:] = self.attempt
        self._step["skipped"][:] = 0
        per_step = self.summaries if self.summaries else self.collectives
        n_coll = self.steps * per_step if self.collectives else 0
        self._kind = wire.COLLECTIVE_SUMMARY if self.summaries else wire.COLLECTIVE
        self._coll = _template(self._kind, n_coll, rng) if n_coll else {}
        if n_coll:
            self._coll["attempt"][:] = self.attempt
            self._coll_step_offset = np.repeat(np.arange(self.steps), per_step)
            if self.summaries:  # each row stands for its share of the step's ops, of its own (op, axis)
                self._coll["num_ops"][:] = max(1, self.collectives // self.summaries)
                self._coll["op"][:] = np.tile(np.arange(per_step) % len(OPS), self.steps)
                self._coll["axis"][:] = np.tile(np.arange(per_step) // len(OPS) % len(AXES), self.steps)
                self._coll["peer"][:] = -1
            else:
                self._coll["seq"][:] = np.arange(n_coll)
        self._hb = _template(wire.HEARTBEAT, 1, rng) if self.heartbeat else {}
        if self._hb:
            self._hb["interval_s"][:] = self.heartbeat_s

    @property
    def rows(self) -> int:
        per_step = self.summaries if self.summaries and self.collectives else self.collectives
        return self.steps * (1 + per_step) + (1 if self.heartbeat else 0)

    def make(self, rank: int, batch_seq: int, *, now: float | None = None, run: dict | None = None,
             events: list | None = None) -> bytes:
        """The batch; its steps are batch_seq*steps ... +steps-1 (unique per rank)."""
        now = time.time() if now is None else now
        step0 = batch_seq * self.steps
        sections = {}
        st = dict(self._step)
        st["step"] = np.arange(step0, step0 + self.steps, dtype=np.int64)
        st["ts"] = np.full(self.steps, now)
        sections[wire.STEP] = (self.steps, {k: v.tobytes() for k, v in st.items()})
        if self._coll:
            co = dict(self._coll)
            co["step"] = self._coll_step_offset + step0
            for ts in ("start_ts", "end_ts", "mean_start_ts", "mean_end_ts"):
                if ts in co:
                    co[ts] = co[ts] + now
            sections[self._kind] = (len(co["step"]), {k: v.tobytes() for k, v in co.items()})
        if self._hb:
            hb = dict(self._hb)
            hb["ts"] = np.full(1, now)
            hb["step"] = np.full(1, step0 + self.steps - 1, dtype=np.int64)
            # the collective entered last moves on with the steps, as a healthy rank's does (a constant
            # one read as a rank stuck in its collective once the collector saw the ranks alive)
            per_step = max(1, self.collectives)
            hb["last_seq"] = np.full(1, (step0 + self.steps) * per_step - 1, dtype=np.int64)
            hb["last_group_seq"] = np.full(1, step0 + self.steps - 1, dtype=np.int64)
            sections[wire.HEARTBEAT] = (1, {k: v.tobytes() for k, v in hb.items()})
        header = {"run_id": self.run_id, "rank": rank, "incarnation": self.incarnation, "batch_seq": batch_seq,
                  "node": f"node{rank // 8}", "pid": 1000 + rank, "sent_ts": now,
                  "coords": {"dp": rank, "tp": 0, "pp": 0},
                  "dicts": {"op": OPS, "axis": AXES, "phase": ["forward", "backward", "optimizer"], "name": ["eval_loss"]},
                  "events": events or [], "run": run, "stats": {"dropped": {}}}
        return wire.encode_batch(header, sections)


# -- HTTP client ------------------------------------------------------------------
class Conn:
    """One keep-alive HTTP/1.1 connection; reconnects on demand."""

    def __init__(self, url: str, token: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.auth = f"Authorization: Bearer {token}\r\n".encode()
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, content_type: str = wire.CONTENT_TYPE) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n").encode() + self.auth + b"\r\n"
        try:
            self.writer.write(head + body)
            status_line = await self.reader.readuntil(b"\r\n")
            length, close = 0, False
            while True:
                line = await self.reader.readuntil(b"\r\n")
                if line == b"\r\n":
                    break
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            payload = await self.reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            self.close()
            raise ConnectionError("connection lost") from None
        if close:
            self.close()
        return int(status_line.split()[1]), payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


@dataclass
class Stats:
    rows: int = 0
    requests: int = 0
    errors: int = 0
    duplicates: int = 0
    latencies_s: list = field(default_factory=list)

    def summary(self, elapsed_s: float) -> dict:
        lat = np.array(self.latencies_s) if self.latencies_s else np.zeros(1)
        return {"elapsed_s": round(elapsed_s, 3), "requests": self.requests, "rows": self.rows,
                "rows_per_s": round(self.rows / elapsed_s), "requests_per_s": round(self.requests / elapsed_s, 1),
                "errors": self.errors, "duplicates": self.duplicates,
                "latency_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
                "latency_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2),
                "latency_max_ms": round(float(lat.max()) * 1e3, 2)}


class Sender:
    """Posts batches, records outcomes, optionally retries until acknowledged."""

    def __init__(self, url: str, token: str, *, retry: bool, ack_log: Path | None, deadline: float) -> None:
        self.url, self.token, self.retry, self.deadline = url, token, retry, deadline
        self.stats = Stats()
        self.ack_log = open(ack_log, "a", buffering=1) if ack_log else None

    def _acked(self, rank: int, seq: int, rows: int, reply: dict) -> None:
        """One batch's answer (alone or in a bundle): counted, and logged for --ack-log."""
        self.stats.rows += reply["accepted"]
        self.stats.duplicates += reply["duplicate"]
        if self.ack_log:
            self.ack_log.write(f"{rank} {seq} {rows} {int(reply['duplicate'])}\n")

    async def send_bundle(self, conn: Conn, ranks: list[int], seq: int, bodies: list[bytes], rows: int) -> None:
        """One node's batches as one bundle; resent whole (the collector stores each once)
        until every item is acknowledged, when retrying."""
        body = wire.encode_bundle(bodies)
        while True:
            t0 = time.perf_counter()
            try:
                status, payload = await conn.post(wire.BUNDLE_PATH, body, wire.BUNDLE_CONTENT_TYPE)
            except ConnectionError:
                status, payload = 0, b""
            results = json.loads(payload)["results"] if status == 200 else []
            if results and all(r["status"] == 200 for r in results):
                self.stats.latencies_s.append(time.perf_counter() - t0)
                self.stats.requests += 1
                for rank, r in zip(ranks, results):
                    self._acked(rank, seq, rows, r)
                return
            self.stats.errors += 1
            if not self.retry or time.monotonic() > self.deadline + 30 or 400 <= status < 500:
                print(f"loadgen: bundle HTTP {status}: {payload[:200]!r}", file=sys.stderr)
                return
            await asyncio.sleep(0.05)

    async def send(self, conn: Conn, rank: int, seq: int, body: bytes, rows: int) -> None:
        while True:
            t0 = time.perf_counter()
            try:
                status, payload = await conn.post("/v1/ingest", body)
            except ConnectionError:
                status, payload = 0, b""
            if status == 200:
                self.stats.latencies_s.append(time.perf_counter() - t0)
                self.stats.requests += 1
                self._acked(rank, seq, rows, json.loads(payload))
                return
            self.stats.errors += 1
            if not self.retry or time.monotonic() > self.deadline + 30 or 400 <= status < 500:
                if 400 <= status < 500:
                    print(f"loadgen: HTTP {status}: {payload[:200]!r}", file=sys.stderr)
                return
            await asyncio.sleep(0.05)


async def run_throughput(args, maker: BatchMaker) -> dict:
    deadline = time.monotonic() + args.duration
    sender = Sender(args.url, args.token, retry=args.retry, ack_log=args.ack_log, deadline=deadline)
    next_seq = [args.seq_start] * args.ranks
    counter = iter(range(10**12))

    async def worker() -> None:
        conn = Conn(args.url, args.token)
        while time.monotonic() < deadline:
            i = next(counter)
            if args.max_batches and i >= args.max_batches:
                break
            rank = i % args.ranks
            seq = next_seq[rank]
            next_seq[rank] += 1
            await sender.send(conn, rank, seq, _make(maker, args, rank, seq), maker.rows)
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.connections)))
    return sender.stats.summary(time.perf_counter() - t0)


async def run_ranks(args, maker: BatchMaker) -> dict:
    """Each rank flushes every flush_s; rank r's phase is r/ranks of the period (with
    --per-node, node n's phase is n/nodes, and its ranks flush together)."""
    per_node = max(1, args.per_node)
    units = -(-args.ranks // per_node)  # what flushes: a rank, or a node's relay
    start = time.monotonic() + 0.2
    deadline = start + args.duration
    sender = Sender(args.url, args.token, retry=args.retry, ack_log=args.ack_log, deadline=deadline)
    queue: asyncio.Queue = asyncio.Queue(maxsize=args.connections * 4)
    lag_s = []

    async def dispatcher() -> None:
        period = args.flush_s
        k = 0
        while True:
            cycle, unit = divmod(k, units)
            due = start + cycle * period + unit * period / units
            if due >= deadline:
                break
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            else:
                lag_s.append(now - due)
            await queue.put((unit, args.seq_start + cycle))
            k += 1
        for _ in range(args.connections):
            await queue.put(None)

    async def worker() -> None:
        conn = Conn(args.url, args.token)
        while (item := await queue.get()) is not None:
            unit, seq = item
            if args.per_node:
                ranks = list(range(unit * per_node, min(args.ranks, (unit + 1) * per_node)))
                await sender.send_bundle(conn, ranks, seq, [_make(maker, args, r, seq) for r in ranks], maker.rows)
            else:
                await sender.send(conn, unit, seq, _make(maker, args, unit, seq), maker.rows)
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(dispatcher(), *(worker() for _ in range(args.connections)))
    out = sender.stats.summary(time.perf_counter() - t0)
    offered = args.ranks * maker.rows / args.flush_s
    out.update(offered_rows_per_s=round(offered), dispatch_lag_max_s=round(max(lag_s, default=0.0), 3))
    return out


def _make(maker: BatchMaker, args, rank: int, seq: int) -> bytes:
    """A batch; rank 0's first one carries the run info, as the agent's does."""
    return maker.make(rank, seq, run=_run_info(args) if rank == 0 and seq == 0 else None)


def _run_info(args) -> dict:
    return {"run_id": args.run_id, "config": {"loadgen": True}, "mesh": {"dp": args.ranks, "tp": 1, "pp": 1},
            "world_size": args.ranks, "node_map": {str(r): f"node{r // 8}" for r in range(args.ranks)},
            "code_version": "loadgen", "data_version": "synthetic", "started_ts": time.time()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--token", default=os.environ.get("LLMWATCH_TOKEN", ""))
    p.add_argument("--run-id", default="loadgen")
    p.add_argument("--incarnation", default="inc-0")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--collectives", type=int, default=20, help="collectives per step")
    p.add_argument("--summaries", type=int, default=0,
                   help="> 0: a step's collectives as this many summary rows (agent/summary.py), not a row per op")
    p.add_argument("--heartbeat", action="store_true", help="one heartbeat row per batch")
    p.add_argument("--duration", type=float, default=10.0, help="seconds")
    p.add_argument("--seq-start", type=int, default=0, help="first batch_seq of every rank")
    p.add_argument("--retry", action="store_true", help="resend until acknowledged")
    p.add_argument("--ack-log", type=Path, help="append 'rank batch_seq rows duplicate' per ack")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("throughput", help="post back to back")
    t.add_argument("--steps-per-batch", type=int, default=200)
    t.add_argument("--max-batches", type=int, default=0, help="stop after this many (0: duration only)")
    r = sub.add_parser("ranks", help="ranks stepping at a fixed rate")
    r.add_argument("--step-hz", type=float, default=1.0)
    r.add_argument("--flush-s", type=float, default=1.0, help="each rank's flush period")
    r.add_argument("--per-node", type=int, default=0,
                   help="> 0: ranks per node, each node's batches sent as one bundle (its relay's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "throughput":
        maker = BatchMaker(args.run_id, args.steps_per_batch, args.collectives, args.heartbeat,
                           incarnation=args.incarnation, summaries=args.summaries)
        summary = asyncio.run(run_throughput(args, maker))
    else:
        steps = max(1, round(args.step_hz * args.flush_s))
        maker = BatchMaker(args.run_id, steps, args.collectives, args.heartbeat, incarnation=args.incarnation,
                           summaries=args.summaries, heartbeat_s=args.flush_s)
        summary = asyncio.run(run_ranks(args, maker))
    print(json.dumps(summary) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
