"""Goodput under a scripted fault schedule: healing on, healing off, and no faults.

Three real `trainer --telemetry` runs of one tiny model on dp4 over 4 simulated
nodes (one rank per node), the same steps and checkpoints (`--ckpt-every 5`):

- clean: no fault, `--policy off` (nothing done: a natural loss or grad spike of the
  data is not rolled back in the baseline);
- auto: the schedule below with `--policy auto` (rollback + rerun diagnosis on a
  NaN or a spike, node isolation on a device NaN, a straggler or a hang, restart
  after a crash);
- off: the same schedule with `--policy off`, which heals nothing. What a team has
  today is modelled, not waited for: a crash ends the job, and a person restarts it
  by hand (`--resume`, the newest checkpoint) after `--human-delay-s`; a hang ends
  the job only when the process-group timeout fires (`--hang-timeout-s`, the
  trainer's `parallel.timeout_s`), then the same restart. The bench stops a hung
  segment once its steps stall for `--stall-s` and counts the timeout instead of
  the time it waited; the delays are added to the wall time, never slept. NaN
  steps are skipped by the optimizer and the run goes on: a device NaN skips every
  step from its onset to the end, a straggler slows every step after it.

The schedule (ranks of the first layout; faults follow their hardware through
restarts): spike, data NaN (rank 1), straggler x3 (rank 2), transient NaN (rank 0),
crash (rank 3), hang (rank 1), device NaN (rank 3), at gaps of 1-2.5 units (`FULL`).
A unit is --gap-s (10 s) of clean steps, measured by a 60-step calibration run, so
that two actions are never within the policy's 5 s cooldown whatever the machine's
speed; `--steps N` spreads the same gaps over N steps instead (at ~50 ms a step, 600
steps put them 2-6 s apart: some collide). `--quick`: spike, straggler, crash over
240 steps, a smoke run. Auto is meant to isolate
node2, node1, node3 in that order and finishes on node0 (dp 4 -> 3 -> 2 -> 1, the
global batch of 24 samples kept). The schedule holds 4 rollbacks within 10
minutes; the default guard rail (`max_rollbacks = 3` per `rollback_window_s` 600)
would stop the run at the 4th, so every run here gets `--rules` raising it to 8.

`--mix llama3 [--faults N --seed K]`: instead of the fixed schedule, N faults
drawn in the proportions Llama 3 reported for its 419 unexpected interruptions in
54 days on 16,384 GPUs (`LLAMA3`): a faulty GPU (30.1%) is a device NaN or a
crash, HBM3 memory (17.2%) a bit flip, a software bug (12.9%) a crash, the network
(8.4%) a slow dp link or a hang, and the rest (31.4%) is spread over a straggler,
a loss spike, a data or transient NaN, a slow data loader and slow checkpoint
writes. Ranks are drawn among those auto has not isolated yet by the faults before
(a fault on a node auto already took out would never fire in auto, and off would
pay for it alone); the last one left takes what remains. The gap after each fault
follows what it ends in (`AFTER_UNITS`), as in the fixed schedule.

`--spare-nodes N` gives the healed runs N standby nodes (a node isolated while one
is left is replaced, dp stays 4), and `--always` adds a third faulted run, "always
isolate": auto without the cost model (`weigh_cost = false`), every slow-down that
persisted costs its node whatever that costs the job. The issue's comparison:

    python bench/bench_goodput.py --mix llama3 --faults 8 --seed 1 --spare-nodes 1 --always

Figures per run: wall s and productive s (collector/offline/postmortem.py's goodput: the
step time of the final effective lineage, not skipped, over the run's span), the
final step, and productive steps per wall second relative to the clean run (what
a straggler and a smaller dp cost, which goodput by its definition does not count).
For off, the segments' effective steps are joined (a step redone after a manual
restart counts once, from the segment that ran it last). Every comparison is a
ratio between runs of this invocation; on a shared 2-core machine absolute seconds
are noise.

    python bench/bench_goodput.py --quick
    python bench/bench_goodput.py --mix llama3 --faults 8 --seed 1
    python bench/bench_goodput.py --out-json goodput.json --keep     # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collector.offline import postmortem  # noqa: E402
from collector.read import queries  # noqa: E402
from trainer.config import JobConfig  # noqa: E402

MODEL = ["--layers", "4", "--d-model", "64", "--heads", "4", "--seq-len", "32", "--micro-batch-size", "2",
         "--precision", "fp32", "--no-progress"]
LAYOUT = ["--dp", "4", "--nodes", "4", "--micro-batches", "3"]  # 24 samples: divides over dp 3, 2 and 1
RULES = "[policy]\nmax_rollbacks = 8\n"
MAX_SEGMENTS = 8  # off: manual restarts before the bench gives up


# (fault, gap before it, in units): one unit between two faults, 2-2.5 after one that ends in a
# restart (the straggler's 4 s of cost then its isolation, the crash, the hang's isolation)
FULL = [("spike@step={s}", 1.0), ("nan@step={s},rank=1,mode=data", 1.0),
        ("straggler@rank=2,from={s},factor=3", 1.0), ("nan@step={s},rank=0,mode=transient", 2.5),
        ("crash@rank=3,step={s}", 1.0), ("hang@rank=1,step={s}", 2.0), ("nan@step={s},rank=3,mode=device", 2.5)]
QUICK = [("spike@step={s}", 1.0), ("straggler@rank=2,from={s},factor=3", 1.0), ("crash@rank=3,step={s}", 4.0)]
TAIL_UNITS = {"full": 1.5, "quick": 2.0}  # after the last fault: its recovery, then steps that count

# --mix llama3: Llama 3's 419 unexpected interruptions in 54 days (The Llama 3 Herd of Models, 2024, table 5)
# by cause (share, %), and the faults that stand for each, drawn evenly within a cause
LLAMA3 = (("faulty GPU", 30.1, ("nan_device", "crash")), ("HBM3 memory", 17.2, ("bitflip",)),
          ("software bug", 12.9, ("crash",)), ("network", 8.4, ("slowlink", "hang")),
          ("other", 31.4, ("straggler", "spike", "nan_data", "nan_transient", "slowio_data", "slowio_ckpt")))
MIXES = {"llama3": LLAMA3}
SPECS = {"nan_device": "nan@step={s},rank={r},mode=device", "crash": "crash@rank={r},step={s}",
         "bitflip": "bitflip@rank={r},step={s}", "slowlink": "slowlink@rank={r},axis=dp,from={s},factor=4",
         "hang": "hang@rank={r},step={s}", "straggler": "straggler@rank={r},from={s},factor=3",
         "spike": "spike@step={s}", "nan_data": "nan@step={s},rank={r},mode=data",
         "nan_transient": "nan@step={s},rank={r},mode=transient",
         "slowio_data": "slowio@rank={r},from={s},factor=4,what=data",
         "slowio_ckpt": "slowio@rank={r},from={s},factor=10,what=ckpt"}
# units of gap after a fault: 1 after one auto handles in place (a rollback, a repair, an alert), 2-2.5
# after one it ends in a restart or an isolation (a persisting cost first: the straggler's 4 s)
AFTER_UNITS = {"nan_device": 2.5, "crash": 2.0, "bitflip": 1.0, "slowlink": 2.5, "hang": 2.5, "straggler": 2.5,
               "spike": 1.0, "nan_data": 1.0, "nan_transient": 1.0, "slowio_data": 2.5, "slowio_ckpt": 1.0}
ISOLATING = frozenset({"nan_device", "slowlink", "hang", "straggler", "slowio_data"})  # auto isolates the node
WORLD = 4  # LAYOUT's ranks, one a node


def mix_plan(mix: str, num_faults: int, seed: int, *, crashes_to_isolate: int = 2) -> list[tuple[str, str, float]]:
    """(cause, kind, spec template with {s}) x num_faults drawn from MIXES[mix], with the gap
    before each (units). Ranks are drawn among those auto still runs on (see the module doc)."""
    import random

    rng = random.Random(seed)
    causes = MIXES[mix]
    alive, crashes = list(range(WORLD)), [0] * WORLD
    out, gap = [], 1.0
    for _ in range(num_faults):
        cause, _, kinds = rng.choices(causes, weights=[w for _, w, _ in causes])[0]
        kind = rng.choice(kinds)
        r = rng.choice(alive)
        if kind == "crash":
            crashes[r] += 1
        if len(alive) > 1 and (kind in ISOLATING or (kind == "crash" and crashes[r] >= crashes_to_isolate)):
            alive.remove(r)
        out.append((cause, kind, SPECS[kind].replace("{r}", str(r)), gap))
        gap = AFTER_UNITS[kind]
    return out


def schedule(quick: bool, *, steps: int | None = None, unit_steps: int | None = None,
             plan: list[tuple[str, float]] | None = None, tail: float | None = None) -> tuple[int, list[str]]:
    """(steps, injections): faults `unit_steps` apart (times their gaps), or spread over `steps`.
    `plan`: (spec template, gap before it) instead of the fixed schedule, `tail` units after it."""
    if plan is None:
        plan, tail = (QUICK, TAIL_UNITS["quick"]) if quick else (FULL, TAIL_UNITS["full"])
    units = sum(g for _, g in plan) + tail
    unit = unit_steps if unit_steps is not None else steps / units
    out, at = [], 0.0
    for spec, gap in plan:
        at += gap
        out.append(spec.format(s=max(40, round(at * unit))))  # the spike detector's baseline needs ~40 steps
    return (steps if steps is not None else round(units * unit)), out


def calibrate(base: Path, rules: Path, *, timeout_s: float) -> float:
    """Seconds per step of a short clean run (the step cadence: the newest rank's end to the next)."""
    run_dir = base / "calibrate"
    metrics = run_dir / "metrics.jsonl"
    job = run_job(argv_for(run_dir, "calibrate", steps=60, policy="off", inject=[], rules=rules, metrics=metrics),
                  timeout_s=timeout_s, metrics=metrics)
    ends = sorted(s["ts"] for s in read_run(run_dir / "telemetry.duckdb", "calibrate", job)["steps"].values())
    gaps = [b - a for a, b in zip(ends[10:], ends[11:])]  # past the warm-up
    return statistics.median(gaps)


# -- running one job ----------------------------------------------------------------
def run_job(argv: list[str], *, timeout_s: float, metrics: Path,
            stall_s: float | None = None) -> dict:
    """One launcher process. `stall_s`: stop it (SIGINT, as Ctrl-C) once rank 0's
    metrics.jsonl has not grown for that long after its first step (a hang)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0, ts0 = time.monotonic(), time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    spawned_ts: list[float] = []  # when the launcher had its collector up and started the ranks

    def read_out() -> None:
        for line in proc.stdout:
            if not spawned_ts and line.startswith("telemetry: collector "):
                spawned_ts.append(time.time())
            lines.append(line)

    reader = threading.Thread(target=read_out, daemon=True)
    reader.start()
    ended, seen, grew = "", 0, time.monotonic()
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > timeout_s:
                ended = "timeout"
                break
            if stall_s is not None:
                n = _num_lines(metrics)
                if n != seen:
                    seen, grew = n, now
                elif n and now - grew > stall_s:
                    ended = "stalled"
                    break
            time.sleep(0.5)
    finally:  # also when the bench itself is interrupted: the job is in a session of its own
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # as Ctrl-C: the launcher stops its ranks and its collector
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    said = [x for x in out.splitlines() if x.startswith("goodput:")]
    return {"returncode": proc.returncode, "ended": ended or ("done" if proc.returncode == 0 else "failed"),
            "elapsed_s": time.monotonic() - t0, "launch_ts": ts0, "end_ts": time.time(),
            "spawned_ts": spawned_ts[0] if spawned_ts else ts0,
            "launcher_goodput": said[-1] if said else None, "tail": out[-1500:]}


def _num_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def argv_for(run_dir: Path, run_id: str, *, steps: int, policy: str, inject: list[str], rules: Path,
             metrics: Path, resume: bool = False, spare_nodes: int = 0) -> list[str]:
    argv = [sys.executable, "-m", "trainer", "--telemetry", "--run-dir", str(run_dir), "--run-id", run_id,
            *MODEL, *LAYOUT, "--steps", str(steps), "--policy", policy, "--rules", str(rules),
            "--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", "5", "--ckpt-keep", "40",
            "--metrics-jsonl", str(metrics), "--spare-nodes", str(spare_nodes)]
    for spec in inject:
        argv += ["--inject", spec]
    return argv + (["--resume"] if resume else [])


# -- reading one run back -----------------------------------------------------------
def effective_steps(cur, run_id: str) -> dict[int, dict]:
    """step -> {step_s, skipped, ts} of the effective attempt, per step as queries.step_time_parts
    counts it (its slowest rank's step_s, capped at the time since the step before ended),
    so that segments of a manually restarted job can be joined."""
    rows = queries.records(cur, """
        WITH per_step AS (
            SELECT attempt, step, bool_and(effective) AS effective, coalesce(bool_or(skipped), false) AS skipped,
                   max(step_s) AS slowest_s, max(ts) AS ts
            FROM steps_history WHERE run_id = $r GROUP BY attempt, step)
        SELECT step, effective, skipped, ts,
               coalesce(least(slowest_s, ts - lag(ts) OVER (ORDER BY ts, attempt, step)), slowest_s) AS step_s
        FROM per_step""", {"r": run_id})
    return {int(r["step"]): r for r in rows if r["effective"]}


def read_run(db: Path, run_id: str, job: dict) -> dict:
    if not db.exists():
        raise SystemExit(f"{run_id}: no {db} (rc {job['returncode']}); its output ends:\n{job['tail']}")
    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.cursor()
        span = queries.run_span(cur, run_id)
        g = postmortem.goodput(queries.step_time_parts(cur, run_id), span)
        steps = effective_steps(cur, run_id)
        incidents = {i["id"]: i for i in queries.incidents(cur, run_id)}
        actions = []
        for a in queries.actions(cur, run_id):
            inc = incidents.get(a.get("incident_id")) or {}
            actions.append({"kind": a["kind"], "status": a["status"], "node": a.get("node"),
                            "recovery_s": a.get("recovery_s"), "incident": inc.get("kind"),
                            "incident_step": inc.get("step_from"), "root_cause": inc.get("root_cause")})
    finally:
        con.close()
    return {"span": span, "goodput": g, "steps": steps, "actions": actions,
            "incidents": [(i["kind"], i.get("step_from"), i.get("node")) for i in incidents.values()]}


def figures(wall_s: float, steps: dict[int, dict], num_steps: int) -> dict:
    productive = [s for s in steps.values() if not s["skipped"]]
    prod_s = sum(s["step_s"] for s in productive)
    return {"wall_s": wall_s, "productive_s": prod_s, "goodput": prod_s / wall_s if wall_s > 0 else None,
            "final_step": max(steps, default=0), "num_productive_steps": len(productive),
            "num_skipped_steps": sum(1 for s in steps.values() if s["skipped"]),
            "completed": max(steps, default=0) >= num_steps}


def single(name: str, base: Path, *, steps: int, policy: str, inject: list[str], rules: Path,
           timeout_s: float, spare_nodes: int = 0) -> dict:
    run_dir = base / name
    metrics = run_dir / "metrics.jsonl"
    job = run_job(argv_for(run_dir, name, steps=steps, policy=policy, inject=inject, rules=rules, metrics=metrics,
                           spare_nodes=spare_nodes), timeout_s=timeout_s, metrics=metrics)
    r = read_run(run_dir / "telemetry.duckdb", name, job)
    g = r["goodput"]
    out = figures(g.wall_s, r["steps"], steps)
    out.update(returncode=job["returncode"], ended=job["ended"], elapsed_s=job["elapsed_s"],
               launcher_goodput=job["launcher_goodput"], postmortem_goodput=g.goodput,
               num_superseded_steps=g.num_superseded, superseded_s=g.superseded_s, skipped_s=g.skipped_s,
               outside_steps_s=g.outside_steps_s, actions=r["actions"], incidents=r["incidents"])
    if job["ended"] not in ("done",):
        out["tail"] = job["tail"]
    if inject:
        out["judged"] = judged(run_dir, name, rules)
    return out


def judged(run_dir: Path, run_id: str, rules: Path) -> dict:
    """`collector replay --truth`: was the right thing done (each injected fault matched to
    its incident, the live actions on it against analysis/judging.py's expected ones), and
    did the cost model's decisions pay (realized gain above zero)."""
    p = subprocess.run([sys.executable, "-m", "collector", "replay", "--db", str(run_dir / "telemetry.duckdb"),
                        "--truth", str(run_dir / "injections.jsonl"), "--run", run_id, "--rules", str(rules),
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    r = json.loads(p.stdout)
    actions = r.get("actions") or {}
    return {"summary": actions.get("summary"), "faults": actions.get("faults"),
            "cost_paid": r["cost_model"]["num_paid"], "cost_measured": r["cost_model"]["num_measured"],
            "cost_decisions": r["cost_model"]["decisions"]}


def manual(base: Path, *, steps: int, inject: list[str], rules: Path, timeout_s: float, stall_s: float,
           human_delay_s: float, hang_timeout_s: float) -> dict:
    """`--policy off`, restarted by hand: segments of one run dir (fault state and
    checkpoints carry over), each its own run id (the attempts restart at the checkpoint's)."""
    run_dir = base / "off"
    joined: dict[int, dict] = {}
    segments = []
    wall_s = 0.0
    for k in range(MAX_SEGMENTS):
        run_id = f"off-seg{k}"
        metrics = run_dir / f"metrics-seg{k}.jsonl"
        job = run_job(argv_for(run_dir, run_id, steps=steps, policy="off", inject=inject, rules=rules,
                               metrics=metrics, resume=k > 0),
                      timeout_s=timeout_s, metrics=metrics, stall_s=stall_s)
        r = read_run(run_dir / "telemetry.duckdb", run_id, job)
        # the first segment from its span's start, as clean and auto; a manual restart also pays
        # its ranks' start-up (auto's restarts are inside its span), not the embedded collector's
        start = max(r["span"]["start_ts"] or job["launch_ts"], job["launch_ts"]) if k == 0 else job["spawned_ts"]
        last_step_ts = max((s["ts"] for s in r["steps"].values()), default=start)
        if job["ended"] == "stalled":  # hung: it would sit until the process-group timeout
            seg_wall, why = (last_step_ts - start) + hang_timeout_s, "hang"
        else:
            seg_wall = min(r["span"]["end_ts"] or job["end_ts"], job["end_ts"]) - start
            why = "done" if job["ended"] == "done" else ("timeout" if job["ended"] == "timeout" else "crash")
        first = min(r["steps"], default=None)
        for step in [s for s in joined if first is not None and s >= first]:
            del joined[step]  # redone by this segment
        joined.update(r["steps"])
        restart = why in ("crash", "hang") and k + 1 < MAX_SEGMENTS
        wall_s += seg_wall + (human_delay_s if restart else 0.0)
        segments.append({"run_id": run_id, "ended": why, "returncode": job["returncode"],
                         "first_step": first, "last_step": max(r["steps"], default=None), "wall_s": seg_wall,
                         "modelled_wait_s": (hang_timeout_s if why == "hang" else 0.0)
                         + (human_delay_s if restart else 0.0),
                         "actual_elapsed_s": job["elapsed_s"], "incidents": r["incidents"]})
        if not restart:
            break
    out = figures(wall_s, joined, steps)
    seg0 = segments[0]
    first_steps = {s: v for s, v in joined.items() if s <= (seg0["last_step"] or 0)}
    out.update(segments=segments, ended=segments[-1]["ended"],
               dead_at_first_failure={"final_step": seg0["last_step"], "ended": seg0["ended"],
                                      "num_productive_steps": sum(1 for v in first_steps.values()
                                                                  if not v["skipped"])})
    return out


# -- report -------------------------------------------------------------------------
def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def report(res: dict, steps: int) -> None:
    clean = res["runs"]["clean"]
    rate_clean = clean["num_productive_steps"] / clean["wall_s"] if clean["wall_s"] else None
    print(f"\n{'run':<12}{'wall s':>9}{'productive s':>14}{'goodput':>9}{'final step':>12}{'skipped':>9}"
          f"{'steps/s vs clean':>18}{'rc':>5}  ended")
    for name, r in res["runs"].items():
        rate = r["num_productive_steps"] / r["wall_s"] if r["wall_s"] else None
        r["steps_per_s_vs_clean"] = _ratio(rate, rate_clean)
        vs = "-" if r["steps_per_s_vs_clean"] is None else f"{r['steps_per_s_vs_clean']:.2f}x"
        rc = r.get("returncode", r.get("segments", [{}])[-1].get("returncode"))
        print(f"{name:<12}{r['wall_s']:>9.1f}{r['productive_s']:>14.1f}{_pct(r['goodput']):>9}"
              f"{r['final_step']:>7}/{steps:<4}{r['num_skipped_steps']:>9}{vs:>18}{rc:>5}  {r['ended']}")
    if any((r["goodput"] or 0) > 1 for r in res["runs"].values()):
        print("  (goodput above 100%: the slowest rank's step_s per step, summed, exceeds the wall time: the ranks' "
              "step windows are not aligned, so their maxima overlap)")
    for name in [n for n in ("clean", "auto", "always") if n in res["runs"]]:
        r = res["runs"][name]
        print(f"  {name}: postmortem.goodput {_pct(r['postmortem_goodput'])}; not productive: "
              f"{r['outside_steps_s']:.1f} s outside steps (start-up, checkpoints, restarts), "
              f"{r['superseded_s']:.1f} s in {r['num_superseded_steps']} steps redone after rollbacks, "
              f"{r['skipped_s']:.1f} s skipped")
        print(f"    launcher: {r['launcher_goodput']}")
        incidents = ", ".join(f"{kind} step {step} {node or '-'}" for kind, step, node in r["incidents"])
        print(f"    incidents: {incidents or 'none'}")
        j = r.get("judged")
        if j and j.get("summary"):
            m = j["summary"]
            print(f"    decisions right (collector replay --truth): {m['did_right']} of {m['did_judged']} faults it "
                  f"acted on (the policy replayed: {m['would_right']} of {m['would_judged']}); cost model: "
                  f"{j['cost_paid']} of {j['cost_measured']} measured decisions paid")
            for line in j["faults"] or []:
                print(f"      {line}"[:200])
        elif j:
            print(f"    judging failed: {j.get('error', 'no faults matched')}"[:400])
    off = res["runs"]["off"]
    m = res["off_model"]
    print(f"\noff model: a crash or hang ends the job; a person restarts it from the newest checkpoint after "
          f"{m['human_delay_s']:g} s; a hang ends only at the process-group timeout, {m['hang_timeout_s']:g} s "
          f"after its last step (both added, not slept)")
    for s in off["segments"]:
        print(f"  {s['run_id']}: steps {s['first_step']}-{s['last_step']}, ended by {s['ended']}, "
              f"{s['wall_s']:.1f} s counted (+{s['modelled_wait_s']:g} s modelled wait), "
              f"{s['actual_elapsed_s']:.1f} s real")
    d = off["dead_at_first_failure"]
    print(f"  without the manual restart the job stops at step {d['final_step']} of {steps} "
          f"({d['num_productive_steps']} productive steps; ended by {d['ended']})")

    auto = res["runs"]["auto"]
    for name in [n for n in ("auto", "always") if n in res["runs"]]:
        print(f"\n{name} actions ({len(res['runs'][name]['actions'])}):")
        _actions(res["runs"][name]["actions"])
    _recovery(res, auto)
    ga, go, gc = auto["goodput"], off["goodput"], clean["goodput"]
    res["ratios"] = {"goodput_auto_vs_clean": _ratio(ga, gc), "goodput_off_vs_clean": _ratio(go, gc),
                     "goodput_auto_vs_off": _ratio(ga, go),
                     "steps_per_s_auto_vs_clean": auto["steps_per_s_vs_clean"],
                     "steps_per_s_off_vs_clean": off["steps_per_s_vs_clean"]}
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"\ngoodput(auto)/goodput(clean): {f(res['ratios']['goodput_auto_vs_clean'])}")
    print(f"goodput(off)/goodput(clean):  {f(res['ratios']['goodput_off_vs_clean'])}")
    print(f"goodput(auto)/goodput(off):   {f(res['ratios']['goodput_auto_vs_off'])}")
    if "always" in res["runs"]:
        res["ratios"]["goodput_auto_vs_always"] = _ratio(ga, res["runs"]["always"]["goodput"])
        print(f"goodput(auto)/goodput(always isolate): {f(res['ratios']['goodput_auto_vs_always'])}")
    print(f"productive steps/s vs clean: auto {f(auto['steps_per_s_vs_clean'])}, off {f(off['steps_per_s_vs_clean'])}")


def _actions(actions: list[dict]) -> None:
    print(f"  {'kind':<10}{'node':<8}{'status':<10}{'recovery_s':>11}  incident")
    for a in actions:
        rec = "-" if a["recovery_s"] is None else f"{a['recovery_s']:.2f}"
        cause = f" ({a['root_cause']})" if a["root_cause"] else ""
        print(f"  {a['kind']:<10}{a['node'] or '-':<8}{a['status']:<10}{rec:>11}  "
              f"{a['incident'] or '-'} step {a['incident_step']}{cause}"[:160])


def _recovery(res: dict, auto: dict) -> None:
    summary = {}
    for kind in ("rollback", "isolate", "restart"):
        recs = [a["recovery_s"] for a in auto["actions"] if a["kind"] == kind and a["recovery_s"] is not None]
        n = sum(1 for a in auto["actions"] if a["kind"] == kind)
        summary[kind] = {"num": n, "num_with_recovery": len(recs),
                         "median_s": statistics.median(recs) if recs else None, "max_s": max(recs, default=None)}
        if n:
            med = "-" if not recs else f"{summary[kind]['median_s']:.2f}"
            mx = "-" if not recs else f"{summary[kind]['max_s']:.2f}"
            print(f"  {kind}: {n} actions, recovery median {med} s, max {mx} s ({len(recs)} with recovery_s)")
    res["recovery_summary"] = summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="steps per run, the faults spread over them (default: sized from a "
                   "calibration run so that faults are --gap-s apart; --quick: 240)")
    p.add_argument("--gap-s", type=float, default=10.0,
                   help="without --steps: seconds of clean steps per unit of gap between faults (the policy's "
                        "cooldown is 5 s)")
    p.add_argument("--quick", action="store_true", help="a shorter schedule (spike, straggler, crash) for a smoke run")
    p.add_argument("--mix", choices=sorted(MIXES), help="draw the faults in a reported mix's proportions instead "
                   "of the fixed schedule (llama3: its 419 unexpected interruptions)")
    p.add_argument("--faults", type=int, default=8, help="--mix: how many faults to draw")
    p.add_argument("--seed", type=int, default=0, help="--mix: the draw's seed")
    p.add_argument("--spare-nodes", type=int, default=0, help="standby nodes for the healed runs (the issue's "
                   "figure: 1): an isolated node is replaced, not shrunk away, while one is left")
    p.add_argument("--always", action="store_true", help="a third policy on the same schedule: auto without the "
                   "cost model (`weigh_cost = false`: every slow-down that persisted has its node isolated)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (the path is printed)")
    p.add_argument("--out-json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per launcher process")
    p.add_argument("--human-delay-s", type=float, default=60.0, help="off: a person's reaction to a dead job")
    p.add_argument("--hang-timeout-s", type=float, default=JobConfig().parallel.timeout_s,
                   help="off: how long a hang lasts before the job errors out (the trainer's parallel.timeout_s)")
    p.add_argument("--stall-s", type=float, default=20.0, help="off: no new step for this long is a hang")
    a = p.parse_args()
    if a.mix and a.quick:
        p.error("--mix and --quick are two schedules: choose one")
    drawn = mix_plan(a.mix, a.faults, a.seed) if a.mix else None
    plan = [(spec, gap) for _, _, spec, gap in drawn] if drawn else None
    tail = max(TAIL_UNITS["full"], AFTER_UNITS[drawn[-1][1]]) if drawn else None
    base = Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    rules = base / "rules.toml"
    rules.write_text(RULES)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (other work on this machine "
          f"shows up in every figure)")
    step_s = None
    if a.steps or a.quick:
        steps, inject = schedule(a.quick, steps=a.steps or 240, plan=plan, tail=tail)
    else:
        step_s = calibrate(base, rules, timeout_s=a.timeout_s)
        unit = max(40, int(a.gap_s / step_s + 0.5))
        steps, inject = schedule(a.quick, unit_steps=unit, plan=plan, tail=tail)
        print(f"calibration: {1e3 * step_s:.0f} ms per step: {unit} steps per {a.gap_s:g} s unit")
    if drawn:
        counts: dict[str, int] = {}
        for cause, _, _, _ in drawn:
            counts[cause] = counts.get(cause, 0) + 1
        print(f"mix {a.mix}, seed {a.seed}: {a.faults} faults: "
              + ", ".join(f"{c} {counts.get(c, 0)} ({w:g}%)" for c, w, _ in MIXES[a.mix]))
        print("  " + "; ".join(f"{cause}: {kind}" for cause, kind, _, _ in drawn))
    print(f"{steps} steps, dp4 over 4 nodes" + (f" and {a.spare_nodes} spare(s)" if a.spare_nodes else "")
          + f"; schedule: {' '.join(inject)}")
    res = {"steps": steps, "quick": a.quick, "calibrated_step_s": step_s, "schedule": inject,
           "mix": a.mix, "mix_seed": a.seed if a.mix else None,
           "drawn": [{"cause": c, "kind": k} for c, k, _, _ in drawn] if drawn else None,
           "model": MODEL + LAYOUT, "rules": RULES, "spare_nodes": a.spare_nodes,
           "off_model": {"human_delay_s": a.human_delay_s, "hang_timeout_s": a.hang_timeout_s,
                         "stall_s": a.stall_s}, "runs": {}}
    t_all = time.monotonic()
    try:
        res["runs"]["clean"] = single("clean", base, steps=steps, policy="off", inject=[], rules=rules,
                                      timeout_s=a.timeout_s)
        print(f"clean done ({res['runs']['clean']['elapsed_s']:.0f} s)", flush=True)
        res["runs"]["auto"] = single("auto", base, steps=steps, policy="auto", inject=inject, rules=rules,
                                     timeout_s=a.timeout_s, spare_nodes=a.spare_nodes)
        print(f"auto done ({res['runs']['auto']['elapsed_s']:.0f} s)", flush=True)
        if a.always:
            always = base / "always.toml"
            always.write_text(RULES + "weigh_cost = false\n")
            res["runs"]["always"] = single("always", base, steps=steps, policy="auto", inject=inject, rules=always,
                                           timeout_s=a.timeout_s, spare_nodes=a.spare_nodes)
            print(f"always done ({res['runs']['always']['elapsed_s']:.0f} s)", flush=True)
        res["runs"]["off"] = manual(base, steps=steps, inject=inject, rules=rules, timeout_s=a.timeout_s,
                                    stall_s=a.stall_s, human_delay_s=a.human_delay_s,
                                    hang_timeout_s=a.hang_timeout_s)
        print(f"off done ({sum(s['actual_elapsed_s'] for s in res['runs']['off']['segments']):.0f} s, "
              f"{len(res['runs']['off']['segments'])} segments)", flush=True)
        report(res, steps)
        for name in [n for n in ("clean", "auto", "always") if n in res["runs"]]:
            if res["runs"][name].get("tail"):
                print(f"\n{name} ended {res['runs'][name]['ended']} (rc {res['runs'][name]['returncode']}); "
                      f"its output ends:\n{res['runs'][name]['tail']}")
    finally:  # what was measured, also when a run failed
        if a.out_json:
            Path(a.out_json).write_text(json.dumps(res, indent=2, default=str))
        print(f"\n{time.monotonic() - t_all:.0f} s in all; load average at end: {os.getloadavg()[0]:.2f}")
        if a.keep:
            print(f"run directories kept in {base}")
        else:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
