"""Token files: read one, write one private. Stdlib only.

Here, in the package every other one may import (DESIGN.md: trainer -> agent <-
collector), so that the trainer, the collector and the agent's own tools read and
write a token file the same way.
"""

from __future__ import annotations

import os
from pathlib import Path


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
