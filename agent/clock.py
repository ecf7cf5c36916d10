"""This host's clock against the collector's, from the ingest round trips.

Ranks on different hosts stamp enqueue times with their own wall clocks; to tell
who entered a collective last across hosts (analysis/attribution.py) those times
must be on one clock. Every ingest answer carries the collector's `server_ts`;
a round trip sent at `t0` and answered at `t1` (this host's clock) says the
collector's clock read `server_ts` somewhere in between, so

    offset = server_ts - (t0 + t1) / 2,  |error| <= (t1 - t0) / 2.

The estimate kept is that of the quickest round trip among the last `window`
(queueing delays only ever widen a trip, and skew it), so the bound is half the
best recent round trip: ~0.1-0.5 ms on one rack, a few ms across a WAN. The
window lets it follow a slow drift (NTP steps a clock by far less per minute).

With the collector on this host (a loopback URL) the clocks are one: offset 0,
error 0, and nothing is estimated (two ranks of one host must not differ by two
estimates' noise).

Through a node's relay (collector/relay.py, on loopback too) they are not: the
relay answers with its own estimate of the collector's clock, read at the middle
of the time it held the request, how long it held it (`hold_s`, taken out of the
round trip, so the relay's wait for the collector's commit widens nothing) and its
own estimate's error bound (added to this one's). The first relayed answer turns
a loopback client's "one clock" off.
"""

from __future__ import annotations

import ipaddress
import math
from collections import deque


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClockSync:
    __slots__ = ("_samples", "local", "offset_s", "error_s", "num_samples")

    def __init__(self, *, local: bool, window: int = 32) -> None:
        self.local = local
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (error bound s, offset s)
        self.offset_s = 0.0
        self.error_s = 0.0 if local else math.inf  # unknown until the first answer
        self.num_samples = 0

    def add(self, t0: float, t1: float, server_ts, *, hold_s: float = 0.0, upstream_error_s: float = 0.0) -> None:
        """One round trip: sent at t0, answered at t1 (this host's wall clock), the
        collector's clock reading `server_ts` in between (through a relay: at the middle
        of its `hold_s`, within `upstream_error_s` of the collector's)."""
        if self.local or not isinstance(server_ts, (int, float)) or not math.isfinite(server_ts) or t1 < t0:
            return
        rtt = max(0.0, t1 - t0 - max(0.0, hold_s))
        self._samples.append((0.5 * rtt + max(0.0, upstream_error_s), float(server_ts) - 0.5 * (t0 + t1)))
        self.num_samples += 1
        self.error_s, self.offset_s = min(self._samples)

    def relayed(self) -> None:
        """The answers come from a relay (a loopback URL notwithstanding): estimate."""
        if self.local:
            self.local = False
            self.error_s = math.inf
