"""The same entry point under torchrun: two elastic agents on one machine stand in for two nodes."""

import json
import os
import re
import socket
import subprocess
import sys

import duckdb
import pytest

from tests.integration.trainer_run import ROOT, TINY, assert_close, run_trainer
from tests.polling import wait_until
from tests.procs import stop_tree
from tests.unit.collector.collector_server import CollectorProcess
from trainer.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_torchrun_nodes_match_the_embedded_launcher(tmp_path):
    port = free_port()
    run_dir = tmp_path / "tr"
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "llmwatch-test", "--max-restarts", "0"]
    trainer_args = ["-m", "trainer", "--dp", "2", "--tp", "2", "--steps", "4", "--micro-batches", "2",
                    "--run-dir", str(run_dir), "--metrics-jsonl", str(run_dir / "metrics.jsonl"), *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, *trainer_args],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outs)
    torchrun = {json.loads(x)["step"]: json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()}
    embedded = run_trainer(tmp_path / "emb", "--dp", "2", "--tp", "2", "--steps", "4", "--micro-batches", "2",
                           "--nodes", "2")
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    assert_close(torchrun, embedded.losses(), range(1, 5))


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


RUN_LINE = re.compile(r"trainer: rank (\d+) in run (\S+) \((\S+)\)")


def torchrun_job(cwd, *trainer_args, max_restarts=0, timeout_s=300):
    """One single-node torchrun job of 2 ranks with no --rdzv-id (torchrun's run id: `none`).
    Returns (exit code, output, [(rank, run id, run dir) per rank start])."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--max-restarts", str(max_restarts), "-m", "trainer", *TINY, "--layers", "2", "--dp", "2", *trainer_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TORCHELASTIC_RUN_ID", None)
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = p.stdout + p.stderr
    return p.returncode, out, [(int(r), i, d) for r, i, d in RUN_LINE.findall(out)]


def test_torchrun_jobs_without_ids_get_their_own_and_a_restart_keeps_it(tmp_path):
    # Job a: rank 1 crashes at step 2, torchrun restarts the group. The crash is one-shot by
    # the fault state in the run dir, so the restart completes only if it found the same dir.
    rc, out, starts = torchrun_job(tmp_path, "--steps", "3", "--inject", "crash@rank=1,step=2", max_restarts=1)
    assert rc == 0, out[-4000:]
    assert sorted(r for r, _, _ in starts) == [0, 0, 1, 1], out[-4000:]  # two rounds of two ranks
    (run_a,) = {i for _, i, _ in starts}
    assert run_a not in ("none", "torchrun")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_a]
    crashes = [json.loads(x) for x in (tmp_path / "runs" / run_a / "injections.jsonl").read_text().splitlines()]
    assert [c["kind"] for c in crashes] == ["crash"]
    # Job b, the same command line otherwise: another run
    rc, out, starts = torchrun_job(tmp_path, "--steps", "1")
    assert rc == 0, out[-4000:]
    (run_b,) = {i for _, i, _ in starts}
    assert len(starts) == 2 and run_b != run_a
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([run_a, run_b])


def test_torchrun_keeps_a_given_run_id(tmp_path):
    rc, out, starts = torchrun_job(tmp_path, "--steps", "1", "--run-id", "mine")
    assert rc == 0, out[-4000:]
    assert sorted(starts) == [(0, "mine", "runs/mine"), (1, "mine", "runs/mine")]


STEPS = 150  # the isolation lands around step 70-100
# isolated after 2 s of its cost, not 4 s: sooner; and taken out, not rebalanced in place (a 12x straggler's
# replica keeping one micro-batch of 6 is the cost model's cheaper candidate here, with no restart)
ISOLATE_RULES = "[policy]\nstraggler_persist_s = 2.0\nrebalance = false\n"


def elastic_job(tmp_path, *, nnodes: str, active: int, spares: int = 0, inject: str) -> dict:
    """`active` torchrun agents on loopback, one per simulated node (node0, node1, ...), then
    `spares` standby agents (named on from there) once the job's first round is running, so
    that they wait in the rendezvous's redundancy list; all under a collector with
    ISOLATE_RULES. Returns the agents' exit codes and output, and what the database says."""
    (tmp_path / "rules.toml").write_text(ISOLATE_RULES)
    col = CollectorProcess(tmp_path / "tel.duckdb", args=("--rules", str(tmp_path / "rules.toml"))).start()
    run_dir = tmp_path / "run"
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
                "--max-restarts", "3",
                # a departed agent is known dead after ~3 s of missed keep-alives (at 2 s an agent
                # that had just joined declared itself dead: its first beat after the join comes a
                # second later, so a standby saw a free place, waited, and made the job restart
                # again and again); the round closes 1 s after the minimum joined
                "--rdzv-conf", "last_call_timeout=1,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"]
    trainer_args = ["-m", "trainer", "--run-id", "elastic", "--run-dir", str(run_dir), "--dp", str(active),
                    "--micro-batches", "2", *TINY, "--d-model", "128", "--seq-len", "64", "--steps", str(STEPS),
                    "--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", "10", "--telemetry", "--collector", col.url,
                    "--metrics-jsonl", str(run_dir / "metrics.jsonl"), "--inject", inject]
    spare_names = ",".join(f"node{k}" for k in range(active, active + spares))
    agents, logs = [], []

    def start(k: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LLMWATCH_TOKEN=col.token,
                   LLMWATCH_NODE_NAME=f"node{k}", LLMWATCH_NODE_INDEX=str(k), LLMWATCH_SPARE_NODES=spare_names)
        if spares:
            # torch 2.13's agents share one TCPStore for the workers, and its address is
            # published only in the round that made it: an agent that joins a later round
            # (the standby) waits for it forever. Unshared, every round publishes its own.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        log = open(tmp_path / f"agent{k}.log", "w")
        logs.append(log)
        agents.append(subprocess.Popen([*torchrun, *trainer_args], cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT))

    def started() -> int:  # the ranks of the first round that said they run
        return sum(len(RUN_LINE.findall((tmp_path / f"agent{k}.log").read_text())) for k in range(active))

    try:
        for k in range(active):
            start(k)
            if k == 0:
                # node0's agent hosts the rendezvous store (the first to bind the endpoint does):
                # the isolated node must not be the one that holds it (docs/healing.md)
                assert wait_until(lambda: listening(port), 60.0, 0.1), "node0's agent never served the store"
        if spares:
            assert wait_until(lambda: started() >= active, 120.0, 0.2), "the first round never started"
            for k in range(active, active + spares):
                start(k)
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            stop_tree(a)
        for log in logs:
            log.close()
        col.stop()
    out = "\n".join(f"== agent{k}\n" + (tmp_path / f"agent{k}.log").read_text()[-3000:] for k in range(len(agents)))
    con = duckdb.connect(str(tmp_path / "tel.duckdb"), read_only=True)
    try:
        q = {
            "nodes": dict(con.execute("SELECT node, status FROM nodes WHERE run_id = 'elastic'").fetchall()),
            "actions": con.execute("SELECT kind, status, node, recovery_s, detail FROM actions "
                                   "WHERE run_id = 'elastic'").fetchall(),
            "run": con.execute("SELECT world_size, mesh::VARCHAR FROM runs WHERE run_id = 'elastic'").fetchone(),
            "last": con.execute("SELECT max(attempt) FROM steps WHERE run_id = 'elastic'").fetchone()[0],
            "final_step": con.execute("SELECT max(step) FROM steps WHERE run_id = 'elastic'").fetchone()[0],
            # samples per step, over the replicas (each rank reports its replica's window)
            "samples": dict(con.execute("""SELECT attempt, list(DISTINCT n) FROM (
                                               SELECT attempt, step, sum(sample_to - sample_from) AS n
                                               FROM steps WHERE run_id = 'elastic' GROUP BY attempt, step)
                                           GROUP BY attempt""").fetchall()),
        }
        q["tail"] = sorted(n for (n,) in con.execute(
            "SELECT DISTINCT node FROM steps WHERE run_id = 'elastic' AND attempt = ?", [q["last"]]).fetchall())
    finally:
        con.close()
    return {"codes": codes, "out": out, **q}


