"""Dashboard speed on a big run: each page's callback work and what it ships, from both sources.

1. fill     a real `collector serve` (temp DuckDB file, loopback, one token per
            role, detection on, policy auto) receives a simulated training run
            as the agents would post it (agent.wire batches, bench/loadgen.py's
            HTTP client): `--ranks` x `--steps` steps (dp x tp8 mesh, 8 ranks a
            node) with a straggler from 30% of the run, six collectives a step
            (four tp all-reduces, a dp reduce-scatter overlapped with backward, a
            dp all-gather) whose group_seq, start_ts and waits agree across each
            group, a loss spike at 60% rolled back to the checkpoint before it
            (attempt 1 replays from there), eval scalars, checkpoints,
            heartbeats. Incidents and actions are the collector's own: its
            detectors and policy act on that data (there is no route that writes
            an incident); the ranks ack the rollback command it issues. The
            steps' clock is simulated (the run "ended" when the fill began), the
            collector's is not: incident and action times are the fill's.
            50 steps a batch: detection holds at most 64 incomplete steps.
2. measure  every page's pure `build(src, run_id)` (dashboard/pages/<name>.py; a
            page without one yet is listed and skipped), the overview's live
            `extend` (a 2 s refresh: 4 new steps, and an idle one), every read
            view on its own, and one real Dash round trip (POST
            /_dash-update-component through Flask's test client) of the
            overview's callback, full and on a tick; through `HttpSource` (the
            live collector, read token), then `DbSource` on the file once the
            collector has stopped.
3. verdict  per page against the goals: callback p95 < 300 ms, payload < 1 MB.

The payload is the JSON of what a callback returns to the browser (figures,
tables, stores). Times are wall-clock milliseconds; `cpu ms` is the mean CPU a
call cost this process and, live, the collector: on a shared 2-core machine the
wall time moves with everyone's load, the CPU time much less. It is a
measurement, not a test: exit status 0 unless the setup failed.

    python bench/bench_dashboard.py                       # 64 ranks x 10,000 steps
    python bench/bench_dashboard.py --quick               # 16 x 1,000, a smoke run
    python bench/bench_dashboard.py --keep /tmp/dashbench # keep the file; reused next time
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import dash
import numpy as np
import plotly.utils

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402
from dashsim import TrainingRun  # noqa: E402

TOKENS = {"INGEST": "bench-ingest-token-0123456789", "READ": "bench-read-token-0123456789",
          "CONTROL": "bench-control-token-0123456789"}
PAGES = ("overview", "ranks", "comm", "incidents", "nodes", "sql", "runs")
GOAL_P95_MS = 300.0
GOAL_PAYLOAD_BYTES = 1_000_000


async def fill(url: str, run: TrainingRun, *, steps_per_batch: int, connections: int,
               before_resume: Callable[[], Any] | None = None) -> loadgen.Stats:
    """Every chunk's batches, all ranks of a chunk before the next one's, over keep-alive
    connections. Before attempt 1, everything sent is acknowledged and `before_resume`
    runs (the trainer waits for the collector's rollback command)."""
    sender = loadgen.Sender(url, TOKENS["INGEST"], retry=True, ack_log=None, deadline=time.monotonic() + 3600)
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * run.num_ranks)

    async def worker() -> None:
        conn = loadgen.Conn(url, TOKENS["INGEST"])
        try:
            while (item := await queue.get()) is not None:
                try:
                    await sender.send(conn, *item)
                finally:
                    queue.task_done()
        finally:
            conn.close()

    tasks = [asyncio.create_task(worker()) for _ in range(connections)]
    resumed = False
    for e0, attempt, steps in run.chunks(steps_per_batch):
        if attempt == 1 and not resumed:
            resumed = True
            await queue.join()
            if before_resume is not None:
                await asyncio.to_thread(before_resume)
        for item in run.batches(e0, attempt, steps):
            await queue.put(item)
    for _ in tasks:
        await queue.put(None)
    await asyncio.gather(*tasks)
    return sender.stats


