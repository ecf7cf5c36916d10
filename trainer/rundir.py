"""A run's identity and its directory.

The run id names the run in every table and, by default, its directory
(`runs/<run id>`). Two jobs must never share one, and the ranks of one job
must all use the same one, including after an elastic restart:

- the embedded launcher makes the id before it starts any rank;
- under torchrun, the rendezvous id (`--rdzv-id`, or the uuid `--standalone`
  makes) is the job's id by torchrun's own contract. torchrun's default is the
  literal `none`, which every job shares, so it counts as no id: then rank 0
  makes one and the others read it from the rendezvous store (`agree_run_id`).

The run directory holds the run's telemetry, spool and token files, so it is
private to its owner (0700).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from trainer.config import JobConfig
from trainer.private import is_private, private_dir

RUN_ID_KEY = "llmwatch/run_id"
TORCHRUN_DEFAULT_RUN_ID = "none"  # torch.distributed.run's --rdzv-id default
# What a directory a trainer made holds: an existing directory with one of these
# (or an empty one) is ours to make private.
_RUN_DIR_MARKERS = ("config.json", "metrics.jsonl", "telemetry.duckdb", "tokens", "spool", "injections.jsonl")


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def torchrun_run_id(environ: Mapping[str, str]) -> str | None:
    """The job id torchrun gave the ranks, or None when it gave none (`none`)."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    return run_id if run_id and run_id != TORCHRUN_DEFAULT_RUN_ID else None


def agree_run_id(store, *, rank: int, propose: Callable[[], str] = new_run_id) -> str:
    """The job's run id, the same on every rank: rank 0 proposes one, the first
    proposal stored wins, the other ranks wait for it.

    `store` is the job's c10d store (the one the process group is built on; the
    key is outside the group's prefix). Under torchrun that store is served by the
    agent of node 0 and outlives the worker processes, so after an elastic restart
    (a new round, the same store) rank 0's `compare_set` finds the id already there
    and the job keeps it, and with it its directory, fault state and checkpoints'
    lineage (the attempt counter comes back with the checkpoint).
    The store is lost only when node 0's agent itself goes, or with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the workers host it then): a restart
    then starts a new run id. Pass `--run-id` (or `--rdzv-id`) where that matters.
    """
    if rank == 0:
        value = store.compare_set(RUN_ID_KEY, "", propose())  # "" expected: set only if absent
    else:
        value = store.get(RUN_ID_KEY)  # blocks until rank 0 has set it (the store's timeout)
    return value.decode() if isinstance(value, bytes) else str(value)


def prepare_run(cfg: JobConfig) -> Path:
    """Fill in the run dir (the run id must be known), create it 0700.

    An existing directory is tightened to 0700 only when it is empty or holds a
    previous run's files: `--run-dir` may name a directory the user shares with
    others, and changing its mode would take their access away. The secrets are
    safe either way, in `tokens/` (0700) and 0600 files; the note says what is not."""
    if not cfg.run_id:
        raise ValueError("prepare_run needs the run id")
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / cfg.run_id)
    run_dir = Path(cfg.run_dir)
    ours = not run_dir.exists() or (run_dir.is_dir() and (
        not any(run_dir.iterdir()) or any((run_dir / m).exists() for m in _RUN_DIR_MARKERS)))
    if ours and run_dir.exists() and run_dir.stat().st_uid != os.getuid():
        ours = False  # someone else's: chmod would fail anyway
    private_dir(run_dir, tighten_existing=ours)
    if not is_private(run_dir) and int(os.environ.get("RANK", "0")) == 0:
        print(f"trainer: note: {run_dir} is readable by others (mode {run_dir.stat().st_mode & 0o777:o}); "
              "its telemetry and spool are too", file=sys.stderr, flush=True)
    return run_dir