def test_an_isolated_node_leaves_and_the_job_finishes_on_the_other_two(tmp_path):
    """Three torchrun agents on loopback, one per simulated node, and a collector: node2's
    rank straggles; the policy isolates node2, whose agent leaves (it is told to stop and
    does not rejoin), and the other two re-rendezvous (--nnodes 2:3), reshard the
    checkpoint to dp 2 with the same global batch, and finish."""
    # rank 2 of the first layout: node2's; 12x, so that the job finishes sooner on two nodes
    # than waiting for it on three (the cost model weighs the restart, ~8 s here, and the
    # ~100 steps left: at 6x it kept the node, 16 s against 18)
    r = elastic_job(tmp_path, nnodes="2:3", active=3, inject="straggler@rank=2,from=30,factor=12")
    codes, out, actions = r["codes"], r["out"], r["actions"]
    assert codes[:2] == [0, 0] and codes[2] != 0, out  # node2's agent was told to leave
    assert r["nodes"]["node2"] == "isolated", (r["nodes"], actions, out)
    assert ("isolate", "done", "node2") in [a[:3] for a in actions], actions
    world, mesh = r["run"]
    assert world == 2 and json.loads(mesh)["dp"] == 2, (world, mesh)
    assert r["tail"] == ["node0", "node1"], r["tail"]
    assert r["final_step"] == STEPS
    samples, last = r["samples"], r["last"]
    assert last >= 1 and samples[last] == samples[0] == [12], samples  # the same global batch on two replicas
    recovery = next(a[3] for a in actions if a[0] == "isolate")
    print(f"isolation to the first new step on two nodes: {recovery:.1f} s")


