"""Asynchronous, sharded, checksummed checkpoints.

Assumes a filesystem shared by all ranks (one machine, or NFS/Lustre across nodes):
rank 0 finalizes what every rank wrote, and every rank reads the manifest.

One checkpoint is one directory:

    <dir>/step-00000010/
        manifest.json        written last; a directory without it is never loaded
        model-pp00-tp01.pt   {"model": ..., "optim": ...} of one (pp, tp) coordinate
        rank-00003.pt        one rank's own state (RNG states, ...)

Who writes what: data-parallel replicas hold identical model and optimizer
shards, so only dp rank 0 of each (pp, tp) coordinate writes its
`model-ppXX-tpYY.pt`. Every rank may pass its `model_state`/`optim_state`; the
Checkpointer decides by `dims.dp_rank` and ignores them (without copying) on
dp ranks > 0. Every rank writes its `rank-RRRRR.pt`.

What a save costs the training loop: `save()` only copies the state to host
memory (a memcpy into host buffers reused from earlier saves; on CUDA a
non-blocking copy into pinned buffers and one sync) and queues a job. A background writer thread (one per Checkpointer) then
serializes each shard into `<dir>/step-XXXXXXXX.tmp/`, hashing (sha256) and
counting bytes as it writes, fsyncs, and publishes a partial manifest
`rank-RRRRR.json` atomically. Rank 0's writer polls the filesystem (background
threads never run collectives) until all partial manifests of this session
exist, writes `manifest.json`, and renames the directory to `step-XXXXXXXX`.
Then it prunes to the newest `keep` (removing checkpoints of later steps: after a
rollback they belong to an abandoned lineage) and, with a `persist_dir`, hands
the checkpoint to a persister thread that copies it to the second tier.

Back-pressure: at most two saves are in flight per rank, one being written and
one queued (so at most two host copies of the state exist). A third `save()`
blocks the loop until the writer is done with the save it is writing (on rank 0:
done finalizing it, which waits for the slowest rank); it logs when it blocks.
A persist that is still waiting when a newer checkpoint is finalized is skipped
(only the newest waiting checkpoint is copied), so a slow second tier never
backs up the first.

Loading: `load_latest()` tries finalized checkpoints newest first (for one
step the local copy, then the persisted one); `load_latest(before_step=S)` only
those of steps before S: the newest verified checkpoint from before a bad step,
where a rollback restarts. The checkpoints it passes over stay on disk until the
next save prunes them as an abandoned lineage. Each rank verifies sha256 and
size of the files it needs; one `all_reduce(MIN)` of a flag makes every rank
move on together when any rank's shard is bad. A different dp size reshards by
mapping each rank to the model file of its (pp, tp) coordinate; tp/pp cannot
change. Shards are pickles (RNG states hold numpy arrays), so they are loaded
with `weights_only=False`: checkpoint directories must be trusted. Everything is
loaded with `map_location="cpu"`; the caller moves it to its device.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import queue
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
import torch.distributed as dist

from trainer.comm import Comm
from trainer.config import CheckpointConfig
from trainer.parallel_dims import Axis, ParallelDims

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_IN_FLIGHT = 2  # saves per rank: one being written, one queued
KNOWN_GOOD_SPAN = 4  # x keep: checkpoints kept after the newest known-good one once the watermark is stale
KNOWN_GOOD_STALE_S = 120.0  # a watermark that has not moved this long: the collector is away or stuck
_FINAL_RE = re.compile(r"^step-(\d{8,})$")
_STEP_RE = re.compile(r"^step-(\d{8,})\.\w+$")  # not finalized: .tmp, .replaced
_POLL_S = 0.05
_COPY_CHUNK = 8 << 20
_OK, _BAD, _INCOMPATIBLE = 1, 0, -1  # MIN over ranks: one incompatible rank outvotes, one bad rank outvotes ok


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def model_filename(pp: int, tp: int) -> str:
    return f"model-pp{pp:02d}-tp{tp:02d}.pt"


def rank_filename(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


@dataclass(frozen=True, slots=True)
class SaveRecord:
    """One finished save, as seen by this rank (`Checkpointer.poll()`)."""

    step: int
    path: Path  # the finalized directory
    num_shards: int  # files this rank wrote
    bytes: int  # bytes this rank wrote
    write_s: float  # background time to serialize, hash and fsync this rank's files and its partial manifest
    stall_s: float  # time save() blocked the training loop (back-pressure + copy to host)
    checksums: dict[str, str]  # file name -> sha256, this rank's files
    finalized: bool | None  # rank 0: manifest written and renamed; None elsewhere (not known there)
    persisted: bool | None  # rank 0 with a persist_dir: copied to it; None elsewhere
    error: str | None = None


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    step: int
    path: Path
    model_state: Any
    optim_state: Any
    rank_state: Any  # None when this rank's coordinate has no rank file (a larger dp): reseed
    meta: dict
    manifest: dict


@dataclass(frozen=True, slots=True)
class _Shard:
    file: str
    kind: str  # "model" | "rank"
    coords: dict[str, int]
    state: Any


@dataclass(frozen=True, slots=True)
class Queued:
    """One save handed to the background writer (`Checkpointer.save()`)."""

    step: int
    num_shards: int  # files this rank will write
    bytes: int  # bytes of the host copies they are written from
    stall_s: float  # time save() blocked the training loop (back-pressure + copy to host)


@dataclass(frozen=True, slots=True)
class _Job:
    step: int
    shards: list[_Shard]
    meta: dict
    stall_s: float
    buffers: list[torch.Tensor]  # host copies, back to the pool once written


@dataclass(frozen=True, slots=True)
class _Candidate:
    step: int
    tier: int  # 0 = cfg.dir, 1 = persist_dir
    path: Path


class _ShardError(Exception):
    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


class _HashingWriter:
    """File wrapper that hashes and counts what `torch.save` writes: one pass, no re-read."""

    __slots__ = ("_f", "sha256", "nbytes")

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.nbytes += memoryview(data).nbytes
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


class _HostPool:
    """Host buffers of earlier saves, reused by later ones.

    A fresh allocation of the state's size page-faults on first touch, which costs the loop
    more than the copy itself (96 MB here: ~40 ms cold, ~15 ms into reused buffers). Buffers
    go back once the writer is done with them; the pool keeps only shapes the latest save
    used, so it holds at most MAX_IN_FLIGHT host copies of the state, the peak the
    back-pressure allows anyway."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(shape, dtype, pinned: bool) -> tuple:
        return tuple(shape), dtype, pinned

    def take(self, like: torch.Tensor, pinned: bool) -> torch.Tensor:
        with self._lock:
            bucket = self._free.get(self._key(like.shape, like.dtype, pinned))
            if bucket:
                return bucket.pop()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)

    def give(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for t in buffers:
                self._free.setdefault(self._key(t.shape, t.dtype, t.is_pinned()), []).append(t)

    def retain(self, used: set[tuple]) -> None:
        """Drop buffers of shapes the latest save did not use (the state changed shape)."""
        with self._lock:
            self._free = {k: v for k, v in self._free.items() if k in used}


class Checkpointer:
    """Sharded asynchronous checkpoints of one rank (see the module docstring).

    Collective: every rank constructs it at the same point (one broadcast agrees
    on a session token, so that partial manifests left by a crashed earlier run
    in a same-named `.tmp` directory are never mixed into this run's manifest).
    `serialize` writes one shard to a binary file; tests inject a slow one.
    `slow_write(step)` (fault injection, trainer/faults.py `slowio` what=ckpt) is how
    many times as long this rank's shard writes of that step take: the writer thread
    really waits (F - 1) x each shard's measured write, and its `write_s` shows it.
    `keep_older_than` (steps; 0: off): pruning to `cfg.keep` also keeps every checkpoint
    of the last that many steps and the newest one before them. The replicas' checksums
    (every `checksum_every` steps) vouch for a checkpoint only once a later checksum
    agreed, and a divergence caught at the next checksum rolls back to before the last
    agreeing one: with checkpoints more frequent than checksums the newest `keep` can
    all be too recent (the trainer passes 2 x checksum_every).
    `known_good()` (rank 0's): the collector's clean-through watermark (collector/live/
    watermark.py, through the agent); -1 while it has vouched for nothing of this attempt
    (it trails the ranks by a second or more); None when no watermark comes (no collector,
    no detection): pruning is then plain `keep`. Pruning never removes the newest
    checkpoint at or below it, nor any after it, so a rollback decided late still finds
    one before its incident. Should the watermark not move for `KNOWN_GOOD_STALE_S` (a
    collector away or stuck), disk stays bounded: the known-good one and the newest
    `KNOWN_GOOD_SPAN` x `keep` after it stay.
    """

    def __init__(self, cfg: CheckpointConfig, *, dims: ParallelDims, comm: Comm, log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.time, serialize: Callable[[Any, BinaryIO], None] = torch.save,
                 finalize_timeout_s: float = 600.0, slow_write: Callable[[int], float] | None = None,
                 keep_older_than: int = 0, known_good: Callable[[], int | None] | None = None) -> None:
        if not cfg.dir:
            raise ValueError("CheckpointConfig.dir is required")
        self.cfg = cfg
        self.dims = dims
        self.comm = comm
        self.log = log
        self.clock = clock
        self.dir = Path(cfg.dir)
        self.persist_dir = Path(cfg.persist_dir) if cfg.persist_dir else None
        self._serialize = serialize
        self._slow_write = slow_write
        self._keep_older_than = keep_older_than
        self._known_good = known_good
        self._mark_moved: tuple[int | None, float] = (None, time.monotonic())  # the watermark, when it last moved
        self._lag_logged = False
        self._finalize_timeout_s = finalize_timeout_s
        self.dir.mkdir(parents=True, exist_ok=True)
        token = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=comm.device)
        comm.broadcast(token, Axis.WORLD)
        self._session = int(token.item())  # host sync: once, at construction

        self._slots = threading.Semaphore(MAX_IN_FLIGHT)
        self._pool = _HostPool()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._cv = threading.Condition()
        self._records: list[SaveRecord] = []
        self._num_outstanding = 0  # saves not yet reported (written; finalized and persisted on rank 0)
        self._persist_next: SaveRecord | None = None
        self._pinned: set[int] = set()  # local steps the persister still reads; pruning skips them
        self._last_finalized = -1
        self._last_saved_step: int | None = None
        self._prune_lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._writer = threading.Thread(target=self._writer_loop, name="ckpt-writer", daemon=True)
        self._writer.start()
        self._persister = None
        if self.persist_dir is not None and dims.rank == 0:
            self._persister = threading.Thread(target=self._persister_loop, name="ckpt-persister", daemon=True)
            self._persister.start()

    # -- training-loop API ---------------------------------------------------
    def save(self, step: int, *, model_state: dict | None, optim_state: dict | None, rank_state: dict,
             meta: dict) -> Queued | None:
        """Copy this rank's shards to host memory and queue them; returns before any file is written
        (what was queued; None: not saved).

        `meta` must be JSON (it goes into the manifest) and identical on all ranks. Saving the
        step saved last again (without a `load_latest()` in between) is a no-op: two jobs of one
        step would write into the same `.tmp` directory."""
        if self._closed:
            raise RuntimeError("save() after close()")
        if step == self._last_saved_step:  # saved on schedule and on command at the same step
            self.log(f"checkpoint step {step}: already saved, not saved again")
            return None
        t0 = self.clock()
        meta = json.loads(json.dumps(meta))  # fails here, in the caller, if it is not JSON; also a snapshot
        if not self._slots.acquire(blocking=False):
            self.log(f"checkpoint step {step}: {MAX_IN_FLIGHT} saves still in flight, waiting for the writer")
            self._slots.acquire()
        try:
            copier = _HostCopier(self._pool)
            d = self.dims
            shards = []
            if d.dp_rank == 0:
                state = {"model": copier.copy(model_state), "optim": copier.copy(optim_state)}
                coords = {"pp": d.pp_rank, "tp": d.tp_rank}
                shards.append(_Shard(model_filename(d.pp_rank, d.tp_rank), "model", coords, state))
            shards.append(_Shard(rank_filename(d.rank), "rank", dict(d.coords), copier.copy(rank_state)))
            copier.sync()
        except BaseException:
            self._slots.release()
            raise
        self._pool.retain(copier.keys)
        with self._cv:
            self._num_outstanding += 1
        stall_s = self.clock() - t0
        self._jobs.put(_Job(step, shards, meta, stall_s, copier.buffers))
        self._last_saved_step = step
        return Queued(step, len(shards), sum(b.numel() * b.element_size() for b in copier.buffers), stall_s)

    def poll(self) -> list[SaveRecord]:
        """Saves finished since the last call (for telemetry events)."""
        with self._cv:
            records, self._records = self._records, []
        return records

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this rank's saves are written (on rank 0: finalized and persisted). False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._num_outstanding == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued saves and stop the threads. False if saves were still running at `timeout`."""
        if self._closed:
            return True
        self._closed = True
        done = self.wait(timeout)
        self._jobs.put(None)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if not done:
            self.log("checkpoint: closing with saves still being written; their directories stay .tmp")
            return False
        self._writer.join()
        if self._persister is not None:
            self._persister.join()
        return True

    # -- writer thread ------------------------------------------------------
    def _writer_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run_job(job)
            except Exception as e:  # never raise into training: report it as the save's result
                self.log(f"checkpoint step {job.step}: save failed: {e!r}")
                self._finish(SaveRecord(job.step, self.dir / step_dirname(job.step), 0, 0, 0.0, job.stall_s, {},
                                        False if self.dims.rank == 0 else None, None, repr(e)))
            finally:
                self._pool.give(job.buffers)
                self._slots.release()

    def _run_job(self, job: _Job) -> None:
        t0 = self.clock()
        name = step_dirname(job.step)
        tmp = self.dir / f"{name}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        entries = [self._write_shard(tmp, shard, job.step) for shard in job.shards]
        partial = {"format": FORMAT_VERSION, "session": self._session, "step": job.step, "rank": self.dims.rank,
                   "write_s": self.clock() - t0, "shards": entries}
        _write_json_atomic(tmp / f"rank-{self.dims.rank:05d}.json", partial)
        # the whole of this rank's part, its partial manifest's fsyncs included: what checkpoint_slow's
        # still-writing bound (queued to the newest step row without a report) is a lower bound of
        write_s = self.clock() - t0
        record = SaveRecord(job.step, self.dir / name, len(entries), sum(e["bytes"] for e in entries), write_s,
                            job.stall_s, {e["file"]: e["sha256"] for e in entries}, None, None)
        if self.dims.rank != 0:
            self._finish(record)
            return
        try:
            self._finalize(job, tmp)
        except Exception as e:
            self.log(f"checkpoint step {job.step}: not finalized: {e}")
            self._finish(replace(record, finalized=False, error=str(e)))
            return
        self._prune(self.dir, job.step)
        record = replace(record, finalized=True)
        if self._persister is None:
            self._finish(record)
            return
        with self._cv:
            superseded, self._persist_next = self._persist_next, record
            self._pinned.add(job.step)
            if superseded is not None:
                self._pinned.discard(superseded.step)
            self._cv.notify_all()
        if superseded is not None:
            self.log(f"checkpoint step {superseded.step}: not persisted, superseded by step {job.step}")
            self._finish(replace(superseded, persisted=False))

    def _write_shard(self, tmp: Path, shard: _Shard, step: int) -> dict:
        t0 = self.clock()
        with open(tmp / shard.file, "wb") as f:
            writer = _HashingWriter(f)
            self._serialize(shard.state, writer)
            f.flush()
            os.fsync(f.fileno())
        factor = self._slow_write(step) if self._slow_write is not None else 1.0
        if factor > 1.0:  # injected slow storage: the write really takes factor x as long
            time.sleep((factor - 1.0) * max(0.0, self.clock() - t0))
        return {"file": shard.file, "kind": shard.kind, "coords": shard.coords, "sha256": writer.sha256.hexdigest(),
                "bytes": writer.nbytes, "writer_rank": self.dims.rank, "write_s": self.clock() - t0}

    def _finalize(self, job: _Job, tmp: Path) -> None:
        """Rank 0: wait for every rank's partial manifest, write manifest.json, rename into place."""
        partials = self._await_partials(job.step, tmp)
        shards = sorted((s for p in partials for s in p["shards"]), key=lambda s: s["file"])
        d = self.dims
        manifest = {
            "format": FORMAT_VERSION, "step": job.step, "session": self._session, "world_size": d.world_size,
            "mesh": {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sp": d.sp}, "created_unix": self.clock(),
            "write_s": {str(p["rank"]): p["write_s"] for p in partials}, "meta": job.meta, "shards": shards,
        }
        listed = {s["file"] for s in shards}
        for entry in os.scandir(tmp):  # partial manifests, files left by an earlier run with another layout
            if entry.name not in listed:
                os.unlink(entry.path)
        _write_json_atomic(tmp / MANIFEST, manifest)
        with self._prune_lock:  # a concurrent prune never sees this directory without knowing it is the newest
            _publish(tmp, self.dir / step_dirname(job.step))
            self._last_finalized = job.step

    def _await_partials(self, step: int, tmp: Path) -> list[dict]:
        deadline = self.clock() + self._finalize_timeout_s
        found: dict[int, dict] = {}
        while True:
            present = {e.name for e in os.scandir(tmp)}
            for rank in range(self.dims.world_size):
                name = f"rank-{rank:05d}.json"
                if rank in found or name not in present:
                    continue
                try:
                    partial = json.loads((tmp / name).read_text())
                except (OSError, ValueError):
                    continue
                if partial.get("session") == self._session and partial.get("step") == step:
                    found[rank] = partial
            if len(found) == self.dims.world_size:
                return [found[r] for r in range(self.dims.world_size)]
            if self.clock() > deadline:
                missing = sorted(set(range(self.dims.world_size)) - set(found))
                raise TimeoutError(f"ranks {missing} did not finish writing within {self._finalize_timeout_s:.0f} s")
            time.sleep(_POLL_S)

    # -- persister thread (rank 0) ---------------------------------------------
    def _persister_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._persist_next is not None or self._stopping)
                record, self._persist_next = self._persist_next, None
            if record is None:
                return
            try:
                self._persist(record.step)
                record = replace(record, persisted=True)
            except Exception as e:
                self.log(f"checkpoint step {record.step}: not persisted: {e}")
                record = replace(record, persisted=False, error=f"persist: {e}")
            with self._cv:
                self._pinned.discard(record.step)
            self._prune(self.dir, None)  # what was pinned during the copy
            self._finish(record)

    def _persist(self, step: int) -> None:
        name = step_dirname(step)
        src = self.dir / name
        manifest = json.loads((src / MANIFEST).read_text())
        tmp = self.persist_dir / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for shard in manifest["shards"]:
            sha256, nbytes = _copy_hashed(src / shard["file"], tmp / shard["file"])
            if sha256 != shard["sha256"] or nbytes != shard["bytes"]:
                raise OSError(f"{src / shard['file']} no longer matches its checksum")
        _copy_hashed(src / MANIFEST, tmp / MANIFEST)  # last: the copy is loadable only once complete
        _fsync_dir(tmp)
        _publish(tmp, self.persist_dir / name)
        self._prune(self.persist_dir, step)

    # -- bookkeeping ---------------------------------------------------------
    def _finish(self, record: SaveRecord) -> None:
        with self._cv:
            self._records.append(record)
            self._num_outstanding -= 1
            self._cv.notify_all()

    def _prune(self, root: Path, newest_step: int | None) -> None:
        """Make `newest_step` (just finalized; None: the last one finalized locally) the newest
        checkpoint under `root`, keep the newest `cfg.keep` (0 keeps all), and drop non-final
        leftovers of older steps.

        Finalized checkpoints of later steps are removed: a save of step s means the run is at
        s, so they belong to a lineage a rollback abandoned (or to an earlier run in the same
        directory), and `load_latest()` must not resume into them."""
        with self._prune_lock:
            if newest_step is None:
                newest_step = self._last_finalized
            with self._cv:
                pinned = set(self._pinned) if root == self.dir else set()
            finals, newer = [], []
            for step, path in _list_final(root):
                if step > newest_step:
                    _remove_checkpoint(path)
                    newer.append(step)
                else:
                    finals.append((step, path))
            if newer:
                self.log(f"checkpoints {', '.join(step_dirname(s) for s in newer)} under {root}: removed, newer than "
                         f"step {newest_step} just saved (abandoned by a rollback, or left by an earlier run)")
            if self.cfg.keep > 0:
                if self._keep_older_than > 0:  # the window, and the newest one a later checksum vouches for
                    edge = newest_step - self._keep_older_than
                    old_enough = [s for s, _ in finals if s <= edge]
                    pinned.update(s for s, _ in finals if s > edge)
                    if old_enough:
                        pinned.add(old_enough[-1])
                pinned.update(self._known_good_span(finals, root))
                for step, path in finals[:-self.cfg.keep]:
                    if step not in pinned:
                        _remove_checkpoint(path)
            for entry in os.scandir(root):
                m = _STEP_RE.match(entry.name)
                if m and int(m.group(1)) < newest_step and entry.is_dir():
                    shutil.rmtree(entry.path, ignore_errors=True)

    def _known_good_span(self, finals: list[tuple[int, Path]], root: Path) -> set[int]:
        """The steps pruning must keep for the watermark: the newest known-good checkpoint and
        every one after it. The watermark trails the ranks by the collector's latency (a
        second: dozens of tiny steps): while no checkpoint is at or below it yet, every one
        is kept, for it may become that one. A watermark stale for KNOWN_GOOD_STALE_S keeps
        only the newest KNOWN_GOOD_SPAN x keep after it: disk stays bounded."""
        try:
            mark = self._known_good() if self._known_good is not None and root == self.dir else None
        except Exception:  # noqa: BLE001 - a watermark read must never fail a save
            mark = None
        if mark is None:
            return set()
        now = time.monotonic()
        if mark != self._mark_moved[0]:
            self._mark_moved = (mark, now)
        good = [s for s, _ in finals if s <= mark][-1:]  # none yet: every one may become it
        after = [s for s, _ in finals if s > mark]
        span = KNOWN_GOOD_SPAN * self.cfg.keep
        if len(after) > span and now - self._mark_moved[1] >= KNOWN_GOOD_STALE_S:
            self._log_lag(mark, len(after))
            after = after[-span:]
        return {*good, *after}

    def _log_lag(self, mark: int, n: int) -> None:
        if not self._lag_logged:
            self._lag_logged = True
            self.log(f"checkpoints: the collector's known-good watermark (step {mark}) has not moved for "
                     f"{KNOWN_GOOD_STALE_S:g} s and is {n} checkpoints behind; keeping the newest at or below it "
                     f"and the newest {KNOWN_GOOD_SPAN * self.cfg.keep}")

    # -- loading -------------------------------------------------------------
    def load_latest(self, before_step: int | None = None) -> LoadedCheckpoint | None:
        """Newest checkpoint that verifies on every rank, or None. With `before_step`, only
        checkpoints of earlier steps count: a rollback must restart before the bad step,
        even when a newer checkpoint (saved at or after it) is intact. Collective (every
        rank calls it, with the same `before_step`)."""
        self.wait()
        self.comm.barrier(Axis.WORLD)  # every rank's saves have landed: all ranks list the same directories
        candidates = [c for c in self._candidates() if before_step is None or c.step < before_step]
        index = 0
        while True:
            cand = candidates[index] if index < len(candidates) else None
            status, result = self._try_load(cand) if cand is not None else (_BAD, None)
            step, tier = (cand.step, cand.tier) if cand is not None else (-1, -1)
            # One all_reduce(MIN): the worst status, and min/max of (step, tier) to prove that all
            # ranks looked at the same candidate (they cannot diverge on a shared filesystem).
            vote = torch.tensor([status, step, -step, tier, -tier], dtype=torch.int64, device=self.comm.device)
            self.comm.all_reduce(vote, Axis.WORLD, op=dist.ReduceOp.MIN)
            worst, lo_step, neg_hi_step, lo_tier, neg_hi_tier = vote.tolist()  # host sync, once per candidate
            if lo_step != -neg_hi_step or lo_tier != -neg_hi_tier:
                raise RuntimeError("ranks see different checkpoint directories: is the checkpoint directory on a "
                                   "filesystem shared by all ranks?")
            if cand is None:
                return None
            if worst == _INCOMPATIBLE:
                raise ValueError(result if status == _INCOMPATIBLE else
                                 f"cannot reshard tp/pp: {cand.path} was written with another tp/pp layout")
            if worst == _OK:
                self._last_saved_step = None  # the loop continues from here: saving this step again is real
                return result
            if status == _OK and self.dims.rank == 0:
                self.log(f"checkpoint {cand.path} failed verification on another rank; trying an older one")
            index += 1

    def _candidates(self) -> list[_Candidate]:
        roots = [self.dir] if self.persist_dir is None else [self.dir, self.persist_dir]
        found = [_Candidate(step, tier, path) for tier, root in enumerate(roots) if root.is_dir()
                 for step, path in _list_final(root) if (path / MANIFEST).is_file()]
        return sorted(found, key=lambda c: (-c.step, c.tier))

    def _try_load(self, cand: _Candidate) -> tuple[int, Any]:
        d = self.dims
        try:
            manifest = json.loads((cand.path / MANIFEST).read_text())
            mesh, shards = manifest["mesh"], manifest["shards"]
        except (OSError, ValueError, KeyError) as e:
            self.log(f"checkpoint {cand.path}: skipped: {MANIFEST} unreadable ({e})")
            return _BAD, None
        if (mesh["tp"], mesh["pp"]) != (d.tp, d.pp):
            return _INCOMPATIBLE, (f"cannot reshard tp/pp: {cand.path} was written with tp={mesh['tp']} "
                                   f"pp={mesh['pp']}, this run has tp={d.tp} pp={d.pp} (only dp may change)")
        model_coords = {"pp": d.pp_rank, "tp": d.tp_rank}
        model_entry = next((s for s in shards if s["kind"] == "model" and s["coords"] == model_coords), None)
        # the rank file of the same (pp, dp, tp) coordinate; with a larger dp, new replicas have none
        rank_entry = next((s for s in shards if s["kind"] == "rank" and s["coords"] == d.coords), None)
        try:
            if model_entry is None:
                raise _ShardError(model_filename(d.pp_rank, d.tp_rank), "missing from the manifest")
            model_blob = _read_verified(cand.path, model_entry)
            rank_state = _read_verified(cand.path, rank_entry) if rank_entry is not None else None
        except _ShardError as e:
            self.log(f"checkpoint {cand.path}: bad shard {e.file}: {e.reason}; falling back to an older checkpoint")
            return _BAD, None
        return _OK, LoadedCheckpoint(step=int(manifest["step"]), path=cand.path, model_state=model_blob["model"],
                                     optim_state=model_blob["optim"], rank_state=rank_state,
                                     meta=manifest["meta"], manifest=manifest)


