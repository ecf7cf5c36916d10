"""Storage.sql: the SQL slots and caps as settings, and a close that does not wait out a query."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from collector.settings import DuckDBSettings, Settings, SqlSettings, WriterSettings
from collector.sql.guard import SqlRefused
from collector.sql.slots import SqlBusy
from collector.storage import Storage

SLOW = "SELECT count(*) FROM range(1000000000000) a, range(10) b"


def gauge(storage: Storage, name: str) -> float:
    for line in storage.metrics.exposition().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def one_slot(tmp_path):
    s = Storage(Settings(db_path=tmp_path / "s.duckdb", token="tok", writer=WriterSettings(linger_s=0.0),
                         sql=SqlSettings(max_concurrent=1, queue_timeout_s=0.2, timeout_s=60.0),
                         duckdb=DuckDBSettings(threads=1)))
    yield s
    s.close()


def test_busy_slots_answer_sql_busy_and_close_interrupts_the_query(one_slot):
    outcome: list = []
    t = threading.Thread(target=lambda: outcome.append(pytest.raises(SqlRefused, one_slot.sql, SLOW)))
    t.start()
    wait_until(lambda: gauge(one_slot, "llmwatch_collector_sql_running") == 1)
    start = time.monotonic()
    with pytest.raises(SqlBusy, match="stayed busy for 0.2 s"):
        one_slot.sql("SELECT 1")
    assert time.monotonic() - start < 2.0
    assert gauge(one_slot, "llmwatch_collector_sql_waiting") == 0
    start = time.monotonic()
    one_slot.close()  # interrupts the 60 s query instead of waiting for it
    assert time.monotonic() - start < 10.0
    t.join(10)
    assert outcome and not t.is_alive()


def test_the_byte_cap_is_a_setting(tmp_path):
    s = Storage(Settings(db_path=tmp_path / "b.duckdb", token="tok", writer=WriterSettings(linger_s=0.0),
                         sql=SqlSettings(max_bytes=10_000)))
    try:
        result = s.sql("SELECT lpad('', 100, 'x') || i AS s FROM range(100000) t(i)", max_rows=100_000)
        assert result.truncated and 0 < result.num_bytes <= 10_000
        result = asyncio.run(s.sql_async("SELECT i FROM range(5) t(i)", encode_row=lambda r: json.dumps(r).encode()))
        assert result.rows_json == [b"[0]", b"[1]", b"[2]", b"[3]", b"[4]"] and not result.truncated
    finally:
        s.close()


def test_timeout_is_enforced(storage):
    start = time.monotonic()
    with pytest.raises(SqlRefused, match="timed out after 0.3 s"):
        storage.sql(SLOW, timeout_s=0.3)
    assert time.monotonic() - start < 2.0
