"""Trainer throughput: against plain PyTorch, layouts side by side, and telemetry on vs off.

    python bench/bench_trainer.py [--steps 30] [--repeats 3] [--only peer|layouts|telemetry] [--embedded]
                                  [--warmup 5]

`peer`: the trainer against bench/plain_gpt.py (the same GPT in plain torch: torch
DDP over gloo, `no_sync` accumulation, bf16 autocast, AdamW, clip 1.0) at dp1 and
dp2 with the same global batch, interleaved, telemetry off. Both run micro-batches
of the same widths: the trainer's samples vary in length, and the peer is handed
the widths the trainer's own loader gives each rank's micro-batches. The ratio is
the peer's median step time over the trainer's (above 1: the trainer is faster).

Every figure is the median tokens/s of steps after a warm-up, read from the
run's metrics.jsonl, and every comparison is a ratio between runs made in this
same invocation (absolute numbers on a shared 2-core machine are noise). The
telemetry comparison interleaves on/off runs so drift hits both equally; with
`--embedded` a third arm runs the embedded collector and dashboard below the
ranks (`LLMWATCH_SIDECAR_NICE=10`) instead of at their priority (the default). `--warmup 60 --steps 200`
reads the steady state only. The embedded arms also print the low-noise figure: each
process's CPU per step in the steady state (/proc, after the warm-up and a few steps
before the end), by role (ranks, collector, dashboard, launcher), and the sidecars'
share of the job's CPU; and the collector's by thread (collector/threads.py: detection,
writer, policy, the HTTP loop `main`, the read routes' `pool`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, MICRO_BATCH_SIZE = 128, 4
PEER_SHAPES = ["--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", str(SEQ_LEN),
               "--micro-batch-size", str(MICRO_BATCH_SIZE)]
MODEL = [*PEER_SHAPES, "--precision", "bf16", "--no-progress"]
WARMUP = 5


def run(args: list[str], steps: int, workdir: Path, *, field: str = "tokens_per_s",
        env: dict[str, str] | None = None) -> float:
    """The median of metrics.jsonl's `field` over the steps after the warm-up (`WARMUP`)."""
    return run_steady(args, steps, workdir, field=field, env=env, sample=False)[0]


ROLES = ("ranks", "collector", "dashboard", "launcher")


def _role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    text = b" ".join(argv).decode(errors="replace")
    if "trainer.worker" in text or "trainer.zygote" in text:
        return "ranks"
    if "-m collector" in text:
        return "collector"
    if "-m dashboard" in text:
        return "dashboard"
    return "launcher"


def _tree(root: int) -> list[int]:
    """`root` and every process below it (/proc/<pid>/task/<tid>/children)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def _cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of the launcher's process tree, by role (a process gone meanwhile is left
    out), and the collector's by thread as `collector:<name>` (collector/threads.py names them;
    its main thread, the HTTP server's loop, is `main`, and the ASGI pool's workers `pool`)."""
    out = dict.fromkeys(ROLES, 0.0)
    for pid in _tree(root):
        try:
            role = _role(pid)
            out[role] += _proc_cpu_s(pid)
            if role == "collector":
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    name = (task / "comm").read_text().strip()
                    name = "main" if int(task.name) == pid else "pool" if name == "python" else name
                    key = f"collector:{name}"
                    out[key] = out.get(key, 0.0) + _proc_cpu_s(pid, int(task.name))
        except OSError:
            continue
    return out


