"""`LlmwatchCallback`: the agent in a Lightning `Trainer` (`lightning.pytorch`, or
`pytorch_lightning` when only that is installed).

    from agent.integrations.lightning import LlmwatchCallback

    cb = LlmwatchCallback(run_id="my-run")        # collector: $LLMWATCH_URL, $LLMWATCH_TOKEN(_FILE)
    trainer = L.Trainer(max_steps=1000, callbacks=[cb, ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model, data)
    while cb.resume_from:                         # a rollback command stopped the fit
        trainer = L.Trainer(max_steps=1000, callbacks=[cb, ModelCheckpoint(every_n_train_steps=100)])
        trainer.fit(model, data, ckpt_path=cb.resume_from)

One row per optimizer step (`trainer.global_step`, 1 for the first) and rank
(`trainer.global_rank` of `trainer.world_size`): `local_loss` from what
`training_step` returned (this rank's own; its `.item()` is a host sync per
step, like `self.log(..., prog_bar=True)`; `loss`, the global one, stays NULL), `grad_norm` the total 2-norm of the gradients
before clipping (`on_before_optimizer_step`), `lr` of the first optimizer's first
group, `step_s` the wall time since the previous step ended. The LightningModule
and the first optimizer are watched as `agent.watch` does (a probe: phases, the
local loss and finiteness), and every collective comes from torch's Flight
Recorder (agent/flight.py).

Commands (agent/integrations/_common.py): `stop` sets `trainer.should_stop`;
`rollback` stops the fit and names in `resume_from` the newest ModelCheckpoint
file (named with `step=N`, as its default filename is) of a step before the
command's `step`; the fit resumed from it is the next attempt. `checkpoint` is
refused: ModelCheckpoint decides when to save.
"""

from __future__ import annotations

from pathlib import Path

try:
    from lightning.pytorch import Callback
except ImportError:  # only the older package name is installed
    from pytorch_lightning import Callback

from agent.integrations._common import Telemetry, TelemetryCallback, step_of_name


def lightning_checkpoints(trainer) -> list[tuple[int, str]]:
    """(N, path) of the `.ckpt` files named `...step=N...` in the ModelCheckpoint directories."""
    out = []
    for cb in getattr(trainer, "checkpoint_callbacks", ()):
        dirpath = getattr(cb, "dirpath", None)
        if not dirpath or not Path(dirpath).is_dir():
            continue
        for p in Path(dirpath).glob("*.ckpt"):
            n = step_of_name(p.stem)
            if n is not None:
                out.append((n, str(p)))
    return out


class LlmwatchCallback(TelemetryCallback, Callback):
    """Telemetry and control for one rank of a Lightning fit (arguments as
    `agent.integrations.hf.LlmwatchCallback`)."""

    def __init__(self, *, agent=None, run_id: str | None = None, node: str | None = None, url: str | None = None,
                 token: str | None = None, token_file: str | None = None, config=None) -> None:
        super().__init__()
        self.telemetry = Telemetry(framework="lightning", agent=agent, run_id=run_id, node=node, url=url,
                                   token=token, token_file=token_file, config=config)
        self._grad_norm = None  # a 0-dim tensor: read at the step's end, with the loss
        self._recorded_step = -1

    def on_train_start(self, trainer, pl_module):
        # after the checkpoint restore: global_step is the resumed one
        self._recorded_step = trainer.global_step
        self.telemetry.begin_fit(rank=trainer.global_rank, world_size=trainer.world_size, step=trainer.global_step,
                                 config={"max_steps": trainer.max_steps})
        self.telemetry.attach(pl_module, trainer.optimizers[0] if trainer.optimizers else None,
                              step=trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.telemetry.step_started()
        if self.telemetry.probe is not None:
            self.telemetry.probe.align(trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        import torch

        grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
        self._grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) \
            if grads else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step <= self._recorded_step:  # a micro-batch inside gradient accumulation
            return
        self._recorded_step = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        grad_norm, self._grad_norm = self._grad_norm, None
        lr = None
        if trainer.optimizers:
            lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        # what training_step returned is this rank's own loss (a global one would take a
        # collective): local_loss; the read side draws the mean over the ranks as the curve
        self.telemetry.record(step, local_loss=None if loss is None else float(loss.detach()),  # host sync
                              grad_norm=None if grad_norm is None else float(grad_norm),
                              lr=lr, step_s=self.telemetry.step_time())
        decision = self.telemetry.boundary(step, checkpoints=lambda: lightning_checkpoints(trainer))
        if decision.stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        self.telemetry.end_fit(trainer.global_step)

    def close(self) -> None:
        self.telemetry.close()
