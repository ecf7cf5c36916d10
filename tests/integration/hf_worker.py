"""A tiny Hugging Face fit (GPT-2 built from a config, CPU): the Trainer the callback tests
use, and, run under torchrun, one rank of a multi-rank fit with the llmwatch callback.

    python -m torch.distributed.run --nproc-per-node 2 ... tests/integration/hf_worker.py \\
        --out DIR --max-steps 40 --gate-step 8

The collector comes from $LLMWATCH_URL, $LLMWATCH_TOKEN, $LLMWATCH_RUN_ID. `--gate-step G`:
at step G torch.distributed rank 0 waits (bounded) until its agent holds a command, so a
command the test posts once the fit is running lands by step G. Each rank writes
`DIR/rank-R.json`: its ranks as the Trainer and torch.distributed see them, the step the fit
ended at, and the median step time as a plain timer saw it (with `--no-callback`: the same
fit without llmwatch, the baseline of the callback's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import transformers

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent import AgentConfig  # noqa: E402
from agent.integrations.hf import LlmwatchCallback  # noqa: E402
from tests.polling import wait_until  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_trainer(out_dir, callbacks, max_steps: int, **args) -> transformers.Trainer:
    """A Trainer of a 1-layer GPT-2 on random tokens, logging every step (`args`: more
    TrainingArguments, or overrides)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    targs = dict(output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=4, logging_steps=1,
                 save_steps=4, report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                 learning_rate=1e-3)
    targs.update(args)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=transformers.TrainingArguments(**targs),
                                train_dataset=Tokens(), callbacks=callbacks)


class Gate(transformers.TrainerCallback):
    """At step `step`, before the llmwatch callback's turn, torch.distributed rank 0 waits
    until its agent's mailbox holds a command (the other ranks wait in the next collective)."""

    def __init__(self, cb: LlmwatchCallback, step: int) -> None:
        self.cb, self.step = cb, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and torch.distributed.get_rank() == 0:
            agent = self.cb.agent
            if not wait_until(lambda: agent.flush(2.0) and len(agent._mailbox) > 0, 60.0, 0.05):
                raise RuntimeError(f"no command reached rank 0 by step {self.step}")


class Timer(transformers.TrainerCallback):
    """Each step's end, by the wall clock (the first step's is left out: warm-up)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def median_step_s(self) -> float | None:
        gaps = [b - a for a, b in zip(self.ends[1:], self.ends[2:])]
        return statistics.median(gaps) if gaps else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory of the per-rank result files (and the Trainer's output)")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--gate-step", type=int, default=None, help="rank 0 waits for a command at this step")
    p.add_argument("--no-callback", action="store_true", help="the same fit without llmwatch (a timing baseline)")
    a = p.parse_args(argv)
    out = Path(a.out)
    timer = Timer()
    callbacks: list = [timer]
    cb = None
    if not a.no_callback:
        cb = LlmwatchCallback(config=AgentConfig(flush_interval_s=0.2, heartbeat_interval_s=0.5,
                                                 spool_dir=str(out / f"spool-{os.environ.get('RANK', 0)}")))
        callbacks += ([Gate(cb, a.gate_step)] if a.gate_step else []) + [cb]
    t = build_trainer(out / "trainer", callbacks, a.max_steps, save_strategy="no")
    t.train()
    dist = torch.distributed
    result = {"process_index": t.args.process_index, "world_size": t.args.world_size,
              "dist_rank": dist.get_rank() if dist.is_initialized() else None,
              "dist_world": dist.get_world_size() if dist.is_initialized() else None,
              "global_step": t.state.global_step, "stopped": bool(cb and cb.telemetry.stopped),
              "median_step_s": timer.median_step_s()}
    (out / f"rank-{t.args.process_index}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        # leave together: a rank whose gloo peers are gone at interpreter exit can abort
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
