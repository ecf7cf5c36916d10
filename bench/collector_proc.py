"""A real `collector serve` for the benchmarks, and what /proc says about it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def start_collector(root: Path, db: Path, token: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`python -m collector serve` of the checkout `root` on a free loopback port, the
    token in its environment; returns the process and its URL once it listens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_")}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", LLMWATCH_TOKEN=token)
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--db", str(db), "--port", "0", *extra],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        m = re.search(r"listening on (https?://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("the collector did not start")
