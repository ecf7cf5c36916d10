"""The per-run state a pass reads and updates, and the `Pass` handed to each detector.

`RunState` is everything `analysis` remembers about one run between commits.
All of it is bounded: arrays indexed by rank (a few dozen bytes per rank),
rolling windows of a fixed number of steps, the rows of incomplete steps, and
the open incidents. Nothing in it grows with the length of the run
(`RunState.footprint()` counts what it holds; a test runs a long run against it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import polars as pl

from analysis.assembly import StepAssembler, StepSight
from analysis.findings import Finding, IncidentBook
from analysis.frames import Frames, StepColumns
from analysis.liveness import Liveness
from analysis.marks import RunMarks
from analysis.robust import median1
from analysis.rules import Rules
from analysis.topology import Topology


class StepClock:
    """The run's step interval: the median gap between consecutive complete steps'
    end times (the median over ranks of `ts`), over the last `window` gaps."""

    __slots__ = ("_gaps", "_last", "min_gaps")

    def __init__(self, *, min_gaps: int, window: int = 32) -> None:
        self._gaps: deque[float] = deque(maxlen=window)
        self._last: tuple[int, int, float] | None = None  # attempt, step, ts
        self.min_gaps = min_gaps

    def update(self, steps: StepColumns | None) -> None:
        """Take a pass's released steps."""
        if steps is None:
            return
        ts_all = steps.floats("ts")
        for attempt, step, lo, hi in steps.steps():
            ts = ts_all[lo:hi]
            ts = ts[np.isfinite(ts)]
            if not len(ts):
                continue
            ts = median1(ts)
            last = self._last
            if last is not None and attempt == last[0] and step == last[1] + 1 and ts > last[2]:
                self._gaps.append(ts - last[2])
            if last is None or (attempt, step) > (last[0], last[1]):
                self._last = (attempt, step, ts)

    @property
    def interval_s(self) -> float | None:
        """None until `min_gaps` gaps were seen."""
        if len(self._gaps) < self.min_gaps:
            return None
        return float(np.median(np.fromiter(self._gaps, float)))


class RunState:
    """Everything remembered about one run. Create with `new_run_state`."""

    def __init__(self, run_id: str, rules: Rules) -> None:
        st = rules.steps
        self.run_id = run_id
        self.topo = Topology()
        self.live = Liveness()
        self.marks = RunMarks(steps_after_start=st.steps_after_start, steps_after_checkpoint=st.steps_after_checkpoint,
                              steps_after_eval=st.steps_after_eval, steps_after_skip=st.steps_after_skip)
        self.assembler = StepAssembler(complete_timeout_s=st.complete_timeout_s, max_open_steps=st.max_open_steps)
        self.clock = StepClock(min_gaps=rules.hang.min_intervals)
        self.book = IncidentBook(run_id)
        self.detectors: dict[str, object] = {}  # detector name -> its state
        self.shared: dict[str, object] = {}  # what one detector leaves for a later one in the same pass
        self.scaler_seen = False  # a loss scale above 1 was seen: fp16 dynamic scaling is on
        self.newest_step: int | None = None
        self.num_passes = 0
        self.last_now: float | None = None
        self.round = 0  # the job's restart round these rows are from (trainer/supervisor.py)

    def footprint(self) -> dict[str, int]:
        """Sizes of what the state holds (rows, entries), for the boundedness test."""
        sizes = {"pending_step_rows": self.assembler.num_pending_rows,
                 "open_steps": self.assembler.num_open_steps,
                 "released_memory": len(self.assembler._released),
                 "excluded_memory": len(self.marks._excluded),
                 "open_incidents": len(self.book.open_keys()),
                 "rank_slots": self.topo.num_slots}
        for name, st in self.detectors.items():
            fp = getattr(st, "footprint", None)
            if fp is not None:
                for k, v in fp().items():
                    sizes[f"{name}.{k}"] = v
        return sizes


@dataclass(slots=True)
class Pass:
    """One pass over one run's new rows: what a detector's `run` receives."""

    run: RunState
    rules: Rules
    now: float
    frames: Frames  # this run's rows of the commit
    first_sight: list[StepSight]  # steps first seen in this pass (their first rows' medians)
    released: pl.DataFrame | None  # all rows of the steps that became complete, sorted by attempt, step, rank
    out: list[Finding] = field(default_factory=list)
    steps: StepColumns | None = None  # `released` as numpy columns, read once for every detector (None: none)

    @property
    def topo(self) -> Topology:
        return self.run.topo

    @property
    def book(self) -> IncidentBook:
        return self.run.book

    def report(self, finding: Finding) -> None:
        """Open or update an incident (emitted only when its row would change)."""
        self.run.book.report(replace(finding, run_id=self.run.run_id, ts=self.now,
                                     detected_step=self.run.newest_step), self.out)

    def resolve(self, key: str, **changes) -> None:
        self.run.book.resolve(key, self.out, ts=self.now, detected_step=self.run.newest_step, **changes)


def new_run_state(run_id: str, rules: Rules, detectors: list) -> RunState:
    state = RunState(run_id, rules)
    for d in detectors:
        state.detectors[d.name] = d.new_state()
    return state
