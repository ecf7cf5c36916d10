"""The token stays out of logs, the spool and batches; run_info is scrubbed."""

import logging
import socket

import pytest

from agent import Agent, AgentConfig, wire
from agent.agent import REDACTED, is_secret_key, scrub_secrets
from agent.spool import Spool

TOKEN = "s3cr3t-t0ken-value"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("key", ["token", "TOKEN", "Token", "auth_token", "hf-token", "authToken", "secret",
                                 "client_secret", "SECRET_KEY", "password", "db_password", "Passwd", "api_key",
                                 "API_KEY", "apiKey", "ApiKey", "APIKEY", "x-api-key", "openai_api_keys",
                                 "authorization", "Authorization", "proxy_authorization", "token_file", "secrets",
                                 "db_passwords"])
def test_secret_looking_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["tokens", "num_tokens", "tokens_per_s", "max_new_tokens", "tokenizer",
                                 "tokenizer_path", "keys", "key", "api", "api_version", "monkey", "passes",
                                 "author", "run_id", "secretary", ""])
def test_keys_that_are_not_secrets(key):
    assert not is_secret_key(key)  # whole words only; "tokens" counts tokens in this field


def test_scrub_replaces_values_at_any_depth_and_leaves_the_input_alone():
    info = {"config": {"telemetry": {"token": TOKEN, "collector_url": "http://c"}, "tokens": 1024,
                       "optim": [{"lr": 1e-3}, {"API_KEY": {"nested": TOKEN}}]},
            "Authorization": f"Bearer {TOKEN}", "password": None, "secret": ""}
    out = scrub_secrets(info)
    assert out == {"config": {"telemetry": {"token": REDACTED, "collector_url": "http://c"}, "tokens": 1024,
                              "optim": [{"lr": 1e-3}, {"API_KEY": REDACTED}]},
                   "Authorization": REDACTED, "password": None, "secret": ""}
    assert info["config"]["telemetry"]["token"] == TOKEN  # a copy: the caller's dict is not touched


def test_config_repr_hides_the_token():
    cfg = AgentConfig(url="http://127.0.0.1:1", token=TOKEN)
    assert TOKEN not in repr(cfg) and TOKEN not in str(cfg)


def test_token_is_in_no_batch_no_spool_file_and_no_log_line(tmp_path, caplog):
    cfg = AgentConfig(url=f"http://127.0.0.1:{_closed_port()}", token=TOKEN, spool_dir=str(tmp_path),
                      capacity=64, timeout_s=0.5)
    run_info = {"config": {"telemetry": {"token": TOKEN}, "steps": 10}, "env": {"HF_TOKEN": TOKEN}}
    with caplog.at_level(logging.DEBUG, logger="llmwatch.agent"):
        agent = Agent(cfg, run_id="r", rank=0, run_info=run_info)
        agent.record_scalar(1, "x", 1.0)
        assert not agent.flush(1.0)  # no collector: spooled
        agent.record_scalar(2, "x", 2.0)
        agent.close(timeout_s=1.0)
    assert agent.stats()["batches"]["spooled"] == 2
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert TOKEN.encode() not in f.read_bytes(), f
    spool = Spool(str(tmp_path), max_bytes=1 << 30)
    first = wire.decode_batch(spool.peek())
    spool.close()
    assert first.header["run"] == {"config": {"telemetry": {"token": REDACTED}, "steps": 10},
                                   "env": {"HF_TOKEN": REDACTED}}
    assert caplog.records and not any(TOKEN in r.getMessage() for r in caplog.records)
    assert TOKEN not in str(agent.stats())
