"""The harness's fault injection for the foreign loops (not the loops' own code): $LOOP_FAULTS
holds "kind:rank=R,step=S[,ms=M];...", and each loop script calls `inject(...)` with hooks
of its framework. Kinds:

  straggler  rank R's forward is M ms slower from step S (a slow device);
  hang       rank R sleeps forever before the forward of step S;
  nan        rank R's loss is NaN at step S;
  noise      rank R's batch at step S is random tokens (a poisoned batch on one replica).

What each rank was given goes to $LOOP_TRUTH.rank<R> (JSON lines); llmwatch never reads it.
"""

import json
import math
import os
import time

import torch


def mine(rank: int) -> dict[str, dict[str, int]]:
    out = {}
    for spec in filter(None, os.environ.get("LOOP_FAULTS", "").split(";")):
        kind, _, args = spec.partition(":")
        kv = {k: int(v) for k, v in (a.split("=") for a in args.split(",") if a)}
        if kv.get("rank", -1) == rank:
            out[kind] = kv
    truth = os.environ.get("LOOP_TRUTH")
    if truth and out:
        with open(f"{truth}.rank{rank}", "w") as f:
            for kind, kv in out.items():
                f.write(json.dumps({"kind": kind, **kv}) + "\n")
    return out


class Injector:
    """Faults of one rank, driven by the loop's step count (`at(step)` before each step)
    and a forward pre/post hook pair on the module whose forward makes the loss."""

    def __init__(self, rank: int, vocab: int) -> None:
        self.faults, self.vocab, self.step = mine(rank), vocab, 0

    def at(self, step: int) -> None:
        self.step = step
        hang = self.faults.get("hang")
        if hang and step == hang["step"]:
            while True:
                time.sleep(1.0)

    def hook(self, module: torch.nn.Module) -> None:
        """`module` makes the loss: its inputs are poisoned and its loss made NaN here; the
        straggler's sleep is in its first child, inside its forward (a slow device, not a
        slow data loader)."""
        module.register_forward_pre_hook(self._pre, with_kwargs=True)
        module.register_forward_hook(self._post)
        next(iter(module.children())).register_forward_pre_hook(self._slow)

    def _slow(self, module, args):
        slow = self.faults.get("straggler")
        if slow and self.step >= slow["step"]:
            time.sleep(slow.get("ms", 40) / 1e3)

    def _pre(self, module, args, kwargs):
        noise = self.faults.get("noise")
        if noise and self.step == noise["step"]:
            def rand(t):
                return torch.randint(0, self.vocab, t.shape) if isinstance(t, torch.Tensor) else t
            return (tuple(rand(a) for a in args),
                    {k: rand(v) if k in ("input_ids", "labels") else v for k, v in kwargs.items()})
        return None

    def _post(self, module, args, output):
        nan = self.faults.get("nan")
        if nan and self.step == nan["step"]:
            if isinstance(output, torch.Tensor):
                return output * math.nan
            if isinstance(output, tuple):
                return tuple(t * math.nan if isinstance(t, torch.Tensor) and t.dim() == 0 else t for t in output)
            if getattr(output, "loss", None) is not None:
                output["loss"] = output["loss"] * math.nan
            elif isinstance(output, dict) and "loss" in output:
                output["loss"] = output["loss"] * math.nan
        return output
