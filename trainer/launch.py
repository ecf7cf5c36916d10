"""Start the ranks: embedded (spawn local processes) or under `torchrun`.

Embedded mode is the default: `trainer` picks a rendezvous port on loopback,
starts one `python -m trainer.worker` process per rank with the torchrun
environment variables set, and supervises them like torchrun does: when one
rank fails, the others are stopped (they would otherwise wait for it in a
collective until the process-group timeout). With `--telemetry` and no
`--collector`, it also starts an embedded collector for the run. Its children
die with it, however it dies (`trainer.lifeline`). The collector token reaches
the ranks in their environment only (`trainer.private`).

With telemetry, the launcher reports every rank's exit to the collector as soon
as it sees it (a `rank_exited` event, `agent.launcher`: exit code or signal, and
"stopped" for the ranks that went down with the job after another failed), so a crash is named at once; with
the embedded collector it also prints each incident as it opens, and the run's
list at the end (`trainer.incident_feed`).

Under `torchrun` (RANK/WORLD_SIZE in the environment) the same entry point runs
the worker in-process, unchanged.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from trainer.config import ConfigError, JobConfig
from trainer.lifeline import Lifeline, die_with_parent
from trainer.private import COLLECTOR_TOKEN_ENVS, TOKEN_ENV
from trainer.rundir import new_run_id, prepare_run, torchrun_run_id
from trainer.supervisor import ORIG_WORLD_ENV, Layout, NodeWatch, Supervisor, fit_world

EXIT_REPORT_TIMEOUT_S = 2.0  # per rank_exited POST, and for the last ones at the end
# at the end: the list is read once the collector's detection has judged the last batches, waiting
# at most this long (it takes tens of milliseconds on an idle host; a loaded one gets the rest)
INCIDENT_SETTLE_S = 5.0

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch(cfg: JobConfig, *, token: str | None = None, progress: bool = True, keep_collector: bool = False) -> int:
    """Run the job. `token`: the one collector token the user gave (flag, file or
    env); it is kept out of `cfg`, which is written to disk and shipped as run info."""
    if under_torchrun():
        return _launch_torchrun(cfg, token=token, progress=progress)
    cfg.run_id = cfg.run_id or new_run_id()
    run_dir = prepare_run(cfg)
    (run_dir / "collector.token").unlink(missing_ok=True)  # an older trainer's token file: a secret nothing reads
    lifeline = Lifeline()
    zygote = _zygote(cfg, lifeline)  # imports torch for the ranks while the collector starts
    try:
        return _launch_embedded(cfg, run_dir, token=token, progress=progress, keep_collector=keep_collector,
                                lifeline=lifeline, zygote=zygote)
    finally:
        if zygote is not None:
            zygote.close()  # idempotent: after the rounds it is closed already; this covers an early return
        lifeline.close()


def _launch_embedded(cfg: JobConfig, run_dir: Path, *, token: str | None, progress: bool, keep_collector: bool,
                     lifeline: Lifeline, zygote) -> int:
    collector = dashboard = None
    rank_token = token
    if cfg.telemetry.enabled and not cfg.telemetry.collector_url:
        from trainer.embedded import EmbeddedCollector

        collector = EmbeddedCollector(db_path=run_dir / "telemetry.duckdb", tokens_dir=run_dir / "tokens",
                                      log_path=run_dir / "collector.log", token=token,
                                      rules=cfg.telemetry.rules, alerts=cfg.telemetry.alerts,
                                      archive=cfg.telemetry.archive,
                                      policy=cfg.healing.policy, min_nodes=cfg.healing.min_nodes)
        try:
            collector.start()
        except (RuntimeError, ValueError) as e:  # ValueError: a bad LLMWATCH_SIDECAR_NICE
            print(f"trainer: error: {e}", file=sys.stderr)
            return 1
        cfg.telemetry.collector_url = collector.url
        rank_token = collector.rank_token
        print(f"telemetry: collector {collector.url}  db {collector.db_path}", flush=True)
        for line in collector.describe_tokens():
            print(f"telemetry: {line}", flush=True)
        dashboard = _embedded_dashboard(cfg, collector, run_dir)
    elif cfg.telemetry.enabled:
        print(f"telemetry: shipping to {cfg.telemetry.collector_url}", flush=True)
    config_path = run_dir / "config.json"
    config_path.write_text(cfg.to_json())
    reporter = _exit_reporter(cfg, rank_token)
    feed = _incident_feed(cfg, collector, run_dir)
    watch = _node_watch(cfg, collector, run_dir)
    try:
        return _spawn_ranks(cfg, config_path, token=rank_token if cfg.telemetry.enabled else None,
                            progress=progress, reporter=reporter, watch=watch, lifeline=lifeline, zygote=zygote)
    finally:
        if zygote is not None:
            zygote.close()  # no more rounds: its memory goes now, not after a kept collector
        if watch is not None:
            watch.close()
        if reporter is not None:
            reporter.close(timeout_s=EXIT_REPORT_TIMEOUT_S)  # the exits reach the collector before it stops
        if feed is not None:
            feed.finish(settle_s=INCIDENT_SETTLE_S)
        if collector is not None:
            if keep_collector:
                also = f", dashboard {dashboard.url}" if dashboard is not None and dashboard.url else ""
                print(f"telemetry: collector still serving {collector.url}{also} (Ctrl-C to stop)", flush=True)
                collector.wait_interrupted()
            if dashboard is not None:
                dashboard.stop()
            collector.stop()
            print(f"telemetry: stored in {collector.db_path}", flush=True)
            if dashboard is not None:
                print(f"telemetry: browse it afterwards: dashboard --db {collector.db_path}", flush=True)


def _embedded_dashboard(cfg: JobConfig, collector, run_dir: Path):
    """The dashboard next to the embedded collector (--no-dashboard: none). It reads with
    the read token's file; its URL is printed once it answers (trainer/embedded_dashboard.py)."""
    if not cfg.telemetry.dashboard:
        return None
    from trainer.embedded_dashboard import EmbeddedDashboard

    paths = collector.token_paths
    dashboard = EmbeddedDashboard(collector_url=collector.url, token_path=paths.get("read") or paths.get("all"),
                                  run_dir=run_dir, port=cfg.telemetry.dashboard_port)
    dashboard.start()
    dashboard.announce()
    return dashboard


