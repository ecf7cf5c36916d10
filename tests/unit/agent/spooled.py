"""What an agent would have sent: it points at a closed port, so every batch goes to its spool,
and the tests read the spool back."""

from __future__ import annotations

import socket
from pathlib import Path

from agent import wire
from agent.spool import Spool


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spooled_payloads(spool_dir: str | Path) -> list[bytes]:
    """The spooled batches' bytes, oldest first, taken out of the spool."""
    spool = Spool(str(spool_dir), max_bytes=1 << 30)
    out = []
    while (payload := spool.peek()) is not None:
        out.append(payload)
        spool.pop()
    spool.close()
    return out


def spooled_batches(spool_dir: str | Path) -> list[wire.Batch]:
    """The spooled batches, decoded, oldest first."""
    return [wire.decode_batch(p) for p in spooled_payloads(spool_dir)]
