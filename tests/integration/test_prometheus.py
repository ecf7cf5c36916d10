"""A real Prometheus scraping a real collector, as compose/ deploys them: GET /metrics
with the read token from a file (`authorization: credentials_file:`), a run's step
queryable from Prometheus, a scrape without the token refused (401, target down), and
the shipped rules (compose/prometheus/rules/) loaded and evaluated without error.

Debian's `prometheus` runs here as a plain process on a free loopback port with a
temporary config and storage. Without the binary the test is skipped, except in CI
(`$CI` set), where it fails: .ci/system-deps installs it."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest

from agent import wire
from agent.secrets import write_secret
from tests.polling import wait_for
from tests.unit.collector.collector_batches import make_batch, steps_section
from tests.unit.collector.collector_server import ROOT, CollectorProcess
from trainer.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BINARY = shutil.which("prometheus")
RULES = ROOT / "compose" / "prometheus" / "rules" / "llmwatch.rules.yml"
INGEST, READ = "ingest-token-for-the-prometheus-test", "read-token-for-the-prometheus-test"

CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - {rules}
scrape_configs:
  - job_name: llmwatch-collector
    authorization:
      credentials_file: {token_file}
    static_configs:
      - targets: ["127.0.0.1:{port}"]
  - job_name: no-token
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


@pytest.fixture
def prometheus_binary() -> str:
    if BINARY is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (.ci/system-deps installs it with apt-get)")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return BINARY


@pytest.fixture
def collector(tmp_path):
    files = {}
    for role, token in (("ingest", INGEST), ("read", READ)):
        files[role] = write_secret(tmp_path / f"{role}.token", token)
    c = CollectorProcess(tmp_path / "c.duckdb", token=None, args=(
        "--ingest-token-file", str(files["ingest"]), "--read-token-file", str(files["read"]),
        "--group-min-interval-s", "0", "--group-linger-s", "0", "--no-detect")).start()
    try:
        yield c, files["read"]
    finally:
        assert c.stop() == 0


@pytest.fixture
def prometheus(prometheus_binary, collector, tmp_path):
    c, read_token_file = collector
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(CONFIG.format(rules=RULES, token_file=read_token_file, port=c.port))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode}: "
                                 + (tmp_path / "prometheus.log").read_text()[-2000:])
        try:
            return api.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 20, "prometheus to be ready")
        yield api
    finally:
        api.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(api: httpx.Client, promql: str) -> list[dict]:
    r = api.get("/api/v1/query", params={"query": promql})
    assert r.status_code == 200, r.text
    return r.json()["data"]["result"]


def test_prometheus_scrapes_a_runs_step_with_the_read_token(collector, prometheus):
    c, _ = collector
    body = make_batch("prom-run", 0, 0, world_size=1, sections={wire.STEP: steps_section(
        [5, 6, 7], loss=2.5, grad_norm=1.0, local_loss=2.5, finite_fwd=1, finite_bwd=1)})
    r = httpx.post(f"{c.url}/v1/ingest", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {INGEST}", "Content-Type": wire.CONTENT_TYPE})
    assert r.status_code == 200, r.text

    step = 'llmwatch_run_step{job="llmwatch-collector", run_id="prom-run"}'
    (sample,) = wait_for(lambda: query(prometheus, step), 15, "llmwatch_run_step of the run in Prometheus")
    assert float(sample["value"][1]) == 7.0
    (loss,) = query(prometheus, 'llmwatch_run_loss{run_id="prom-run"}')
    assert float(loss["value"][1]) == 2.5
    (incidents,) = query(prometheus, 'llmwatch_run_open_incidents{run_id="prom-run"}')
    assert float(incidents["value"][1]) == 0.0
    # its wall time by cause: the batch's steps are skipped ones (steps_section's default)
    causes = {r["metric"]["cause"] for r in query(prometheus, 'llmwatch_run_goodput_seconds{run_id="prom-run"}')}
    assert causes == {"skipped"}, causes

    # the job without the token: the collector refuses it, Prometheus shows the target down
    def targets() -> dict[str, dict]:
        active = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
        out = {t["labels"]["job"]: t for t in active}
        return out if all(t["health"] != "unknown" for t in out.values()) and len(out) == 2 else {}

    by_job = wait_for(targets, 15, "both targets scraped once")
    assert by_job["llmwatch-collector"]["health"] == "up", by_job["llmwatch-collector"]["lastError"]
    assert by_job["no-token"]["health"] == "down"
    assert "401" in by_job["no-token"]["lastError"], by_job["no-token"]["lastError"]
    assert query(prometheus, 'up{job="no-token"}')[0]["value"][1] == "0"
    assert not query(prometheus, 'llmwatch_run_step{job="no-token"}')


def test_prometheus_loads_and_evaluates_the_shipped_rules(prometheus):
    def evaluated() -> dict[str, list[dict]]:
        groups = prometheus.get("/api/v1/rules").json()["data"]["groups"]
        rules = {g["name"]: g["rules"] for g in groups}
        # a rule not evaluated yet has health "unknown" and a zero time (0001-01-01...)
        done = rules and all(r["health"] != "unknown" and not r.get("lastEvaluation", "0001").startswith("0001")
                             for rs in rules.values() for r in rs)
        return rules if done else {}

    rules = wait_for(evaluated, 15, "the rules evaluated once")
    assert {g: sorted(r["name"] for r in rs) for g, rs in rules.items()} == {
        "llmwatch-recording": ["llmwatch:run_steps_per_s:deriv5m", "llmwatch:run_tokens_per_s:avg1h",
                               "llmwatch:run_tokens_per_s:avg5m"],
        "llmwatch-alerts": ["LlmwatchCollectorDown", "LlmwatchRunOpenIncident", "LlmwatchStepStalled",
                            "LlmwatchTokensPerSecondDrop"]}
    assert {(r["name"], r["health"], r.get("lastError", "")) for rs in rules.values() for r in rs} == {
        (r["name"], "ok", "") for rs in rules.values() for r in rs}
    assert {r["type"] for r in rules["llmwatch-alerts"]} == {"alerting"}
    assert {r["type"] for r in rules["llmwatch-recording"]} == {"recording"}