def run_steady(args: list[str], steps: int, workdir: Path, *, field: str = "tokens_per_s",
               env: dict[str, str] | None = None, sample: bool = True) -> tuple[float, dict[str, float]]:
    """`run`'s median, and (`sample`) the CPU ms per step of each role of the job (ranks, collector,
    dashboard, launcher) in its steady state: /proc read when metrics.jsonl has `WARMUP` steps and
    again a few steps before the end (polled every 0.2 s, bounded by the run itself)."""
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--metrics-jsonl", str(metrics),
           "--steps", str(steps), *MODEL, *args]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
        marks: list[tuple[int, dict[str, float]]] = []
        wanted = [WARMUP, max(WARMUP + 1, steps - 3)] if sample else []
        while proc.poll() is None and wanted:
            done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if done >= wanted[0]:
                marks.append((done, _cpu_by_role(proc.pid)))
                wanted.pop(0)
            time.sleep(0.2)
        rc = proc.wait()
        if rc != 0:
            err.seek(0)
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err.read()[-2000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    per_step = {}
    if len(marks) == 2 and marks[1][0] > marks[0][0]:
        (s0, c0), (s1, c1) = marks
        per_step = {k: 1e3 * (c1[k] - c0.get(k, 0.0)) / (s1 - s0) for k in c1}
    return statistics.median(r[field] for r in rows[WARMUP:]), per_step


def trainer_widths(dp: int, micro_batches: int, steps: int) -> list[list[list[int]]]:
    """Per dp rank, per step, the width of each micro-batch the trainer runs (its samples vary
    in length; each micro-batch is padded to its longest, rounded up: trainer/data.py), read
    from the trainer's own data loader with the bench's config, so the peer does the same work."""
    from trainer import data as data_mod
    from trainer.config import JobConfig

    cfg = JobConfig()
    corpus = data_mod.build_corpus(cfg.data, seq_len=SEQ_LEN, seed=cfg.seed)
    widths = []
    for rank in range(dp):
        loader = data_mod.DataLoader(corpus, seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH_SIZE, micro_batches=micro_batches,
                                     dp_size=dp, dp_rank=rank, seed=cfg.seed, position=data_mod.DataPosition(),
                                     group_window=cfg.data.group_window, prefetch=0,
                                     pad_multiple=data_mod.pad_multiple_for(SEQ_LEN), start_step=1)
        widths.append([[int(mb.inputs.shape[1]) for mb in loader.next().micro_batches] for _ in range(steps)])
        loader.close()
    return widths


def peer_run(dp: int, micro_batches: int, steps: int, workdir: Path) -> float:
    """bench/plain_gpt.py's median step seconds after the warm-up (torchrun for dp > 1), on
    micro-batches of the trainer's widths."""
    out = Path(tempfile.mkdtemp(dir=workdir)) / "peer.json"
    widths = out.with_name("widths.json")
    widths.write_text(json.dumps(trainer_widths(dp, micro_batches, steps)))
    from trainer.launch import free_port

    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp), "--rdzv-backend",
                 "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"] if dp > 1 else [sys.executable])
    cmd = [*launcher, str(ROOT / "bench" / "plain_gpt.py"), *PEER_SHAPES, "--micro-batches", str(micro_batches),
           "--steps", str(steps), "--widths", str(widths), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(max(1, 2 // dp))))
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return statistics.median(json.loads(out.read_text())["step_s"][WARMUP:])


def peer(steps: int, repeats: int, workdir: Path) -> dict:
    """The trainer's step time against the plain-torch peer's, same global batch (16 samples)."""
    out = {}
    for dp, micro in ((1, 4), (2, 2)):
        mine, theirs = [], []
        for _ in range(repeats):
            mine.append(run(["--dp", str(dp), "--micro-batches", str(micro)], steps, workdir, field="step_s"))
            theirs.append(peer_run(dp, micro, steps, workdir))
        m, t = statistics.median(mine), statistics.median(theirs)
        out[f"dp{dp}"] = t / m
        print(f"dp{dp} (M={micro}): trainer {1e3 * m:.1f} ms/step, plain torch {1e3 * t:.1f} ms/step: "
              f"trainer / plain torch {t / m:.3f}x  (goal >= 0.95; runs: trainer "
              f"{['%.1f' % (1e3 * x) for x in mine]}, peer {['%.1f' % (1e3 * x) for x in theirs]} ms)")
    return out


def layouts(steps: int, repeats: int, workdir: Path) -> None:
    cases = {
        "1 process (M=4)": ["--micro-batches", "4"],
        "dp2 (M=2)": ["--dp", "2", "--micro-batches", "2"],
        "tp2 (M=4)": ["--tp", "2", "--micro-batches", "4"],
        "tp2+sp (M=4)": ["--tp", "2", "--sp", "--micro-batches", "4"],
        "pp2 (M=4)": ["--pp", "2", "--micro-batches", "4"],
        "dp2 x tp2 (M=2)": ["--dp", "2", "--tp", "2", "--micro-batches", "2"],
    }
    results = {name: [] for name in cases}
    for _ in range(repeats):
        for name, args in cases.items():
            results[name].append(run(args, steps, workdir))
    base = statistics.median(results["1 process (M=4)"])
    print(f"{'layout':<20} {'tokens/s':>10} {'vs 1 process':>13}")
    for name, vals in results.items():
        med = statistics.median(vals)
        print(f"{name:<20} {med:>10,.0f} {med / base:>12.2f}x")


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _proc_cpu_s(pid: int, tid: int | None = None) -> float:
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def telemetry(steps: int, repeats: int, workdir: Path, flush_s: float | None = None, embedded: bool = False) -> None:
    """Interleaved off/on pairs. "on" ships to a collector process started here, the
    same command the embedded launcher runs, so its CPU can be read from /proc; with
    `embedded`, "on" is plain `--telemetry`, as a user runs it: the launcher's own
    collector and dashboard on the same cores (their CPU is in the trainer's).

    Two figures: tokens/s (wall clock, what the goal is stated in; on 2 saturated
    cores every CPU-second of telemetry is taken from training) and CPU-seconds per
    step, trainer ranks plus collector (much less noisy than wall time)."""
    if embedded:
        return _telemetry_embedded(steps, repeats, workdir, flush_s)
    from trainer.launch import free_port

    port = free_port()
    token = "bench"
    collector = subprocess.Popen(
        [sys.executable, "-m", "collector", "serve", "--db", str(workdir / "bench.duckdb"), "--port", str(port),
         "--duckdb-threads", "1"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), LLMWATCH_TOKEN=token),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3)
    layout = ["--dp", "2", "--micro-batches", "2"]
    on_args = layout + ["--telemetry", "--collector", f"http://127.0.0.1:{port}", "--token", token]
    if flush_s is not None:
        on_args += ["--telemetry-flush-s", str(flush_s)]
    tput = {"off": [], "on": []}
    cpu = {"off": [], "on": [], "collector": []}
    try:
        for _ in range(repeats):
            for mode, args in (("off", layout), ("on", on_args)):
                c0, k0 = _children_cpu_s(), _proc_cpu_s(collector.pid)
                tput[mode].append(run(args, steps, workdir))
                cpu[mode].append((_children_cpu_s() - c0) / steps)
                if mode == "on":
                    cpu["collector"].append((_proc_cpu_s(collector.pid) - k0) / steps)
    finally:
        collector.terminate()
        collector.wait()
    _print_tokens(tput, "on")
    ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    print(f"CPU per step (whole trainer, incl. start-up), off: {ms['off']:.1f} ms   on: {ms['on']:.1f} ms "
          f"+ collector {ms['collector']:.2f} ms")
    print(f"CPU ratio off/(on + collector): {ms['off'] / (ms['on'] + ms['collector']):.3f}")


def _print_tokens(tput: dict[str, list[float]], on: str) -> None:
    m_off, m_on = statistics.median(tput["off"]), statistics.median(tput["on"])
    print(f"telemetry off: {m_off:,.0f} tokens/s  {['%.0f' % x for x in tput['off']]}")
    print(f"telemetry {on}: {m_on:,.0f} tokens/s  {['%.0f' % x for x in tput['on']]}")
    print(f"ratio on/off:  {m_on / m_off:.3f}   (goal >= 0.99)")


def _telemetry_embedded(steps: int, repeats: int, workdir: Path, flush_s: float | None) -> None:
    """Off, on (the sidecars at their default priority, the ranks'), and on with the sidecars
    below the ranks (LLMWATCH_SIDECAR_NICE=10), interleaved."""
    layout = ["--dp", "2", "--micro-batches", "2"]
    on_args = layout + ["--telemetry"] + (["--telemetry-flush-s", str(flush_s)] if flush_s is not None else [])
    arms = (("off", layout, None), ("on", on_args, None), ("on, nice 10", on_args, {"LLMWATCH_SIDECAR_NICE": "10"}))
    tput: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    steady: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in arms}
    for _ in range(repeats):
        for name, args, env in arms:
            c0 = _children_cpu_s()
            tokens, per_step = run_steady(args, steps, workdir, env=env)
            tput[name].append(tokens)
            cpu[name].append((_children_cpu_s() - c0) / steps)
            if per_step:
                steady[name].append(per_step)
    _print_tokens(tput, "on (embedded collector and dashboard)")
    m_off, m_low = statistics.median(tput["off"]), statistics.median(tput["on, nice 10"])
    print(f"telemetry on, sidecars below the ranks (nice 10): {m_low:,.0f} tokens/s  "
          f"{['%.0f' % x for x in tput['on, nice 10']]}  ratio on/off {m_low / m_off:.3f}")
    ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    print("CPU per step (whole job, incl. start-up and the collector's and dashboard's): "
          + "   ".join(f"{k}: {v:.1f} ms" for k, v in ms.items()))
    # the low-noise figure: CPU per step of each process in the steady state (after the warm-up,
    # before the end), by role; what the sidecars take is what the ranks cannot have on saturated cores
    print(f"CPU ms per step in the steady state (steps {WARMUP} to the end - 3, median of the repeats):")
    for name, samples in steady.items():
        if not samples:
            continue
        med = {k: statistics.median(x[k] for x in samples) for k in ROLES}
        side = med["collector"] + med["dashboard"] + med["launcher"]
        print(f"  {name:<12} " + "  ".join(f"{k} {v:.2f}" for k, v in med.items())
              + f"   sidecars {100 * side / max(1e-9, side + med['ranks']):.1f}% of the job's CPU")
        threads = {k.split(":", 1)[1]: statistics.median(x.get(k, 0.0) for x in samples)
                   for k in sorted({k for x in samples for k in x if k.startswith("collector:")})}
        if threads:
            print(f"  {'':<12} the collector by thread: " + "  ".join(
                f"{k} {v:.2f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v >= 0.005))


def main() -> None:
    global WARMUP
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=("peer", "layouts", "telemetry"))
    p.add_argument("--flush-s", type=float, help="the agents' flush interval (default: the trainer's, 1.0 s)")
    p.add_argument("--warmup", type=int, default=WARMUP,
                   help=f"steps left out of each run's median (default {WARMUP}; more: the steady state only)")
    p.add_argument("--embedded", action="store_true",
                   help="telemetry on = plain --telemetry: the embedded collector and dashboard on the same cores")
    a = p.parse_args()
    WARMUP = a.warmup
    with tempfile.TemporaryDirectory() as tmp:
        if a.only in (None, "peer"):
            peer(a.steps, a.repeats, Path(tmp))
        if a.only in (None, "layouts"):
            layouts(a.steps, a.repeats, Path(tmp))
        if a.only in (None, "telemetry"):
            telemetry(a.steps, a.repeats, Path(tmp), a.flush_s, a.embedded)


if __name__ == "__main__":
    main()
