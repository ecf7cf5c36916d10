"""The same entry point under torchrun: two elastic agents on one machine stand in for two nodes."""

import json
import os
import subprocess
import sys

import pytest

from tests.integration.trainer_run import ROOT, TINY, assert_close, run_trainer
from trainer.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_torchrun_nodes_match_the_embedded_launcher(tmp_path):
    port = free_port()
    run_dir = tmp_path / "tr"
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "llmwatch-test", "--max-restarts", "0"]
    trainer_args = ["-m", "trainer", "--dp", "2", "--tp", "2", "--steps", "4", "--micro-batches", "2",
                    "--run-dir", str(run_dir), "--metrics-jsonl", str(run_dir / "metrics.jsonl"), *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, *trainer_args],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outs)
    torchrun = {json.loads(x)["step"]: json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()}
    embedded = run_trainer(tmp_path / "emb", "--dp", "2", "--tp", "2", "--steps", "4", "--micro-batches", "2",
                           "--nodes", "2")
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    assert_close(torchrun, embedded.losses(), range(1, 5))
