"""Detection on real runs: precision, recall, latency and culprit accuracy of the live incidents.

Each scenario is a real `trainer --telemetry` run (embedded collector, a tiny model, or a
small one with `--model small`) with one random fault (kind, rank, step, factor) on a
random layout among dp2,
dp2 x tp2 and dp2 x pp2, or none (a clean run), and background jitter on every
run (`jitter@pct=10`: every rank's compute stretched by a random 0-10% each
step, which is noise, not a fault). Some kinds need a layout of their own
(`KIND_LAYOUTS`): a slow link is drawn on the dp axis of dp2 x tp2 or dp2 x pp2
(a slow_link needs two groups of its axis to compare; tp's tiny transfers on two
cores are noise), a bit flip on dp3 (three replicas: the one that differs is
named; with dp2 neither can be), a slow checkpoint on dp2 x tp2 or dp2 x pp2, on a
run that checkpoints every 5 steps, on a rank that writes a model shard (dp rank 0
of its (pp, tp); checkpoint_slow compares a rank's writes with those of the ranks
that wrote as many shards: on dp2 the one model-shard writer has none; and the
other ranks write only a ~5 KB rank file, which even 30x slower is under
checkpoint_slow's min_excess_s). The kinds: spike, straggler, nan_data, nan_transient, overflow,
crash, hang, slowlink (x3-x4 on that rank's dp ops), slowio_data (its data
loader x3-x5), slowio_ckpt (its shard writes x20-x30), bitflip (one mantissa bit
of one parameter, checksums every 10 steps), devhealth_ecc, devhealth_thermal,
devhealth_memory (a simulated device's samples: ECC errors, thermal throttling, the
node's memory nearly gone; runs of 400 steps, the thermal and memory windows cut
to 3 s and 2 s). The incidents the live collector wrote are
scored against the run's injections.jsonl with analysis/scoring.py:

- precision, recall, culprit accuracy by kind;
- latency in seconds (fault injected -> incident opened, both on this host's
  clock) and in steps (the newest step the run had reported when it opened; a
  straggler's, the step it fired at), p50 and max;
- false incidents per 1,000 clean steps: incidents matching no fault that start
  in a clean stretch (a clean run, or a run before its fault), over those steps.

A hang never ends by itself: the run is interrupted once its incident opened (or
after --hang-wait-s, a miss). The goals: precision and recall >= 0.98, culprit
accuracy 100%, no false incident per 1,000 clean steps.

    python bench/bench_detection.py --seed 1 --scenarios 8
    python bench/bench_detection.py --seed 2 --scenarios 30 --json out.json
    python bench/bench_detection.py --seed 3 --scenarios 12 --hog   # a process spinning beside it
    python bench/bench_detection.py --seed 4 --scenarios 12 --kinds straggler clean --model small

Runs take 15-40 s each on two cores; the machine is shared, and what other
processes do shows up in the compute times the straggler detector reads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis.scoring import Incident, cause_of, opened_step_of, score, suspects_of, truths_from_rows  # noqa: E402

TINY = ["--layers", "4", "--d-model", "64", "--heads", "4", "--seq-len", "32", "--micro-batch-size", "2",
        "--micro-batches", "2", "--no-progress"]
# steps of ~15-40 ms on two cores (the default: many runs in little time), or of ~150-250 ms, where a
# host's scheduler swings (a fraction of a second whatever the step) are a step or two, as on a real model
MODELS = {"tiny": TINY,
          "small": ["--layers", "4", "--d-model", "256", "--heads", "4", "--seq-len", "128", "--micro-batch-size", "4",
                    "--micro-batches", "2", "--no-progress"]}
LAYOUTS = {"dp2": ["--dp", "2", "--nodes", "2"], "dp2xtp2": ["--dp", "2", "--tp", "2", "--nodes", "2"],
           "dp2xpp2": ["--dp", "2", "--pp", "2", "--nodes", "2"], "dp3": ["--dp", "3", "--nodes", "3"]}
WORLD = {"dp2": 2, "dp2xtp2": 4, "dp2xpp2": 4, "dp3": 3}
KINDS = ("clean", "spike", "straggler", "nan_data", "nan_transient", "overflow", "crash", "hang",
         "slowlink", "slowio_data", "slowio_ckpt", "bitflip", "devhealth_ecc", "devhealth_thermal", "devhealth_memory")
DEFAULT_LAYOUTS = ("dp2", "dp2xtp2", "dp2xpp2")
KIND_LAYOUTS = {"slowlink": ("dp2", "dp2xtp2", "dp2xpp2"), "slowio_ckpt": ("dp2xtp2", "dp2xpp2"),
                "bitflip": ("dp3",)}  # the rest: DEFAULT_LAYOUTS
# device-health samples come once per heartbeat (1 s) and the detector's windows are in seconds:
# these runs are longer (a tiny step is ~15-40 ms here), and their rules shorten the thermal and
# memory windows from 30 s and 10 s (what is measured is the path, sample to incident, not the window)
DEVHEALTH_STEPS = 400
DEVHEALTH_RULES = "[device_health]\nthrottle_window_s = 3.0\nmemory_window_s = 2.0\n"
FACTORS = {"straggler": (1.3, 1.5, 1.75, 2.0), "slowlink": (3.0, 4.0), "slowio_data": (3.0, 4.0, 5.0),
           "slowio_ckpt": (20.0, 30.0)}
CKPT_EVERY = 5  # slowio_ckpt runs checkpoint this often
MODEL_WRITERS = {"dp2xtp2": (0, 1), "dp2xpp2": (0, 2)}  # dp rank 0 of each (pp, tp): model and optimizer shards


@dataclass
class Scenario:
    index: int
    layout: str
    kind: str
    rank: int = -1
    step: int = 0
    factor: float = 1.0
    steps: int = 80
    jitter_seed: int = 0
    model: str = "tiny"

    def injections(self) -> list[str]:
        out = [f"jitter@pct=10,seed={self.jitter_seed}"]
        if self.kind == "spike":
            out.append(f"spike@step={self.step}")
        elif self.kind == "straggler":
            out.append(f"straggler@rank={self.rank},from={self.step},factor={self.factor:g}")
        elif self.kind in ("nan_data", "nan_transient"):
            out.append(f"nan@step={self.step},rank={self.rank},mode={self.kind[4:]}")
        elif self.kind == "overflow":
            out.append(f"overflow@rank={self.rank},from={self.step},to={self.step + 6}")
        elif self.kind in ("crash", "hang", "bitflip"):
            out.append(f"{self.kind}@rank={self.rank},step={self.step}")
        elif self.kind == "slowlink":
            out.append(f"slowlink@rank={self.rank},axis=dp,from={self.step},factor={self.factor:g}")
        elif self.kind in ("slowio_data", "slowio_ckpt"):
            out.append(f"slowio@rank={self.rank},from={self.step},factor={self.factor:g},what={self.kind[7:]}")
        elif self.kind.startswith("devhealth_"):
            out.append(f"devhealth@rank={self.rank},from={self.step},what={self.kind[10:]}")
        return out

    def argv(self, run_dir: Path) -> list[str]:
        # detection alone is measured: the policy is off, the faults stay as injected
        argv = [sys.executable, "-m", "trainer", "--telemetry", "--policy", "off", "--run-dir", str(run_dir),
                "--run-id", run_dir.name, *MODELS[self.model], *LAYOUTS[self.layout], "--steps", str(self.steps if self.kind != "hang" else 1000),
                "--precision", "fp16" if self.kind == "overflow" else "fp32"]
        if self.kind == "slowio_ckpt":
            argv += ["--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", str(CKPT_EVERY)]
        if self.kind.startswith("devhealth_"):
            rules = run_dir.parent / f"{run_dir.name}.rules.toml"
            rules.write_text(DEVHEALTH_RULES)
            argv += ["--rules", str(rules)]
        for spec in self.injections():
            argv += ["--inject", spec]
        return argv

    def describe(self) -> str:
        what = self.kind if self.kind == "clean" else f"{self.kind} rank {self.rank} step {self.step}"
        if self.kind in FACTORS:
            what += f" x{self.factor:g}"
        return f"#{self.index:<3} {self.layout:<8} {what}"


def draw(rng: random.Random, index: int, steps: int, kinds: tuple[str, ...] = KINDS, model: str = "tiny",
         layouts: tuple[str, ...] = (), factors: tuple[float, ...] = ()) -> Scenario:
    """One scenario; `layouts` and `factors` (when given) narrow the draw to those the kind allows."""
    kind = rng.choice(kinds)
    allowed = KIND_LAYOUTS.get(kind, DEFAULT_LAYOUTS)
    layout = rng.choice([x for x in allowed if x in layouts] or allowed if layouts else allowed)
    if kind.startswith("devhealth_"):
        steps = max(steps, DEVHEALTH_STEPS)
    sc = Scenario(index=index, layout=layout, kind=kind, steps=steps, jitter_seed=rng.randrange(1 << 16), model=model)
    if kind == "clean":
        return sc
    # a slow checkpoint on a rank that writes a model shard: the others write only their ~5 KB
    # rank file, which even 30x slower costs less than checkpoint_slow's min_excess_s (0.25 s)
    sc.rank = rng.choice(MODEL_WRITERS[layout]) if kind == "slowio_ckpt" else rng.randrange(WORLD[layout])
    # after the warm-ups (spike baseline, straggler noise, slow_link's baseline); a slow checkpoint
    # opens at the first or second checkpoint after onset, a bit flip at the next checksum
    sc.step = rng.randrange(30, steps - 25)
    if kind == "straggler":  # a straggler lasts until someone acts: at least 50 steps of it (a 1.3x one on a
        sc.step = rng.randrange(30, max(45, steps - 50))  # loaded host needs ~40 at the detector's level_z)
    if kind.startswith("devhealth_"):  # in the first half: a dp2 run does its 400 steps in ~20 s, and its
        sc.step = rng.randrange(30, steps // 2)  # last 57 held less than the thermal window's 3 s
    if kind in FACTORS:
        sc.factor = rng.choice([f for f in FACTORS[kind] if f in factors] or FACTORS[kind] if factors
                               else FACTORS[kind])
    return sc


@dataclass
class Result:
    scenario: Scenario
    returncode: int
    wall_s: float
    incidents: list[Incident] = field(default_factory=list)
    truths: list = field(default_factory=list)
    num_steps: int = 0
    clean_steps: int = 0  # steps before the fault (all of a clean run's)
    error: str = ""


def run_one(sc: Scenario, run_dir: Path, *, hang_wait_s: float) -> Result:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    proc = subprocess.Popen(sc.argv(run_dir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    seen = threading.Event()
    err: list[str] = []

    def watch() -> None:
        for line in proc.stdout:
            if line.startswith("incident: hang "):
                seen.set()

    threading.Thread(target=watch, daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    if sc.kind == "hang":
        seen.wait(hang_wait_s)
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    res = Result(scenario=sc, returncode=proc.returncode, wall_s=time.monotonic() - t0)
    db = run_dir / "telemetry.duckdb"
    if not db.exists():
        res.error = "".join(err)[-500:]
        return res
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("SELECT kind, cause_key, rank, node, step_from, step_to, opened_ts, closed_ts, evidence "
                           "FROM incidents ORDER BY id").fetchall()
        ends = con.execute("SELECT step, max(ts) FROM steps WHERE attempt = 0 GROUP BY step ORDER BY step").fetchall()
    finally:
        con.close()
    res.num_steps = len(ends)
    for kind, key, rank, node, lo, hi, opened, closed, evidence in rows:
        ev = json.loads(evidence) if isinstance(evidence, str) else (evidence or {})
        # a straggler's or a slow link's from the step it fired at; else the newest step whose rows
        # were in when it opened (the ranks share this host's clock)
        opened_step = opened_step_of(kind, ev, max((s for s, ts in ends if ts <= opened), default=None))
        res.incidents.append(Incident(kind=kind, key=f"{run_dir.name}/{key}", run_id=run_dir.name, rank=rank,
                                      node=node, step_from=lo, step_to=hi, opened_ts=opened, opened_step=opened_step,
                                      closed_ts=closed, suspects=suspects_of(kind, rank, ev),
                                      cause=cause_of(kind, ev)))
    inj = run_dir / "injections.jsonl"
    rows = [json.loads(x) for x in inj.read_text().splitlines() if x.strip()] if inj.exists() else []
    res.truths = truths_from_rows(rows, run_id=run_dir.name)
    first_fault = min((t.step for t in res.truths), default=None)
    res.clean_steps = res.num_steps if first_fault is None else max(0, first_fault - 1)
    return res


def median(xs):
    return statistics.median(xs) if xs else None


HOG = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n    pass\n"


def main() -> int:
    p = argparse.ArgumentParser(description="detection precision/recall/latency on real runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", type=int, default=8)
    p.add_argument("--steps", type=int, default=80, help="steps per run (hangs run until interrupted)")
    p.add_argument("--hang-wait-s", type=float, default=60.0, help="how long a hang run waits for its incident")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny",
                   help="tiny: ~15-40 ms steps on two cores; small: ~150-250 ms (latency in steps as on a real model)")
    p.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS), help="draw only these kinds")
    p.add_argument("--layouts", nargs="*", choices=sorted(LAYOUTS), default=[],
                   help="draw only these layouts (where the kind allows one of them)")
    p.add_argument("--factors", nargs="*", type=float, default=[],
                   help="draw only these factors (where the kind has one of them: straggler 1.3 1.5 1.75 2)")
    p.add_argument("--keep", metavar="DIR", help="keep the run directories under DIR")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--hog", action="store_true",
                   help="a process spinning on one core beside every run, for the whole bench (a loaded host)")
    args = p.parse_args()
    # the hog spins until its parent is gone: a bench killed by a signal (no finally) leaves no hog behind
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())]) if args.hog else None
    try:
        return _bench(args)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def _bench(args) -> int:

    rng = random.Random(args.seed)
    scenarios = [draw(rng, i, args.steps, tuple(args.kinds), args.model, tuple(args.layouts),
                       tuple(args.factors)) for i in range(args.scenarios)]
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; seed {args.seed}; "
          f"model {args.model}"
          + ("; a CPU hog beside it" if args.hog else ""))
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_detection_"))
    base.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    t_all = time.monotonic()
    for sc in scenarios:
        run_dir = base / f"s{args.seed}-{sc.index:03d}-{sc.layout}-{sc.kind}"
        r = run_one(sc, run_dir, hang_wait_s=args.hang_wait_s)
        results.append(r)
        got = ", ".join(f"{i.kind}(rank {i.rank}, {i.node}, step {i.step_from}, opened at {i.opened_step})"
                        for i in r.incidents) or "no incident"
        print(f"{sc.describe():<44} rc {r.returncode:>3}  {r.wall_s:5.1f} s  -> {got}{'  ' + r.error if r.error else ''}",
              flush=True)
    incidents = [i for r in results for i in r.incidents]
    truths = [t for r in results for t in r.truths]
    s = score(incidents, truths)
    truth_by_run = {}
    for t in truths:
        truth_by_run.setdefault(t.run_id, min(truth_by_run.get(t.run_id, 1 << 62), t.step))
    false_clean = [i for i in s.false_positives if i.step_from is None or i.run_id not in truth_by_run
                   or i.step_from < truth_by_run[i.run_id]]
    clean_steps = sum(r.clean_steps for r in results)
    per_1000 = 1000.0 * len(false_clean) / clean_steps if clean_steps else None

    print(f"\n{len(results)} runs in {time.monotonic() - t_all:.0f} s, {sum(r.num_steps for r in results)} steps "
          f"({clean_steps} clean)\n")
    lines = [f"{'kind':<20}{'truths':>7}{'found':>7}{'FP':>5}{'prec':>7}{'recall':>8}{'culprit':>9}"
             f"{'lat_s p50':>11}{'lat_s max':>11}{'lat_steps p50':>15}{'max':>5}"]

    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    out = {"seed": args.seed, "scenarios": [asdict(r.scenario) for r in results], "by_kind": {}}
    for k in sorted(s.by_kind):
        v = s.by_kind[k]
        lines.append(f"{k:<20}{v.num_truths:>7}{v.num_matched:>7}{v.num_incidents - v.num_matched:>5}"
                     f"{f(v.precision):>7}{f(v.recall):>8}{f(v.culprit_accuracy):>9}"
                     f"{f(median(v.latency_s), '{:.2f}'):>11}{f(max(v.latency_s, default=None), '{:.2f}'):>11}"
                     f"{f(median(v.latency_steps), '{:.0f}'):>15}{f(max(v.latency_steps, default=None), '{:.0f}'):>5}")
        out["by_kind"][k] = {"truths": v.num_truths, "incidents": v.num_incidents, "matched": v.num_matched,
                             "precision": v.precision, "recall": v.recall, "culprit_accuracy": v.culprit_accuracy,
                             "culprit_among_suspects": v.num_culprit_among_suspects, "latency_s": v.latency_s,
                             "latency_steps": v.latency_steps}
    n_inc, n_match = len(s.matches) + len(s.false_positives), len(s.matches)
    overall_p = n_match / n_inc if n_inc else None
    overall_r = n_match / len(truths) if truths else None
    checked = sum(v.num_culprit_checked for v in s.by_kind.values())
    right = sum(v.num_culprit_right for v in s.by_kind.values())
    print("\n".join(lines))
    among = sum(v.num_culprit_among_suspects for v in s.by_kind.values())
    print(f"\noverall: precision {f(overall_p)}, recall {f(overall_r)}, culprit accuracy "
          f"{f(right / checked if checked else None)} ({right}/{checked}"
          + (f", {among} only as one of an incident's suspects" if among else "") + ")")
    print(f"false incidents per 1,000 clean steps: {f(per_1000, '{:.2f}')} ({len(false_clean)} in {clean_steps} steps)")
    for i in s.false_positives:
        print(f"  false: {i.run_id} {i.kind} rank {i.rank} node {i.node} steps {i.step_from}-{i.step_to}")
    for t in s.missed:
        print(f"  missed: {t.run_id} {t.label} rank {t.rank} step {t.step}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    out.update(precision=overall_p, recall=overall_r, culprit_accuracy=right / checked if checked else None,
               culprit_among_suspects=among,
               false_per_1000_clean_steps=per_1000, clean_steps=clean_steps,
               false_positives=[asdict(i) for i in s.false_positives], missed=[asdict(t) for t in s.missed])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
