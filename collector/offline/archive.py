"""`collector archive`: finished runs out of the DuckDB file into a Parquet archive.

Layout (hive partitioning, what DuckDB, polars, Spark and Trino read as is):

    DIR/<table>/run_id=<id>/day=YYYY-MM-DD/data_0.parquet

One folder per table with per-run rows (`ARCHIVED`), partitioned by run and by the
UTC day of the row's own time column (`ARCHIVED[table]`; a row without one gets
its run's `created_ts` day). The partition values live in the paths only (DuckDB
URL-encodes them: a run id may hold `/`), so a reader adds them back as columns
with hive partitioning; give `run_id` as VARCHAR (`hive_types`), or a run id of
digits is read as a number. docs/scale.md has the queries.

Re-archiving a run replaces it: every table's files of the run are written into a
staging folder under DIR first, then each `run_id=<id>` folder is swapped in
(the old one renamed away, the new one renamed in, the old one removed), so a
run is never in the archive twice and a failed archive leaves the old copy.

Not archived: `alert_outbox` (the delivery queue: the exact bytes sent to
receivers, whose URLs and signing secret the collector never stores anyway) and
`schema_version` (not about a run). No table holds a token or a secret
(DESIGN.md section 5): a column whose name says so is refused all the same.

The source is opened read-only: a closed file, or a copy of a live one (DuckDB
lets no second process open a file a collector holds; `collector serve` itself
never archives). A run still `running` is skipped unless asked for with `force`.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import duckdb

# table -> the column whose UTC day partitions it
ARCHIVED: dict[str, str | None] = {
    "runs": "created_ts", "ranks": "first_seen_ts", "steps": "ts", "collectives": "start_ts",
    "collectives_rollup": "start_ts", "collective_waits_rollup": None, "scalars": "ts", "heartbeats": "ts",
    "device_health": "ts",
    "events": "ts", "incidents": "opened_ts", "actions": "requested_ts", "checkpoints": "ts",
    "nodes": "updated_ts", "commands": "issued_ts", "bad_batches": "ts", "batches": "received_ts",
}
NOT_ARCHIVED = {"alert_outbox": "the alert delivery queue, not telemetry",
                "schema_version": "not about a run"}
# a column named like a credential (not `tokens`: training tokens are a count)
_SECRET_COLUMN = re.compile(r"(^|_)(token|secret|password|passwd|credentials?|api_key|auth)($|_)", re.I)
_MAX_TS = 253402300799.0  # 9999-12-31: a clock that far off is no day


class ArchiveError(RuntimeError):
    pass


@dataclass(slots=True)
class ArchiveResult:
    archived: list[str] = field(default_factory=list)  # run ids written
    skipped: dict[str, str] = field(default_factory=dict)  # run id -> why not
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows written
    files: int = 0


def partition_name(run_id: str) -> str:
    """The folder DuckDB's PARTITION_BY writes for this run (its value URL-encoded)."""
    return "run_id=" + quote(run_id, safe="")


def _day_sql(column: str | None) -> str:
    """The UTC day of `column` (unix s), falling back to the run's created_ts."""
    ts = f"CASE WHEN isfinite(t.{column}) AND t.{column} BETWEEN 0 AND {_MAX_TS} THEN t.{column} END" \
        if column else "NULL"
    return (f"strftime(make_timestamp(CAST(coalesce({ts}, r.created_ts, 0) * 1e6 AS BIGINT)), '%Y-%m-%d')")


