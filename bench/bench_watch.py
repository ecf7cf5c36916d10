"""What `watch(model, optimizer)` costs a foreign DDP loop, and what reading torch's Flight Recorder costs.

    .venv/bin/python bench/bench_watch.py [--blocks 8] [--block-steps 40]             # (a) and (b), ~2-3 min
    .venv/bin/python bench/bench_watch.py --only a --blocks 12 --block-steps 150 --sink null   # the agent alone
    .venv/bin/python bench/bench_watch.py --only b [--pairs 3] [--block-s 5] [--rate 1000] [--buffer 512]

Both figures come from one torchrun job of 2 gloo ranks each (this file, run as
its own worker), with the two modes interleaved in blocks inside that job, so
that what the machine does meanwhile falls on both alike:

(a) watch on vs off. The plain DDP GPT loop of tests/integration/loops/ddp_gpt.py
    (its model, data, clip and AdamW; not its fault injection or printing). After a
    warm-up block in each mode, `--blocks` blocks of `--block-steps` steps
    alternate off, on, off, on... (both ranks switch at the same step, behind a
    barrier). An "on" block makes a `Watch` (`agent.watch.watch(model, optimizer,
    agent=...)`, its steps numbered on from the job's) recording into one
    `agent.Agent` per rank, made once at the start and pointed at a real
    `collector serve` started here, and closes it at the block's end; an "off"
    block has no watch. A block's time is its steps only (the slower rank's):
    making and closing the watch (a Flight Recorder dump, the hooks, a flush) are
    printed apart. The agent's own thread (a heartbeat a second) runs in both
    modes, and torch's recorder records in both (it is on by default in torch
    2.13; `Watch` only reads it), holding `--buffer` entries ($TORCH_FR_BUFFER_SIZE;
    2,000 is torch's default and what llmwatch-instrument sets): every read dumps
    all of them, however few are new. Figures: tokens/s per mode (median of blocks),
    their ratio, the median of each on-block's ratio to the mean of the off
    blocks beside it, and the reader's stats per on-block. Goal: on/off >= 0.98.
    On one host the collector's ingest shares the ranks' cores in the on-blocks
    (an off block sends nothing): `--sink null` ships to a server in this process
    that reads each batch and answers, so the figure is the agent's own cost (its
    hooks, the reader, encoding and POSTs); `--no-detect` keeps the collector but
    not its detection.

(b) the reader at ~1,000 collectives/s. Each rank issues small `dist.all_reduce`
    calls paced to `--rate`/s for `--block-s` s per block; `--pairs` pairs of blocks
    without and with a `FlightReader` (`FlightReader.create(Recorder, step_of=
    lambda ns: (0, 0))`, `poll()` on a thread of its own every 1 s) alternate.
    Figures: the reader's seconds per second of training (read_s / wall) and its
    CPU seconds (the polls' thread time: on a loaded machine read_s also holds
    the time the reading thread waited for a core), its longest read, rows per
    second, the collectives/s ratio with/without and the calls' p99 and max
    latency (a read holds the GIL); and, apart, the cost of one dump (+ unpickle)
    of a full buffer (`--buffer` entries, $TORCH_FR_BUFFER_SIZE).

Both jobs count the CPU time of every `FlightReader.poll` (a wrapper put on the
class in the worker; agent/ is unchanged). On two cores shared with other work,
block-to-block noise can exceed the 2% the goal asks to resolve: run more blocks
(`--blocks 24`) and compare the spread of the off blocks printed with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.flight import DEFAULT_BUFFER  # noqa: E402  (stdlib only: nothing heavy in the parent)

TOKEN = "bench-token"


# -- the workers (one per rank, under torchrun) -------------------------------------------
def _count_reader_cpu() -> None:
    """Each FlightReader also sums the CPU seconds of its polls' thread (`cpu_s`): on a
    loaded machine read_s (wall time) holds the time the reading thread waited for a core."""
    from agent.flight import FlightReader

    poll = FlightReader.poll

    def counted(self, force: bool = False) -> int:
        t0 = time.thread_time()
        try:
            return poll(self, force)
        finally:
            self.cpu_s = getattr(self, "cpu_s", 0.0) + time.thread_time() - t0

    FlightReader.poll = counted


def _reader_stats(reader) -> dict:
    return {**reader.stats(), "cpu_s": getattr(reader, "cpu_s", 0.0)}


def _overhead_worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agent import Agent, AgentConfig
    from agent.watch import watch
    from tests.integration.loops.ddp_gpt import GPT, SEQ, batches

    torch.set_num_threads(1)
    _count_reader_cpu()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(GPT(), bucket_cap_mb=0.05)  # as ddp_gpt.py
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(rank)
    batch_size = next(batches(rank))[0].shape[0]
    agent = Agent(AgentConfig(url=args.url, token=os.environ["LLMWATCH_TOKEN"],
                              spool_dir=os.path.join(args.out, f"spool{rank}")),
                  run_id=args.run_id, rank=rank, node="bench", world_size=world,
                  coords={"dp": rank, "tp": 0, "pp": 0},
                  run_info={"run_id": args.run_id, "world_size": world, "mesh": {"dp": world, "tp": 1, "pp": 1},
                            "started_ts": time.time(), "config": {"source": "bench_watch"}})
    agent.start()
    step = 0

    def train(n: int) -> float:
        nonlocal step
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = next(data)
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        return time.perf_counter() - t0

    blocks = []
    modes = ["off", "on"] + ["off" if i % 2 == 0 else "on" for i in range(args.blocks)]  # a warm-up in each mode
    for i, mode in enumerate(modes):
        dist.barrier()
        block = {"mode": mode, "warmup": i < 2, "step_from": step + 1}
        w = None
        if mode == "on":
            t0 = time.perf_counter()
            w = watch(model, optimizer, agent=agent, start_step=step)
            block["create_s"] = time.perf_counter() - t0
            dist.barrier()
        block["wall_s"] = train(args.block_steps)
        if w is not None:
            t0 = time.perf_counter()
            w.close()  # the last read, the rows waiting, a flush of the shared agent
            block["close_s"] = time.perf_counter() - t0
            block["reader"] = _reader_stats(w.reader) if w.reader is not None else None
        blocks.append(block)
    dist.barrier()
    agent.flush(timeout_s=10.0)
    stats = agent.stats()
    agent.close()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "tokens_per_block": args.block_steps * batch_size * SEQ * world,
            "blocks": blocks, "agent": {k: stats[k] for k in ("recorded", "sent", "dropped", "last_error")}}


def _reader_worker(args: argparse.Namespace) -> dict:
    import pickle
    import threading

    import torch
    import torch.distributed as dist

    from agent.flight import FlightReader, _dumper
    from agent.ring import Recorder

    torch.set_num_threads(1)
    _count_reader_cpu()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tensor = torch.zeros(args.numel)
    num_calls = int(args.rate * args.block_s)

    def paced(n: int) -> tuple[float, list[float]]:
        """n all-reduces, each started no sooner than its slot at `rate`/s; wall, call seconds."""
        lat = [0.0] * n
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            ahead = t0 + i / args.rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            c0 = time.perf_counter()
            dist.all_reduce(tensor)
            lat[i] = time.perf_counter() - c0
        return time.perf_counter() - t0, lat

    # a full buffer, and what one dump of it costs (the reader's worst read)
    for _ in range(args.buffer + 200):
        dist.all_reduce(tensor)
    dump = _dumper()
    dump_s, unpickle_s, num_entries = [], [], 0
    for _ in range(args.dumps):
        t0 = time.perf_counter()
        raw = dump()
        t1 = time.perf_counter()
        num_entries = len(pickle.loads(raw).get("entries") or [])
        t2 = time.perf_counter()
        dump_s.append(t1 - t0)
        unpickle_s.append(t2 - t1)

    paced(min(num_calls, 500))  # warm-up
    blocks = []
    for i in range(2 * args.pairs):
        mode = "with" if i % 2 else "without"
        block = {"mode": mode, "calls": num_calls}
        stop, poller, reader, sink = threading.Event(), None, None, None
        if mode == "with":
            sink = Recorder(capacity=num_calls + 4 * args.buffer)
            reader = FlightReader.create(sink, step_of=lambda ns: (0, 0), interval_s=1.0)

            def poll_loop(reader=reader):  # the agent's schedule: once a second, sooner at a high op rate
                while not stop.wait(reader.tick()):
                    pass

            poller = threading.Thread(target=poll_loop, daemon=True)
            poller.start()
        wall, lat = paced(num_calls)
        if poller is not None:
            stop.set()
            poller.join()
            block["reader"] = _reader_stats(reader)
            block["sink_dropped"] = sink._active.collective.num_dropped
        lat.sort()
        block.update(wall_s=wall, p50_call_s=lat[len(lat) // 2], p99_call_s=lat[int(0.99 * (len(lat) - 1))],
                     max_call_s=lat[-1])
        blocks.append(block)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "blocks": blocks, "dump": {"entries": num_entries, "dump_s": dump_s, "unpickle_s": unpickle_s}}


def worker(args: argparse.Namespace) -> None:
    out = _overhead_worker(args) if args.worker == "overhead" else _reader_worker(args)
    Path(args.out, f"{args.worker}.rank{out['rank']}.json").write_text(json.dumps(out))


# -- the parent: starts the collector and the jobs, prints the figures -------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(part: str, out: Path, extra: list[str], env_extra: dict[str, str], timeout_s: float) -> list[dict]:
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), __file__, "--worker", part, "--out", str(out), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMWATCH_", "TORCH_FR_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env_extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"the {part} job failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads((out / f"{part}.rank{r}.json").read_text()) for r in range(2)]


class _NullSink:
    """An HTTP server on a thread of this (otherwise idle) process that reads each batch
    and answers 200 `{}`: the agent's whole path (encode, POST, answer) with none of the
    collector's work on the ranks' cores. `terminate`/`wait` as a process's."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.num_batches = self.num_bytes = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                sink.num_batches += 1
                sink.num_bytes += n
                body = json.dumps({"server_ts": time.time()}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def terminate(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait(self, timeout_s: float | None = None) -> None:
        self.thread.join(timeout_s)


def _null_sink():
    sink = _NullSink()
    return sink, f"http://127.0.0.1:{sink.server.server_address[1]}"


def run_overhead(args: argparse.Namespace, tmp: Path) -> None:
    from collector_proc import start_collector  # bench/, this script's folder

    db = tmp / "watch.duckdb"
    run_id = f"bench-watch-{int(time.time())}"
    if args.sink == "null":
        col, url = _null_sink()
    else:
        col, url = start_collector(ROOT, db, TOKEN, "--policy", "off", *(["--no-detect"] if args.no_detect else []))
    try:
        t0 = time.monotonic()
        ranks = _torchrun("overhead", tmp, ["--url", url, "--run-id", run_id, "--blocks", str(args.blocks),
                                            "--block-steps", str(args.block_steps)],
                          {"LLMWATCH_TOKEN": TOKEN, "TORCH_FR_BUFFER_SIZE": str(args.buffer)}, args.timeout_s)
        job_s = time.monotonic() - t0
    finally:
        col.terminate()
        col.wait(60)
    num_steps = num_coll = num_inc = None
    if args.sink != "null":
        import duckdb

        con = duckdb.connect(str(db), read_only=True)
        num_steps, num_coll, num_inc = (con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?",
                                                    [run_id]).fetchone()[0]
                                        for t in ("steps", "collectives", "incidents"))
        con.close()

    tokens = ranks[0]["tokens_per_block"]
    rows = []  # per block: mode, tokens/s (the slower rank's time), rank 0's block
    for b0, b1 in zip(ranks[0]["blocks"], ranks[1]["blocks"]):
        rows.append((b0["mode"], b0["warmup"], tokens / max(b0["wall_s"], b1["wall_s"]), b0, b1))
    timed = [r for r in rows if not r[1]]
    tps = {m: [r[2] for r in timed if r[0] == m] for m in ("off", "on")}
    med = {m: statistics.median(v) for m, v in tps.items()}
    paired = []
    for i, r in enumerate(timed):
        if r[0] == "on":
            beside = [timed[j][2] for j in (i - 1, i + 1) if 0 <= j < len(timed) and timed[j][0] == "off"]
            paired.append(r[2] / statistics.mean(beside))

    print(f"\n(a) watch() on a foreign DDP loop: 2 gloo ranks, ddp_gpt.py's GPT, {args.block_steps} steps a block, "
          f"{len(timed)} blocks after a warm-up in each mode, recorder buffer {args.buffer}; job {job_s:.0f} s; "
          f"{os.cpu_count()} cpus, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'block':>5} {'mode':<4} {'steps':>9}{'tokens/s':>10}  "
          f"{'create ms':>9}{'close ms':>9}  reader per rank (reads, read_s, max_read_s, rows, lost)")
    for i, (mode, warm, tp, b0, b1) in enumerate(rows):
        steps = f"{b0['step_from']}-{b0['step_from'] + args.block_steps - 1}"
        line = f"{'w' if warm else i - 1:>5} {mode:<4} {steps:>9}{tp:>10,.0f}  "
        if mode == "on":
            line += f"{1e3 * max(b0['create_s'], b1['create_s']):>9.1f}{1e3 * max(b0['close_s'], b1['close_s']):>9.1f}  "
            line += "  ".join(f"r{k}: {s['reads']}, {s['read_s'] * 1e3:.1f} ms, {s['max_read_s'] * 1e3:.1f} ms, "
                              f"{s['rows']}, {s['lost']}" if s else f"r{k}: no reader"
                              for k, s in ((0, b0["reader"]), (1, b1["reader"])))
        print(line)
    ratio = med["on"] / med["off"]
    print(f"\ntokens/s, median of blocks: off {med['off']:,.0f}  on {med['on']:,.0f}  on/off {ratio:.3f}  "
          f"(spread of off blocks: {min(tps['off']) / med['off']:.3f}-{max(tps['off']) / med['off']:.3f} of their median)")
    print(f"each on-block / the off blocks beside it: median {statistics.median(paired):.3f}, "
          f"range {min(paired):.3f}-{max(paired):.3f}")
    print(f"goal on/off >= 0.98: {ratio:.3f} -> {'MET' if ratio >= 0.98 else 'NOT MET'}")
    on_blocks = [(b0, b1) for mode, warm, _, b0, b1 in timed if mode == "on"]
    if all(b0["reader"] and b1["reader"] for b0, b1 in on_blocks):
        share = [sum(b[k]["reader"]["read_s"] for b in on_blocks) / sum(b[k]["wall_s"] for b in on_blocks)
                 for k in (0, 1)]
        cpu = [sum(b[k]["reader"]["cpu_s"] for b in on_blocks) / sum(b[k]["wall_s"] for b in on_blocks)
               for k in (0, 1)]
        print(f"the reader over the on-blocks' time: its reads' wall time (read_s) rank 0 {share[0]:.3f}, rank 1 "
              f"{share[1]:.3f}; its polls' CPU time rank 0 {cpu[0]:.3f}, rank 1 {cpu[1]:.3f}")
    for r in ranks:
        a = r["agent"]
        print(f"rank {r['rank']} agent: recorded {a['recorded'].get('step', 0)} steps, "
              f"{a['recorded'].get('collective', 0)} collectives; dropped {sum(a['dropped'].values())}"
              + (f"; last error {a['last_error']}" if a["last_error"] else ""))
    num_on = sum(1 for r in rows if r[0] == "on")
    if num_steps is None:
        print(f"a null sink took the batches ({col.num_batches} POSTs, {col.num_bytes:,} bytes): nothing stored")
        return
    print(f"collector stored {num_steps} step rows (expected {2 * num_on * args.block_steps}), {num_coll} collectives, "
          f"{num_inc} incidents (off blocks leave gaps in the rows)")


def run_reader(args: argparse.Namespace, tmp: Path) -> None:
    t0 = time.monotonic()
    ranks = _torchrun("reader", tmp, ["--pairs", str(args.pairs), "--block-s", str(args.block_s), "--rate",
                                      str(args.rate), "--buffer", str(args.buffer), "--numel", str(args.numel),
                                      "--dumps", str(args.dumps)],
                      {"TORCH_FR_BUFFER_SIZE": str(args.buffer)}, args.timeout_s)
    job_s = time.monotonic() - t0
    print(f"\n(b) the Flight Recorder reader at ~{args.rate:,.0f} collectives/s: 2 gloo ranks, all_reduce of "
          f"{args.numel} floats paced to {args.rate:,.0f}/s, {args.pairs} pairs of {args.block_s:g} s blocks "
          f"without/with a reader polled every 1 s; job {job_s:.0f} s; load {os.getloadavg()[0]:.2f}")
    print(f"{'rank':>4} {'block':>5} {'mode':<8}{'coll/s':>9}{'p50 us':>8}{'p99 us':>8}{'max ms':>8}  "
          f"{'reads':>5}{'read s/s':>10}{'cpu s/s':>9}{'max read ms':>12}{'rows/s':>8}{'lost':>6}")
    for r in ranks:
        for i, b in enumerate(r["blocks"]):
            line = (f"{r['rank']:>4} {i:>5} {b['mode']:<8}{b['calls'] / b['wall_s']:>9,.0f}{b['p50_call_s'] * 1e6:>8.0f}"
                    f"{b['p99_call_s'] * 1e6:>8.0f}{b['max_call_s'] * 1e3:>8.1f}  ")
            s = b.get("reader")
            if s:
                line += (f"{s['reads']:>5}{s['read_s'] / b['wall_s']:>10.4f}{s['cpu_s'] / b['wall_s']:>9.4f}"
                         f"{s['max_read_s'] * 1e3:>12.1f}"
                         f"{s['rows'] / b['wall_s']:>8,.0f}{s['lost']:>6}")
            print(line)

    def of(mode: str, key) -> list[float]:
        return [key(b) for r in ranks for b in r["blocks"] if b["mode"] == mode]

    rate = {m: statistics.median(of(m, lambda b: b["calls"] / b["wall_s"])) for m in ("without", "with")}
    share = of("with", lambda b: b["reader"]["read_s"] / b["wall_s"])
    cpu = of("with", lambda b: b["reader"]["cpu_s"] / b["wall_s"])
    max_read = max(of("with", lambda b: b["reader"]["max_read_s"]))
    rows_s = of("with", lambda b: b["reader"]["rows"] / b["wall_s"])
    p99 = {m: statistics.median(of(m, lambda b: b["p99_call_s"])) for m in ("without", "with")}
    mx = {m: max(of(m, lambda b: b["max_call_s"])) for m in ("without", "with")}
    print(f"\nreader's seconds per second of training: median {statistics.median(share):.4f} "
          f"(max {max(share):.4f}; its CPU seconds: median {statistics.median(cpu):.4f}); longest read {max_read * 1e3:.1f} ms; rows/s median {statistics.median(rows_s):,.0f}; "
          f"lost {sum(of('with', lambda b: b['reader']['lost'])):.0f}")
    print(f"collectives/s, median of blocks: without {rate['without']:,.0f}  with {rate['with']:,.0f}  "
          f"with/without {rate['with'] / rate['without']:.3f}")
    print(f"all_reduce call p99 (median of blocks) without {p99['without'] * 1e6:.0f} us, with {p99['with'] * 1e6:.0f} us; "
          f"max without {mx['without'] * 1e3:.1f} ms, with {mx['with'] * 1e3:.1f} ms")
    for r in ranks:
        d = r["dump"]
        dump_ms, unpickle_ms = statistics.median(d["dump_s"]) * 1e3, statistics.median(d["unpickle_s"]) * 1e3
        print(f"rank {r['rank']}: one read of a full buffer ({d['entries']} entries, median of {len(d['dump_s'])}): "
              f"dump {dump_ms:.1f} ms + unpickle {unpickle_ms:.1f} ms = {dump_ms + unpickle_ms:.1f} ms "
              f"({1e6 * (dump_ms + unpickle_ms) / 1e3 / max(1, d['entries']):.1f} us an entry)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("a", "b"), help="run one figure (default: both)")
    ap.add_argument("--blocks", type=int, default=8, help="(a) timed blocks, alternating off/on")
    ap.add_argument("--block-steps", type=int, default=40, help="(a) steps a block")
    ap.add_argument("--sink", choices=("collector", "null"), default="collector",
                    help="(a) where the agent ships: a real `collector serve` (on the ranks' cores, as on one "
                         "host), or a null sink that reads and answers only (the agent's own cost)")
    ap.add_argument("--no-detect", action="store_true",
                    help="(a) the collector stores only: its detection does not share the ranks' cores")
    ap.add_argument("--pairs", type=int, default=3, help="(b) pairs of blocks without/with the reader")
    ap.add_argument("--block-s", type=float, default=5.0, help="(b) seconds a block")
    ap.add_argument("--rate", type=float, default=1000.0, help="(b) collectives a second, each rank")
    ap.add_argument("--buffer", type=int, default=DEFAULT_BUFFER,
                    help="the Flight Recorder's entries ($TORCH_FR_BUFFER_SIZE; default: what llmwatch-instrument sets)")
    ap.add_argument("--numel", type=int, default=16, help="(b) floats an all_reduce")
    ap.add_argument("--dumps", type=int, default=10, help="(b) timed dumps of a full buffer")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="bound on each torchrun job")
    ap.add_argument("--worker", choices=("overhead", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.blocks < 2 or args.blocks % 2:
        ap.error("--blocks: an even number >= 2 (off and on alternate)")
    tmp = Path(tempfile.mkdtemp(prefix="llmwatch-bench-watch-"))
    try:
        if args.only in (None, "a"):
            run_overhead(args, tmp)
        if args.only in (None, "b"):
            run_reader(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
