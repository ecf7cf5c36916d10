"""Each injected fault has its real effect (the rules never see the ground truth; tests do)."""

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.trainer_run import ROOT, TINY, run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_spike_raises_loss_and_grad_norm(tmp_path):
    r = run_trainer(tmp_path / "run", "--steps", "22", "--inject", "spike@step=20")
    assert r.returncode == 0, r.stderr[-3000:]
    m = {x["step"]: x for x in r.metrics()}
    assert m[20]["loss"] > 1.3 * m[19]["loss"]
    assert m[20]["grad_norm"] > 2 * m[19]["grad_norm"]
    assert [i["step"] for i in r.injections()] == [20]


def test_fp16_nan_skips_the_step_and_halves_the_scale(tmp_path):
    r = run_trainer(tmp_path / "run", "--steps", "4", "--precision", "fp16", "--dp", "2",
                    "--inject", "nan@step=3,rank=1")
    assert r.returncode == 0, r.stderr[-3000:]
    m = {x["step"]: x for x in r.metrics()}
    assert m[3]["skipped"] and not m[2]["skipped"] and not m[4]["skipped"]
    assert not math.isfinite(m[3]["loss"]) or not math.isfinite(m[3]["grad_norm"])
    assert m[3]["loss_scale"] == m[2]["loss_scale"] / 2
    assert math.isfinite(m[4]["loss"])


def test_crash_kills_a_rank_and_the_launcher_stops_the_rest(tmp_path):
    t0 = time.monotonic()
    r = run_trainer(tmp_path / "run", "--steps", "20", "--dp", "2", "--inject", "crash@rank=1,step=3")
    assert r.returncode != 0
    assert "rank 1 exited with code 17" in r.stderr
    assert time.monotonic() - t0 < 120  # not the process-group timeout
    assert max(x["step"] for x in r.metrics()) <= 3


def test_hang_stops_a_rank_entering_collectives(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--metrics-jsonl",
            str(run_dir / "metrics.jsonl"), *TINY, "--steps", "50", "--dp", "2", "--inject", "hang@rank=1,step=3"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        truth = run_dir / "injections.jsonl"
        deadline = time.monotonic() + 120
        while not truth.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert truth.exists(), "hang never fired"
        time.sleep(5)
        assert proc.poll() is None, "a hung job must not finish"
        steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        assert len(steps) == 2  # steps 1 and 2 completed, step 3 never does
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
