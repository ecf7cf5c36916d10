"""Detection on jobs we did not write: precision, recall, culprit and hang latency over random faults.

    .venv/bin/python bench/bench_foreign_detection.py [--n 12] [--seed 0]     # ~5 min on two cores
    .venv/bin/python bench/bench_foreign_detection.py --n 40 --seed 3 --keep /tmp/fd

Each scenario is one run of a foreign loop (tests/integration/loops/) with 2 gloo
ranks under torchrun, against a real collector (`--policy off`: detection alone),
through tests/integration/foreign_run.py `run_loop`; the loops alternate between
the plain DDP loop under `llmwatch-instrument` (zero code, "ddp"), the Hugging
Face Trainer with its one-line callback ("hf"), the FSDP2 loop under
`llmwatch-instrument` ("fsdp2") and the Lightning fit with its callback ("lightning"). One fault a run, drawn with
`--seed` (the harness's $LOOP_FAULTS, loops/faults.py; the collector never sees it):

  clean      none: every incident is a false one;
  straggler  rank r's forward slower by (f - 1) x the loop's step time from step s,
             f in 1.4-2.0 (the loop's `ms`; the realized step-time ratio is printed);
  hang       rank r sleeps forever before the forward of step s (the run is killed
             once a hang incident opened, or at --run-timeout-s);
  nan        rank r's loss is NaN at step s;
  noise      rank r's batch at step s is random tokens (a loss spike of that replica).

s is drawn after the warm-ups (the loss baseline holds 20 steps). Scoring, per run:
an incident matches the fault when it is of the expected kind (straggler ->
"straggler", hang -> "hang", nan -> "nan", noise -> "loss_spike") and is about
the fault's steps (a NaN's and a spike's first step is s; a straggler's or a
hang's is s - 1 or later); every other incident is a false positive. Recall: runs
with a fault whose matching incident opened; precision: matching incidents over
all incidents (a second matching incident for one fault is not counted against
it); culprit: the first matching incident names rank r. Hang latency: from the
hung rank's last step's end (`run.steps[s - 1]`) to the incident's `opened_ts`,
against max(5 s, 3 step times).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration import foreign_run  # noqa: E402

KINDS = ("clean", "straggler", "hang", "nan", "noise")
EXPECTED = {"clean": None, "straggler": "straggler", "hang": "hang", "nan": "nan", "noise": "loss_spike"}
AT_THE_STEP = {"nan", "noise"}  # their incident starts at the fault's step
LOOPS = ("ddp", "hf", "fsdp2", "lightning")
# a step of each loop with 2 ranks watched, on this machine's two cores (median, clean runs): the
# straggler's extra forward time is (f - 1) times this
STEP_MS = {"ddp": 40, "hf": 45, "fsdp2": 40, "lightning": 30}
FAULT_STEPS = (25, 40)  # s is drawn in [25, 40): after the loss baseline's 20 steps and the first 5


@dataclass
class Scenario:
    index: int
    loop: str
    kind: str
    rank: int = -1
    step: int = 0
    factor: float = 1.0

    @property
    def ms(self) -> int:
        return round((self.factor - 1.0) * STEP_MS[self.loop])

    def faults(self) -> str:
        if self.kind == "clean":
            return ""
        spec = f"{self.kind}:rank={self.rank},step={self.step}"
        return spec + (f",ms={self.ms}" if self.kind == "straggler" else "")

    def describe(self) -> str:
        if self.kind == "clean":
            return "clean"
        extra = f" x{self.factor:.2f} ({self.ms} ms)" if self.kind == "straggler" else ""
        return f"{self.kind} r{self.rank} s{self.step}{extra}"


def draw(rng: random.Random, index: int, loops: tuple[str, ...], kinds: tuple[str, ...] = KINDS) -> Scenario:
    sc = Scenario(index=index, loop=loops[index % len(loops)], kind=rng.choice(kinds))
    if sc.kind != "clean":
        sc.rank = rng.randrange(2)
        sc.step = rng.randrange(*FAULT_STEPS)
    if sc.kind == "straggler":
        sc.factor = round(rng.uniform(1.4, 2.0), 2)
    return sc


@dataclass
class Outcome:
    scenario: Scenario
    run: foreign_run.ForeignRun | None
    wall_s: float
    error: str = ""
    matched: list[dict] = field(default_factory=list)
    false: list[dict] = field(default_factory=list)
    latency_s: float | None = None  # a hang's: last step's end -> incident opened
    bound_s: float | None = None  # max(5 s, 3 step times)
    realized: float | None = None  # a straggler's step time after / before

    @property
    def found(self) -> bool:
        return bool(self.matched)

    @property
    def culprit_right(self) -> bool:
        return bool(self.matched) and self.matched[0]["rank"] == self.scenario.rank


def matches(inc: dict, sc: Scenario) -> bool:
    if EXPECTED[sc.kind] is None or inc["kind"] != EXPECTED[sc.kind]:
        return False
    first = inc["step_from"]
    if first is None:
        return sc.kind not in AT_THE_STEP
    return first == sc.step if sc.kind in AT_THE_STEP else first >= sc.step - 1


def _step_s(ends: dict[int, float], lo: int, hi: int) -> float | None:
    """Median interval between the ends of consecutive steps in [lo, hi]."""
    d = [ends[k] - ends[k - 1] for k in range(lo, hi + 1) if k in ends and k - 1 in ends]
    return statistics.median(d) if d else None


def run_one(sc: Scenario, tmp: Path, steps: int) -> Outcome:
    t0 = time.monotonic()
    try:
        hang = sc.kind == "hang"
        run = foreign_run.run_loop(tmp, sc.loop, faults=sc.faults(), steps=400 if hang else steps,
                                   stop_when=foreign_run.hang_seen(sc.rank, sc.step - 1) if hang else None)
    except Exception as e:  # noqa: BLE001 - one failed run must not end the others
        return Outcome(sc, None, time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
    out = Outcome(sc, run, time.monotonic() - t0)
    for inc in run.incidents:
        (out.matched if matches(inc, sc) else out.false).append(inc)
    before = _step_s(run.steps, 6, sc.step - 1) if sc.kind != "clean" else None
    if sc.kind == "hang" and out.matched and sc.step - 1 in run.steps:
        out.latency_s = out.matched[0]["opened_ts"] - run.steps[sc.step - 1]
        out.bound_s = max(5.0, 3 * before) if before else 5.0
    if sc.kind == "straggler" and before:
        after = _step_s(run.steps, sc.step + 2, max(run.steps, default=0))
        out.realized = after / before if after else None
    if run.returncode not in (0, None) and sc.kind != "hang":
        out.error = f"rc {run.returncode}: {run.output.strip().splitlines()[-1][:120] if run.output.strip() else ''}"
    return out


def _incidents(incs: list[dict]) -> str:
    return ", ".join(f"{i['kind']} r{i['rank']} s{i['step_from']}" for i in incs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=12, help="scenarios (~25 s each on two cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=140,
                    help="steps of a run (a hang's: until its incident); a straggler verdict on a foreign job comes "
                         "once the ranks' drift is measured, ~64 steps in")
    ap.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS), help="the loops, taken in turn")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="draw only these kinds")
    ap.add_argument("--run-timeout-s", type=float, default=120.0,
                    help="bound on one run (a hang never detected waits this long)")
    ap.add_argument("--keep", metavar="DIR", help="keep the runs' folders (collector db, job log) under DIR")
    args = ap.parse_args(argv)
    foreign_run.RUN_TIMEOUT_S = args.run_timeout_s  # read by run_loop at each call

    rng = random.Random(args.seed)
    scenarios = [draw(rng, i, tuple(args.loops), tuple(args.kinds)) for i in range(args.n)]
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="llmwatch-bench-foreign-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"{args.n} runs, seed {args.seed}, {args.steps} steps; load {os.getloadavg()[0]:.2f}")
    print(f"{'#':>3} {'loop':<4} {'scenario':<36}{'rc':>4}{'wall s':>7}  {'found':<6}{'culprit':<8}"
          f"{'latency s':>10}{'bound':>6}  incidents")
    outcomes: list[Outcome] = []
    t_all = time.monotonic()
    for sc in scenarios:
        o = run_one(sc, base / f"s{args.seed}-{sc.index:02d}-{sc.loop}-{sc.kind}", args.steps)
        outcomes.append(o)
        fault = sc.kind != "clean"
        what = sc.describe() + (f" ~x{o.realized:.2f}" if o.realized else "")
        rc = "-" if o.run is None or o.run.returncode is None else str(o.run.returncode)
        got = ("matched: " + _incidents(o.matched) if o.matched else "") + \
              (("; " if o.matched else "") + "FALSE: " + _incidents(o.false) if o.false else "")
        print(f"{sc.index:>3} {sc.loop:<4} {what:<36}{rc:>4}{o.wall_s:>7.1f}  "
              f"{('yes' if o.found else 'NO') if fault else '-':<6}"
              f"{('yes' if o.culprit_right else 'no') if o.found else '-':<8}"
              f"{f'{o.latency_s:.1f}' if o.latency_s is not None else '-':>10}"
              f"{f'{o.bound_s:.1f}' if o.bound_s is not None else '-':>6}  "
              f"{got or 'none'}{'  ERROR ' + o.error if o.error else ''}", flush=True)

    def ratio(a: int, b: int) -> str:
        return f"{a / b:.2f} ({a}/{b})" if b else "- (0/0)"

    print(f"\n{len(outcomes)} runs in {time.monotonic() - t_all:.0f} s")
    print(f"{'kind':<10}{'runs':>5}{'found':>7}{'culprit':>9}{'false':>7}")
    for kind in args.kinds:
        of = [o for o in outcomes if o.scenario.kind == kind]
        if of:
            print(f"{kind:<10}{len(of):>5}{sum(o.found for o in of) if kind != 'clean' else '-':>7}"
                  f"{sum(o.culprit_right for o in of) if kind != 'clean' else '-':>9}{sum(len(o.false) for o in of):>7}")
    faulted = [o for o in outcomes if o.scenario.kind != "clean" and o.run is not None]
    num_matched = sum(len(o.matched) for o in outcomes)
    num_false = sum(len(o.false) for o in outcomes)
    found = [o for o in faulted if o.found]
    print(f"\nprecision {ratio(num_matched, num_matched + num_false)}  recall {ratio(len(found), len(faulted))}  "
          f"culprit right {ratio(sum(o.culprit_right for o in found), len(found))}")
    lat = [o for o in outcomes if o.latency_s is not None]
    if lat:
        values = [o.latency_s for o in lat]
        print(f"hang latency: median {statistics.median(values):.1f} s, max {max(values):.1f} s; within max(5 s, "
              f"3 step times): {sum(o.latency_s <= o.bound_s for o in lat)}/{len(lat)}")
    else:
        print("hang latency: no hang detected" if any(o.scenario.kind == "hang" for o in outcomes) else
              "hang latency: no hang drawn")
    errors = [o for o in outcomes if o.error]
    if errors:
        print(f"{len(errors)} runs with errors (see above)")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
