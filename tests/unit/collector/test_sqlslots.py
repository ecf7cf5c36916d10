"""SQL slots: bounded concurrency, a bounded wait for a slot, an answer at the deadline."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from collector.sql.slots import SqlBusy, SqlDeadline, SqlSlots


def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


@pytest.fixture
def slots():
    s = SqlSlots(num_slots=2, queue_timeout_s=0.2, max_waiting=3)
    yield s
    s.close()


def hold(slots: SqlSlots, n: int) -> tuple[threading.Event, list[threading.Thread]]:
    """Fill n slots with jobs that run until the event is set."""
    release = threading.Event()
    threads = [threading.Thread(target=slots.run_blocking, args=(release.wait,), kwargs={"deadline_s": 30.0})
               for _ in range(n)]
    for t in threads:
        t.start()
    wait_until(lambda: slots.num_running == n)
    return release, threads


def test_a_request_gives_up_waiting_for_a_slot(slots):
    release, threads = hold(slots, 2)
    start = time.monotonic()
    with pytest.raises(SqlBusy, match="2 SQL slots stayed busy for 0.2 s"):
        slots.run_blocking(lambda: 1, deadline_s=1.0)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert slots.num_waiting == 0
    release.set()
    for t in threads:
        t.join()
    assert slots.run_blocking(lambda: 42, deadline_s=1.0) == 42


def test_past_max_waiting_requests_are_refused_at_once(slots):
    release, threads = hold(slots, 2)
    slots.queue_timeout_s = 5.0
    waiting = [threading.Thread(target=slots.run_blocking, args=(lambda: 1,), kwargs={"deadline_s": 1.0})
               for _ in range(3)]
    for t in waiting:
        t.start()
    wait_until(lambda: slots.num_waiting == 3)
    start = time.monotonic()
    with pytest.raises(SqlBusy, match="3 SQL requests already wait"):
        slots.run_blocking(lambda: 1, deadline_s=1.0)
    assert time.monotonic() - start < 0.1
    release.set()
    for t in threads + waiting:
        t.join()


def test_the_answer_comes_at_the_deadline_and_the_query_keeps_its_slot(slots):
    """Like a DuckDB call that ignores the interrupt: the caller hears back at the
    deadline, but the slot stays taken until the call really returns."""
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(SqlDeadline):
        slots.run_blocking(release.wait, deadline_s=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert slots.num_running == 1
    release.set()
    wait_until(lambda: slots.num_running == 0)


def test_concurrency_is_bounded_by_the_slots(slots):
    lock, running, peak = threading.Lock(), [0], [0]

    def job() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    slots.queue_timeout_s = 5.0
    threads = [threading.Thread(target=slots.run_blocking, args=(job,), kwargs={"deadline_s": 5.0}) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 2


def test_waiting_requests_hold_no_thread():
    """40 requests await 1 busy slot as coroutines: no thread per waiter, and the
    event loop keeps turning."""
    slots = SqlSlots(num_slots=1, queue_timeout_s=0.5, max_waiting=64)
    release = threading.Event()

    async def main() -> tuple[list, int, float]:
        first = asyncio.ensure_future(slots.run(release.wait, deadline_s=30.0))
        while slots.num_running == 0:
            await asyncio.sleep(0.001)
        waiters = [asyncio.ensure_future(slots.run(lambda: 1, deadline_s=1.0)) for _ in range(40)]
        await asyncio.sleep(0.05)
        threads_while_waiting = threading.active_count()
        t0 = time.monotonic()
        await asyncio.sleep(0.01)
        lag_s = time.monotonic() - t0 - 0.01
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        release.set()
        await first
        return outcomes, threads_while_waiting, lag_s

    before = threading.active_count()
    outcomes, threads_while_waiting, lag_s = asyncio.run(main())
    slots.close()
    assert all(isinstance(o, SqlBusy) for o in outcomes)
    assert threads_while_waiting <= before + 1  # the one slot's thread
    assert lag_s < 0.3  # the loop was not blocked: a waiter blocking it would hold it for its 0.5 s queue timeout
    assert slots.num_waiting == 0


def test_async_deadline():
    slots = SqlSlots(num_slots=1, queue_timeout_s=0.5, max_waiting=4)
    release = threading.Event()

    async def main() -> float:
        start = time.monotonic()
        with pytest.raises(SqlDeadline):
            await slots.run(release.wait, deadline_s=0.2)
        return time.monotonic() - start

    assert 0.2 <= asyncio.run(main()) < 1.0
    assert slots.num_running == 1
    release.set()
    slots.close()
    assert slots.num_running == 0
