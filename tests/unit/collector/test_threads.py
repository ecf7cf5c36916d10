"""The collector's threads carry native names (collector/threads.py), so that `top -H`
and /proc tell which one spends the CPU."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from analysis import Analyzer
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from collector.threads import name_native
from tests.polling import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="native thread names are prctl and /proc: Linux (name_native is a no-op elsewhere)")


def native_names() -> set[str]:
    return {p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")}


def test_a_thread_names_itself_and_the_kernel_keeps_15_bytes():
    seen = []
    t = threading.Thread(target=lambda: (name_native("lw-a-name-longer-than-fifteen"),
                                         seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm")
                                                     .read_text().strip())))
    t.start()
    t.join()
    assert seen == ["lw-a-name-longe"]


def test_the_writer_and_detection_threads_are_named(tmp_path):
    storage = Storage(Settings(db_path=tmp_path / "t.duckdb", token="tok", writer=WriterSettings(linger_s=0.0)),
                      analyzer=Analyzer())
    try:
        assert wait_until(lambda: {"lw-writer", "lw-detection"} <= native_names(), timeout_s=10), native_names()
    finally:
        storage.close()
