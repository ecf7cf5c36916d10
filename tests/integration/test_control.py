"""The control channel: a command posted to the collector reaches every rank and is carried out once."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import duckdb
import pytest

from tests.integration.trainer_run import ROOT, TINY
from tests.unit.collector.collector_server import CollectorProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def api(col, method, path, body=None):
    req = urllib.request.Request(col.url + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {col.token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_checkpoint_then_stop_commands(tmp_path):
    db = tmp_path / "tel.duckdb"
    run_dir = tmp_path / "run"
    col = CollectorProcess(db).start()
    try:
        argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--run-id", "ctl",
                "--metrics-jsonl", str(run_dir / "metrics.jsonl"), *TINY, "--steps", "400", "--dp", "2",
                "--ckpt-dir", str(tmp_path / "ckpt"), "--telemetry", "--collector", col.url, "--token", col.token,
                "--inject", "straggler@rank=0,from=1,factor=6"]
        proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                rows = api(col, "POST", "/v1/sql", {"sql": "SELECT count(*) FROM steps WHERE run_id = 'ctl'"})["rows"]
                if rows[0][0] >= 10:
                    break
                time.sleep(0.2)
            ckpt = api(col, "POST", "/v1/runs/ctl/commands", {"kind": "checkpoint"})
            api(col, "POST", "/v1/runs/ctl/commands", {"kind": "reticulate"})
            time.sleep(2)
            stop = api(col, "POST", "/v1/runs/ctl/commands", {"kind": "stop"})
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err[-3000:]
        assert "stop requested by the collector" in out
        time.sleep(1)
        cmds = {c["kind"]: c for c in api(col, "GET", "/v1/runs/ctl/commands")}
    finally:
        col.stop()
    last_step = max(json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert last_step < 400
    # both ranks carried out checkpoint and stop, and refused the unknown command
    assert cmds["checkpoint"]["status"] == "acked" and cmds["stop"]["status"] == "acked"
    assert {a["status"] for a in cmds["reticulate"]["acks"].values()} == {"rejected"}
    assert set(cmds["stop"]["acks"]) == {"0", "1"}
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert len(steps) == 2 and steps[-1] == last_step  # one on command, one at the stop
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT status FROM runs WHERE run_id = 'ctl'").fetchone() == ("stopped",)
    con.close()
    assert ckpt["id"] != stop["id"]
