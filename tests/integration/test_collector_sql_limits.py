"""POST /v1/sql against a real collector: answers capped in bytes, a bounded wait for a
SQL slot, and the rest of the collector responsive while every slot is busy."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent import wire
from tests.unit.collector.collector_batches import make_batch, steps_section
from tests.unit.collector.collector_server import CollectorProcess

pytestmark = pytest.mark.integration

MiB = 1 << 20
SQL_TIMEOUT_S = 3.0
QUEUE_TIMEOUT_S = 5.0  # SqlSettings.queue_timeout_s
NUM_SLOTS = 4  # SqlSettings.max_concurrent
NUM_SLOW = 44  # as many as took the shared thread pool in the report
# Allowed, interruptible, and as long as the timeout lets it run.
SLOW = "SELECT count(*) FROM range(1000000000000) a, range(10) b"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = CollectorProcess(tmp_path_factory.mktemp("sql") / "c.duckdb",
                            args=("--group-linger-s", "0", "--group-min-interval-s", "0", "--duckdb-threads", "1",
                                  "--sql-timeout-s", str(SQL_TIMEOUT_S))).start()
    yield proc
    assert proc.stop() == 0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def gauges(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {name: float(line.split()[1]) for line in text.splitlines()
            for name in ("llmwatch_collector_sql_running", "llmwatch_collector_sql_waiting")
            if line.startswith(name + " ")}


def test_answers_are_capped_in_bytes_and_amplifiers_refused(server):
    rss_before = rss_bytes(server.proc.pid)
    with server.client() as c:
        r = c.post("/v1/sql", json={"sql": "SELECT repeat('a', 100000000) AS s FROM range(5)"})
        assert r.status_code == 400 and "repeat()" in r.json()["error"]  # was a 500 MB answer
        r = c.post("/v1/sql", json={"sql": "SELECT length(repeat('a', 1000000000))"})
        assert r.status_code == 400 and "repeat()" in r.json()["error"]  # ran 23 s past a 10 s timeout
        big = "SELECT lpad('', 1000, 'x') || i AS s FROM range(100000000) t(i)"
        r = c.post("/v1/sql", json={"sql": big, "max_rows": 10_000})
        body = r.json()
        assert r.status_code == 200 and body["truncated"]
        assert 8 * MiB - 2048 < len(r.content) <= 8 * MiB + 1024  # as many rows as fit under the cap
        r = c.post("/v1/sql", json={"sql": big, "max_rows": 10_000, "format": "arrow"})
        assert r.headers["x-llmwatch-truncated"] == "true" and len(r.content) <= 8 * MiB + 64 * 1024
        r = c.post("/v1/sql", json={"sql": "SELECT * FROM json_execute_serialized_sql("
                                           "json_serialize_sql('SELECT * FROM checkpoint()'))"})
        assert r.status_code == 400 and "json_execute_serialized_sql" in r.json()["error"]
    assert rss_bytes(server.proc.pid) - rss_before < 400 * MiB  # grew by 2.2 GB before


def test_the_collector_stays_responsive_while_every_sql_slot_is_busy(server):
    """44 slow queries: 4 run, 40 wait. /healthz, the query API and ingest still
    answer at once, the waiting ones give up after the queue timeout with a 503,
    the running ones are answered at their timeout."""
    outcomes: list[tuple[float, int, dict, str]] = []
    lock = threading.Lock()

    def slow() -> None:
        with server.client() as c:
            start = time.monotonic()
            r = c.post("/v1/sql", json={"sql": SLOW}, timeout=60)
            with lock:
                outcomes.append((time.monotonic() - start, r.status_code, r.json(), r.headers.get("retry-after", "")))

    pool = ThreadPoolExecutor(NUM_SLOW)
    futures = [pool.submit(slow) for _ in range(NUM_SLOW)]
    with server.client() as probe:
        deadline = time.monotonic() + 30
        while True:  # every slot taken and the rest in line: only then measure
            g = gauges(probe)
            if g.get("llmwatch_collector_sql_running") == NUM_SLOTS and \
                    g.get("llmwatch_collector_sql_waiting", 0) >= NUM_SLOW - 2 * NUM_SLOTS:
                break
            assert time.monotonic() < deadline, f"the SQL slots never filled: {g}"
            time.sleep(0.01)
        health_s, query_s, ingest_s = [], [], []
        for i in range(50):
            t0 = time.monotonic()
            assert probe.get("/healthz").status_code == 200
            health_s.append(time.monotonic() - t0)
            if i % 5 == 0:
                t0 = time.monotonic()
                assert probe.get("/v1/runs").status_code == 200
                query_s.append(time.monotonic() - t0)
                t0 = time.monotonic()
                body = make_batch("busy", 0, i, sections={wire.STEP: steps_section([i])})
                assert probe.post("/v1/ingest", content=body, headers={"Content-Type": wire.CONTENT_TYPE}
                                  ).status_code == 200
                ingest_s.append(time.monotonic() - t0)
        assert gauges(probe).get("llmwatch_collector_sql_running") == NUM_SLOTS, "slots emptied while measuring"
    for f in futures:
        f.result()
    pool.shutdown()

    # Answered at once: 10-30 ms here with the host's two cores busy besides. A /healthz that
    # waited on a SQL slot would wait out a query (3 s) every time; one probe of the fifty that
    # lost the CPU to the host (1.3 s in one CI run) is not the collector's doing.
    p90 = statistics.quantiles(health_s, n=10)[8]
    assert p90 < 0.25 and max(health_s) < SQL_TIMEOUT_S, \
        f"/healthz with every SQL slot busy: p90 {p90 * 1e3:.0f} ms, the slowest {max(health_s) * 1e3:.0f} ms"
    assert max(query_s) < 2.0 and max(ingest_s) < 2.0, (query_s, ingest_s)
    timed_out = [o for o in outcomes if o[1] == 400]
    busy = [o for o in outcomes if o[1] == 503]
    assert len(timed_out) + len(busy) == NUM_SLOW, [o[1:3] for o in outcomes if o[1] not in (400, 503)]
    assert len(timed_out) >= NUM_SLOTS and len(busy) >= NUM_SLOW - 3 * NUM_SLOTS
    assert all("timed out after 3 s" in o[2]["error"] for o in timed_out)
    assert all("busy" in o[2]["error"] and o[3] == "1" for o in busy)
    # Nobody waits longer than the line plus one query (and the answer's grace).
    assert max(o[0] for o in outcomes) < QUEUE_TIMEOUT_S + SQL_TIMEOUT_S + 3.0
    assert min(o[0] for o in busy) >= QUEUE_TIMEOUT_S - 0.5