def test_a_standby_agent_takes_the_isolated_nodes_place(tmp_path):
    """Two torchrun agents run the job (--nnodes 2:2) and a third waits as a standby: it
    joins once the first round is running, so the rendezvous keeps it in its redundancy
    list. node1's rank straggles; with a spare the cost model replaces node1 rather than
    keeping it; node1's agent leaves, node0's re-rendezvous, and the standby takes the
    free place: dp 2 and the global batch stay, and node2 goes from spare to healthy."""
    r = elastic_job(tmp_path, nnodes="2:2", active=2, spares=1, inject="straggler@rank=1,from=30,factor=12")
    codes, out, actions = r["codes"], r["out"], r["actions"]
    assert codes[0] == 0 and codes[1] != 0 and codes[2] == 0, (codes, out)  # node1's agent was told to leave
    assert r["nodes"] == {"node0": "healthy", "node1": "isolated", "node2": "healthy"}, (r["nodes"], actions, out)
    isolate = next(a for a in actions if a[0] == "isolate")
    assert isolate[1:3] == ("done", "node1"), actions
    predicted = json.loads(isolate[4])["predicted"]
    # the collector knew of the standby (the ranks listed it as a spare) when it weighed the straggler
    assert predicted["best"] == "replace" and predicted["inputs"]["spares"] == 1, predicted
    world, mesh = r["run"]
    assert world == 2 and json.loads(mesh)["dp"] == 2, (world, mesh)
    assert r["tail"] == ["node0", "node2"], r["tail"]
    assert r["final_step"] == STEPS
    samples, last = r["samples"], r["last"]
    assert last >= 1 and samples[last] == samples[0] == [8], samples  # the same global batch, the same replicas
    print(f"isolation to the first new step with the standby in its place: {isolate[3]:.1f} s")
