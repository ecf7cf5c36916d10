"""Beyond loopback every viewer signs in: the gate in front of the whole Flask server."""

from __future__ import annotations

import pytest
from flask import Flask

from dashboard.access import COOKIE, require_sign_in
from dashboard.cli import is_loopback, main

TOKEN = "viewer-secret-token"


@pytest.fixture
def client():
    server = Flask("t")
    server.add_url_rule("/", "index", lambda: "the dashboard")
    server.add_url_rule("/_dash-update-component", "cb", lambda: "data", methods=["POST"])
    server.add_url_rule("/healthz", "health", lambda: {"ok": True})
    require_sign_in(server, TOKEN)
    return server.test_client()


def test_pages_redirect_to_the_sign_in_and_callbacks_are_refused(client):
    r = client.get("/ranks?run=r1")
    assert r.status_code == 302 and r.headers["Location"] == "/login?next=%2Franks%3Frun%3Dr1"
    assert client.post("/_dash-update-component", json={}).status_code == 401
    assert client.get("/healthz").status_code == 200
    assert "viewer token" in client.get("/login").get_data(as_text=True)


def test_signing_in_sets_a_strict_cookie_that_is_not_the_token(client):
    bad = client.post("/login", data={"token": "nope", "next": "/"})
    assert bad.status_code == 401 and "wrong token" in bad.get_data(as_text=True)
    r = client.post("/login", data={"token": TOKEN, "next": "/ranks?run=r1"})
    assert r.status_code == 302 and r.headers["Location"] == "/ranks?run=r1"
    cookie = r.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert TOKEN not in cookie
    assert client.get("/").get_data(as_text=True) == "the dashboard"
    assert client.post("/_dash-update-component", json={}).status_code == 200


def test_a_bearer_token_works_for_scripts(client):
    assert client.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 302


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "\\\\evil", "javascript:alert(1)"])
def test_the_redirect_after_sign_in_stays_on_this_server(client, target):
    r = client.post("/login", data={"token": TOKEN, "next": target})
    assert r.headers["Location"] == "/"


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2") and not is_loopback("example.com")


def test_binding_beyond_loopback_without_a_viewer_token_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLMWATCH_TOKEN", raising=False)
    db = tmp_path / "x.duckdb"
    db.write_bytes(b"")
    assert main(["--db", str(db), "--host", "0.0.0.0"]) == 2
    assert "viewers must sign in" in capsys.readouterr().err


def test_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["--db", str(tmp_path / "none.duckdb")]) == 2
    assert "no database file" in capsys.readouterr().err
