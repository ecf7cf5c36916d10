"""agent.integrations.lightning.LlmwatchCallback in a real Lightning fit (a tiny module, CPU)
against a real collector: one row per step, stop, rollback to a ModelCheckpoint file."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch  # noqa: E402

from agent.integrations.lightning import LlmwatchCallback  # noqa: E402
from tests.integration.framework_run import agent_config, deliver, settled  # noqa: E402
from tests.unit.collector.collector_server import CollectorProcess  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class At(L.Callback):
    def __init__(self, col, cb, run_id, plan) -> None:
        self.col, self.cb, self.run_id, self.plan = col, cb, run_id, dict(plan)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.plan:
            kind, args = self.plan.pop(trainer.global_step)
            deliver(self.col, self.cb.agent, self.run_id, kind, args)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def fit(tmp_path, callbacks, max_steps, ckpt_path=None):
    ckpt = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(max_steps=max_steps, callbacks=[*callbacks, ckpt], accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)
    trainer.fit(Tiny(), data(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def col(tmp_path):
    c = CollectorProcess(tmp_path / "tel.duckdb").start()
    yield c
    c.stop()


def test_rows_once_per_step_and_stop(col, tmp_path):
    cb = LlmwatchCallback(run_id="pl", url=col.url, token=col.token, config=agent_config(tmp_path))
    at = At(col, cb, "pl", {3: ("isolate", {"node": "n1"}), 5: ("stop", {})})
    trainer = fit(tmp_path, [at, cb], max_steps=40)
    assert trainer.global_step == 5
    rows = col.sql("SELECT step, local_loss, grad_norm, lr, step_s FROM steps WHERE run_id = 'pl' ORDER BY step")
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5]
    assert all(loss > 0 and grad_norm > 0 and lr == pytest.approx(0.05) and step_s > 0
               for _, loss, grad_norm, lr, step_s in rows)
    cmds = settled(col, "pl", ("isolate", "stop"))
    assert cmds["stop"]["acks"]["0"]["status"] == "done"
    assert cmds["isolate"]["acks"]["0"]["status"] == "rejected" and "launcher" in cmds["isolate"]["acks"]["0"]["detail"]


def test_rollback_resumes_from_the_checkpoint_before_the_step(col, tmp_path):
    cb = LlmwatchCallback(run_id="pl-rb", url=col.url, token=col.token, config=agent_config(tmp_path))
    trainer = fit(tmp_path, [At(col, cb, "pl-rb", {10: ("rollback", {"step": 9})}), cb], max_steps=12)
    assert trainer.global_step == 10
    assert cb.resume_from is not None and "step=8" in cb.resume_from
    trainer = fit(tmp_path, [cb], max_steps=12, ckpt_path=cb.resume_from)
    assert cb.resume_from is None and trainer.global_step == 12
    rows = col.sql("SELECT attempt, step FROM steps WHERE run_id = 'pl-rb' ORDER BY attempt, step")
    assert rows == [[0, s] for s in range(1, 11)] + [[1, s] for s in range(9, 13)]
    ack = settled(col, "pl-rb", ("rollback",))["rollback"]["acks"]["0"]
    assert ack["status"] == "done" and "attempt 1" in ack["detail"]
