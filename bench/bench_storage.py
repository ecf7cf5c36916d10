"""Storage benchmark: bytes per rank-step in the DuckDB file, before and after the
collectives rollup, after compaction and in the Parquet archive; what that means
for a 10,000-rank run on a 100 GB disk.

The run is bench/dashsim.py's (a dp x tp8 mesh, six collectives a step, a
straggler, a rollback, eval scalars, checkpoints, heartbeats), stored through the
real Storage (decode, writer thread, projections) as a collector would store it.
Then, on the closed file:

1. full         the file as the collector left it (closed: checkpointed)
2. rolled up    `collector rollup` (every step: the run is "older" than the age)
3. compacted    `collector compact` of (2); and, to price each table apart,
                compacted copies of (1) and of (1) without collectives
4. archive      `collector archive` of the run (zstd Parquet)

Per collective row and per rollup row follow from (1), (3) and the copy without
collectives, so the projection also covers other op counts per step
(`--collectives-per-step`, default 20 as bench_ingest.py's 10,000-rank scenario).
Figures only, no assertions; bytes are the file sizes on disk (plus the WAL).

    python bench/bench_storage.py            # 64 ranks x 3,000 steps
    python bench/bench_storage.py --quick    # 16 ranks x 500 steps
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dashsim import STEP_OPS, TrainingRun  # noqa: E402

from collector.ingest.decode import decode  # noqa: E402
from collector.offline import archive, retention  # noqa: E402
from collector.settings import Settings, WriterSettings  # noqa: E402
from collector.storage import Storage, connect  # noqa: E402

GB = 1e9


def fill(path: Path, run: TrainingRun, steps_per_batch: int) -> float:
    """Store the whole run through Storage; seconds it took."""
    storage = Storage(Settings(db_path=path, token="bench-token-0123456789",
                               writer=WriterSettings(linger_s=0.0, min_interval_s=0.0)))
    t0 = time.perf_counter()
    try:
        for e0, attempt, steps in run.chunks(steps_per_batch):
            futures = []
            for _, _, body, _ in run.batches(e0, attempt, steps):
                f: Future = Future()
                storage._writer.submit_batch(decode(body), f)  # as bench_ingest.py: no HTTP, grouped commits
                futures.append(f)
            for f in futures:
                f.result()
    finally:
        storage.close()
    return time.perf_counter() - t0


def counts(path: Path) -> dict[str, int]:
    con = connect(path, read_only=True)
    try:
        return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("steps", "collectives", "collectives_rollup", "collective_waits_rollup")}
    finally:
        con.close()


def compacted_copy(src: Path, dst: Path, *, drop_collectives: bool = False) -> int:
    shutil.copyfile(src, dst)
    if drop_collectives:
        con = connect(dst)
        con.execute("DELETE FROM collectives")
        con.close()
    return retention.compact(dst).bytes_after


def main() -> int:
    p = argparse.ArgumentParser(description="bytes per rank-step: full, rolled up, compacted, archived")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--steps-per-batch", type=int, default=50, help="steps per rank per batch (a ~5 s flush)")
    p.add_argument("--quick", action="store_true", help="16 ranks x 500 steps")
    p.add_argument("--fleet-ranks", type=int, default=10_000, help="the projected run's ranks")
    p.add_argument("--fleet-steps-per-s", type=float, default=1.0, help="the projected run's steps per second")
    p.add_argument("--collectives-per-step", type=int, default=20, help="the projected run's ops per rank-step")
    p.add_argument("--rollup-rows-per-step", type=int, default=4,
                   help="the projected run's distinct (axis, op, group) per rank-step: its rollup rows")
    p.add_argument("--disk-gb", type=float, default=100.0)
    args = p.parse_args()
    if args.quick:
        args.ranks, args.steps = 16, 500

    with tempfile.TemporaryDirectory(prefix="bench_storage_") as d:
        tmp = Path(d)
        db = tmp / "run.duckdb"
        run = TrainingRun("bench-storage", args.ranks, args.steps)
        fill_s = fill(db, run, args.steps_per_batch)
        n = counts(db)
        rank_steps = n["steps"]
        coll_rows = n["collectives"]
        full = retention.file_bytes(db)
        print(f"run: {args.ranks} ranks x {len(run.order)} executed steps ({args.steps} distinct, one rollback), "
              f"{len(STEP_OPS)} collectives a step: {rank_steps:,} steps rows, {coll_rows:,} collectives rows; "
              f"stored in {fill_s:.1f} s through Storage")

        full_compacted = compacted_copy(db, tmp / "full_compacted.duckdb")
        no_coll = compacted_copy(db, tmp / "no_collectives.duckdb", drop_collectives=True)

        con = connect(db)
        t0 = time.perf_counter()
        r = retention.rollup(con, older_than_s=retention.DAY_S, now=time.time() + 2 * retention.DAY_S)
        rollup_s = time.perf_counter() - t0
        con.close()
        rolled = retention.file_bytes(db)
        rolled_compacted = retention.compact(db, out=tmp / "rolled_compacted.duckdb").bytes_after

        t0 = time.perf_counter()
        a = archive.archive(db, tmp / "archive")
        archive_s = time.perf_counter() - t0
        parquet = sum(f.stat().st_size for f in (tmp / "archive").rglob("*.parquet"))

        per = lambda b: b / rank_steps  # noqa: E731
        print(f"\nbytes per rank-step ({len(STEP_OPS)} collectives a step)")
        print(f"  1 full file (closed, checkpointed)        : {per(full):8.0f}   ({full / 2**20:.1f} MiB)")
        print(f"    the same, compacted (fresh copy)        : {per(full_compacted):8.0f}")
        print(f"  2 after rollup + checkpoint (same file)   : {per(rolled):8.0f}   "
              f"({rolled / full:.2f} x full: DuckDB reuses freed blocks, does not shrink the file)")
        print(f"  3 rolled up and compacted                 : {per(rolled_compacted):8.0f}   "
              f"({rolled_compacted / full:.2f} x full)")
        print(f"  4 Parquet archive (rolled-up run, zstd)   : {per(parquet):8.0f}   ({a.files} files)")
        print(f"  without any collectives (compacted)       : {per(no_coll):8.0f}")
        coll_row = (full_compacted - no_coll) / coll_rows
        rollup_row = (rolled_compacted - no_coll) / max(1, r.rollup_rows + r.wait_rows)
        print(f"\nper row: collectives {coll_row:.1f} B, rollup (summary + wait) {rollup_row:.1f} B; "
              f"rollup {r.raw_rows:,} rows -> {r.rollup_rows:,} summary + {r.wait_rows:,} wait rows in "
              f"{rollup_s:.2f} s ({r.raw_rows / rollup_s / 1e6:.2f} M raw rows/s, {r.num_chunks} chunks); "
              f"archive {archive_s:.2f} s")

        base = per(no_coll)
        k, m = args.collectives_per_step, args.rollup_rows_per_step
        waits_per_step = (r.wait_rows / rank_steps)
        full_k = base + k * coll_row
        rolled_k = base + (m + waits_per_step) * rollup_row
        rate = args.fleet_ranks * args.fleet_steps_per_s  # rank-steps per second
        disk = args.disk_gb * GB
        days = lambda bps: disk / (bps * rate) / 86400  # noqa: E731
        print(f"\nprojection: {args.fleet_ranks:,} ranks x {args.fleet_steps_per_s:g} step/s x {k} collectives a step "
              f"on {args.disk_gb:g} GB")
        print(f"  full detail      : {full_k:6.0f} B/rank-step = {full_k * rate / 2**20:6.1f} MiB/s -> "
              f"{days(full_k) * 24:6.1f} h ({days(full_k):.2f} days)")
        print(f"  rolled up        : {rolled_k:6.0f} B/rank-step = {rolled_k * rate / 2**20:6.1f} MiB/s -> "
              f"{days(rolled_k) * 24:6.1f} h ({days(rolled_k):.2f} days), compacted")
        print(f"  rolled up, ratio : {full_k / rolled_k:.1f} x the full detail's span")
        keep_s = 86400.0  # one day of full detail (the minimum rollup age), then rolled up
        if full_k * rate * keep_s < disk:
            rest = (disk - full_k * rate * keep_s) / (rolled_k * rate) / 86400
            print(f"  1 day full + rolled up after: {1 + rest:.2f} days on the disk")
        else:
            print("  1 day of full detail alone exceeds the disk: archive and drop, or sample, sooner")
    return 0


if __name__ == "__main__":
    sys.exit(main())
