"""One real run with known injected faults, shared by the postmortem tests.

    run = faulted_run()        # the first call trains (~20 s on 2 cores), later calls reuse it
    run.db, run.truth_path, run.run_id

`trainer --telemetry` on dp=2 x tp=2 over two simulated nodes (ranks 0, 1 on node0;
2, 3 on node1), fp16 with dynamic loss scaling, checkpoints every 10 steps, and:

- a straggler: rank 3 (node1) computes 3x slower from step 10 to the end;
- a transient NaN: rank 1's activations at step 25, once (not tied to the data): every
  rank skips that step's optimizer update and the loss scale halves; training goes on.

With `--policy off`: the run keeps its one lineage (no rollback, no isolation), as a
run under a team that only wants the pages would.

The run directory is named `demo`, the run id the docs/postmortem.md queries use, so
they run here verbatim. What was injected is `injections.jsonl` (the truth); the test
modules assert against FAULTS below, which says the same thing.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.integration.trainer_run import Run, run_trainer

RUN_ID = "demo"
NUM_STEPS = 40
STRAGGLER = {"rank": 3, "node": "node1", "from_step": 10}
NAN = {"rank": 1, "node": "node0", "step": 25}
CHECKPOINT_EVERY = 10
WORLD_SIZE = 4


@dataclass(frozen=True)
class FaultedRun:
    run: Run
    run_id: str
    db: Path
    truth_path: Path


@functools.cache
def faulted_run() -> FaultedRun:
    root = Path(tempfile.mkdtemp(prefix="llmwatch-faulted-"))
    atexit.register(shutil.rmtree, root, True)
    run_dir = root / RUN_ID
    r = run_trainer(run_dir, "--telemetry", "--dp", "2", "--tp", "2", "--nodes", "2", "--steps", str(NUM_STEPS),
                    "--micro-batches", "2", "--precision", "fp16",
                    "--inject", f"straggler@rank={STRAGGLER['rank']},from={STRAGGLER['from_step']},factor=3",
                    "--inject", f"nan@step={NAN['step']},rank={NAN['rank']},mode=transient",
                    "--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", str(CHECKPOINT_EVERY),
                    "--policy", "off")  # detected and alerted, not healed: what the cookbook's queries read
    assert r.returncode == 0, r.stderr[-3000:]
    db = run_dir / "telemetry.duckdb"
    assert db.exists(), r.stdout[-2000:]
    return FaultedRun(run=r, run_id=RUN_ID, db=db, truth_path=run_dir / "injections.jsonl")
