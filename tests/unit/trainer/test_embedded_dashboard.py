"""The embedded dashboard's process: the token travels as a file path, the port falls
back to a free one, and a dashboard that dies is reported instead of waited on."""

from __future__ import annotations

import socket
import sys

from trainer.embedded_dashboard import EmbeddedDashboard, port_free


def test_the_command_line_names_the_token_file_never_the_token(tmp_path):
    token = tmp_path / "read"
    token.write_text("s3cret-read-token\n")
    d = EmbeddedDashboard(collector_url="http://127.0.0.1:1234", token_path=token, run_dir=tmp_path, port=0)
    argv = d.argv()
    assert argv[:3] == [sys.executable, "-m", "dashboard"]
    assert argv[argv.index("--token-file") + 1] == str(token)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "s3cret-read-token" not in " ".join(argv)


def test_no_token_variable_reaches_the_dashboard(monkeypatch):
    monkeypatch.setenv("LLMWATCH_TOKEN", "t")
    assert "LLMWATCH_TOKEN" not in EmbeddedDashboard.env()


def test_a_taken_port_falls_back_to_any_free_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert not port_free(taken)
        d = EmbeddedDashboard(collector_url="http://x", token_path=None, run_dir=tmp_path, port=taken)
        assert d.port == 0 and "--token-file" not in d.argv()


def test_a_dashboard_that_exits_is_not_ready(tmp_path):
    d = EmbeddedDashboard(collector_url="http://127.0.0.1:9", token_path=tmp_path / "missing", run_dir=tmp_path,
                          port=0)
    d.start()  # the token file does not exist: the dashboard exits at once
    try:
        assert d.wait_ready(timeout_s=60) is False
        assert d.url is None
        assert "dashboard:" in d.log_path.read_text()
    finally:
        d.stop()
