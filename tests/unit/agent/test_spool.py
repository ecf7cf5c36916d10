"""The on-disk spool: FIFO order, bound, crash recovery, corruption."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.spool import Spool, SpoolBusy

ROOT = Path(__file__).resolve().parents[3]


def _drain(spool: Spool) -> list[bytes]:
    out = []
    while (rec := spool.peek()) is not None:
        out.append(rec)
        spool.pop()
    return out


def _segments(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.startswith("seg-"))


def test_fifo_order_across_segments_and_files_removed_when_read(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20, segment_bytes=100)
    records = [f"batch-{i}".encode() * (i + 1) for i in range(20)]
    for r in records:
        assert spool.append(r)
    assert len(_segments(tmp_path)) > 3  # rolled at 100 bytes
    assert spool.peek() == records[0] and spool.peek() == records[0]  # peek does not consume
    assert _drain(spool) == records
    assert _segments(tmp_path) == [] and spool.disk_bytes == 0
    spool.append(b"again")
    assert _drain(spool) == [b"again"]
    spool.close()


def test_bound_refuses_appends_and_frees_space_as_records_are_read(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1000, segment_bytes=250)
    num_ok = 0
    while spool.append(b"x" * 92):  # 100 bytes with the record header
        num_ok += 1
    assert num_ok == 10 and spool.disk_bytes == 1000
    assert sum(os.path.getsize(tmp_path / f) for f in _segments(tmp_path)) == 1000
    assert not spool.append(b"y")
    for _ in range(3):  # reading through the first segment (2 records) deletes it
        spool.peek()
        spool.pop()
    spool.peek()
    assert spool.disk_bytes == 800 and spool.append(b"z" * 92)
    assert len(_drain(spool)) == 8
    spool.close()


def test_a_record_larger_than_the_bound_is_refused(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=64)
    assert not spool.append(b"x" * 64)
    assert spool.peek() is None
    spool.close()


def test_records_survive_a_process_crash_and_replay_resumes_at_the_cursor(tmp_path):
    script = (
        "import os, sys\n"
        "from agent.spool import Spool\n"
        "s = Spool(sys.argv[1], max_bytes=1 << 20, segment_bytes=64)\n"
        "for i in range(10):\n"
        "    s.append(b'rec%d' % i)\n"
        "s.peek(); s.pop(); s.peek(); s.pop()\n"  # two records already replayed before the crash
        "os._exit(9)\n"  # no close, no flush of Python objects: a crash
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, timeout=60)
    assert proc.returncode == 9
    spool = Spool(str(tmp_path), max_bytes=1 << 20, segment_bytes=64)
    assert _drain(spool) == [b"rec%d" % i for i in range(2, 10)]
    spool.append(b"new")  # a new instance writes a new segment, never into the old ones
    spool.close()
    again = Spool(str(tmp_path), max_bytes=1 << 20)
    assert _drain(again) == [b"new"]
    again.close()


def test_corrupt_record_is_skipped_and_counted(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    for r in (b"first", b"second", b"third"):
        spool.append(r)
    spool.close()
    seg = tmp_path / _segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    data[8 + 5 + 8 + 2] ^= 0xFF  # a byte inside the payload of "second"
    seg.write_bytes(bytes(data))
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    assert _drain(spool) == [b"first", b"third"]
    assert spool.num_corrupt == 1
    spool.close()


def test_torn_tail_of_a_segment_is_counted_and_the_next_segment_read(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    spool.append(b"whole")
    spool.close()
    seg = tmp_path / _segments(tmp_path)[0]
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # half a record header: the crash hit mid-write
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    spool.append(b"after")
    assert _drain(spool) == [b"whole", b"after"]
    assert spool.num_corrupt == 1
    spool.close()


def test_second_open_of_a_live_spool_is_refused(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1000)
    with pytest.raises(SpoolBusy):
        Spool(str(tmp_path), max_bytes=1000)
    spool.close()
    Spool(str(tmp_path), max_bytes=1000).close()  # released on close


def test_appends_do_not_fsync_rotation_and_close_do_file_and_directory(tmp_path, monkeypatch):
    import stat

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    directory = tmp_path / "new" / "spool"
    spool = Spool(str(directory), max_bytes=1 << 20, segment_bytes=100)
    spool.append(b"a" * 40)  # creates the first segment: its name (and the new directory's) made durable
    assert synced == ["dir", "dir"]
    synced.clear()
    spool.append(b"b" * 40)
    assert synced == []  # a plain append costs no fsync
    spool.append(b"c" * 40)  # rolls: the full segment, then the directory holding the new one
    assert synced == ["file", "dir"]
    synced.clear()
    spool.peek()
    spool.pop()  # rewrites the cursor: no fsync either
    assert synced == []
    spool.close()
    assert synced == ["file", "file", "dir"]  # the open segment, the cursor, the directory


def test_num_pending_counts_unread_records_across_segments(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20, segment_bytes=100)
    for i in range(7):
        spool.append(bytes([i]) * 30)
    assert spool.num_pending() == 7
    spool.peek()
    spool.pop()
    spool.peek()
    spool.pop()
    assert spool.num_pending() == 5
    spool.close()
    with open(tmp_path / _segments(tmp_path)[-1], "ab") as f:
        f.write(b"\x40\x00\x00\x00")  # a torn header is not a record
    again = Spool(str(tmp_path), max_bytes=1 << 20)
    assert again.num_pending() == 5
    again.close()


def test_spool_directories_it_creates_are_private(tmp_path):
    import stat

    os.chmod(tmp_path, 0o755)
    s = Spool(str(tmp_path / "a" / "b" / "rank0"), 1 << 20)
    s.append(b"x")
    s.close()
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "rank0"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o755  # an existing parent keeps its mode
