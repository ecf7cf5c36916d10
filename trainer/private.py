"""Secrets and private directories: where a token may be, and how it is written.

A bearer token is a password. It never enters the `JobConfig` (which is written
to `config.json`, shipped as run info into the collector's `runs` table, and
copied into every spool segment), a command line of a process we start (any
user can read `/proc/<pid>/cmdline`), or a log line. It travels in the
environment of the processes that need it (`/proc/<pid>/environ` is readable
only by its owner) or in a file of mode 0600.

The trainer does not import the collector (DESIGN.md), so the few lines that
the collector's `auth` module also has are repeated here rather than shared.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

TOKEN_ENV = "LLMWATCH_TOKEN"
# Every variable a collector reads a token from (the all-roles one and one per role):
# the embedded collector must get its tokens from our files only, not from the user's shell.
COLLECTOR_TOKEN_ENVS = (TOKEN_ENV, "LLMWATCH_INGEST_TOKEN", "LLMWATCH_READ_TOKEN", "LLMWATCH_CONTROL_TOKEN")


class TokenError(ValueError):
    """A token source that cannot be used. The message names the source, never the token."""


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path`: its first line, stripped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="ascii").strip().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"cannot read the token file {path}: {e.__class__.__name__}") from None
    if not lines or not lines[0].strip():
        raise TokenError(f"the token file {path} is empty")
    return lines[0].strip()


def resolve_token(*, token: str | None, token_file: str | os.PathLike | None,
                  environ: Mapping[str, str]) -> str | None:
    """The one token the user gave: `--token-file`, else `--token`, else `$LLMWATCH_TOKEN`.

    The same order as the collector's clients, so one shell setup serves both.
    `--token` works but is visible in `ps`: the file and the environment are the
    forms to document."""
    if token_file:
        return read_token_file(token_file)
    return token or environ.get(TOKEN_ENV) or None


def write_secret(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (one line) to `path`, mode 0600, in a directory that must exist.

    O_CREAT's mode applies only to a file it creates: a file left 0644 by someone
    else stays 0644 unless we fchmod it, so we do, before a byte is written.
    O_NOFOLLOW: a symlink planted where a token goes must not redirect it."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (text + "\n").encode("ascii"))
    finally:
        os.close(fd)
    return path


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
