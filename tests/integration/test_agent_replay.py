"""`python -m agent.replay`: where the token comes from, and what is replayed."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from agent import Agent, AgentConfig, replay
from tests.integration.test_agent_transport import FakeCollector, _step
from tests.integration.trainer_run import ROOT

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spool_steps(spool_dir, steps) -> None:
    """An agent whose collector is away leaves `steps` in `spool_dir`, one batch each."""
    cfg = AgentConfig(url=f"http://127.0.0.1:{_closed_port()}", token="tok", spool_dir=str(spool_dir),
                      capacity=64, timeout_s=0.5)
    agent = Agent(cfg, run_id="replayed", rank=0)
    for step in steps:
        _step(agent, step)
        agent.flush(0.5)
    agent.close(timeout_s=0.5)


@pytest.fixture
def collector():
    server = FakeCollector()
    yield server
    server.close()


def test_token_from_the_environment(collector, tmp_path, monkeypatch):
    _spool_steps(tmp_path / "rank00000", [0, 1])
    monkeypatch.setenv("LLMWATCH_TOKEN", "tok")
    assert replay.main([str(tmp_path), "--url", collector.url]) == 0
    assert [r["step"] for r in collector.rows("step")] == [0, 1] and collector.num_unauthorized == 0


def test_token_from_a_file_wins_over_the_environment(collector, tmp_path, monkeypatch):
    _spool_steps(tmp_path / "spool", [0])
    token_file = tmp_path / "token"
    token_file.write_text("tok\n")
    monkeypatch.setenv("LLMWATCH_TOKEN", "not-the-token")
    assert replay.main([str(tmp_path / "spool"), "--url", collector.url, "--token-file", str(token_file)]) == 0
    assert [r["step"] for r in collector.rows("step")] == [0] and collector.num_unauthorized == 0


def test_token_flag_still_works_and_a_refused_token_keeps_the_spool(collector, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LLMWATCH_TOKEN", raising=False)
    _spool_steps(tmp_path / "spool", [0, 1])
    assert replay.main([str(tmp_path / "spool"), "--url", collector.url, "--token", "wrong"]) == 1
    assert collector.num_unauthorized == 1 and "refused the token (HTTP 401" in capsys.readouterr().err
    assert replay.main([str(tmp_path / "spool"), "--url", collector.url, "--token", "tok"]) == 0
    assert [r["step"] for r in collector.rows("step")] == [0, 1]  # nothing was lost to the typo


def test_token_flag_and_token_file_are_exclusive_and_a_missing_file_is_an_error(tmp_path, capsys):
    (tmp_path / "spool").mkdir()
    with pytest.raises(SystemExit) as e:
        replay.main([str(tmp_path / "spool"), "--url", "http://127.0.0.1:1", "--token", "a", "--token-file", "b"])
    assert e.value.code == 2
    assert replay.main([str(tmp_path / "spool"), "--url", "http://127.0.0.1:1",
                        "--token-file", str(tmp_path / "missing")]) == 2
    assert "cannot read the token file" in capsys.readouterr().err


def test_the_command_line_needs_no_token(collector, tmp_path):
    """Run as a program with the token in the environment only: nothing for `ps` to show."""
    _spool_steps(tmp_path / "spool", [0])
    argv = [sys.executable, "-m", "agent.replay", str(tmp_path / "spool"), "--url", collector.url]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LLMWATCH_TOKEN": "tok"})
    assert out.returncode == 0, out.stderr
    # the step's batch and the one close() cuts for its agent_closed event
    assert not any(a.startswith("--token") for a in argv) and "replayed 2 batches" in out.stdout
    assert [r["step"] for r in collector.rows("step")] == [0]


def test_a_refused_token_at_run_time_keeps_every_batch_for_a_replay(tmp_path):
    """A wrong token is the operator's mistake, not bad data: nothing is dropped."""
    from tests.unit.collector.collector_server import CollectorProcess

    col = CollectorProcess(tmp_path / "c.duckdb", args=("--group-linger-s", "0")).start()
    try:
        cfg = AgentConfig(url=col.url, token="not-the-token", spool_dir=str(tmp_path / "spool" / "rank00000"),
                          timeout_s=5.0)
        agent = Agent(cfg, run_id="wrongtok", rank=0)
        agent.start()
        for step in range(3):
            _step(agent, step)
            assert agent.flush(5.0) is False  # not delivered...
        agent.close(timeout_s=5.0)
        stats = agent.stats()
        assert stats["rejected"]["step"] == 0 and stats["dropped"]["step"] == 0  # ...and not lost
        assert col.sql("SELECT count(*) FROM steps") == [[0]]
        token_file = tmp_path / "token"
        token_file.write_text(col.token + "\n")
        assert replay.main([str(tmp_path / "spool"), "--url", col.url, "--token-file", str(token_file)]) == 0
        assert col.sql("SELECT list(step ORDER BY step) FROM steps WHERE run_id = 'wrongtok'") == [[[0, 1, 2]]]
    finally:
        assert col.stop() == 0
