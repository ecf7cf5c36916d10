"""A node's relay as a user runs it: `python -m collector serve`, `python -m collector relay
--upstream` in front of it, and real agents posting to the relay on loopback. Their rows are
stored, their commands and watermark come back through it, their clocks stay synced, a rank
with the wrong token is refused at the relay, and while the collector is down every batch
goes to the agents' spools and reaches the collector once it is back."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent import Agent, AgentConfig, wire
from tests.polling import wait_until
from tests.unit.collector.collector_server import ROOT, TOKEN, CollectorProcess

pytestmark = pytest.mark.integration


class RelayProcess:
    def __init__(self, upstream: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_")}
        env.update(PYTHONPATH=str(ROOT), LLMWATCH_TOKEN=TOKEN)
        self.proc = subprocess.Popen([sys.executable, "-m", "collector", "relay", "--upstream", upstream, "--port", "0",
                                      *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.output: list[str] = []
        for line in self.proc.stdout:
            self.output.append(line)
            if m := re.match(r"relay listening on http://127\.0\.0\.1:(\d+) ", line):
                self.port = int(m.group(1))
                break
        else:
            raise RuntimeError(f"relay exited: {''.join(self.output)}")
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, body: bytes, token: str = TOKEN) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/v1/ingest", body, {"Authorization": f"Bearer {token}",
                                                      "Content-Type": wire.CONTENT_TYPE})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def health(self) -> dict:
        import json

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/healthz")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def agent(url: str, rank: int, spool: Path) -> Agent:
    a = Agent(AgentConfig(url=url, token=TOKEN, flush_interval_s=0.2, heartbeat_interval_s=0.2, device_health=False,
                          spool_dir=str(spool / f"rank{rank}"), retry_min_s=0.1, retry_max_s=0.5),
              run_id="relayed", rank=rank, world_size=4, node="node0")
    a.start()
    return a


def test_ranks_behind_a_relay_are_stored_answered_and_kept_through_an_outage(tmp_path):
    db = tmp_path / "c.duckdb"
    col = CollectorProcess(db).start()
    relay = RelayProcess(col.url, "--linger-s", "0.5")
    agents: list[Agent] = []
    try:
        # -- batches that arrive together go up together, each answered on its own --------------
        from tests.unit.collector.collector_batches import make_batch, steps_section

        bodies = [make_batch(run_id="bundled", rank=r, batch_seq=0, sections={wire.STEP: steps_section([1])})
                  for r in range(8)]
        bodies[5] = b"LWB1" + b"\xff" * 12  # a malformed batch among them
        answers: list = [None] * 8
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, relay.post(bodies[i])))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [s for s, _ in answers] == [200] * 5 + [400] + [200] * 2
        assert b"header length" in answers[5][1]  # the collector's own reason
        assert relay.health()["bundles"] < 8  # some of the 8 shared a bundle
        assert sorted(r for (r,) in col.sql("SELECT rank FROM steps WHERE run_id = 'bundled'")) == [0, 1, 2, 3, 4, 6, 7]

        # -- the wrong token stops at the relay ----------------------------------------------------
        status, body = relay.post(make_batch(run_id="intruder", rank=0, batch_seq=0), token="not-the-token-at-all")
        assert status == 401 and b"bearer token" in body
        assert col.sql("SELECT count(*) FROM batches WHERE run_id = 'intruder'") == [[0]]

        # -- real agents: rows, commands, clocks ---------------------------------------------------
        agents = [agent(relay.url, r, tmp_path) for r in range(4)]
        for step in range(1, 21):
            for a in agents:
                a.record_step(step, loss=1.0, grad_norm=0.5)
        assert all(a.flush(30) for a in agents)
        assert col.sql("SELECT count(*) FROM steps WHERE run_id = 'relayed'") == [[80]]
        with col.client() as c:
            r = c.post("/v1/runs/relayed/commands", json={"kind": "checkpoint", "ranks": [2]})
            assert r.status_code == 201, r.text
        assert wait_until(lambda: [c.kind for c in agents[2].commands()] == ["checkpoint"], timeout_s=60)
        for a in agents:
            offset, error = a.clock_offset()
            assert error < 1.0 and abs(offset) <= error + 1e-3  # one host: the collector's clock is ours

        # -- the collector goes away: the agents spool, and replay through the relay later ----------
        port = col.port
        col.stop()
        for step in range(21, 41):
            for a in agents:
                a.record_step(step, loss=1.0, grad_norm=0.5)
        assert wait_until(lambda: all(a.stats()["batches"]["spooled"] > 0 for a in agents), timeout_s=60)
        col = CollectorProcess(db, port=port).start()
        assert all(a.flush(60) for a in agents)
        assert col.sql("SELECT count(DISTINCT (rank, step)) FROM steps WHERE run_id = 'relayed'") == [[160]]
        assert relay.health()["failed_bundles"] > 0
    finally:
        for a in agents:
            a.close(timeout_s=5)
        relay.stop()
        col.stop()
