"""The agent against an HTTPS collector stand-in with a certificate made at test time.

The certificate is self-signed for 127.0.0.1 (openssl on the command line: the
`cryptography` package is not a dependency), so it is its own CA file. With
`ca_file` the agent verifies it and delivers; without, the system's trust store
does not know it: every POST fails the handshake, batches go to the spool, and
nothing raises. `agent.replay --ca-file` then ships that spool.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import subprocess

import pytest

from agent import Agent, AgentConfig, replay
from tests.integration.test_agent_transport import FakeCollector, _step

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("needs the openssl command: .ci/system-deps --require installs it in CI")
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")
    cert_file, key_file = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key_file, "-out", cert_file, "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert_file, key_file


@pytest.fixture
def https_collector(cert):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*cert)
    server = FakeCollector(ssl_context=ctx)
    yield server
    server.close()


def _config(url: str, tmp_path, **kw) -> AgentConfig:
    return AgentConfig(url=url, token="tok", flush_interval_s=60.0, heartbeat_interval_s=60.0,
                       spool_dir=str(tmp_path), capacity=64, timeout_s=2.0, **kw)


def test_with_the_ca_file_the_agent_verifies_the_collector_and_delivers(https_collector, cert, tmp_path):
    assert https_collector.url.startswith("https://")
    agent = Agent(_config(https_collector.url, tmp_path, ca_file=cert[0]), run_id="tls", rank=0)
    for step in range(3):
        _step(agent, step)
        assert agent.flush(5.0)
    agent.close()
    assert [r["step"] for r in https_collector.rows("step")] == [0, 1, 2]
    assert agent.stats()["batches"]["spooled"] == 0


def test_an_untrusted_certificate_fails_spools_and_replays_later_with_the_ca_file(https_collector, cert, tmp_path,
                                                                                  caplog, monkeypatch):
    agent = Agent(_config(https_collector.url, tmp_path), run_id="tls2", rank=0)  # the system's trust store
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        for step in range(3):
            _step(agent, step)
            assert not agent.flush(2.0)
        stats = agent.stats()
        agent.close()
    assert "CERTIFICATE_VERIFY_FAILED" in stats["last_error"]
    assert stats["batches"]["spooled"] == 3 and stats["batches"]["sent"] == 0
    assert https_collector.rows("step") == []
    assert any("left in the spool" in r.getMessage() for r in caplog.records)

    monkeypatch.setenv("LLMWATCH_TOKEN", "tok")
    assert replay.main([str(tmp_path), "--url", https_collector.url]) == 1  # still untrusted: kept
    assert replay.main([str(tmp_path), "--url", https_collector.url, "--ca-file", cert[0]]) == 0
    assert [r["step"] for r in https_collector.rows("step")] == [0, 1, 2]


def test_a_ca_file_that_cannot_be_read_is_logged_and_batches_spool(https_collector, tmp_path, caplog):
    missing = str(tmp_path / "no-such-ca.pem")
    agent = Agent(_config(https_collector.url, tmp_path / "spool", ca_file=missing), run_id="tls3", rank=0)
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        _step(agent, 0)
        assert not agent.flush(1.0)
        agent.close()
    assert any("cannot load the CA file" in r.getMessage() and missing in r.getMessage() for r in caplog.records)
    assert agent.stats()["batches"]["spooled"] == 2  # the step's batch, then close()'s agent_closed event
    assert replay.main([str(tmp_path / "spool"), "--url", https_collector.url, "--token", "tok",
                        "--ca-file", missing]) == 2
