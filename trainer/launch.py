"""Start the ranks: embedded (spawn local processes) or under `torchrun`.

Embedded mode is the default: `trainer` picks a rendezvous port on loopback,
starts one `python -m trainer.worker` process per rank with the torchrun
environment variables set, and supervises them like torchrun does: when one
rank fails, the others are stopped (they would otherwise wait for it in a
collective until the process-group timeout). With `--telemetry` and no
`--collector`, it also starts an embedded collector for the run.

Under `torchrun` (RANK/WORLD_SIZE in the environment) the same entry point runs
the worker in-process, unchanged.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from trainer.config import ConfigError, JobConfig

GRACE_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def prepare_run(cfg: JobConfig) -> Path:
    """Fill in run id and run dir, create the dir, write config.json there."""
    if not cfg.run_id:
        cfg.run_id = new_run_id()
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / cfg.run_id)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch(cfg: JobConfig, *, progress: bool = True, keep_collector: bool = False) -> int:
    if under_torchrun():
        return _launch_torchrun(cfg, progress=progress)
    run_dir = prepare_run(cfg)
    collector = None
    if cfg.telemetry.enabled and not cfg.telemetry.collector_url:
        from trainer.embedded import EmbeddedCollector

        cfg.telemetry.token = cfg.telemetry.token or os.environ.get("LLMWATCH_TOKEN") or secrets.token_urlsafe(24)
        collector = EmbeddedCollector(db_path=run_dir / "telemetry.duckdb", token=cfg.telemetry.token,
                                      log_path=run_dir / "collector.log")
        try:
            collector.start()
        except RuntimeError as e:
            print(f"trainer: error: {e}", file=sys.stderr)
            return 1
        cfg.telemetry.collector_url = collector.url
        print(f"telemetry: collector {collector.url}  db {collector.db_path}", flush=True)
        print(f"telemetry: token in {collector.token_path}", flush=True)
    elif cfg.telemetry.enabled:
        cfg.telemetry.token = cfg.telemetry.token or os.environ.get("LLMWATCH_TOKEN")
        print(f"telemetry: shipping to {cfg.telemetry.collector_url}", flush=True)
    config_path = run_dir / "config.json"
    config_path.write_text(cfg.to_json())
    try:
        return _spawn_ranks(cfg, config_path, progress=progress)
    finally:
        if collector is not None:
            if keep_collector:
                print(f"telemetry: collector still serving {collector.url} (Ctrl-C to stop)", flush=True)
                collector.wait_interrupted()
            collector.stop()
            print(f"telemetry: stored in {collector.db_path}", flush=True)


def _rank_env(cfg: JobConfig, rank: int, port: int, progress: bool) -> dict[str, str]:
    world = cfg.parallel.world_size
    per_node = world // cfg.parallel.nodes
    threads = max(1, (os.cpu_count() or 1) // world)
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(threads)),
        LLMWATCH_EMBEDDED="1", LLMWATCH_PROGRESS="1" if progress else "0",
    )
    if cfg.telemetry.token:
        env["LLMWATCH_TOKEN"] = cfg.telemetry.token
    return env


def _spawn_ranks(cfg: JobConfig, config_path: Path, *, progress: bool) -> int:
    port = free_port()
    procs: list[subprocess.Popen] = []
    for rank in range(cfg.parallel.world_size):
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer.worker", str(config_path)],
                                      env=_rank_env(cfg, rank, port, progress)))
    failed: dict[int, int] = {}
    interrupted = False
    try:
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0) and rank not in failed:
                    failed[rank] = code
            if failed or all(c is not None for c in codes):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        interrupted = True
    if failed or interrupted:
        if failed:
            desc = ", ".join(f"rank {r} exited with {_describe(c)}" for r, c in sorted(failed.items()))
            print(f"trainer: {desc}; stopping the other ranks", file=sys.stderr, flush=True)
        _stop(procs)
        return 130 if interrupted and not failed else 1
    return 0


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _launch_torchrun(cfg: JobConfig, *, progress: bool) -> int:
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cfg.parallel.nodes = max(1, world // local_world)
    try:
        cfg.validate(world_size=world)
    except ConfigError as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    if cfg.telemetry.enabled and not cfg.telemetry.collector_url:
        print("trainer: error: under torchrun, --telemetry needs --collector URL (start one with `collector serve`)",
              file=sys.stderr)
        return 2
    if not cfg.run_id:
        # every rank must agree on the run id without talking: torchrun's run id is shared
        cfg.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "torchrun"
    prepare_run(cfg)
    cfg.telemetry.token = cfg.telemetry.token or os.environ.get("LLMWATCH_TOKEN")
    os.environ.setdefault("LLMWATCH_PROGRESS", "1" if progress else "0")
    from trainer.worker import run_worker

    return run_worker(cfg)
