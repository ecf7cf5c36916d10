"""`LlmwatchCallback`: the agent in a Hugging Face `transformers.Trainer`.

    from agent.integrations.hf import LlmwatchCallback

    cb = LlmwatchCallback(run_id="my-run")        # collector: $LLMWATCH_URL, $LLMWATCH_TOKEN(_FILE)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    while cb.resume_from:                         # a rollback command stopped the fit
        trainer.train(resume_from_checkpoint=cb.resume_from)

One row per optimizer step (`state.global_step`, 1 for the first) and rank
(`args.process_index` of `args.world_size`): `lr` from the scheduler, `step_s`
the wall time since the previous step ended (data, logging and saving included),
and `loss` and `grad_norm` where the Trainer logs them (every `logging_steps`: its
loss is the mean over the logging window); NULL on the other steps. The Trainer
calls `on_step_end` before `on_log` of the same step, so a step is held until its
log (or the next step's end, or the fit's) and recorded exactly once.
The model and optimizer are watched as `agent.watch` does (a probe: the row gains
`fwd_s`, `bwd_s`, `opt_s`, `data_s`, the rank's `local_loss` and finiteness), and
every collective (DDP's bucket all-reduces, FSDP's gathers) comes from torch's
Flight Recorder: the straggler and hang detectors name ranks in a Trainer job too.

Commands (agent/integrations/_common.py): `stop` sets
`control.should_training_stop` (and `should_save` unless `save_strategy` is
"no"); `checkpoint` sets `should_save`; `rollback` stops the fit and names in
`resume_from` the newest `output_dir/checkpoint-N` (with its trainer_state.json)
of a step before the command's `step`; the fit resumed from it is the next attempt.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from agent.integrations._common import Telemetry, TelemetryCallback

_HELD = ("loss", "grad_norm", "lr")


def hf_checkpoints(output_dir: str | None) -> list[tuple[int, str]]:
    """The complete `checkpoint-N` directories under `output_dir`: (N, path)."""
    if not output_dir or not Path(output_dir).is_dir():
        return []
    out = []
    for p in Path(output_dir).glob("checkpoint-*"):
        n = p.name.removeprefix("checkpoint-")
        if n.isdigit() and (p / "trainer_state.json").is_file():
            out.append((int(n), str(p)))
    return out


class LlmwatchCallback(TelemetryCallback, TrainerCallback):
    """Telemetry and control for one rank of a `transformers.Trainer`.

    `agent`: an `agent.Agent` to record into (yours to close); else one is made at
    the first fit from `run_id`, `url`, `token`/`token_file` (default $LLMWATCH_URL,
    $LLMWATCH_TOKEN / $LLMWATCH_TOKEN_FILE, $LLMWATCH_RUN_ID), `node` (default the
    host name) and `config` (an `AgentConfig`), and closed when the last fit ends."""

    def __init__(self, *, agent=None, run_id: str | None = None, node: str | None = None, url: str | None = None,
                 token: str | None = None, token_file: str | None = None, config=None) -> None:
        self.telemetry = Telemetry(framework="transformers", agent=agent, run_id=run_id, node=node, url=url,
                                   token=token, token_file=token_file, config=config)
        self._held: dict | None = None  # the step waiting for its log: {"step", "step_s", "lr", ...}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._held = None
        self.telemetry.begin_fit(rank=args.process_index, world_size=args.world_size, step=state.global_step,
                                 config={"max_steps": state.max_steps, "logging_steps": args.logging_steps,
                                         "output_dir": args.output_dir})
        if model is not None:
            self.telemetry.attach(model, optimizer, step=state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.telemetry.step_started()
        if self.telemetry.probe is not None:
            self.telemetry.probe.align(state.global_step)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self._release()
        lr = None
        if lr_scheduler is not None:
            try:
                lr = float(lr_scheduler.get_last_lr()[0])
            except (AttributeError, IndexError, TypeError, ValueError):
                lr = None
        self._held = {"step": state.global_step, "step_s": self.telemetry.step_time(), "lr": lr}
        decision = self.telemetry.boundary(state.global_step, checkpoints=lambda: hf_checkpoints(args.output_dir),
                                           can_save=getattr(args.save_strategy, "value", args.save_strategy) != "no")
        if decision.stop:
            control.should_training_stop = True
        if decision.save:
            control.should_save = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        held = self._held
        if held is None or not logs or state.global_step != held["step"]:
            return
        for key, name in (("loss", "loss"), ("grad_norm", "grad_norm"), ("learning_rate", "lr")):
            value = logs.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                held[name] = float(value)
        if "loss" in logs:  # the training log of this step (not an eval's or the final summary's)
            self._release()

    def on_train_end(self, args, state, control, **kwargs):
        self._release()
        self.telemetry.end_fit(state.global_step)

    def close(self) -> None:
        """Close the agent this callback made (at the end of a script that may resume)."""
        self.telemetry.close()

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            step = held.pop("step")
            self.telemetry.record(step, **held)
