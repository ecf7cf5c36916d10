"""A bounded on-disk FIFO of encoded batches, for when the collector is away.

Why: training must not block or lose rows because the collector is down or
slow. The flusher appends the batches it cannot send here and replays them,
oldest first, once the collector answers again. The files survive a crash of
the process, so the next incarnation of the same rank (same directory) replays
what the last one left behind.

Layout of the directory:

    seg-0000000001.lws ...   segments; each a sequence of records
                             [u32 LE payload length][u32 LE crc32(payload)][payload]
    cursor                   "<segment> <offset>": where the next unread record starts
    lock                     flock'ed by the open Spool: one writer per directory
    quarantine/              a spool of its own: batches the collector kept failing
                             (agent/transport.py), kept for an operator to inspect or
                             replay; created on first use, never replayed by itself

A Spool never appends to a segment it did not create, so a record torn by a
crash can only sit at the end of an old segment; the reader counts it as
corrupt and moves on. A record whose crc does not match is skipped and counted.

Costs: an append is one write() of the record, no fsync; a pop rewrites the
20-byte cursor file. The bound is on the bytes of all segment files on disk,
consumed parts included; segments roll at `segment_bytes` (1/8 of the bound, at
most 16 MiB) and are deleted as soon as they have been read through, so at most
one segment's worth of consumed bytes still counts.

Durability: a segment is fsync'ed when it rolls over and when the spool is
closed, and so is the directory after a segment file was created in it (a new
file's name is only durable once its directory is); the cursor is fsync'ed at
close. No fsync per append: that would be a disk flush per spooled batch, a
few ms on a quiet disk and up to seconds on one busy with checkpoints, spent
on the flusher thread while its rows pile up.
  - A crash of the process (kill -9, OOM, segfault) loses nothing appended:
    write() has handed the bytes to the kernel, which writes them out anyway.
  - A power cut or kernel crash keeps every segment that rolled over and
    everything before the last close; records appended to the open segment
    since may be lost, or torn at its end (the reader counts a torn record as
    corrupt and moves on). The cursor and the deletion of read segments are not
    forced to disk between closes either, so after a power cut some batches
    already delivered may be replayed again: the collector stores a batch seen
    twice once, so that costs bandwidth, not correctness.
"""

from __future__ import annotations

import os
import struct
import zlib

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process lock
    fcntl = None

_REC = struct.Struct("<II")
_PREFIX, _SUFFIX = "seg-", ".lws"
_CURSOR = "cursor"
QUARANTINE = "quarantine"  # subdirectory: batches set aside (see agent/transport.py), itself a spool


