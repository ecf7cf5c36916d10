"""Tokens by role, their sources, secret files, and the gate's route table."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from collector import cli
from collector.http.auth import Role, Tokens, TokenSources, client_token, generate_role_tokens, write_secret_file
from collector.http.gate import rule_for
from collector.settings import Settings

BEARER = "Bearer {}".format


def test_roles_are_separate_and_control_may_read():
    t = Tokens.build(by_role={Role.INGEST: ["ingest-token-1"], Role.READ: ["read-token-22"],
                              Role.CONTROL: ["control-token-3"]})
    assert t.roles_of(BEARER("ingest-token-1")) == {Role.INGEST}
    assert t.roles_of(BEARER("read-token-22")) == {Role.READ}  # a dashboard cannot stop a run
    assert t.roles_of(BEARER("control-token-3")) == {Role.CONTROL, Role.READ}
    assert not t.roles_of(BEARER("read-token-2"))  # a prefix is not the token
    for bad in (None, "", "Bearer", "Bearer ", "Basic read-token-22", "read-token-22", b"Bearer \xff\xfe"):
        assert not t.roles_of(bad)


def test_a_token_without_a_role_has_every_role():
    t = Tokens.build(all_roles=["one-for-all-xyz"])
    assert t.roles_of(BEARER("one-for-all-xyz")) == set(Role)
    assert Settings(db_path="x", token="one-for-all-xyz").tokens.roles_of(BEARER("one-for-all-xyz")) == set(Role)


def test_settings_do_not_keep_the_token_in_the_clear():
    s = Settings(db_path="x", token="sekrit-value-123")
    assert s.token == "" and "sekrit-value-123" not in repr(s)
    assert not any(b"sekrit-value-123" in d for ds in s.tokens.digests.values() for d in ds)


def test_tokens_from_files_and_environment(tmp_path):
    read = write_secret_file(tmp_path / "read", "read-from-file-1")
    src = TokenSources(role_files={Role.READ: str(read)})
    tokens, where = src.resolve({"LLMWATCH_INGEST_TOKEN": "ingest-from-env", "LLMWATCH_TOKEN": "all-from-env-1"})
    assert tokens.roles_of(BEARER("read-from-file-1")) == {Role.READ}
    assert tokens.roles_of(BEARER("ingest-from-env")) == {Role.INGEST}
    assert tokens.roles_of(BEARER("all-from-env-1")) == set(Role)
    assert "read-from-file-1" not in where and "ingest-from-env" not in where and str(read) in where
    with pytest.raises(ValueError, match="no token given"):
        TokenSources().resolve({})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        TokenSources(token_file=str(tmp_path / "empty")).resolve({})


def test_role_tokens_generated_private_and_reused(tmp_path):
    d = tmp_path / "db.tokens"
    tokens, where = TokenSources().resolve({}, default_dir=d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    values = {}
    for role in Role:
        path = d / role.value
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        values[role] = path.read_text().strip()
        assert len(values[role]) >= 32 and values[role] not in where
    assert tokens.roles_of(BEARER(values[Role.READ])) == {Role.READ}
    os.chmod(d / "read", 0o644)
    again, _ = TokenSources().resolve({}, default_dir=d)  # a restart keeps the agents' tokens
    assert again.roles_of(BEARER(values[Role.INGEST])) == {Role.INGEST}
    assert stat.S_IMODE(os.stat(d / "read").st_mode) == 0o600
    assert generate_role_tokens(d)[Role.CONTROL].read_text().strip() == values[Role.CONTROL]


def test_secret_file_is_tightened_when_it_exists(tmp_path):
    path = tmp_path / "t"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_secret_file(path, "new-secret-abc")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.read_text() == "new-secret-abc\n"


def test_client_token_prefers_the_file(tmp_path):
    f = write_secret_file(tmp_path / "r", "file-token-123")
    assert client_token(token="flag", token_file=str(f), environ={"LLMWATCH_TOKEN": "env"}) == "file-token-123"
    assert client_token(token=None, token_file=None, environ={"LLMWATCH_TOKEN": "env"}) == "env"


@pytest.mark.parametrize("method, path, role", [
    ("GET", "/healthz", None), ("POST", "/v1/ingest", Role.INGEST), ("POST", "/v1/ingest/bundle", Role.INGEST),
    ("GET", "/v1/ingest/bundle", Role.READ), ("POST", "/v1/metrics", Role.INGEST),
    ("POST", "/v1/sql", Role.READ), ("GET", "/v1/runs", Role.READ), ("GET", "/v1/runs/r/steps", Role.READ),
    ("GET", "/metrics", Role.READ), ("GET", "/openapi.json", Role.READ), ("GET", "/docs", Role.READ),
    ("POST", "/v1/runs/r/commands", Role.CONTROL), ("GET", "/v1/runs/r/commands", Role.READ),
    ("DELETE", "/v1/runs/r", Role.READ), ("POST", "/healthz", Role.READ), ("POST", "/nope", Role.READ),
])
def test_every_route_has_a_role_and_a_body_limit(method, path, role):
    s = Settings(db_path="x", token="t" * 16)
    rule = rule_for(method, path, s)
    assert rule.role == role
    assert rule.max_body_bytes <= (s.gate.max_bundle_bytes if path == "/v1/ingest/bundle" else s.gate.max_batch_bytes)
    assert rule_for("GET", "/metrics", Settings(db_path="x", token="t" * 16, public_metrics=True)).role is None


def _serve_args(**kw) -> argparse.Namespace:
    base = dict(host="127.0.0.1", tls_cert=None, tls_key=None, insecure_plaintext=False)
    return argparse.Namespace(**{**base, **kw})


def test_plain_http_beyond_loopback_needs_an_explicit_flag():
    assert cli._check_exposure(_serve_args()) is None
    assert "TLS" in cli._check_exposure(_serve_args(host="0.0.0.0")) or "tls" in cli._check_exposure(
        _serve_args(host="0.0.0.0"))
    assert cli._check_exposure(_serve_args(host="0.0.0.0", insecure_plaintext=True)) is None
    assert cli._check_exposure(_serve_args(host="0.0.0.0", tls_cert="c", tls_key="k")) is None
    assert "together" in cli._check_exposure(_serve_args(tls_cert="c"))
