"""Secrets and private directories: where a token may be, and how it is written.

A bearer token is a password. It never enters the `JobConfig` (which is written
to `config.json`, shipped as run info into the collector's `runs` table, and
copied into every spool segment), a command line of a process we start (any
user can read `/proc/<pid>/cmdline`), or a log line. It travels in the
environment of the processes that need it (`/proc/<pid>/environ` is readable
only by its owner) or in a file of mode 0600.

Reading and writing a token file is `agent.secrets`, shared with the collector.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from agent.secrets import TokenError, read_token_file, write_secret

__all__ = ["TokenError", "read_token_file", "write_secret", "resolve_token", "resolve_webhook_secret",
           "private_dir", "is_private", "TOKEN_ENV", "WEBHOOK_SECRET_ENV", "COLLECTOR_TOKEN_ENVS"]

TOKEN_ENV = "LLMWATCH_TOKEN"
WEBHOOK_SECRET_ENV = "LLMWATCH_WEBHOOK_SECRET"  # the HMAC key the collector signs webhooks with
# Every variable a collector reads a secret from (the all-roles token, one per role, the
# webhook key): the embedded collector must get them from our files only, not from the
# user's shell, and a rank, which sends only its ingest token, gets none of them.
COLLECTOR_TOKEN_ENVS = (TOKEN_ENV, "LLMWATCH_INGEST_TOKEN", "LLMWATCH_READ_TOKEN", "LLMWATCH_CONTROL_TOKEN",
                        WEBHOOK_SECRET_ENV)


def resolve_token(*, token: str | None, token_file: str | os.PathLike | None,
                  environ: Mapping[str, str]) -> str | None:
    """The one token the user gave: `--token-file`, else `--token`, else `$LLMWATCH_TOKEN`.

    The same order as the collector's clients, so one shell setup serves both.
    `--token` works but is visible in `ps`: the file and the environment are the
    forms to document."""
    if token_file:
        return read_token_file(token_file)
    return token or environ.get(TOKEN_ENV) or None


def resolve_webhook_secret(*, secret: str | None, secret_file: str | os.PathLike | None,
                           environ: Mapping[str, str]) -> str | None:
    """The webhook HMAC key: `--webhook-secret-file`, else `--webhook-secret`, else
    `$LLMWATCH_WEBHOOK_SECRET` (the collector's order)."""
    if secret_file:
        return read_token_file(secret_file)
    return secret or environ.get(WEBHOOK_SECRET_ENV) or None


def private_dir(path: str | os.PathLike, *, tighten_existing: bool = True) -> Path:
    """Create `path` with mode 0700 (parents with the usual mode).

    An existing directory is made 0700 too when `tighten_existing` (the caller
    knows it is its own); otherwise its mode is left as it is."""
    path = Path(path)
    existed = path.is_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not existed or tighten_existing:
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask, and exist_ok keeps an old mode
    return path


def is_private(path: str | os.PathLike) -> bool:
    """No access for group or others."""
    return not stat.S_IMODE(os.stat(path).st_mode) & (stat.S_IRWXG | stat.S_IRWXO)
