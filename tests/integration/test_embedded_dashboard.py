"""`trainer --telemetry` starts the dashboard next to its embedded collector and prints
its URL; the dashboard answers while the run trains, and is gone when the run ends."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request

import pytest

from tests.integration.trainer_run import ROOT, TINY
from tests.polling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_the_trainer_prints_a_live_dashboard_url(tmp_path):
    run_dir = tmp_path / "emb"
    argv = [sys.executable, "-m", "trainer", "--telemetry", "--run-dir", str(run_dir), "--run-id", "emb",
            "--dp", "2", "--steps", "200", "--dashboard-port", "0", *TINY]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        assert wait_until(lambda: any(line.startswith("dashboard: http://") for line in lines), 90, 0.1), lines
        url = re.match(r"dashboard: (http://127\.0\.0\.1:\d+/)", next(x for x in lines if x.startswith("dashboard:")))
        assert url, lines
        base = url.group(1)
        with urllib.request.urlopen(base, timeout=10) as r:  # the page shell
            assert r.status == 200 and "llmwatch" in r.read().decode()
        with urllib.request.urlopen(base + "_dash-layout", timeout=10) as r:
            layout = json.loads(r.read())
        assert "live: collector http://127.0.0.1:" in json.dumps(layout)  # it reads the embedded collector
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert "telemetry: browse it afterwards: dashboard --db" in text
    assert "Traceback" not in (run_dir / "dashboard.log").read_text()
    with pytest.raises(OSError):  # stopped with the run
        urllib.request.urlopen(base + "healthz", timeout=2)
