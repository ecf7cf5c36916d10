"""SQL slots: read-only SQL runs on worker threads of its own, and waits a bounded time for one.

Why not FastAPI's thread pool: a sync route runs on anyio's shared pool (40
threads), and a request waiting for a SQL slot held one of them while it waited.
44 slow queries took the whole pool, and every other sync route (the query API)
and, then still sync, /healthz waited behind them: 9 s measured. Here the pool
has exactly `num_slots` threads, a request waits as a coroutine holding no
thread, and it gives up after `queue_timeout_s` (`SqlBusy`: 503 + Retry-After).
At most `max_waiting` requests wait at once; past that they are refused at once.

A running query keeps its slot until it really ends: the HTTP answer comes back
at the query's deadline (`SqlDeadline`) even when DuckDB is inside one call it
cannot interrupt, but the thread stays busy until DuckDB returns, so no more than
`num_slots` queries ever run.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from collector.threads import name_native

T = TypeVar("T")


class SqlBusy(Exception):
    """No slot became free in time (or too many requests already wait): retry later."""


class SqlDeadline(Exception):
    """The query ran past its deadline; it may still be running on its slot."""


class SqlSlots:
    def __init__(self, *, num_slots: int, queue_timeout_s: float, max_waiting: int) -> None:
        self.num_slots = max(1, int(num_slots))
        self.queue_timeout_s = queue_timeout_s
        self.max_waiting = max(0, int(max_waiting))
        self._pool = ThreadPoolExecutor(self.num_slots, thread_name_prefix="llmwatch-sql", initializer=name_native,
                                        initargs=("lw-sql",))
        self._lock = threading.Lock()
        self._closed = False
        self.num_waiting = 0
        self.num_running = 0

    # -- the two ways in ----------------------------------------------------------
    async def run(self, fn: Callable[[], T], *, deadline_s: float) -> T:
        """`fn()` on a slot, awaited: SqlBusy if none frees within queue_timeout_s,
        SqlDeadline if it has not returned `deadline_s` after it started."""
        started, done = self._submit(fn)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(started)), self.queue_timeout_s)
        except asyncio.TimeoutError:
            if self._withdraw(done):
                raise self._busy() from None
        except asyncio.CancelledError:  # the request went away while waiting
            self._withdraw(done)
            raise
        answer = asyncio.wrap_future(done)
        try:
            return await asyncio.wait_for(asyncio.shield(answer), deadline_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            answer.add_done_callback(_consume)  # it ends later; its outcome has no reader
            if isinstance(e, asyncio.CancelledError):
                raise
            raise SqlDeadline from None

    def run_blocking(self, fn: Callable[[], T], *, deadline_s: float) -> T:
        """`run` for callers without an event loop (tests, scripts)."""
        started, done = self._submit(fn)
        try:
            started.result(self.queue_timeout_s)
        except TimeoutError:
            if self._withdraw(done):
                raise self._busy() from None
        try:
            return done.result(deadline_s)
        except TimeoutError:
            raise SqlDeadline from None

    def close(self, *, wait: bool = True) -> None:
        """Refuse new work and drop what waits; with `wait`, also wait for what runs
        (the caller interrupts it: see Storage.close)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)

    # -- internals ------------------------------------------------------------------
    def _submit(self, fn: Callable[[], T]) -> tuple[Future, Future]:
        started: Future = Future()
        with self._lock:
            if self._closed:
                raise SqlBusy("the collector is shutting down")
            if self.num_waiting >= self.max_waiting:
                raise SqlBusy(f"{self.num_waiting} SQL requests already wait for one of {self.num_slots} slots")
            self.num_waiting += 1

        def job() -> T:
            with self._lock:
                self.num_waiting -= 1
                self.num_running += 1
            started.set_result(None)
            try:
                return fn()
            finally:
                with self._lock:
                    self.num_running -= 1

        try:
            return started, self._pool.submit(job)
        except RuntimeError:  # shut down meanwhile
            with self._lock:
                self.num_waiting -= 1
            raise SqlBusy("the collector is shutting down") from None

    def _withdraw(self, done: Future) -> bool:
        """Take a job that has not started out of the line; False if it already runs."""
        if done.cancel():
            with self._lock:
                self.num_waiting -= 1
            return True
        return False

    def _busy(self) -> SqlBusy:
        return SqlBusy(f"all {self.num_slots} SQL slots stayed busy for {self.queue_timeout_s:g} s")


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
