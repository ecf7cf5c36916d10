"""Hot-path cost of recording one training step of 10 scalars, side by side in one run.

    .venv/bin/python bench/bench_agent_hotpath.py [--calls 200000] [--budget-s 3]

Every candidate is timed call by call (`perf_counter_ns` around one call; the
timer's own cost is printed and included in every figure), with a direct
positional call generated per candidate so no `*args` overhead is added:

  numpy floor     10 stores into a preallocated numpy row (the floor)
  llmwatch agent  Agent.record_step (step and 13 values by keyword: the 10
                  scalars plus times, memory, skipped) with its flusher running,
                  pointed at a closed port, so every batch goes to a spool in a
                  temp dir
  agent, loss     the same, called with the loss only (the rest NULL, step_s
    only          derived from the agent's clock: a loop that knows nothing else)
  prometheus      10 pre-bound Gauge children, .set()
  opentelemetry   10 synchronous SDK gauges, .set(value, attributes)
  tensorboardX    10 SummaryWriter.add_scalar        (optional `bench` extra)
  wandb           run.log({10 keys}), offline mode   (optional `bench` extra)
  mlflow          mlflow.log_metrics({10 keys}), local file store (optional)

The four in-process candidates are interleaved over `--rounds` rounds; the
optional ones, whose helper threads and processes would disturb the others,
run after them, one at a time, within `--budget-s` each. Goal (issue 3):
agent median <= 2 us and <= 3x the numpy floor of the same run.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMES = ("loss", "grad_norm", "loss_scale", "lr", "tokens", "step_s", "fwd_s", "bwd_s", "opt_s", "data_s")
VALUES = (2.5, 0.75, 65536.0, 3e-4, 8192.0, 0.25, 0.08, 0.12, 0.03, 0.01)


def _timing_loop(arity: int, names: tuple[str, ...] = ()):
    """A loop timing `fn(i, v1, ..., v_arity)` per call; with `names`, by keyword:
    `fn(i, name1=v1, ...)` (as the agent's keyword-only record_step is called)."""
    args = ", ".join(f"v{k}" for k in range(arity))
    call = ", ".join(f"{n}=v{k}" for k, n in enumerate(names)) if names else args
    src = (f"def loop(fn, n, out, pc, {args}):\n"
           f"    for i in range(n):\n"
           f"        t0 = pc()\n"
           f"        fn(i, {call})\n"
           f"        out[i] = pc() - t0\n")
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - generated from integers only
    return ns["loop"]


def numpy_floor():
    import numpy as np

    buf = np.zeros((65536, 10))

    def record(step, a, b, c, d, e, f, g, h, i, j):
        row = buf[step & 65535]
        row[0] = a
        row[1] = b
        row[2] = c
        row[3] = d
        row[4] = e
        row[5] = f
        row[6] = g
        row[7] = h
        row[8] = i
        row[9] = j

    return record, VALUES, lambda: None


class Kw(dict):
    """Values passed by keyword (their names) rather than by position."""


def llmwatch_agent(tmp: str):
    agent = _agent(tmp, "bench")
    # every value by keyword, as the trainer calls it
    values = Kw(loss=2.5, grad_norm=0.75, loss_scale=65536.0, lr=3e-4, tokens=8192, step_s=0.25, fwd_s=0.08,
                bwd_s=0.12, opt_s=0.03, data_s=0.01, comm_exposed_s=0.005, mem_bytes=1 << 30, skipped=False)
    return agent.record_step, values, _agent_done(agent)


def _agent(tmp: str, run_id: str):
    from agent import Agent, AgentConfig

    with socket.socket() as s:  # a port nobody listens on: the flusher spools
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logging.getLogger("llmwatch.agent").setLevel(logging.ERROR)
    agent = Agent(AgentConfig(url=f"http://127.0.0.1:{port}", spool_dir=os.path.join(tmp, run_id)),
                  run_id=run_id, rank=0, node="bench")
    agent.start()
    return agent


def _agent_done(agent):
    def done():
        stats = agent.stats()
        agent.close(timeout_s=2.0)
        return (f"recorded {stats['recorded']['step']:,} steps, dropped {stats['dropped']['step']}, "
                f"{stats['batches']['spooled']} batches spooled ({stats['spool_bytes'] / 1e6:.1f} MB)")

    return done


def prometheus():
    from prometheus_client import CollectorRegistry, Gauge

    reg = CollectorRegistry()
    children = [Gauge(f"bench_{n}", n, ("run_id", "rank"), registry=reg).labels("bench", "0") for n in NAMES]
    g0, g1, g2, g3, g4, g5, g6, g7, g8, g9 = (c.set for c in children)

    def record(step, a, b, c, d, e, f, g, h, i, j):
        g0(a)
        g1(b)
        g2(c)
        g3(d)
        g4(e)
        g5(f)
        g6(g)
        g7(h)
        g8(i)
        g9(j)

    return record, VALUES, lambda: None


def opentelemetry():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    meter = provider.get_meter("bench")
    attrs = {"run_id": "bench", "rank": 0}
    g0, g1, g2, g3, g4, g5, g6, g7, g8, g9 = (meter.create_gauge(n).set for n in NAMES)

    def record(step, a, b, c, d, e, f, g, h, i, j):
        g0(a, attrs)
        g1(b, attrs)
        g2(c, attrs)
        g3(d, attrs)
        g4(e, attrs)
        g5(f, attrs)
        g6(g, attrs)
        g7(h, attrs)
        g8(i, attrs)
        g9(j, attrs)

    return record, VALUES, provider.shutdown


def tensorboardx(tmp: str):
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(logdir=os.path.join(tmp, "tb"))
    tags = [f"train/{n}" for n in NAMES]

    def record(step, *values):
        for tag, v in zip(tags, values):
            writer.add_scalar(tag, v, step)

    return record, VALUES, writer.close


def wandb_offline(tmp: str):
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(mode="offline", dir=tmp, project="llmwatch-bench")

    def record(step, *values):
        run.log(dict(zip(NAMES, values)), step=step)

    return record, VALUES, run.finish


def mlflow_local(tmp: str):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 wants a database; files need no server
    import mlflow

    mlflow.set_tracking_uri(Path(tmp, "mlruns").as_uri())
    mlflow.start_run()

    def record(step, *values):
        mlflow.log_metrics(dict(zip(NAMES, values)), step=step)

    return record, VALUES, mlflow.end_run


def measure(fn, values, num_calls: int) -> array:
    names = tuple(values) if isinstance(values, Kw) else ()
    loop = _timing_loop(len(values), names)
    out = array("q", bytes(8 * num_calls))
    gc.collect()
    loop(fn, num_calls, out, time.perf_counter_ns, *(values.values() if names else values))
    return out


def summarize(samples) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000, help="calls per in-process candidate")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the in-process candidates")
    ap.add_argument("--budget-s", type=float, default=3.0, help="time cap per optional library")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="llmwatch-bench-")
    results: dict[str, tuple[float, float, int, str]] = {}

    timer = measure(lambda *a: None, (), 100_000)
    timer_ns = statistics.median(timer)

    loss_only = _agent(tmp, "bench-loss-only")
    core = {"numpy floor": numpy_floor(), "llmwatch agent": llmwatch_agent(tmp),
            "agent, loss only": (loss_only.record_step, Kw(loss=2.5), _agent_done(loss_only)),
            "prometheus-client": prometheus(), "opentelemetry-sdk": opentelemetry()}
    per_round = max(1, args.calls // args.rounds)
    samples: dict[str, list[int]] = {name: [] for name in core}
    for name, (fn, values, _) in core.items():  # warm up, then size the slow ones to the budget
        measure(fn, values, 2000)
        t0 = time.perf_counter()
        measure(fn, values, 2000)
        est_s = (time.perf_counter() - t0) / 2000
        core[name] = (fn, values, core[name][2], min(per_round, max(1000, int(args.budget_s / args.rounds / est_s))))
    for _ in range(args.rounds):
        for name, (fn, values, _, n) in core.items():
            samples[name].extend(measure(fn, values, n))
    for name, (_, _, done, _) in core.items():
        note = done() or ""
        med, p99 = summarize(samples[name])
        results[name] = (med, p99, len(samples[name]), note)

    optional = {"tensorboardX": (tensorboardx, "tensorboardX"), "wandb (offline)": (wandb_offline, "wandb"),
                "mlflow (local files)": (mlflow_local, "mlflow")}
    for name, (factory, module) in optional.items():
        try:
            __import__(module)
        except ImportError:
            print(f"{name}: not installed (pip install -e '.[bench]')")
            continue
        try:
            fn, values, done = factory(tmp)
            t0 = time.perf_counter()
            measure(fn, values, 20)
            est_s = (time.perf_counter() - t0) / 20
            n = max(50, min(args.calls, int(args.budget_s / max(est_s, 1e-9))))
            got = measure(fn, values, n)
            done()
            med, p99 = summarize(got)
            results[name] = (med, p99, n, "")
        except Exception as e:  # noqa: BLE001 - one library failing must not hide the others
            print(f"{name}: failed: {type(e).__name__}: {e}")

    floor = results["numpy floor"][0]
    print(f"\nrecording one step of 10 scalars (python {sys.version.split()[0]}, {os.cpu_count()} cpus; "
          f"timer overhead {timer_ns:.0f} ns, included below)")
    print(f"{'candidate':<22}{'median ns':>11}{'p99 ns':>11}{'x floor':>9}{'calls':>9}")
    for name, (med, p99, n, note) in results.items():
        print(f"{name:<22}{med:>11,.0f}{p99:>11,.0f}{med / floor:>9.1f}{n:>9,}" + (f"   {note}" if note else ""))
    agent_med = results["llmwatch agent"][0]
    ok = agent_med <= 2000 and agent_med <= 3 * floor
    print(f"\ngoal: agent median <= 2000 ns and <= 3x the floor: {agent_med:,.0f} ns, "
          f"{agent_med / floor:.2f}x -> {'MET' if ok else 'NOT MET'}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
