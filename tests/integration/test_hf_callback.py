"""agent.integrations.hf.LlmwatchCallback in a real transformers Trainer (a tiny GPT-2 built
from a config, CPU) against a real collector: one row per step, stop, rollback, isolate."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from agent.integrations.hf import LlmwatchCallback  # noqa: E402
from tests.integration.framework_run import agent_config, deliver, settled  # noqa: E402
from tests.unit.collector.collector_server import CollectorProcess  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class At(transformers.TrainerCallback):
    """At step `step` (before the llmwatch callback's turn), deliver a command to its agent."""

    def __init__(self, col, cb, run_id, plan: dict[int, tuple[str, dict]]) -> None:
        self.col, self.cb, self.run_id, self.plan = col, cb, run_id, dict(plan)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.plan:
            kind, cmd_args = self.plan.pop(state.global_step)
            deliver(self.col, self.cb.agent, self.run_id, kind, cmd_args)


def trainer(tmp_path, callbacks, max_steps: int):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=4, logging_steps=1,
        save_steps=4, report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(),
                                callbacks=callbacks)


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
