"""A real Alertmanager between the collector and a pager: an incident the NaN
detector finds in a real `collector serve` is pushed with `--alertmanager`, routed
by Alertmanager to its webhook receiver (a small server here), and so is its
resolution.

Debian's `prometheus-alertmanager` runs here as a plain process on a free
loopback port, with a temporary config and storage and clustering off. Without
the binary the test is skipped, except in CI (`$CI` set), where it fails: .ci/run
installs it."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest

from tests.integration.alert_receiver import NanRun, WebhookReceiver
from tests.polling import wait_for as wait_until
from tests.unit.collector.collector_server import CollectorProcess
from trainer.launch import free_port

pytestmark = [pytest.mark.integration]

BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


@pytest.fixture
def alertmanager_binary() -> str:
    if BINARY is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus-alertmanager is not installed (.ci/run installs it with apt-get)")
        pytest.skip("prometheus-alertmanager is not installed (apt-get install prometheus-alertmanager)")
    return BINARY


CONFIG = """\
route:
  receiver: pager
  group_by: [alertname, run_id]
  group_wait: 100ms
  group_interval: 500ms
  repeat_interval: 1h
receivers:
  - name: pager
    webhook_configs:
      - url: {url}
        send_resolved: true
"""


class Alertmanager:
    def __init__(self, binary: str, tmp_path, receiver_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp_path / "alertmanager.yml"
        config.write_text(CONFIG.format(url=receiver_url))
        self.log = open(tmp_path / "alertmanager.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"alertmanager exited with {self.proc.returncode}")
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, timeout_s, "alertmanager to be ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def test_an_incident_reaches_a_pager_through_alertmanagers_routing(tmp_path, alertmanager_binary):
    with WebhookReceiver() as pager:
        am = Alertmanager(alertmanager_binary, tmp_path, f"{pager.url}/pager")
        c = None
        run = None
        try:
            am.wait_ready()
            c = CollectorProcess(tmp_path / "c.duckdb", args=(
                "--alertmanager", am.url, "--group-min-interval-s", "0", "--group-linger-s", "0",
                "--external-url", "http://collector.example:8428",
                "--policy", "off")).start()  # the incident's alerts alone (a policy would add its action's)
            run = NanRun(c.url, c.token, run_id="paged")
            run.open_incident()
            fired = wait_until(lambda: pager.payloads("/pager"), 30, "Alertmanager's firing notification")[0]
            run.close_incident()
            resolved = wait_until(lambda: [p for p in pager.payloads("/pager") if p["status"] == "resolved"], 30,
                                  "Alertmanager's resolved notification")[0]
            rows = c.sql("SELECT receiver, kind, status FROM alert_outbox ORDER BY id")
        finally:
            if run is not None:
                run.close()
            if c is not None:
                assert c.stop() == 0
            am.stop()
    assert rows == [["alertmanager:1", "firing", "delivered"], ["alertmanager:1", "resolved", "delivered"]]
    # Alertmanager's own webhook: grouped by our route, labels as we pushed them
    assert fired["receiver"] == "pager" and fired["status"] == "firing"
    assert fired["groupLabels"] == {"alertname": "llmwatch_nan", "run_id": "paged"}
    (a,) = fired["alerts"]
    assert (a["labels"]["kind"], a["labels"]["severity"], a["labels"]["rank"]) == ("nan", "critical", "0")
    assert a["generatorURL"] == "http://collector.example:8428/v1/runs/paged/incidents"
    assert "root_cause" in a["annotations"] and a["endsAt"].startswith("0001-")  # firing: no end yet
    (r,) = resolved["alerts"]
    assert r["status"] == "resolved" and r["fingerprint"] == a["fingerprint"] and r["labels"] == a["labels"]