def _tables(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Tables of the file with per-run rows that are archived; an unknown one is an error
    (a new table must be placed in ARCHIVED or NOT_ARCHIVED)."""
    have = {t: [c for (c,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ? "
                                          "AND schema_name = 'main' ORDER BY column_index", [t]).fetchall()]
            for (t,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall()}
    unknown = sorted(t for t, cols in have.items() if "run_id" in cols and t not in ARCHIVED and t not in NOT_ARCHIVED)
    if unknown:
        raise ArchiveError(f"tables {unknown} are neither archived nor excluded (collector/offline/archive.py ARCHIVED)")
    for t in ARCHIVED:
        secret = [c for c in have.get(t, []) if _SECRET_COLUMN.search(c)]
        if secret:
            raise ArchiveError(f"{t} has columns {secret} that may hold secrets: refusing to archive them")
    return [t for t in ARCHIVED if t in have]


def select_runs(con: duckdb.DuckDBPyConnection, run_ids: list[str] | None, *,
                force: bool = False) -> tuple[list[str], dict[str, str]]:
    """(runs to archive, {run: why skipped}): the finished runs, or those named."""
    status = dict(con.execute("SELECT run_id, status FROM runs ORDER BY created_ts, run_id").fetchall())
    chosen, skipped = [], {}
    for run_id in (run_ids if run_ids else list(status)):
        if run_id not in status:
            skipped[run_id] = "no such run"
        elif status[run_id] == "running" and not force:
            skipped[run_id] = "still running (--force archives what it has so far)"
        else:
            chosen.append(run_id)
    return chosen, skipped


def archive(db_path: str | Path, out_dir: str | Path, *, run_ids: list[str] | None = None,
            force: bool = False, con: duckdb.DuckDBPyConnection | None = None) -> ArchiveResult:
    """Write the runs' rows of every archived table under `out_dir` (see the module
    doc). `con`: an open connection to use instead of opening `db_path` read-only."""
    own = con is None
    if own:
        # read-only, but not collector.storage.connect's lockdown: COPY writes files
        con = duckdb.connect(str(db_path), read_only=True)
    out = Path(out_dir)
    try:
        tables = _tables(con)
        chosen, skipped = select_runs(con, run_ids, force=force)
        result = ArchiveResult(skipped=skipped)
        if not chosen:
            return result
        out.mkdir(parents=True, exist_ok=True)
        staging = out / f".staging-{uuid.uuid4().hex[:12]}"
        staging.mkdir()
        try:
            con.execute("CREATE OR REPLACE TEMP TABLE _archive_runs (run_id VARCHAR)")
            con.executemany("INSERT INTO _archive_runs VALUES (?)", [[r] for r in chosen])
            for table in tables:
                (n,), = con.execute(f"SELECT count(*) FROM {table} JOIN _archive_runs USING (run_id)").fetchall()
                result.rows[table] = int(n)
                if not n:
                    continue
                target = staging / table
                target.mkdir()
                con.execute(f"""
                    COPY (SELECT t.*, {_day_sql(ARCHIVED[table])} AS day
                          FROM {table} t JOIN _archive_runs USING (run_id)
                          LEFT JOIN (SELECT run_id, created_ts FROM runs) r USING (run_id))
                    TO '{_sql_text(target)}' (FORMAT parquet, PARTITION_BY (run_id, day), COMPRESSION zstd)""")
            result.files = _swap_in(staging, out, tables, chosen)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            con.execute("DROP TABLE IF EXISTS _archive_runs")
        result.archived = chosen
        return result
    finally:
        if own:
            con.close()


def _swap_in(staging: Path, out: Path, tables: list[str], run_ids: list[str]) -> int:
    """Replace each run's folder of each table with the staged one (or remove it when
    the run has no rows there now). Returns the number of files placed."""
    files = 0
    for table in tables:
        (out / table).mkdir(exist_ok=True)
        for run_id in run_ids:
            name = partition_name(run_id)
            new, old = staging / table / name, out / table / name
            trash = out / table / f".old-{uuid.uuid4().hex[:12]}"
            if old.exists():
                os.replace(old, trash)
            if new.exists():
                os.replace(new, old)
                files += sum(1 for _ in old.rglob("*.parquet"))
            shutil.rmtree(trash, ignore_errors=True)
        left = [p.name for p in (staging / table).glob("run_id=*")] if (staging / table).exists() else []
        if left:  # DuckDB named a partition otherwise than partition_name: never lose it silently
            raise ArchiveError(f"unexpected partition folders for {table}: {left}")
    return files


def _sql_text(path: Path) -> str:
    return str(path).replace("'", "''")


def open_archive(out_dir: str | Path, *, threads: int = 2) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per archived table over `out_dir`'s
    Parquet files (every `ARCHIVED` table, hive partitions `run_id` and `day` as columns):
    the archive queried as the collector's file is, `SELECT ... FROM incidents`. Every
    view has this collector's columns: runs archived by an older collector are read by
    column name (`union_by_name`), a column none of the files has is NULL; a table without
    files (an empty archive) is an empty table of the collector's schema, so every query
    runs and answers nothing. The connection reads files (the archive's): keep it to your
    own queries, not a client's."""
    from collector.store.schema import migrate

    root = Path(out_dir)
    con = duckdb.connect(config={"threads": threads})
    migrate(con)  # every table, empty: what a table without files reads as
    for table in ARCHIVED:
        folder = root / table
        if not any(folder.glob("run_id=*/**/*.parquet")):
            con.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS day VARCHAR")
            continue
        pattern = str(folder / "**" / "*.parquet").replace("'", "''")
        source = (f"read_parquet('{pattern}', hive_partitioning = true, union_by_name = true, "
                  f"hive_types = {{'run_id': VARCHAR, 'day': VARCHAR}})")
        have = {name for name, *_ in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}
        columns = [(name, kind) for name, kind, *_ in con.execute(f"DESCRIBE {table}").fetchall()]
        select = ", ".join(f'"{n}"' if n in have else f'NULL::{k} AS "{n}"' for n, k in columns)
        con.execute(f"DROP TABLE {table}")
        con.execute(f"CREATE VIEW {table} AS SELECT {select}, day FROM {source}")
    return con


_SPARK_TYPES = {"VARCHAR": "STRING", "JSON": "STRING", "DOUBLE": "DOUBLE", "FLOAT": "FLOAT", "BIGINT": "BIGINT",
                "INTEGER": "INT", "SMALLINT": "SMALLINT", "TINYINT": "TINYINT", "BOOLEAN": "BOOLEAN",
                "HUGEINT": "DECIMAL(38,0)", "UBIGINT": "DECIMAL(20,0)"}


def register_spark_views(spark, out_dir: str | Path, tables: list[str] | None = None) -> list[str]:
    """The archive under `out_dir` as Spark temporary views, one per archived table (docs/fleet.md):
    `spark.read.parquet` of the table's folder (hive partitions discovered; `mergeSchema` for runs of
    an older schema), or, for a table without files, an empty frame of the collector's schema.
    `spark` is a SparkSession made with `spark.sql.sources.partitionColumnTypeInference.enabled`
    false (a run id of digits stays a string). Returns the tables that had files."""
    from collector.store.schema import migrate

    root = str(out_dir).rstrip("/")
    local = "://" not in root
    with duckdb.connect() as con:
        migrate(con)
        schemas = {t: ", ".join(f"`{name}` {_SPARK_TYPES.get(str(kind).split('(')[0], 'STRING')}"
                                for name, kind, *_ in con.execute(f"DESCRIBE {t}").fetchall())
                   for t in ARCHIVED}
    found = []
    for table in tables or list(ARCHIVED):
        path = f"{root}/{table}"
        if local and not any(Path(path).glob("run_id=*/**/*.parquet")):
            spark.createDataFrame([], schemas[table] + ", `day` STRING").createOrReplaceTempView(table)
            continue
        spark.read.option("mergeSchema", "true").parquet(path).createOrReplaceTempView(table)
        found.append(table)
    return found
