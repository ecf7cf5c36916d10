"""A Lightning job (the DDP loop's GPT in a LightningModule, strategy "ddp" on CPU) with
llmwatch's one-line callback. Run under torchrun (Lightning takes the ranks from its
environment); faults come from the harness (faults.py, $LOOP_FAULTS)."""

import os
import sys

import torch

try:
    import lightning.pytorch as L
except ImportError:
    import pytorch_lightning as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
from ddp_gpt import GPT, VOCAB, batches  # noqa: E402
from faults import Injector  # noqa: E402

from agent.integrations.lightning import LlmwatchCallback  # noqa: E402


class Counting(torch.utils.data.IterableDataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        for x, y in batches(self.rank):
            yield from zip(x, y)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT()

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.gpt(x, y)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class Steps(L.Callback):
    def __init__(self, faults: Injector) -> None:
        self.faults = faults

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.faults.at(trainer.global_step + 1)


def main():
    torch.manual_seed(0)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    module = Module()
    faults = Injector(rank, VOCAB)
    faults.hook(module.gpt)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=int(os.environ.get("LOOP_STEPS",
                        "60")), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, callbacks=[Steps(faults), LlmwatchCallback()])
    trainer.fit(module, torch.utils.data.DataLoader(Counting(rank), batch_size=8))


if __name__ == "__main__":
    main()
