"""One rank: build everything once, run the loop, close everything.

`python -m trainer.worker CONFIG.json` is what the embedded launcher starts per
rank; under torchrun `trainer.launch` calls `run_worker` directly. The rank's
identity comes from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.comm import Comm
from trainer.config import JobConfig
from trainer.faults import FaultInjector, parse_injections
from trainer.parallel_dims import ParallelDims


def _code_version() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5)
            return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "llmwatch-" + version("llmwatch")
    except PackageNotFoundError:
        return "unknown"


def _device(backend: str, local_rank: int) -> tuple[str, torch.device]:
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def _make_agent(cfg: JobConfig, dims: ParallelDims, node: str, run_info: dict | None):
    from agent import Agent, AgentConfig, NoopAgent

    if not cfg.telemetry.enabled:
        return NoopAgent()
    t = cfg.telemetry
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    spool_dir = Path(cfg.run_dir) / "spool" / f"rank{dims.rank:05d}" if cfg.run_dir else None
    agent_cfg = AgentConfig(
        url=t.collector_url, token=t.token or os.environ.get("LLMWATCH_TOKEN"),
        flush_interval_s=t.flush_interval_s, heartbeat_interval_s=t.heartbeat_interval_s,
        spool_dir=str(spool_dir) if spool_dir else None, spool_bytes=t.spool_bytes,
        otlp_endpoint=t.otlp_endpoint,
        prometheus_port=(t.prometheus_port + local_rank) if t.prometheus_port else None,
    )
    agent = Agent(agent_cfg, run_id=cfg.run_id, rank=dims.rank, node=node, coords=dims.coords,
                  world_size=dims.world_size, run_info=run_info)
    agent.start()
    return agent


def run_worker(cfg: JobConfig) -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # SIGTERM (the launcher stopping us after another rank failed) unwinds through the
    # finally blocks below, so the agent flushes what it has and the spool stays whole.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    backend, device = _device(cfg.parallel.backend, local_rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.parallel.timeout_s))
    dims = ParallelDims.from_config(cfg.parallel, rank=rank, world_size=world)
    dims.build_mesh(device.type)
    node = os.environ.get("LLMWATCH_NODE_NAME") or f"node{dims.node}"

    from trainer import data as data_mod
    from trainer.engine import TrainEngine

    corpus = data_mod.build_corpus(cfg.data, seq_len=cfg.model.seq_len, seed=cfg.seed)
    run_info = None
    if rank == 0:
        run_info = {
            "run_id": cfg.run_id, "config": cfg.to_dict(), "world_size": world,
            "mesh": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "sp": dims.sp, "nodes": dims.nodes},
            "node_map": {str(r): f"node{dims.node_of(r)}" for r in range(world)},
            "code_version": _code_version(), "data_version": corpus.data_version,
            "backend": backend, "device": device.type, "torch": torch.__version__, "started_ts": time.time(),
        }
    agent = _make_agent(cfg, dims, node, run_info)
    try:
        comm = Comm(dims, device=device, sink=agent)
        agent.bind_seq_source(lambda: comm.last_seq)
        engine = TrainEngine(cfg, dims, comm, device)
        pad_multiple = dims.tp if dims.sp else 1

        def loader_factory(position, start_step):
            return data_mod.DataLoader(
                corpus, seq_len=cfg.model.seq_len, micro_batch_size=cfg.parallel.micro_batch_size,
                micro_batches=cfg.parallel.micro_batches, dp_size=dims.dp, dp_rank=dims.dp_rank, seed=cfg.seed,
                position=position, group_window=cfg.data.group_window, prefetch=cfg.data.prefetch,
                pad_multiple=pad_multiple, start_step=start_step,
            )

        eval_sets = {}
        if cfg.eval_every:
            eval_sets = {d: data_mod.eval_batches(corpus, d, micro_batch_size=cfg.parallel.micro_batch_size,
                                                  pad_multiple=pad_multiple) for d in cfg.data.domains}
        checkpointer = None
        if cfg.ckpt.dir:
            from trainer.checkpoint import Checkpointer

            checkpointer = Checkpointer(cfg.ckpt, dims=dims, comm=comm,
                                        log=(lambda m: print(f"[rank {rank}] {m}", flush=True)))
        injector = FaultInjector(parse_injections(cfg.inject, world_size=world), rank=rank, node=dims.node,
                                 run_dir=cfg.run_dir)
        from trainer.train import Trainer

        trainer = Trainer(cfg, dims=dims, comm=comm, engine=engine, loader_factory=loader_factory,
                          eval_sets=eval_sets, checkpointer=checkpointer, agent=agent, injector=injector,
                          device=device, poison=data_mod.poison,
                          progress=os.environ.get("LLMWATCH_PROGRESS") == "1")
        agent.event("run_started", step=0, pid=os.getpid(), node=node)
        state = trainer.fit()
        if checkpointer is not None:
            checkpointer.close()
        if rank == 0:
            agent.event("run_finished", step=state.step, status="stopped" if state.stopped else "completed",
                        skipped_steps=state.num_skipped)
        dist.barrier()
        return 0
    finally:
        agent.close(timeout_s=10.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainer.worker CONFIG.json", file=sys.stderr)
        return 2
    cfg = JobConfig.from_json(Path(argv[0]).read_text())
    return run_worker(cfg)


if __name__ == "__main__":
    sys.exit(main())
