"""The fleet queries (docs/fleet.md) on a real distributed engine: pyspark in local mode and DuckDB
over the same `collector archive` output give the same answers, and the answers are the fleet's
(the slow node first, its fault runs, the weeks' incidents, the rolled-back runs' goodput). Also
over an archive holding a run of an older schema, and over an empty archive."""

from __future__ import annotations

import math
import os
import shutil
import time

import pytest

from collector.offline.archive import archive, open_archive, register_spark_views
from tests.docs_sql import DOCS, sql_blocks
from tests.fleet_runs import fleet_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUERIES = sql_blocks(DOCS / "fleet.md")
NUM_RUNS = 12
T0 = time.time() - 20 * 86400.0


@pytest.fixture(scope="module")
def spark():
    """A local SparkSession (one JVM for the module)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("pyspark is not installed (`make test` installs the [fleet] extra)")
        pytest.skip("pyspark is not installed (pip install -e '.[fleet]')")
    if shutil.which("java") is None:
        if os.environ.get("CI"):
            pytest.fail("no Java runtime for Spark (apt-get install openjdk-17-jre-headless)")
        pytest.skip("no Java runtime for Spark")
    session = (SparkSession.builder.master("local[2]").appName("llmwatch-fleet-test")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
               .config("spark.sql.shuffle.partitions", "4").config("spark.driver.memory", "1g").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def fleet_archive(tmp_path_factory):
    """12 runs of 4 of 6 nodes (node2 slow in each of its runs), archived; plus a run archived by
    an older collector (its steps without the columns added since, its incidents without cause_key)."""
    d = tmp_path_factory.mktemp("fleet")
    root = d / "archive"
    archive(fleet_file(d / "fleet.duckdb", num_runs=NUM_RUNS, t0=T0, steps=40), root)
    import duckdb

    con = duckdb.connect()
    try:
        for table, sql in {  # the run id is in the folder's name only, as `collector archive` writes it
            "steps": f"SELECT 0::INTEGER AS attempt, s::BIGINT AS step, r::INTEGER AS rank, ({T0} + s)::DOUBLE AS ts, "
                     f"0.5::DOUBLE AS step_s, 0.1::DOUBLE AS fwd_s, 0.15::DOUBLE AS bwd_s, 0.05::DOUBLE AS opt_s, "
                     f"'node' || (r // 2) AS node FROM range(1, 21) t(s), range(4) u(r)",
            "ranks": "SELECT r::INTEGER AS rank, 'node' || (r // 2) AS node, 0.0::DOUBLE AS first_seen_ts "
                     "FROM range(4) t(r)",
            "incidents": f"SELECT 99::BIGINT AS id, 'crash' AS kind, 'warning' AS severity, 'node1' AS node, "
                         f"({T0} + 5)::DOUBLE AS opened_ts",
        }.items():
            out = root / table / "run_id=old" / "day=2000-01-01"
            out.mkdir(parents=True)
            con.execute(f"COPY ({sql}) TO '{out / 'data_0.parquet'}' (FORMAT parquet)")
    finally:
        con.close()
    return root


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _answers(spark, root) -> tuple[dict, dict]:
    con = open_archive(root)
    try:
        duck = {name: con.execute(sql).fetchall() for name, sql in QUERIES.items()}
    finally:
        con.close()
    register_spark_views(spark, root)
    sparked = {name: [tuple(r) for r in spark.sql(sql).collect()] for name, sql in QUERIES.items()}
    return duck, sparked


def test_spark_and_duckdb_answer_the_fleet_queries_alike(spark, fleet_archive):
    assert set(QUERIES) == {"slowest_nodes", "nodes_by_fault_runs", "incidents_by_kind_per_week", "goodput_per_run"}
    duck, sparked = _answers(spark, fleet_archive)
    for name in QUERIES:
        d, s = duck[name], sparked[name]
        assert len(d) == len(s) and all(len(x) == len(y) and all(map(_same, x, y)) for x, y in zip(d, s)), (
            name, d[:5], s[:5])
    # and what they say about the fleet
    slowest = duck["slowest_nodes"]
    assert slowest[0][0] == "node2" and 1.25 < slowest[0][2] < 1.35 and all(r[2] < 1.05 for r in slowest[1:])
    faults = {r[0]: r[1:] for r in duck["nodes_by_fault_runs"]}
    assert duck["nodes_by_fault_runs"][0][0] == "node2" and faults["node2"][0] == faults["node2"][1] >= 6
    assert faults["node1"][1] >= 1  # the old run's crash
    weeks = duck["incidents_by_kind_per_week"]
    assert sum(r[2] for r in weeks if r[1] == "straggler") == faults["node2"][1]  # one in each of its runs
    assert all((r[0] - 345600) % 604800 == 0 for r in weeks)
    goodput = {r[0]: r for r in duck["goodput_per_run"]}
    assert len(goodput) == NUM_RUNS + 1 and goodput["run002"][2] == 1 and goodput["run000"][2] == 0
    assert goodput["run002"][5] < 0.9 < goodput["run000"][5] <= 1.0 + 1e-6  # 10 rerun steps of 50


def test_an_empty_archive_answers_nothing_on_either_engine(spark, tmp_path):
    (tmp_path / "empty" / "steps").mkdir(parents=True)
    duck, sparked = _answers(spark, tmp_path / "empty")
    assert duck == sparked == {name: [] for name in QUERIES}
