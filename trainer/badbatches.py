"""The run's list of bad sample windows, `<run dir>/bad_batches.jsonl`.

A rollback that skips poisoned data only helps if the skip outlives the process:
a resume after a crash, an elastic restart, or a later rollback to an even older
checkpoint restarts from a data position *before* the bad window, and without
the list it would serve those samples again and hit the same fault. So every
window the healing logic condemns goes here, and every DataLoader of the run is
built with all of them (`DataLoader(bad_windows=...)`, `add_bad_window()`): a
skipped sample never comes back.

One JSON object per line: epoch, sample_from, sample_to (the window in the
sample coordinates of `trainer.data.step_window`), step, incident_id, verdict, ts.
Only rank 0 writes (appends, fsynced); the other ranks apply the same agreed
command to their copy in memory, so no two processes write the file. A line torn
by a crash mid-write is ignored on load, and the next append starts on a fresh
line.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

FILENAME = "bad_batches.jsonl"

__all__ = ["FILENAME", "BadBatch", "BadBatchList"]


@dataclass(frozen=True, slots=True)
class BadBatch:
    epoch: int
    sample_from: int
    sample_to: int
    step: int  # the step that served the window when it was condemned
    incident_id: str | int | None
    verdict: str
    ts: float

    @property
    def window(self) -> tuple[int, int, int]:
        return (self.epoch, self.sample_from, self.sample_to)


class BadBatchList:
    """The bad windows of one run, in the order they were condemned, without duplicates.

    `path` None (a run without a run directory) keeps the list in memory only."""

    def __init__(self, path: str | os.PathLike | None, entries: list[BadBatch] | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path) if path is not None else None
        self.clock = clock
        self._entries: list[BadBatch] = []
        for entry in entries or ():
            if entry.window not in self.windows:
                self._entries.append(entry)

    @classmethod
    def load(cls, run_dir: str | os.PathLike | None, *, clock: Callable[[], float] = time.time) -> "BadBatchList":
        """The list saved in `run_dir` (empty when there is none yet)."""
        if run_dir is None:
            return cls(None, clock=clock)
        path = Path(run_dir) / FILENAME
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        return cls(path, [e for e in map(_parse, lines) if e is not None], clock=clock)

    @property
    def entries(self) -> list[BadBatch]:
        return list(self._entries)

    @property
    def windows(self) -> list[tuple[int, int, int]]:
        return [e.window for e in self._entries]

    def add(self, window: tuple[int, int, int], *, step: int, incident_id: str | int | None, verdict: str,
            write: bool) -> bool:
        """Condemn `window` (epoch, from, to); False if it already is. Appends it to the
        file only with `write` (rank 0), so that one process writes."""
        epoch, lo, hi = (int(x) for x in window)
        if (epoch, lo, hi) in self.windows:
            return False
        entry = BadBatch(epoch=epoch, sample_from=lo, sample_to=hi, step=int(step), incident_id=incident_id,
                         verdict=verdict, ts=self.clock())
        if write and self.path is not None:
            _append(self.path, json.dumps(asdict(entry)))
        self._entries.append(entry)
        return True


def _parse(line: str) -> BadBatch | None:
    """One line, or None for a torn or foreign one."""
    try:
        row = json.loads(line)
        return BadBatch(epoch=int(row["epoch"]), sample_from=int(row["sample_from"]),
                        sample_to=int(row["sample_to"]), step=int(row["step"]), incident_id=row.get("incident_id"),
                        verdict=str(row.get("verdict", "")), ts=float(row.get("ts", 0.0)))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _append(path: Path, line: str) -> None:
    """Append one line durably. After a torn last line (a crash mid-write) a newline goes
    first, or the new line would be glued to the fragment and lost with it."""
    with open(path, "a+b") as f:  # "a": every write goes to the end, wherever we read
        size = f.seek(0, os.SEEK_END)
        torn = False
        if size:
            f.seek(size - 1)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
