"""Callbacks that put the agent into a framework's own training loop, each in an
optional extra, imported only by name (`import agent` never loads a framework):

- `agent.integrations.hf.LlmwatchCallback`: a Hugging Face transformers
  `TrainerCallback` (extra `hf`);
- `agent.integrations.lightning.LlmwatchCallback`: a Lightning `Callback`
  (extra `lightning`; `pytorch_lightning` when only that is installed).

Both record loss, grad norm, lr and step time per rank and honour the
collector's stop and rollback commands (agent/integrations/_common.py;
docs/integrations.md).
"""