class SpoolBusy(RuntimeError):
    """Another live Spool holds this directory."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # pragma: no cover - a platform whose directories cannot be opened
    try:
        os.fsync(fd)
    except OSError:
        pass  # pragma: no cover - some filesystems refuse fsync on a directory
    finally:
        os.close(fd)


def _private_dirs(directory: str) -> None:
    """Create `directory` and the parents it lacks with mode 0700: a spool holds a
    run's telemetry (no secret, but nothing for other users either). An existing
    directory keeps its mode (it may be a shared parent)."""
    missing = []
    d = os.path.abspath(directory)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def _seg_name(num: int) -> str:
    return f"{_PREFIX}{num:010d}{_SUFFIX}"


class Spool:
    """FIFO of byte strings in `directory`, at most `max_bytes` on disk.

    Used by one thread (the agent's flusher); the counters may be read from any."""

    def __init__(self, directory: str, max_bytes: int, *, segment_bytes: int | None = None) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(64 * 1024, min(16 * 1024 * 1024, max_bytes // 8))
        self.num_corrupt = 0  # records skipped: bad crc, torn tail, impossible length
        self._new_dir = not os.path.isdir(directory)  # its name in the parent is durable once fsync'ed
        _private_dirs(directory)
        self._dir_dirty = False  # a file was created here since the directory was last fsync'ed
        self._lock_fd = self._take_lock()
        self._segs: list[int] = sorted(
            int(f[len(_PREFIX):-len(_SUFFIX)]) for f in os.listdir(directory)
            if f.startswith(_PREFIX) and f.endswith(_SUFFIX) and f[len(_PREFIX):-len(_SUFFIX)].isdigit())
        self._head_off = 0
        self._restore_cursor()
        self._disk_bytes = sum(os.path.getsize(self._path(s)) for s in self._segs)
        self._next_seg = (self._segs[-1] + 1) if self._segs else 1
        self._writer = None  # append handle of the tail segment, only one this instance created
        self._writer_seg = -1
        self._writer_bytes = 0
        self._reader = None  # (segment, unbuffered read handle) of the head segment
        self._peeked: tuple[bytes, int] | None = None  # (payload, offset after it)

    # -- public ------------------------------------------------------------
    @property
    def disk_bytes(self) -> int:
        return self._disk_bytes

    def append(self, payload: bytes) -> bool:
        """Add a record at the tail. False (nothing written) when it would pass the bound."""
        rec_len = _REC.size + len(payload)
        if self._disk_bytes + rec_len > self.max_bytes:
            return False
        if self._writer is None or (self._writer_bytes and self._writer_bytes + rec_len > self.segment_bytes):
            self._roll()
        self._writer.write(_REC.pack(len(payload), zlib.crc32(payload)) + payload)
        self._writer.flush()
        self._writer_bytes += rec_len
        self._disk_bytes += rec_len
        return True

    def peek(self) -> bytes | None:
        """The oldest unread record, or None when there is none. Corrupt records on
        the way are skipped (counted in `num_corrupt`) and fully read segments deleted."""
        if self._peeked is not None:
            return self._peeked[0]
        while self._segs:
            seg = self._segs[0]
            status, payload, next_off = self._read(seg, self._head_off)
            if status == "ok":
                self._peeked = (payload, next_off)
                return payload
            if status == "corrupt":
                self.num_corrupt += 1
                if next_off is not None:
                    self._head_off = next_off
                    continue
            elif seg == self._writer_seg:
                return None  # read up to what this instance has written
            self._drop_head()
        return None

    def pop(self) -> None:
        """Mark the record returned by `peek` as consumed (persisted in the cursor)."""
        if self._peeked is None and self.peek() is None:
            return
        self._head_off = self._peeked[1]
        self._peeked = None
        if self._segs[0] == self._writer_seg and self._head_off >= self._writer_bytes and len(self._segs) == 1:
            self._reset()  # everything read: remove the files so an idle spool takes no disk
        else:
            self._write_cursor()

    def num_pending(self) -> int:
        """Records not read yet. Walks the record headers (no payload is read):
        for the close-time report and tools, not for a hot loop."""
        num = 0
        for i, seg in enumerate(self._segs):
            off = self._head_off if i == 0 else 0
            try:
                with open(self._path(seg), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    while off + _REC.size <= size:
                        f.seek(off)
                        length, _ = _REC.unpack(f.read(_REC.size))
                        off += _REC.size + length
                        if off > size:
                            break  # torn at the end
                        num += 1
            except OSError:
                continue
        return num

    def sync(self) -> None:
        """Force what was appended, the cursor and new file names to disk (see the
        module docstring for what that buys). Done at roll-over and close."""
        if self._writer is not None:
            self._writer.flush()
            os.fsync(self._writer.fileno())
        cursor = self._path(_CURSOR)
        if os.path.exists(cursor):
            fd = os.open(cursor, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._dir_dirty = True  # the rename that installed it
        self._sync_dirs()

    def close(self) -> None:
        try:
            if self._lock_fd is not None:
                self.sync()
        except OSError:
            pass  # a disk that refuses fsync keeps what write() gave it; closing must go on
        for f in (self._writer, self._reader[1] if self._reader else None):
            if f is not None:
                f.close()
        self._writer, self._reader = None, None
        self._writer_seg = -1
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    # -- internals ---------------------------------------------------------
    def _path(self, name) -> str:
        return os.path.join(self.directory, _seg_name(name) if isinstance(name, int) else name)

    def _take_lock(self):
        fd = os.open(os.path.join(self.directory, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise SpoolBusy(f"spool directory {self.directory} is in use by another process") from None
        return fd

    def _restore_cursor(self) -> None:
        try:
            with open(self._path(_CURSOR)) as f:
                seg, off = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            return
        for s in [s for s in self._segs if s < seg]:  # read through before a crash, not yet deleted
            os.remove(self._path(s))
            self._segs.remove(s)
        if self._segs and self._segs[0] == seg:
            self._head_off = off

    def _write_cursor(self) -> None:
        tmp = self._path(_CURSOR + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{self._segs[0]} {self._head_off}")
        os.replace(tmp, self._path(_CURSOR))

    def _roll(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            os.fsync(self._writer.fileno())  # a full segment is durable before the next one starts
            self._writer.close()
        seg = self._next_seg
        self._next_seg += 1
        self._writer = open(self._path(seg), "ab")
        self._writer_seg = seg
        self._writer_bytes = 0
        self._segs.append(seg)
        self._dir_dirty = True
        self._sync_dirs()

    def _sync_dirs(self) -> None:
        """fsync the directory after files were created in it (and its parent, once,
        when this Spool created the directory itself)."""
        if self._new_dir:
            _fsync_dir(os.path.dirname(os.path.abspath(self.directory)))
            self._new_dir = False
        if self._dir_dirty:
            _fsync_dir(self.directory)
            self._dir_dirty = False

    def _read(self, seg: int, off: int) -> tuple[str, bytes | None, int | None]:
        """("ok", payload, next offset) | ("end", None, None) | ("corrupt", None, next offset or None)."""
        if self._reader is None or self._reader[0] != seg:
            if self._reader is not None:
                self._reader[1].close()
            self._reader = (seg, open(self._path(seg), "rb", buffering=0))
        f = self._reader[1]
        f.seek(off)
        head = f.read(_REC.size)
        if not head:
            return "end", None, None
        if len(head) < _REC.size:
            return "corrupt", None, None  # torn record header at the end of a segment
        length, crc = _REC.unpack(head)
        payload = f.read(length)
        if len(payload) < length:
            return "corrupt", None, None  # torn payload, or a length field that was garbled
        next_off = off + _REC.size + length
        if zlib.crc32(payload) != crc:
            return "corrupt", None, next_off
        return "ok", payload, next_off

    def _drop_head(self) -> None:
        seg = self._segs.pop(0)
        if self._reader is not None and self._reader[0] == seg:
            self._reader[1].close()
            self._reader = None
        if seg == self._writer_seg:
            self._writer.close()
            self._writer, self._writer_seg, self._writer_bytes = None, -1, 0
        path = self._path(seg)
        self._disk_bytes -= os.path.getsize(path)
        os.remove(path)
        self._head_off = 0
        if self._segs:
            self._write_cursor()
        else:
            self._remove_cursor()

    def _reset(self) -> None:
        self._drop_head()
        self._next_seg = 1

    def _remove_cursor(self) -> None:
        try:
            os.remove(self._path(_CURSOR))
        except FileNotFoundError:
            pass
