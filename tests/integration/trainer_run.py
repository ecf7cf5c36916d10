"""Run the real `trainer` command in a subprocess and read what it left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "4", "--d-model", "64", "--heads", "4", "--seq-len", "32",
        "--micro-batch-size", "2", "--precision", "fp32", "--no-progress"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics()}

    def injections(self) -> list[dict]:
        path = self.run_dir / "injections.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run_trainer(run_dir: Path, *args: str, timeout: float = 240, tiny: bool = True, env: dict | None = None) -> Run:
    run_dir = Path(run_dir)
    argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--run-id", run_dir.name,
            "--metrics-jsonl", str(run_dir / "metrics.jsonl"), *(TINY if tiny else []), *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    full_env.update(env or {})
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def assert_close(a: dict[int, float], b: dict[int, float], steps, rel: float = 1e-5) -> None:
    for s in steps:
        assert s in a and s in b, f"step {s} missing: {sorted(a)} vs {sorted(b)}"
        assert abs(a[s] - b[s]) <= rel * abs(b[s]), f"step {s}: {a[s]!r} vs {b[s]!r} (rel {abs(a[s]-b[s])/abs(b[s]):.2e})"
