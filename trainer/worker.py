"""One rank: build everything once, run the loop, close everything.

`python -m trainer.worker CONFIG.json` is what the embedded launcher starts per
rank; under torchrun `trainer.launch` calls `run_worker` directly. The rank's
identity comes from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK);
its run id from the config, or, under torchrun without one, from rank 0 through
the job's store (`trainer.rundir.agree_run_id`); its collector token from the
launcher (the environment), never from the config.
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
from trainer.lifeline import exit_now, watch_lifeline
from trainer.membership import read_membership, under_elastic_agent
from trainer.parallel_dims import ParallelDims
from trainer.private import TOKEN_ENV
from trainer.rundir import agree_run_id, prepare_run
from trainer.supervisor import (
    ATTEMPT_FILE,
    ATTEMPT_FLOOR_ENV,
    HW_RANK_ENV,
    NODE_NAMES_ENV,
    ORIG_WORLD_ENV,
    RESTART_ROUND_ENV,
    SPARES_ENV,
    attempt_high_water,
)

NODE_NAME_ENV = "LLMWATCH_NODE_NAME"  # this node's name (under torchrun: set per agent)
NODE_INDEX_ENV = "LLMWATCH_NODE_INDEX"  # this node's index in the first layout (under torchrun: per agent)

# The lifeline's hard exit comes this long after its SIGTERM: time for the agent's
# final flush (close(timeout_s=10)) and the process group's teardown.
ORPHAN_GRACE_S = 20.0


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


def _make_agent(cfg: JobConfig, dims: ParallelDims, node: str, run_info: dict | None, token: str | None):
    from agent import Agent, AgentConfig, NoopAgent

    if not cfg.telemetry.enabled:
        return NoopAgent()
    t = cfg.telemetry
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    spool_dir = Path(cfg.run_dir) / "spool" / f"rank{dims.rank:05d}" if cfg.run_dir else None
    agent_cfg = AgentConfig(
        url=t.collector_url, token=token, ca_file=t.ca_file,
        flush_interval_s=t.flush_interval_s, heartbeat_interval_s=t.heartbeat_interval_s,
        spool_dir=str(spool_dir) if spool_dir else None, spool_bytes=t.spool_bytes,
        otlp_endpoint=t.otlp_endpoint,
        prometheus_port=(t.prometheus_port + local_rank) if t.prometheus_port else None,
    )
    agent = Agent(agent_cfg, run_id=cfg.run_id, rank=dims.rank, node=node, coords=dims.coords,
                  world_size=dims.world_size, run_info=run_info)
    agent.start()
    return agent


def _job_store(*, rank: int, world: int, timeout: timedelta):
    """The job's c10d store, as `init_process_group` would make it from the env://
    variables: under torchrun a client of the store node 0's agent serves (it
    outlives restarts), in the embedded launcher one that rank 0 serves."""
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    store.set_timeout(timeout)
    return store


def node_names_from(environ, nodes: int) -> list[str]:
    """The names of this layout's nodes, by node index: the supervisor's list after an
    elastic restart (the surviving nodes keep their names), else node0..node<n-1>."""
    names = [n for n in environ.get(NODE_NAMES_ENV, "").split(",") if n]
    return names if len(names) == nodes else [f"node{i}" for i in range(nodes)]


def agree_restart(store, *, rank: int, world: int, own: int) -> int:
    """The job's restart round under torchrun, the same on every rank. Each elastic agent
    counts its own restarts (TORCHELASTIC_RESTART_COUNT), and a standby agent that joins
    a later round has restarted nothing: its ranks would take the first round's key space
    and start from scratch beside ranks that resume. When the workers' store is new this
    round (agents started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which standby agents
    need: rank 0's worker serves it), every rank publishes its count and all take the
    highest. In the agents' shared store, which outlives rounds, the agents restart
    together and their counts agree already."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "false":
        return own
    store.set(f"llmwatch/restart_count/{rank}", str(own))
    return max(int(store.get(f"llmwatch/restart_count/{r}")) for r in range(world))


def spares_left(environ, node_names: list[str], run_dir) -> list[str]:
    """The standby nodes this round leaves waiting: LLMWATCH_SPARE_NODES less the nodes
    that hold ranks now and those isolated. The embedded supervisor sets the variable to
    the spares it has left; under torchrun every agent is given the names of the standby
    agents (one that waits in the rendezvous's redundancy list takes an isolated node's
    place at the next round), and a spare that joined, or was isolated since, is no
    longer one."""
    declared = [n for n in environ.get(SPARES_ENV, "").split(",") if n]
    if not declared:
        return []
    gone = {x["node"] for x in read_membership(Path(run_dir))["isolated"]} if run_dir else set()
    return [n for n in dict.fromkeys(declared) if n not in node_names and n not in gone]


def gather_node_names(store, *, rank: int, world: int, per_node: int, round_: int) -> list[str]:
    """Under torchrun each agent names its own node (LLMWATCH_NODE_NAME) and the ranks
    are numbered by rendezvous order: every rank publishes its node's name in the job's
    store, and all read the list by node index (torchrun numbers an agent's ranks
    consecutively: node index = rank // ranks per node)."""
    store.set(f"llmwatch/nodes/{round_}/{rank}", os.environ[NODE_NAME_ENV])
    return [store.get(f"llmwatch/nodes/{round_}/{n * per_node}").decode() for n in range(world // per_node)]


def hardware_rank(environ, rank: int, per_node: int) -> int:
    """The rank this process's node and local slot had in the job's first layout: what
    an injection names. The embedded supervisor says it (LLMWATCH_HW_RANK); under
    torchrun the node's own index (LLMWATCH_NODE_INDEX, set per agent) and the local
    rank give it; else the rank itself."""
    if environ.get(HW_RANK_ENV):
        return int(environ[HW_RANK_ENV])
    if environ.get(NODE_INDEX_ENV):
        return int(environ[NODE_INDEX_ENV]) * per_node + int(environ.get("LOCAL_RANK", 0))
    return rank


def _exit_on_sigterm(signum, frame) -> None:
    # Once only: PDEATHSIG and the lifeline both send one when the launcher dies, and a
    # second SystemExit raised inside the finally blocks would cut the agent's flush short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


SILENT_MARGIN_S = 10.0  # past the collector's verdict time and the supervisor's grace: nobody stopped us


def _preflight(agent, *, cfg: JobConfig, store, node: str, node_of: dict[int, str], device, injector,
               rank: int, world: int) -> dict:
    """The pre-flight checks (trainer/preflight.py) on every rank; rank 0 prints the report and
    records it as the `preflight` event, flushed at once (the collector's policy acts on it).
    A node that never answered holds up every collective of the job: its ranks and ours
    wait here, at most the collector's verdict time and a margin, for the supervisor to stop
    them (the policy isolates the node); then, or without a collector, PreflightError."""
    from trainer.preflight import NO_ANSWER, Checks, PreflightError, bad_nodes, render, rules_ratio, run_checks

    compute, link = injector.preflight_factors()
    # the suspects are picked, and the printed verdicts given, by the ratio the collector judges by
    ratio = cfg.healing.preflight_ratio or rules_ratio(cfg.telemetry.rules) or Checks().ratio
    checks = Checks(ratio=ratio, timeout_s=cfg.healing.preflight_timeout_s)
    report = run_checks(node=node, store=dist.PrefixStore(f"llmwatch/{cfg.run_id}", store), rank=rank, world=world,
                        device=device, compute_factor=compute, link_factor=link, hang=injector.preflight_hang(),
                        node_of=node_of, checks=checks)
    if rank == 0:
        print(render(report), flush=True)
        agent.event("preflight", step=0, **report)
        agent.flush(timeout_s=5.0)
    silent = sorted(n for n, v in bad_nodes(report).items() if v == NO_ANSWER)
    if silent:
        if rank != 0:
            agent.flush(timeout_s=5.0)  # one answer from the collector, which says how long its verdict takes
        said = agent.end_wait_s()  # 0 or None: no collector, or its policy would not act
        wait_s = said + cfg.healing.isolate_grace_s + SILENT_MARGIN_S if said else 0.0
        if rank == 0 and wait_s:
            print(f"preflight: {', '.join(silent)} never answered; waiting up to {wait_s:.0f} s for the "
                  "collector to isolate it", flush=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:  # the supervisor stops this process (a bounded poll of nothing)
            time.sleep(0.2)
        raise PreflightError(f"preflight: {', '.join(silent)} never answered the pre-flight checks "
                             f"(within {checks.timeout_s:g} s); the job cannot start with it")
    return report


def run_worker(cfg: JobConfig, *, token: str | None = None) -> int:
    """Run this rank. `token`: the collector token the agent sends (not in `cfg`)."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # SIGTERM (the launcher stopping us after another rank failed, or the kernel and the
    # lifeline telling us the launcher died) unwinds through the finally blocks below,
    # so the agent flushes what it has and the spool stays whole.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    backend, device = _device(cfg.parallel.backend, local_rank)
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    store = _job_store(rank=rank, world=world, timeout=timeout)
    if not cfg.run_id:
        # torchrun without a job id: agree on one before anything is recorded or written
        cfg.run_id = agree_run_id(store, rank=rank)
        prepare_run(cfg)
    # torchrun's restart round, or the embedded supervisor's (trainer/supervisor.py)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(RESTART_ROUND_ENV) or "0")
    if under_elastic_agent():
        restart = agree_restart(store, rank=rank, world=world, own=restart)
    if restart > 0 and cfg.ckpt.dir:
        cfg.ckpt.resume = True  # a restarted round goes on from the newest verified checkpoint
    # One key space per restart round. Under torchrun the store outlives the workers
    # (node 0's agent serves it), so a restarted group would otherwise read the previous
    # round's keys: gloo then dials the dead ranks' addresses and the restart fails.
    dist.init_process_group(backend, store=dist.PrefixStore(f"default_pg/restart{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)
    if os.environ.get("LLMWATCH_EMBEDDED") != "1":  # the embedded launcher says it once for all
        print(f"trainer: rank {rank} in run {cfg.run_id} ({cfg.run_dir})", flush=True)
    dims = ParallelDims.from_config(cfg.parallel, rank=rank, world_size=world)
    dims.build_mesh(device.type)
    node_names = node_names_from(os.environ, dims.nodes)
    if under_elastic_agent() and os.environ.get(NODE_NAME_ENV):
        node_names = gather_node_names(store, rank=rank, world=world, per_node=dims.ranks_per_node, round_=restart)
    node = os.environ.get(NODE_NAME_ENV) or node_names[dims.node]

    from trainer import data as data_mod
    from trainer.engine import TrainEngine
    from trainer.preflight import bad_nodes

    corpus = data_mod.build_corpus(cfg.data, seq_len=cfg.model.seq_len, seed=cfg.seed)
    run_info = None
    if rank == 0:
        run_info = {
            "run_id": cfg.run_id, "config": cfg.to_dict(), "world_size": world,
            "mesh": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "sp": dims.sp, "nodes": dims.nodes},
            "node_map": {str(r): node_names[dims.node_of(r)] for r in range(world)},
            "spares": spares_left(os.environ, node_names, cfg.run_dir),  # the standby nodes
            "code_version": _code_version(), "data_version": corpus.data_version,
            "backend": backend, "device": device.type, "torch": torch.__version__, "started_ts": time.time(),
        }
    agent = _make_agent(cfg, dims, node, run_info, token)
    try:
        comm = Comm(dims, device=device, sink=agent)
        agent.bind_seq_source(lambda: comm.last_entered)  # the heartbeat names the collective it entered last
        engine = TrainEngine(cfg, dims, comm, device)
        pad_multiple = data_mod.pad_multiple_for(cfg.model.seq_len, dims.tp if dims.sp else 1)

        def loader_factory(position, start_step, bad_windows=()):
            return data_mod.DataLoader(
                corpus, seq_len=cfg.model.seq_len, micro_batch_size=cfg.parallel.micro_batch_size,
                micro_batches=cfg.parallel.micro_batches, dp_size=dims.dp, dp_rank=dims.dp_rank, seed=cfg.seed,
                position=position, group_window=cfg.data.group_window, prefetch=cfg.data.prefetch,
                pad_multiple=pad_multiple, start_step=start_step, bad_windows=bad_windows,
                slow_fetch=lambda step: injector.slowio_factor("data", step),  # injected slowio (what=data)
                shares=cfg.parallel.shares,
            )

        eval_sets = {}
        if cfg.eval_every:
            eval_sets = {d: data_mod.eval_batches(corpus, d, micro_batch_size=cfg.parallel.micro_batch_size,
                                                  pad_multiple=pad_multiple) for d in cfg.data.domains}
        checkpointer = None
        if cfg.ckpt.dir:
            from trainer.checkpoint import Checkpointer

            checkpointer = Checkpointer(cfg.ckpt, dims=dims, comm=comm,
                                        log=(lambda m: print(f"[rank {rank}] {m}", flush=True)),
                                        slow_write=lambda step: injector.slowio_factor("ckpt", step),
                                        # a divergence rolls back before the last agreeing checksum
                                        keep_older_than=2 * cfg.telemetry.checksum_every
                                        if cfg.telemetry.enabled and dims.dp > 1 else 0,
                                        # rank 0 prunes: never the newest known-good checkpoint or after it
                                        known_good=agent.clean_through)
        # Injections name ranks of the job's first layout: after an elastic restart with fewer
        # nodes a fault stays with its hardware (the launcher's LLMWATCH_HW_RANK), not its number.
        hw_rank = hardware_rank(os.environ, rank, dims.ranks_per_node)
        # the first layout's world: the supervisor's, or under torchrun the command line's (_launch_torchrun)
        orig_world = int(os.environ.get(ORIG_WORLD_ENV) or world)
        injector = FaultInjector(parse_injections(cfg.inject, world_size=orig_world), rank=rank, hw_rank=hw_rank,
                                 node=hw_rank // dims.ranks_per_node,
                                 run_dir=cfg.run_dir, tp=dims.tp, pp=dims.pp, dp=dims.dp,
                                 orig_dp=orig_world // (dims.tp * dims.pp), ranks_per_node=dims.ranks_per_node)
        if injector.shows_device_faults():  # an injected devhealth: its (simulated) device's samples show it
            agent.set_health_overlay(injector.device_health)
        if any(inj.kind == "slowlink" for inj in injector.injections):  # a slow link stretches its healthy time
            comm.link_memory(injector.link_times(), injector.remember_links)
        from trainer.train import Trainer

        floor = int(os.environ.get(ATTEMPT_FLOOR_ENV) or 0)
        attempts_file = Path(cfg.run_dir) / ATTEMPT_FILE if cfg.run_dir else None
        if not floor and attempts_file is not None and (restart > 0 or (cfg.ckpt.resume and attempts_file.exists())):
            # torchrun's restart, or a --resume of a run that ran before: above every attempt
            # already written, so no (step, attempt) row is written twice. Every rank reads
            # it before rank 0 can write this one's (the barrier), so all agree.
            floor = attempt_high_water(Path(cfg.run_dir)) + 1
            dist.barrier()
        trainer = Trainer(cfg, dims=dims, comm=comm, engine=engine, loader_factory=loader_factory,
                          eval_sets=eval_sets, checkpointer=checkpointer, agent=agent, injector=injector,
                          device=device, poison=data_mod.poison,
                          progress=os.environ.get("LLMWATCH_PROGRESS") == "1",
                          attempt_floor=floor, node_names=tuple(node_names), node=node)
        # a supervisor's restart says the attempt it starts at: the collector tells its
        # first new step from the old round's last ones by it
        agent.event("run_started", step=0, pid=os.getpid(), node=node, restart=restart, attempt_floor=floor)
        if cfg.healing.preflight and restart == 0:
            report = _preflight(agent, cfg=cfg, store=store, node=node, device=device, injector=injector, rank=rank,
                                world=world, node_of={r: node_names[dims.node_of(r)] for r in range(world)})
            trainer.preflight_failed = bool(bad_nodes(report))
        state = trainer.fit()
        if checkpointer is not None:
            checkpointer.close()
        if state.exit_code:  # isolate: every rank leaves for the supervisor's restart
            # no collective here: the isolated node's ranks may be gone already (under torchrun
            # its agent is stopping them); the handler's barrier was the last one
            agent.event("run_restarting", step=state.step, exit_code=state.exit_code)
            return state.exit_code
        if rank == 0:
            agent.event("run_finished", step=state.step, status="stopped" if state.stopped else "completed",
                        skipped_steps=state.num_skipped)
        dist.barrier()
        return 0
    finally:
        # Unwinding already (a peer's failure raised here, or our SIGTERM): a SIGTERM now, the
        # launcher stopping the ranks, must not cut the final flush short (its SystemExit would
        # abort close() and lose the agent's last batch); the launcher's SIGKILL bounds the wait.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        agent.close(timeout_s=10.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainer.worker CONFIG.json", file=sys.stderr)
        return 2
    watch_lifeline(os.environ, grace_s=ORPHAN_GRACE_S)  # before the config is read: nothing to unwind yet
    # out of the environment as soon as read: nothing this rank starts (git, a shell) inherits it
    token = os.environ.pop(TOKEN_ENV, None)
    cfg = JobConfig.from_json(Path(argv[0]).read_text())
    return run_worker(cfg, token=token)


if __name__ == "__main__":
    exit_now(main())