# -- helpers -------------------------------------------------------------------
class _HostCopier:
    """Copies one save's nested state to host memory, so that training may mutate the original
    right after save(): tensors into pooled buffers (a tensor shared in the state is copied
    once), containers rebuilt, other leaves deep-copied. CUDA tensors go into pinned buffers
    with non-blocking copies and one `sync()` at the end."""

    def __init__(self, pool: _HostPool) -> None:
        self._pool = pool
        self._memo: dict[int, torch.Tensor] = {}
        self._devices: set[torch.device] = set()
        self.buffers: list[torch.Tensor] = []
        self.keys: set[tuple] = set()

    def copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            host = self._memo.get(id(obj))
            if host is None:
                host = self._memo[id(obj)] = self._copy_tensor(obj.detach())
            return host
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the type and attributes (a state_dict's OrderedDict and its _metadata)
            for key, value in obj.items():
                out[key] = self.copy(value)
            return out
        if isinstance(obj, list):
            return [self.copy(v) for v in obj]
        if isinstance(obj, tuple):
            items = [self.copy(v) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return copy.deepcopy(obj)

    def _copy_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided:  # sparse and friends: a plain copy, not pooled
            return t.to("cpu", copy=True)
        pinned = t.device.type == "cuda"
        host = self._pool.take(t, pinned)
        host.copy_(t, non_blocking=pinned)
        if pinned:
            self._devices.add(t.device)
        self.buffers.append(host)
        self.keys.add(_HostPool._key(host.shape, host.dtype, pinned))
        return host

    def sync(self) -> None:
        for device in self._devices:
            torch.cuda.synchronize(device)  # the one sync: pinned copies must land before the writer reads them


def _read_verified(directory: Path, entry: dict) -> Any:
    path, expected = directory / entry["file"], int(entry["bytes"])
    try:
        nbytes = path.stat().st_size
    except FileNotFoundError:
        raise _ShardError(entry["file"], "missing") from None
    if nbytes < expected:
        raise _ShardError(entry["file"], f"truncated ({nbytes} of {expected} bytes)")
    if nbytes != expected:
        raise _ShardError(entry["file"], f"size mismatch ({nbytes} bytes, manifest says {expected})")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise _ShardError(entry["file"], "checksum mismatch (sha256 differs from the manifest)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:  # verified bytes that do not unpickle: written by an incompatible version
        raise _ShardError(entry["file"], f"unreadable ({e})") from None


def _list_final(root: Path) -> list[tuple[int, Path]]:
    """Finalized checkpoint directories under `root`, oldest first."""
    found = []
    for entry in os.scandir(root):
        m = _FINAL_RE.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), Path(entry.path)))
    return sorted(found)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a complete `.tmp` directory into place, replacing an older one of the same step
    (a step saved again after a rollback). Costs two renames and two directory fsyncs."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        _remove_checkpoint(old)


def _remove_checkpoint(path: Path) -> None:
    """Manifest first: a half-deleted directory is never mistaken for a checkpoint."""
    try:
        os.unlink(path / MANIFEST)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _write_json_atomic(path: Path, obj: dict) -> None:
    part = path.with_name(f"{path.name}.part")
    with open(part, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    _fsync_dir(path.parent)


def _copy_hashed(src: Path, dst: Path) -> tuple[str, int]:
    """Copy with fsync, hashing the bytes on the way: the persisted copy is checked in the same pass."""
    sha256, nbytes = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_COPY_CHUNK):
            sha256.update(chunk)
            nbytes += len(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return sha256.hexdigest(), nbytes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