# -- the collector ----------------------------------------------------------------------
def start_collector(db: Path) -> tuple[subprocess.Popen, str]:
    """`collector serve` on a free loopback port, one token per role in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{f"LLMWATCH_{r}_TOKEN": t for r, t in TOKENS.items()})
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--db", str(db), "--port", "0",
                             "--policy", "auto"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"listening on (https?://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("the collector did not start:\n" + "".join(lines[-20:]))


def wait_for_rollback(src, run: TrainingRun, timeout_s: float = 60.0) -> None:
    """Until the collector's policy has issued the rollback of the spike (or the time is up);
    the ranks then ack its command as the trainer does (trainer/control.py), in their first
    batch of attempt 1."""
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        action = next((a for a in src.table(run.run_id, "actions") if a["kind"] == "rollback"), None)
        if action is not None:
            print(f"  rollback issued by the collector {time.monotonic() - t:.1f} s after the spike's steps "
                  f"(command {action.get('command_id')})")
            run.ack_command = action.get("command_id")
            return
        time.sleep(0.2)
    print(f"  no rollback issued within {timeout_s:.0f} s; attempt 1 starts anyway")


def stop_collector(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- measuring ----------------------------------------------------------------------------
class _Encoder(plotly.utils.PlotlyJSONEncoder):
    def default(self, o: Any) -> Any:
        return None if o is dash.no_update else super().default(o)


def payload_bytes(obj: Any) -> int:
    """The JSON a callback would send: figures, components and plain data, as Dash encodes them."""
    return len(json.dumps(obj, cls=_Encoder).encode())


CPU_PIDS: list[int] = []  # other processes whose CPU a call costs too (the live collector)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s() -> float:
    """CPU seconds of this process and of CPU_PIDS: on a shared machine the wall time of
    a call moves with everyone's load, its CPU time much less."""
    total = time.process_time()
    for pid in CPU_PIDS:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    return total


def timed(fn: Callable[[], Any], repeat: int, warmup: int) -> tuple[dict[str, float], Any]:
    """Wall-time p50/p95/max ms of `repeat` calls after `warmup` unmeasured ones, their
    mean CPU ms, and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    ms = []
    cpu0 = cpu_s()
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        ms.append((time.perf_counter() - t) * 1e3)
    cpu = (cpu_s() - cpu0) / repeat * 1e3
    a = np.array(ms)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)), "max": float(a.max()),
            "cpu": cpu}, out


def load_pages() -> dict[str, Any]:
    """The page modules by name; a page that does not import is reported, not fatal."""
    mods = {}
    for name in PAGES:
        try:
            mods[name] = importlib.import_module(f"dashboard.pages.{name}")
        except Exception as e:  # noqa: BLE001 - a page being written may be broken right now
            print(f"  {name}: import failed ({type(e).__name__}: {e})")
    return mods


def measure_pages(src, run_id: str, mods: dict, repeat: int, warmup: int) -> list[dict]:
    rows = []
    for name in PAGES:
        build = getattr(mods.get(name), "build", None)
        if build is None:
            if name in mods:
                print(f"  {name}: missing build(), skipped")
            continue
        try:
            st, out = timed(lambda: build(src, run_id), repeat, warmup)
        except Exception as e:  # noqa: BLE001 - one page failing must not hide the others' numbers
            print(f"  {name}: build failed ({type(e).__name__}: {e})")
            continue
        rows.append({"what": f"{name}.build", "page": name, **st, "bytes": payload_bytes(out)})
        if name == "overview":
            rows += measure_extend(src, run_id, mods[name], out["drawn"], repeat, warmup)
    from dashboard import app as app_module

    status = getattr(app_module, "_status", None)  # the header's run status: every page, every tick
    if status is not None:
        st, out = timed(lambda: status(run_id, 1), repeat, warmup)
        rows.append({"what": "app header status (each tick)", "page": "app", **st, "bytes": payload_bytes(out)})
    return rows


def measure_extend(src, run_id: str, overview, drawn: dict, repeat: int, warmup: int) -> list[dict]:
    """The live refresh after a full draw: 4 steps arrived since (a 2 s tick at 0.5 s a
    step: the drawn state is set back by 4), and nothing new (the idle tick)."""
    out = []
    for label, state in (("+4 steps", {**drawn, "last_step": (drawn.get("last_step") or 4) - 4}),
                         ("idle", drawn)):
        st, res = timed(lambda: overview.extend(src, run_id, state), repeat, warmup)
        note = "" if res is not None else " (asked for a full draw)"
        out.append({"what": f"overview.extend {label}{note}", "page": "overview", **st,
                    "bytes": payload_bytes(res[0] if res else None)})
    return out


def measure_views(src, run_id: str, repeat: int, warmup: int) -> list[dict]:
    """Every read view, table and run call on its own (defaults, as the pages ask without state)."""
    from collector.read import views
    from dashboard.source import TABLES

    calls: list[tuple[str, Callable[[], Any]]] = [("runs", src.runs), ("run", lambda: src.run(run_id))]
    calls += [(f"view {v}", lambda v=v: src.view(run_id, v)) for v in views.VIEWS]
    calls += [("view overview max_points=1000", lambda: src.view(run_id, "overview", max_points=1000)),
              ("view scalars prefix=eval/", lambda: src.view(run_id, "scalars", prefix="eval/"))]
    calls += [(f"table {t}", lambda t=t: src.table(run_id, t)) for t in TABLES]
    rows = []
    for what, fn in calls:
        try:
            st, out = timed(fn, max(3, repeat // 3), 1)
        except Exception as e:  # noqa: BLE001
            print(f"  {what}: failed ({type(e).__name__}: {e})")
            continue
        n = len(out) if isinstance(out, list) else 1
        rows.append({"what": what, **st, "bytes": len(json.dumps(out, default=str)), "rows": n})
    return rows


def dash_round_trip(app, run_id: str, repeat: int, warmup: int) -> list[dict]:
    """POST /_dash-update-component as the browser does for the overview's figures: the
    full draw (the run picked) and a tick (drawn state 4 steps behind). Inputs and state
    take the values of the page's own layout (its defaults), the run picker the run."""
    from dashboard.pages import overview

    client = app.server.test_client()
    deps = client.get("/_dash-dependencies").get_json()
    dep = next((d for d in deps if "ov-drawn.data" in d["output"]), None)
    if dep is None:
        print("  dash round trip: no overview callback registered, skipped")
        return []
    comps = _components(overview.layout())

    def matching(ident: Any) -> list[Any]:
        """The ids a dependency names: itself, or every layout id its wildcard matches."""
        if not isinstance(ident, dict):
            return [ident]
        ids = [json.loads(k) for k in comps if k.startswith("{")]
        return [c for c in ids if c.keys() == ident.keys()
                and all(isinstance(v, list) or c[k] == v for k, v in ident.items())]

    def value(ident: Any, prop: str, drawn: Any) -> Any:
        if (ident, prop) == ("run", "value"):
            return run_id
        if (ident, prop) == ("tick", "n_intervals"):
            return 1
        if (ident, prop) == ("ov-drawn", "data"):
            return drawn
        comp = comps.get(json.dumps(ident, sort_keys=True) if isinstance(ident, dict) else ident)
        return getattr(comp, prop, None)

    def deps_of(specs: list[dict], drawn: Any) -> list[Any]:
        out = []
        for d in specs:
            ident = json.loads(d["id"]) if str(d["id"]).startswith("{") else d["id"]
            items = [{"id": i, "property": d["property"], "value": value(i, d["property"], drawn)}
                     for i in matching(ident)]
            out.append(items if isinstance(ident, dict) else items[0])
        return out

    def output_specs() -> list[Any]:
        out = []
        for spec in dep["output"].strip(".").split("..."):
            ident, prop = spec.rsplit(".", 1)
            ident = json.loads(ident) if ident.startswith("{") else ident
            items = [{"id": i, "property": prop} for i in matching(ident)]
            out.append(items if isinstance(ident, dict) else items[0])
        return out

    outputs = output_specs()

    def post(changed: str, drawn: Any) -> tuple[float, int, dict]:
        body = {"output": dep["output"], "outputs": outputs, "inputs": deps_of(dep["inputs"], drawn),
                "state": deps_of(dep["state"], drawn), "changedPropIds": [changed]}
        t = time.perf_counter()
        resp = client.post("/_dash-update-component", json=body)
        ms = (time.perf_counter() - t) * 1e3
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.data[:300]!r}")
        return ms, len(resp.data), resp.get_json()

    rows = []
    for label, changed in (("full draw", "run.value"), ("tick +4 steps", "tick.n_intervals")):
        drawn = None
        if changed != "run.value":
            drawn = post("run.value", None)[2]["response"]["ov-drawn"]["data"]
            drawn = {**drawn, "last_step": drawn["last_step"] - 4}
        st, (_, size, _) = timed(lambda: post(changed, drawn), repeat, warmup)
        rows.append({"what": f"dash POST overview {label}", "page": "overview", **st, "bytes": size})
    return rows


