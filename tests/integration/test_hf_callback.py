"""agent.integrations.hf.LlmwatchCallback in a real transformers Trainer (a tiny GPT-2 built
from a config, CPU) against a real collector: one row per step, stop, rollback, isolate; and
two ranks under torchrun (gloo) stopping at the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from agent.integrations.hf import LlmwatchCallback  # noqa: E402
from tests.integration.framework_run import agent_config, deliver, post_command, settled  # noqa: E402
from tests.integration.hf_worker import build_trainer  # noqa: E402
from tests.polling import wait_until  # noqa: E402
from tests.procs import stop_tree  # noqa: E402
from tests.unit.collector.collector_server import CollectorProcess  # noqa: E402
from trainer.launch import free_port  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


class At(transformers.TrainerCallback):
    """At step `step` (before the llmwatch callback's turn), deliver a command to its agent."""

    def __init__(self, col, cb, run_id, plan: dict[int, tuple[str, dict]]) -> None:
        self.col, self.cb, self.run_id, self.plan = col, cb, run_id, dict(plan)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.plan:
            kind, cmd_args = self.plan.pop(state.global_step)
            deliver(self.col, self.cb.agent, self.run_id, kind, cmd_args)


def trainer(tmp_path, callbacks, max_steps: int):
    return build_trainer(tmp_path / "out", callbacks, max_steps)


@pytest.fixture
def col(tmp_path):
    c = CollectorProcess(tmp_path / "tel.duckdb").start()
    yield c
    c.stop()


def test_rows_once_per_step_stop_isolate_and_an_unknown_kind(col, tmp_path):
    cb = LlmwatchCallback(run_id="hf", url=col.url, token=col.token, config=agent_config(tmp_path))
    at = At(col, cb, "hf", {3: ("isolate", {"node": "n1"}), 4: ("reticulate", {}), 6: ("stop", {})})
    t = trainer(tmp_path, [at, cb], max_steps=40)
    t.train()
    assert t.state.global_step == 6  # stopped early, at the stop command's step
    rows = col.sql("SELECT step, attempt, loss, grad_norm, lr, step_s FROM steps WHERE run_id = 'hf' ORDER BY step")
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]  # once per step
    logged = {e["step"]: e for e in t.state.log_history if "loss" in e}
    for step, attempt, loss, grad_norm, lr, step_s in rows:
        assert attempt == 0 and loss == pytest.approx(logged[step]["loss"])
        assert grad_norm == pytest.approx(logged[step]["grad_norm"]) and lr > 0 and step_s > 0
    cmds = settled(col, "hf", ("isolate", "reticulate", "stop"))
    assert cmds["stop"]["acks"]["0"]["status"] == "done"
    assert cmds["isolate"]["status"] == "failed" and cmds["isolate"]["acks"]["0"]["status"] == "rejected"
    assert "launcher" in cmds["isolate"]["acks"]["0"]["detail"]
    assert cmds["reticulate"]["acks"]["0"]["status"] == "rejected"
    assert col.sql("SELECT status FROM runs WHERE run_id = 'hf'") == [["stopped"]]


def test_rollback_resumes_from_the_checkpoint_before_the_step_as_the_next_attempt(col, tmp_path):
    cb = LlmwatchCallback(run_id="hf-rb", url=col.url, token=col.token, config=agent_config(tmp_path))
    at = At(col, cb, "hf-rb", {10: ("rollback", {"step": 9}), 11: ("rollback", {"step": 3})})
    t = trainer(tmp_path, [at, cb], max_steps=12)
    t.train()
    assert t.state.global_step == 10
    assert cb.resume_from == str(tmp_path / "out" / "checkpoint-8")  # newest before step 9 (not 8's successor)
    t.train(resume_from_checkpoint=cb.resume_from)
    assert cb.resume_from is None and t.state.global_step == 12
    rows = col.sql("SELECT attempt, step FROM steps WHERE run_id = 'hf-rb' ORDER BY attempt, step")
    assert rows == [[0, s] for s in range(1, 11)] + [[1, s] for s in range(9, 13)]
    cmds = col.sql("SELECT count(*) FROM steps_effective WHERE run_id = 'hf-rb'")
    assert cmds == [[12]]
    got = settled(col, "hf-rb", ("rollback",))
    (first, second) = sorted((c for c in _all(col, "hf-rb") if c["kind"] == "rollback"), key=lambda c: c["id"])
    assert first["acks"]["0"]["status"] == "done" and "attempt 1" in first["acks"]["0"]["detail"]
    # step 11 of the resumed attempt: no checkpoint before step 3 (the first is step 4's): refused
    assert second["acks"]["0"]["status"] == "rejected" and "no checkpoint before step 3" in second["acks"]["0"]["detail"]
    assert got["rollback"]["id"] == second["id"]


def _all(col, run_id):
    with col.client() as c:
        return c.get(f"/v1/runs/{run_id}/commands").json()


def test_two_ranks_under_torchrun_record_every_step_and_stop_at_the_same_step(col, tmp_path):
    # rank 0 waits at step 8 until the stop has reached it: the stop lands at a step in 1..8
    out, run_id, gate = tmp_path / "w", "hf-2r", 8
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0",
            str(ROOT / "tests" / "integration" / "hf_worker.py"), "--out", str(out), "--max-steps", "40",
            "--gate-step", str(gate)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LLMWATCH_URL=col.url,
               LLMWATCH_TOKEN=col.token, LLMWATCH_RUN_ID=run_id)
    env.pop("TORCHELASTIC_RUN_ID", None)
    job = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ranks_at_work = lambda: col.sql(f"SELECT DISTINCT rank FROM steps WHERE run_id = '{run_id}'")  # noqa: E731
        assert wait_until(lambda: len(ranks_at_work()) == 2 or job.poll() is not None, 120.0, 0.1)
        post_command(col, run_id, "stop")  # mid-run: both ranks have recorded a step, rank 0 is at most at the gate
        output = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            stop_tree(job)
            job.communicate()
    assert job.returncode == 0, output[-4000:]
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(results):  # the Trainer's rank is torch.distributed's (the broadcast's source)
        assert (res["process_index"], res["world_size"]) == (r, 2) and (res["dist_rank"], res["dist_world"]) == (r, 2)
        assert res["stopped"]
    stop_step = results[0]["global_step"]
    assert 1 <= stop_step <= gate and results[1]["global_step"] == stop_step
    rows = col.sql(f"SELECT rank, step FROM steps WHERE run_id = '{run_id}' ORDER BY rank, step")
    assert rows == [[r, s] for r in (0, 1) for s in range(1, stop_step + 1)]  # once per step and rank

    def acked() -> list:
        got = col.sql(f"SELECT status, acks FROM commands WHERE run_id = '{run_id}' AND kind = 'stop'")
        return got if got and len(json.loads(got[0][1] or "{}")) == 2 else []

    assert wait_until(acked, 30.0, 0.1), col.sql(f"SELECT * FROM commands WHERE run_id = '{run_id}'")
    ((status, acks),) = acked()
    acks = json.loads(acks)
    assert status == "acked" and sorted(acks) == ["0", "1"]
    for rank in ("0", "1"):
        assert acks[rank]["status"] == "done" and acks[rank]["detail"] == f"stopped at step {stop_step}"
    assert col.sql(f"SELECT status FROM runs WHERE run_id = '{run_id}'") == [["stopped"]]
