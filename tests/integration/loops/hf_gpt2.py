"""A Hugging Face `Trainer` job (a tiny GPT-2 from a config, random init, local data) with
llmwatch's one-line callback, as the README shows it. Run under torchrun; faults come from
the harness (faults.py, $LOOP_FAULTS), the collector from $LLMWATCH_URL/_TOKEN/_RUN_ID."""

import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
from faults import Injector  # noqa: E402

from agent.integrations.hf import LlmwatchCallback  # noqa: E402

VOCAB, SEQ = 64, 32


class Counting(torch.utils.data.Dataset):
    """Counting sequences mod VOCAB: a curve that falls within a few dozen steps."""

    def __init__(self, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Steps(transformers.TrainerCallback):
    def __init__(self, faults: Injector) -> None:
        self.faults = faults

    def on_step_begin(self, args, state, control, **kwargs):
        self.faults.at(state.global_step + 1)


def main():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=SEQ)
    model = transformers.GPT2LMHeadModel(cfg)
    faults = Injector(int(os.environ.get("RANK", 0)), VOCAB)
    faults.hook(model)
    args = transformers.TrainingArguments(
        output_dir=os.environ.get("LOOP_OUT", "/tmp/hf-loop"), max_steps=int(os.environ.get("LOOP_STEPS", "60")),
        per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Counting(),
                                   callbacks=[Steps(faults), LlmwatchCallback()])
    trainer.train()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
