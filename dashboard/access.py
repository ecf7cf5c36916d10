"""Sign-in for a dashboard bound beyond loopback.

On loopback the dashboard is open, like the collector's own host-local tools. Bound
to another address, every request but `/healthz` and `/login` needs either the
viewer token as a bearer token (scripts) or the session cookie that `/login` sets
after the viewer typed the token into its form. The cookie holds a random value
made at start (never the token), is HttpOnly and SameSite=Strict, and dies with the
process. The Dash callbacks (`/_dash-*`) answer 401 instead of a redirect.
"""

from __future__ import annotations

import hmac
import html
import secrets
from urllib.parse import quote

from flask import Flask, Response, redirect, request

COOKIE = "llmwatch_session"
_FORM = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>llmwatch · sign in</title>
<style>body{{font-family:system-ui,sans-serif;background:#f5f7fb;display:flex;justify-content:center;margin-top:12vh}}
form{{background:#fff;padding:2em;border-radius:10px;box-shadow:0 2px 10px #0001;min-width:320px}}
input{{width:100%;padding:.5em;margin:.6em 0 1em;box-sizing:border-box}}.err{{color:#b42318}}</style></head>
<body><form method="post" action="/login"><h2>llmwatch</h2><div class="err">{error}</div>
<label for="token">viewer token</label><input id="token" name="token" type="password" autofocus>
<input type="hidden" name="next" value="{next}"><button type="submit">sign in</button></form></body></html>"""


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _safe_next(target: str | None) -> str:
    """Only a path on this server: no scheme, no host, no `//evil`."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def require_sign_in(server: Flask, token: str) -> None:
    if not token:
        raise ValueError("a dashboard beyond loopback needs a viewer token")
    session = secrets.token_urlsafe(32)

    @server.before_request
    def _gate():
        if request.path in ("/healthz", "/login"):
            return None
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and _same(auth[len("Bearer "):], token):
            return None
        if _same(request.cookies.get(COOKIE, ""), session):
            return None
        if request.method != "GET" or request.path.startswith("/_dash"):
            return Response("sign in first", status=401, mimetype="text/plain")
        return redirect("/login?next=" + quote(request.full_path.rstrip("?"), safe=""))

    @server.route("/login", methods=["GET", "POST"])
    def _login():
        if request.method == "GET":
            return Response(_FORM.format(error="", next=html.escape(_safe_next(request.args.get("next")))),
                            mimetype="text/html")
        given = request.form.get("token", "")
        target = _safe_next(request.form.get("next"))
        if not _same(given, token):
            return Response(_FORM.format(error="wrong token", next=html.escape(target)), status=401,
                            mimetype="text/html")
        resp = redirect(target)
        resp.set_cookie(COOKIE, session, httponly=True, samesite="Strict", secure=request.is_secure)
        return resp