def _exit_reporter(cfg: JobConfig, token: str | None):
    """Reports each rank's exit to the collector (a `rank_exited` event), when there is one."""
    if not (cfg.telemetry.enabled and cfg.telemetry.collector_url):
        return None
    from agent.launcher import LauncherReporter

    return LauncherReporter(cfg.telemetry.collector_url, token, cfg.run_id, ca_file=cfg.telemetry.ca_file,
                            timeout_s=EXIT_REPORT_TIMEOUT_S)


def _incident_feed(cfg: JobConfig, collector, run_dir: Path):
    """Prints the run's incidents as they open: the embedded collector only (its read
    token is in the run dir; an external collector's read token is not ours to hold)."""
    if collector is None:
        return None
    from trainer.incident_feed import IncidentFeed, read_token

    token = read_token(run_dir / "tokens")
    if token is None:
        return None
    feed = IncidentFeed(collector.url, token, cfg.run_id)
    feed.start()
    return feed


def _node_watch(cfg: JobConfig, collector, run_dir: Path):
    """The supervisor's view of the collector's isolations (embedded collector: its read token)."""
    if collector is None or cfg.healing.policy != "auto":
        return None
    from trainer.incident_feed import read_token

    token = read_token(run_dir / "tokens")
    return NodeWatch(collector.url, token, cfg.run_id).start() if token else None


def _shared_env(cfg: JobConfig) -> dict[str, str]:
    """What every rank's environment starts from: the launcher's, less the user's collector
    tokens (a rank holds at most the one it sends, the ingest token), with its thread count."""
    threads = max(1, (os.cpu_count() or 1) // cfg.parallel.world_size)
    env = {k: v for k, v in os.environ.items() if k not in COLLECTOR_TOKEN_ENVS}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(threads))
    return env


