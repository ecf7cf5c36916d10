"""--max-memory: a query that builds one huge value fails; the collector lives on."""

from __future__ import annotations

import pytest

from collector.cli import parse_bytes
from tests.unit.collector.collector_server import CollectorProcess

pytestmark = pytest.mark.integration
X1000 = "lpad('', 1000, 'x')"
# Each level concatenates the previous value with itself 10 times: 1 kB -> 1 GB in six
# levels, inside single vectors, where DuckDB's memory_limit does not reach.
SELF_CONCAT_1GB = ("WITH a AS (SELECT " + X1000 + " AS s), " + ", ".join(
    f"{n} AS (SELECT {'||'.join(['s'] * 10)} AS s FROM {p})" for p, n in zip("abcdef", "bcdefg"))
    + " SELECT length(s) AS n FROM g")


def test_sizes_parse():
    assert parse_bytes("8GB") == 8 * 1000**3 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("0") == 0
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_a_query_past_the_memory_cap_fails_and_the_collector_lives_on(tmp_path):
    proc = CollectorProcess(tmp_path / "m.duckdb", args=("--max-memory", "3GB", "--duckdb-memory-limit", "1GB",
                                                           "--sql-timeout-s", "60")).start()
    try:
        with proc.client() as c:
            r = c.post("/v1/sql", json={"sql": SELF_CONCAT_1GB})
            assert r.status_code == 400 and "memory" in r.json()["error"].lower(), r.text
            assert c.get("/healthz").json()["status"] == "ok"
            assert c.post("/v1/sql", json={"sql": "SELECT 40 + 2"}).json()["rows"] == [[42]]
        status = {line.split(":")[0]: line.split()[1] for line in
                  open(f"/proc/{proc.proc.pid}/status").read().splitlines() if line.startswith(("VmHWM", "VmRSS"))}
        assert int(status["VmHWM"]) < 3 * 1000**3 // 1024  # never past the cap, in KiB
    finally:
        assert proc.stop() == 0
