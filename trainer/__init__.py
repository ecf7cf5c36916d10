"""The instrumented hybrid-parallel GPT trainer.

Entry points: the `trainer` command (`trainer.cli`), `trainer.launch.launch`
for the embedded launcher or torchrun, and `trainer.worker.run_worker` for one
rank. Components, each one concern: `config` (dataclasses, validation),
`parallel_dims` (the mesh), `comm` (every collective, timed), `engine` (model
shard, 1F1B, DP buckets, optimizer), `data`, `checkpoint`, `faults`, `train`
(the loop); around the ranks, `rundir` (run id and directory), `private`
(tokens and 0600 files), `lifeline` (children die with the launcher) and
`embedded` (the run's own collector). Importing this package does not import torch.
"""

from trainer.config import ConfigError, JobConfig

__all__ = ["ConfigError", "JobConfig"]