def _components(root: Any) -> dict[str, Any]:
    """Every component of a layout with an id, by its id (a dict id as sorted JSON)."""
    found: dict[str, Any] = {}

    def walk(c: Any) -> None:  # in layout order: a wildcard's matches come in this order
        if isinstance(c, (list, tuple)):
            for x in c:
                walk(x)
            return
        ident = getattr(c, "id", None)
        if ident is not None:
            found[json.dumps(ident, sort_keys=True) if isinstance(ident, dict) else ident] = c
        children = getattr(c, "children", None)
        if children is not None and not isinstance(children, str):
            walk(children)

    walk(root)
    return found


# -- report -------------------------------------------------------------------------------
def fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def print_table(title: str, rows: list[dict], *, verdict: bool = True) -> None:
    print(f"\n{title}; load average {os.getloadavg()[0]:.2f}")
    print(f"  {'':<44} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'cpu ms':>8} {'payload' if verdict else 'answer':>10}"
          + ("  verdict" if verdict else "     rows"))
    for r in rows:
        tail = f"  {r['rows']:>7}" if "rows" in r else ""
        if verdict:
            misses = [m for m, bad in (("p95", r["p95"] >= GOAL_P95_MS), ("payload", r["bytes"] >= GOAL_PAYLOAD_BYTES))
                      if bad]
            tail = "  ok" if not misses else "  MISS " + ", ".join(misses)
            if "p95" in misses and r["cpu"] < GOAL_P95_MS:
                tail += " (cpu under goal: load?)"
        print(f"  {r['what']:<44} {r['p50']:>8.1f} {r['p95']:>8.1f} {r['max']:>8.1f} {r['cpu']:>8.1f} "
              f"{fmt_bytes(r['bytes']):>10}{tail}")


