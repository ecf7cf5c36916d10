"""The gates `make test` runs over the tree: ruff (pyflakes, import order, imports at the
top: pyproject.toml [tool.ruff]) and DESIGN.md's import direction (tests/import_rules.py).
Each is shown failing on a planted violation, so a gate that passes is one that looked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.import_rules import ROOT, violations


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_ruff_passes_over_the_tree():
    r = _ruff(".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_fails_on_a_planted_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nx = 1\nimport json\n\n\ndef f():\n    unused = 2\n")
    r = _ruff("--config", str(ROOT / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert r.returncode == 1, r.stdout
    for code in ("F401", "I001", "E402", "F841"):
        assert code in r.stdout, (code, r.stdout)


def test_the_import_direction_of_design_md_holds():
    found = violations()
    assert found == [], "\n".join(map(str, found))


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_import_direction_fails_on_planted_violations(tmp_path):
    _plant(tmp_path, {
        # fine: the standard library at the top, torch inside a function, a bridge's own framework
        "agent/ok.py": """
            import os
            import threading

            def f():
                import torch
                return torch, os, threading
            """,
        "agent/integrations/hf.py": "from transformers import TrainerCallback\n",
        "analysis/ok.py": "import math\nimport numpy as np\n\ndef f(now):\n    return math.floor(now) + np.pi\n",
        "trainer/ok.py": "import torch\nfrom agent import Agent\n",
        "collector/ok.py": "import duckdb\nfrom analysis import Analyzer\n",
        # planted
        "agent/heavy.py": """
            import numpy

            def g():
                import polars
                return polars
            """,
        "agent/ours.py": "def h():\n    from collector import read\n    return read\n",
        "analysis/impure.py": """
            import time
            import duckdb
            from datetime import datetime
            from threading import Thread

            def f():
                return time.monotonic(), datetime.now()
            """,
        "trainer/peek.py": "from collector.read.queries import steps\n",
        "collector/up.py": "def f():\n    import dashboard.app\n",
    })
    found = violations(tmp_path)
    assert {v.path for v in found} == {"agent/heavy.py", "agent/ours.py", "analysis/impure.py", "trainer/peek.py",
                                       "collector/up.py"}, found
    rules = "\n".join(v.rule for v in found)
    for expected in ("agent imports numpy at module level", "agent imports polars", "agent imports collector",
                     "analysis imports duckdb", "analysis imports threading", "analysis reads a clock (time.monotonic)",
                     "analysis reads a clock (datetime.now)", "trainer imports collector.read.queries",
                     "collector imports dashboard.app"):
        assert expected in rules, (expected, rules)
