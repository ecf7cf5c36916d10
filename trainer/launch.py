"""Start the ranks: embedded (spawn local processes) or under `torchrun`.

Embedded mode is the default: `trainer` picks a rendezvous port on loopback,
starts one `python -m trainer.worker` process per rank with the torchrun
environment variables set, and supervises them like torchrun does: when one
rank fails, the others are stopped (they would otherwise wait for it in a
collective until the process-group timeout). With `--telemetry` and no
`--collector`, it also starts an embedded collector for the run. Its children
die with it, however it dies (`trainer.lifeline`). The collector token reaches
the ranks in their environment only (`trainer.private`).

Under `torchrun` (RANK/WORLD_SIZE in the environment) the same entry point runs
the worker in-process, unchanged.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainer.config import ConfigError, JobConfig
from trainer.lifeline import Lifeline, die_with_parent
from trainer.private import COLLECTOR_TOKEN_ENVS, TOKEN_ENV
from trainer.rundir import new_run_id, prepare_run, torchrun_run_id

GRACE_S = 5.0


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
    collector = None
    rank_token = token
    if cfg.telemetry.enabled and not cfg.telemetry.collector_url:
        from trainer.embedded import EmbeddedCollector

        collector = EmbeddedCollector(db_path=run_dir / "telemetry.duckdb", tokens_dir=run_dir / "tokens",
                                      log_path=run_dir / "collector.log", token=token)
        try:
            collector.start()
        except RuntimeError as e:
            print(f"trainer: error: {e}", file=sys.stderr)
            return 1
        cfg.telemetry.collector_url = collector.url
        rank_token = collector.rank_token
        print(f"telemetry: collector {collector.url}  db {collector.db_path}", flush=True)
        for line in collector.describe_tokens():
            print(f"telemetry: {line}", flush=True)
    elif cfg.telemetry.enabled:
        print(f"telemetry: shipping to {cfg.telemetry.collector_url}", flush=True)
    config_path = run_dir / "config.json"
    config_path.write_text(cfg.to_json())
    try:
        return _spawn_ranks(cfg, config_path, token=rank_token if cfg.telemetry.enabled else None,
                            progress=progress)
    finally:
        if collector is not None:
            if keep_collector:
                print(f"telemetry: collector still serving {collector.url} (Ctrl-C to stop)", flush=True)
                collector.wait_interrupted()
            collector.stop()
            print(f"telemetry: stored in {collector.db_path}", flush=True)


def _rank_env(cfg: JobConfig, rank: int, port: int, progress: bool, token: str | None) -> dict[str, str]:
    world = cfg.parallel.world_size
    per_node = world // cfg.parallel.nodes
    threads = max(1, (os.cpu_count() or 1) // world)
    # a rank holds at most the one token it sends (the ingest token), never the user's others
    env = {k: v for k, v in os.environ.items() if k not in COLLECTOR_TOKEN_ENVS}
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(threads)),
        LLMWATCH_EMBEDDED="1", LLMWATCH_PROGRESS="1" if progress else "0",
    )
    if token:
        env[TOKEN_ENV] = token
    return env


def _spawn_ranks(cfg: JobConfig, config_path: Path, *, token: str | None, progress: bool) -> int:
    port = free_port()
    lifeline = Lifeline()
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(cfg.parallel.world_size):
            env = _rank_env(cfg, rank, port, progress, token) | lifeline.env()
            procs.append(subprocess.Popen([sys.executable, "-m", "trainer.worker", str(config_path)], env=env,
                                          pass_fds=lifeline.pass_fds, preexec_fn=die_with_parent()))
        return _supervise(procs)
    finally:
        lifeline.close()


def _supervise(procs: list[subprocess.Popen]) -> int:
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


def _launch_torchrun(cfg: JobConfig, *, token: str | None, progress: bool) -> int:
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
    # --run-id, else torchrun's job id; with neither, run_worker agrees on a new one
    # through the rendezvous store once the process group is up, then prepares the dir
    cfg.run_id = cfg.run_id or torchrun_run_id(os.environ)
    if cfg.run_id:
        prepare_run(cfg)
    os.environ.setdefault("LLMWATCH_PROGRESS", "1" if progress else "0")
    from trainer.worker import run_worker

    return run_worker(cfg, token=token if cfg.telemetry.enabled else None)
