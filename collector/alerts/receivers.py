"""Alert receivers: the `--webhook` and `--alertmanager` URLs, checked and named.

Receivers are named `webhook:<n>` / `alertmanager:<n>` (n counts from 1, in flag
order): the outbox table and the log hold those names, never a URL (its userinfo,
path or query may be a credential: a Slack webhook's path is one). A webhook's body
is signed with the secret (`--webhook-secret-file` or LLMWATCH_WEBHOOK_SECRET).
"""

from __future__ import annotations

import base64
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from collector.alerts import payloads

WEBHOOK, ALERTMANAGER = "webhook", "alertmanager"
WEBHOOK_SECRET_ENV = "LLMWATCH_WEBHOOK_SECRET"  # the webhook HMAC key, when not in --webhook-secret-file
AM_ALERTS_PATH = "/api/v2/alerts"


def redact_url(url: str) -> str:
    """What a log may say about `url`: its scheme, host and port (no userinfo, path,
    query or fragment, any of which may hold a token)."""
    try:
        u = urllib.parse.urlsplit(url)
        host = u.hostname or "?"
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "<unparsable URL>"
    host = f"[{host}]" if ":" in host else host
    return f"{u.scheme}://{host}{port}/..."


def check_url(url: str, *, flag: str) -> None:
    """ValueError unless `url` is http(s) with a host. The message holds no more of
    the URL than `redact_url` shows."""
    try:
        u = urllib.parse.urlsplit(url)
        u.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError:
        raise ValueError(f"{flag}: not a URL") from None
    if u.scheme not in ("http", "https"):
        raise ValueError(f"{flag}: {u.scheme or 'a URL without a scheme'}:// is not http(s); "
                         "alerts go to http:// or https:// URLs")
    if not u.hostname:
        raise ValueError(f"{flag}: the URL has no host")


@dataclass(frozen=True, slots=True)
class Receiver:
    """Where one receiver's alerts go. `url` and `secret` never reach a log or a table."""

    name: str  # webhook:1, alertmanager:1
    kind: str  # WEBHOOK or ALERTMANAGER
    url: str = field(repr=False)
    secret: bytes = field(default=b"", repr=False)  # HMAC key of a webhook's X-Signature-256

    def __repr__(self) -> str:
        return f"Receiver({self.name}, {redact_url(self.url)})"

    @property
    def endpoint(self) -> str:
        """The URL to POST to, without userinfo (sent as Basic auth instead)."""
        u = urllib.parse.urlsplit(self.url)
        netloc = u.hostname or ""
        netloc = f"[{netloc}]" if ":" in netloc else netloc
        if u.port:
            netloc += f":{u.port}"
        path = u.path
        if self.kind == ALERTMANAGER and not path.rstrip("/").endswith(AM_ALERTS_PATH):
            path = path.rstrip("/") + AM_ALERTS_PATH
        return urllib.parse.urlunsplit((u.scheme, netloc, path or "/", u.query, ""))

    def headers(self, body: bytes) -> dict[str, str]:
        h = {"Content-Type": "application/json", "User-Agent": "llmwatch-collector"}
        u = urllib.parse.urlsplit(self.url)
        if u.username is not None:
            cred = f"{urllib.parse.unquote(u.username)}:{urllib.parse.unquote(u.password or '')}"
            h["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        if self.kind == WEBHOOK:
            h[payloads.SIGNATURE_HEADER] = payloads.sign(body, self.secret)
        return h

    def scrub(self, text: str) -> str:
        """`text` without any part of the URL that may be a credential."""
        u = urllib.parse.urlsplit(self.url)
        secrets = [self.url, self.endpoint, u.netloc, u.path + ("?" + u.query if u.query else ""), u.query,
                   u.password or "", u.username or ""]
        for s in sorted((s for s in secrets if s and s != "/" and len(s) > 1), key=len, reverse=True):
            text = text.replace(s, "...")
        return text


def build_receivers(*, webhooks: Sequence[str] = (), alertmanagers: Sequence[str] = (),
                    webhook_secret: str | bytes = "") -> list[Receiver]:
    """The receivers the flags name. ValueError for a URL that is not http(s), or for
    webhooks without a secret: a webhook is always signed, so that its receiver can
    tell our alerts from anyone's who learns its URL."""
    secret = webhook_secret.encode() if isinstance(webhook_secret, str) else bytes(webhook_secret)
    out = []
    for n, url in enumerate(webhooks, 1):
        check_url(url, flag=f"--webhook #{n}")
        out.append(Receiver(f"{WEBHOOK}:{n}", WEBHOOK, url, secret))
    for n, url in enumerate(alertmanagers, 1):
        check_url(url, flag=f"--alertmanager #{n}")
        out.append(Receiver(f"{ALERTMANAGER}:{n}", ALERTMANAGER, url))
    if webhooks and not secret.strip():
        raise ValueError("--webhook needs a secret to sign with: --webhook-secret-file FILE (0600) or "
                         "$LLMWATCH_WEBHOOK_SECRET (receivers check X-Signature-256; docs/operations.md)")
    return out


# -- rows and intents ---------------------------------------------------------------