def _rank_env(cfg: JobConfig, rank: int, port: int, progress: bool, token: str | None) -> dict[str, str]:
    world = cfg.parallel.world_size
    per_node = world // cfg.parallel.nodes
    env = _shared_env(cfg)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        LLMWATCH_EMBEDDED="1", LLMWATCH_PROGRESS="1" if progress else "0",
    )
    if token:
        env[TOKEN_ENV] = token
    return env


def _zygote(cfg: JobConfig, lifeline: Lifeline):
    """The warm interpreter the ranks are forked from (trainer/zygote.py); None off Linux,
    or where LLMWATCH_ZYGOTE=0 asks for plain processes. A GPU build of torch gets plain
    processes too unless LLMWATCH_ZYGOTE=1."""
    from trainer.zygote import MODE_ENV, Zygote

    mode = os.environ.get(MODE_ENV, "auto")
    if mode == "0" or not sys.platform.startswith("linux"):
        return None
    return Zygote(_shared_env(cfg), pass_fds=lifeline.pass_fds, gpu_build_ok=mode == "1")


def _spawn_ranks(cfg: JobConfig, config_path: Path, *, token: str | None, progress: bool, reporter=None,
                 watch=None, lifeline: Lifeline, zygote=None) -> int:
    """Run the job's rounds under the supervisor (trainer/supervisor.py): the first on
    every node, each restart on the nodes that are left. A rank is forked from the
    zygote when there is one, else a process of its own."""
    run_dir = config_path.parent

    def spawn(round_cfg: JobConfig, layout: Layout, round_: int) -> list[subprocess.Popen]:
        path = config_path if round_ == 0 else run_dir / f"config.round{round_}.json"
        if round_:
            round_cfg.ckpt.resume = True  # a restart resumes from the newest verified checkpoint
            path.write_text(round_cfg.to_json())
        port = free_port()
        procs = []
        for rank in range(round_cfg.parallel.world_size):
            env = (_rank_env(round_cfg, rank, port, progress, token) | lifeline.env()
                   | supervisor.rank_env(layout, rank, round_))
            argv = [sys.executable, "-m", "trainer.worker", str(path)]
            popen = {"pass_fds": lifeline.pass_fds, "preexec_fn": die_with_parent()}
            procs.append(zygote.spawn(argv, env, popen_kwargs=popen) if zygote is not None
                         else subprocess.Popen(argv, env=env, **popen))
        return procs

    supervisor = Supervisor(cfg, run_dir, spawn=spawn, on_exit=reporter.rank_exited if reporter is not None else None,
                            watch=watch, on_end=reporter.run_ended if reporter is not None else None)
    return supervisor.run()


def _launch_torchrun(cfg: JobConfig, *, token: str | None, progress: bool) -> int:
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    configured = cfg.parallel.world_size
    os.environ.setdefault(ORIG_WORLD_ENV, str(configured))  # injections name ranks of this layout
    try:
        # --nnodes MIN:MAX: a re-rendezvous after an isolation brings fewer ranks than the
        # command line's dp x tp x pp; dp follows them and the global batch stays
        note = fit_world(cfg, world)
        if note and int(os.environ.get("RANK", "0")) == 0:
            print(f"trainer: {world} ranks instead of {configured}: {note}", flush=True)
        cfg.parallel.nodes = max(1, world // local_world)
        cfg.validate(world_size=world, injection_world=int(os.environ[ORIG_WORLD_ENV]))
    except (ConfigError, ValueError) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    if cfg.telemetry.enabled and not cfg.telemetry.collector_url:
        print("trainer: error: under torchrun, --telemetry needs --collector URL (start one with `collector serve`)",
              file=sys.stderr)
        return 2
    # --run-id, else torchrun's job id; with neither, run_worker agrees on a new one
    # through the rendezvous store once the process group is up, then prepares the dir
    cfg.run_id = cfg.run_id or torchrun_run_id(os.environ)
    if cfg.run_id:
        prepare_run(cfg)
    os.environ.setdefault("LLMWATCH_PROGRESS", "1" if progress else "0")
    from trainer.worker import run_worker

    return run_worker(cfg, token=token if cfg.telemetry.enabled else None)