def measure(src, label: str, run_id: str, mods: dict, app, args) -> None:
    from dashboard import state

    state.set_source(src)
    print(f"\n== {label}: {src.describe()}")
    pages = measure_pages(src, run_id, mods, args.repeat, args.warmup)
    try:
        trips = dash_round_trip(app, run_id, args.repeat, args.warmup) if app is not None else []
    except Exception as e:  # noqa: BLE001
        print(f"  dash round trip failed: {type(e).__name__}: {e}")
        trips = []
    print_table(f"{label}: page callbacks (goal: p95 < {GOAL_P95_MS:.0f} ms, payload < 1 MB)", pages + trips)
    print_table(f"{label}: read calls on their own (answer: the rows' JSON, collector to dashboard)",
                measure_views(src, run_id, args.repeat, args.warmup), verdict=False)


def make_app(src):
    """The real app (it imports every page); None when it cannot be built today."""
    from dashboard.app import create_app

    try:
        return create_app(src)
    except Exception as e:  # noqa: BLE001 - a page being written may break the app; time what still works
        print(f"  create_app failed ({type(e).__name__}: {e}): no Dash round trip")
        dash.Dash(__name__, use_pages=True, pages_folder="")  # the page registry needs an app
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=15, help="measured calls per page")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 ranks x 1,000 steps, 5 repeats")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="keep the DuckDB file in DIR (reused, without a fill, when it holds the run)")
    p.add_argument("--steps-per-batch", type=int, default=50, help="steps per posted batch (detection holds 64 open)")
    p.add_argument("--connections", type=int, default=64, help="keep-alive connections (an agent has one)")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.steps, args.repeat = 16, 1_000, 5
    run_id = f"bench-{args.ranks}x{args.steps}"
    tmp = tempfile.TemporaryDirectory(prefix="bench_dashboard_") if args.keep is None else None
    folder = args.keep if args.keep is not None else Path(tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "telemetry.duckdb"
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; db {db}")

    from dashboard.source import DbSource, HttpSource

    proc, url = start_collector(db)
    try:
        http = HttpSource(url, TOKENS["READ"])
        have = http.run(run_id)
        if have and have.get("last_step") == args.steps - 1 and have.get("num_ranks") == args.ranks:
            print(f"reusing run {run_id} in {db}")
        else:
            sim = TrainingRun(run_id, args.ranks, args.steps)
            t = time.perf_counter()
            st = asyncio.run(fill(url, sim, steps_per_batch=args.steps_per_batch, connections=args.connections,
                                  before_resume=lambda: wait_for_rollback(http, sim)))
            fill_s = time.perf_counter() - t
            print(f"fill: {st.rows:,} rows in {st.requests:,} batches, {fill_s:.1f} s "
                  f"({st.rows / fill_s:,.0f} rows/s), {st.errors} errors (retried); {len(sim.order):,} steps x "
                  f"{args.ranks} ranks "
                  f"(attempt 0: 0-{sim.spike + 5}, attempt 1: {sim.resume}-{args.steps - 1})")
        counts = http.sql("SELECT (SELECT count(*) FROM steps), (SELECT count(*) FROM collectives), "
                          "(SELECT count(*) FROM heartbeats), (SELECT count(*) FROM scalars)")["rows"][0]
        print(f"stored: {counts[0]:,} steps, {counts[1]:,} collectives, {counts[2]:,} heartbeats, "
              f"{counts[3]:,} scalars")
        for r in http.table(run_id, "incidents"):
            print(f"  incident {r['id']}: {r['kind']} {r['severity']} rank={r['rank']} node={r['node']} "
                  f"steps {r['step_from']}-{r['step_to']} {r['status']}")
        for r in http.table(run_id, "actions"):
            print(f"  action {r['id']}: {r['kind']} {r['status']} (incident {r['incident_id']})")
        app = make_app(http)
        mods = load_pages()
        CPU_PIDS.append(proc.pid)
        measure(http, "HttpSource", run_id, mods, app, args)
    finally:
        CPU_PIDS.clear()
        stop_collector(proc)
    src = DbSource(db)
    try:
        measure(src, "DbSource", run_id, mods, app, args)
    finally:
        src.close()
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
