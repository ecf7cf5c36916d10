"""`LauncherReporter`: events about the ranks, sent by the process that supervises them.

A rank cannot report its own death. The launcher sees it (a child's exit code
or signal) and tells the collector at once with a `rank_exited` event, so that a
crash is named from the first batch after it rather than after a heartbeat
silence (analysis/detectors/crash.py).

Its batches carry rank `wire.LAUNCHER_RANK` (-1), events only: the collector
stores the events with rank -1 and keeps no `ranks` row for it. One batch per
event, each with its own `batch_seq` (the collector stores a batch once).

Never in the launcher's way: `report()` queues and returns; one daemon thread
posts in order with a bounded timeout per request; nothing is retried or
spooled (the launcher outlives no outage worth remembering: its stdout says the
same), a failure is logged once, and `close(timeout_s)` waits at most that long
for the queue. Stdlib only, like the rest of the agent.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from typing import Callable

from agent import wire
from agent.agent import json_safe
from agent.transport import HttpClient

log = logging.getLogger("llmwatch.agent")

_STOP = object()


class LauncherReporter:
    def __init__(self, url: str, token: str | None, run_id: str, *, ca_file: str | None = None,
                 timeout_s: float = 2.0, node: str = "", clock: Callable[[], float] = time.time,
                 client=None) -> None:
        """`client`: anything with `post(body, timeout_s=...) -> PostResult` and
        `close()` (tests); default an `HttpClient` for `url`."""
        self.run_id = str(run_id)
        self.node = node or socket.gethostname()
        self.incarnation = uuid.uuid4().hex
        self.num_sent = 0
        self.num_failed = 0
        self._clock = clock
        self._timeout_s = timeout_s
        self._batch_seq = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._logged = False
        try:
            self._client = client if client is not None else HttpClient(url, token, timeout_s, ca_file=ca_file)
        except ValueError as e:  # a bad URL or CA file: report nothing, say so once
            self._client = None
            self._log_once("launcher: cannot report rank exits to the collector: %s", e)
        self._thread = threading.Thread(target=self._run, name="llmwatch-launcher-reporter", daemon=True)
        self._thread.start()

    def event(self, kind: str, step: int = -1, **data) -> None:
        """Queue one event (its own batch). Never blocks, never raises."""
        try:
            self._queue.put({"ts": self._clock(), "step": int(step), "attempt": None, "kind": str(kind),
                             "data": json_safe(data)})
        except Exception as e:  # noqa: BLE001
            self._log_once("launcher: dropped event %r: %r", kind, e)

    def rank_exited(self, rank: int, returncode: int, *, cause: str) -> None:
        """A rank's process ended with `returncode` (negative: killed by that signal).
        `cause`: "exited" (on its own) or "stopped" (it went down with the job after
        another rank failed: the launcher stopped it, or its collectives failed first)."""
        code, sig = (returncode, None) if returncode >= 0 else (None, signal_name(-returncode))
        self.event("rank_exited", rank=int(rank), exit_code=code, signal=sig, cause=cause)

    def run_ended(self, status: str, reason: str) -> None:
        """The launcher ended the job after a failure (its ranks are gone and cannot say so):
        a `run_finished` event with `status` ("stopped": the collector's policy stopped it;
        "failed": the launcher gave up) and why."""
        self.event("run_finished", status=str(status), reason=str(reason))

    def close(self, timeout_s: float = 3.0) -> None:
        """Send what is queued, within `timeout_s`; then stop. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._log_once("launcher: the collector did not take the exit reports within %.1f s", timeout_s)

    # -- the sender thread --------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            self._send(item)
        if self._client is not None:
            try:
                self._client.close()
            except OSError:
                pass

    def _send(self, event: dict) -> None:
        if self._client is None:
            self.num_failed += 1
            return
        header = {"run_id": self.run_id, "rank": wire.LAUNCHER_RANK, "incarnation": self.incarnation,
                  "batch_seq": self._batch_seq, "node": self.node, "pid": os.getpid(), "sent_ts": self._clock(),
                  "dicts": {}, "events": [event], "run": None, "stats": {"dropped": {}}}
        self._batch_seq += 1
        try:
            result = self._client.post(wire.encode_batch(header, {}), timeout_s=self._timeout_s)
        except Exception as e:  # noqa: BLE001 - a client that raises: count it, go on
            result = None
            reason = repr(e)
        else:
            reason = result.reason
        if result is not None and result.status == "ok":
            self.num_sent += 1
            return
        self.num_failed += 1
        self._log_once("launcher: could not report %s to the collector (%s); further failures are not logged",
                       event["kind"], reason)

    def _log_once(self, msg: str, *args) -> None:
        if not self._logged:
            self._logged = True
            log.warning(msg, *args)


def signal_name(num: int) -> str:
    """"SIGKILL" for 9; the number as text for one Python does not name."""
    import signal

    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)
