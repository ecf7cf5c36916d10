"""What happened to a run besides its steps: starts, restarts, checkpoints, evals, the end.

Read from events, scalars and heartbeat phases, and kept small:

- *excluded steps*: steps whose timings say nothing about a rank's speed. The
  first `steps_after_start` of a run, an attempt or a restart (compile, warm
  caches), a checkpoint step and `steps_after_checkpoint` after it (background
  writes compete for the host), an eval step and `steps_after_eval` after it, a
  step some rank reported skipped or non-finite and `steps_after_skip` after it
  (no optimizer update, a NaN's checks, an fp16 backoff: other work), and a
  `rebalanced` step (the split of the global batch changed) with the step before
  it and `steps_after_start` after it: the ranks' shares change at a step
  boundary they reach at different times, and the compute judged at an even share
  jumped for a step or two (a false 1.27x straggler on the rank that took the
  micro-batches back, seen once in CI).
  Known ahead from the run's config (`eval_every`, `ckpt.every`) when it has
  them, and from what the ranks report (`checkpoint_saved`, `eval/...` scalars,
  heartbeats in phase `eval` or `checkpoint`) when not.
- *finished*: a `run_finished` event (from any rank); cleared when the run
  starts again (`run_started`, or the runs row back to `running`).
- *closed ranks*: ranks whose agent closed cleanly (`agent_closed`), and when the
  latest one did (a run shutting down: its remaining ranks stop entering
  collectives too, which is no new hang).
- *exits*: the launcher's `rank_exited` reports, queued for the crash detector.
- *reruns*: the (attempt, step) a rollback reruns to diagnose its incident
  (`rollback_started` with `diagnose`: every rank sends it before the rerun's rows).
  The rerun reproducing the fault is the diagnosis (its `rerun_verdict`), not a new
  incident: the nan and spike detectors leave those steps to it (a device NaN's
  rerun, opened as a second incident, was rolled back again and again).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass

import numpy as np
import polars as pl

from analysis.frames import Frames, floats, has, ints
from analysis.topology import Topology, _grow

_EXCLUDED_MEMORY = 1024
_RERUN_MEMORY = 64


# A rank that exits with this left for the supervisor's restart (an isolation; the
# trainer's membership.EXIT_RESTART, EX_TEMPFAIL): not a crash.
RESTART_EXIT_CODE = 75


@dataclass(frozen=True, slots=True)
class RankExit:
    ts: float
    rank: int
    exit_code: int | None
    signal: str | None
    cause: str  # "exited" (on its own) | "stopped" (went down with the job after another failed)

    @property
    def failed(self) -> bool:
        return self.cause != "stopped" and (self.signal is not None
                                            or self.exit_code not in (0, None, RESTART_EXIT_CODE))


def _data(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        d = json.loads(raw) if raw else {}
    except (TypeError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _odd_rows(steps: pl.DataFrame) -> np.ndarray:
    """Per row: skipped, or a loss or grad norm that is not finite (a NULL is neither: nothing
    was measured). Numpy on three columns: a polars filter was ~1 ms of every pass."""
    odd = np.zeros(steps.height, bool)
    for name in ("loss", "grad_norm"):
        s = steps[name]
        bad = ~np.isfinite(floats(s))
        if s.null_count():
            bad &= s.is_not_null().to_numpy()
        odd |= bad
    if has(steps, "skipped"):
        odd |= steps["skipped"].cast(pl.Boolean).fill_null(False).to_numpy()
    return odd


class RunMarks:
    __slots__ = ("steps_after_start", "steps_after_checkpoint", "steps_after_eval", "steps_after_skip", "_excluded",
                 "_excluded_order", "_warm", "finished", "finished_ts", "closed", "closed_s", "exits",
                 "_first_step", "_now", "_reruns")

    def __init__(self, *, steps_after_start: int, steps_after_checkpoint: int, steps_after_eval: int,
                 steps_after_skip: int = 0) -> None:
        self.steps_after_start = steps_after_start
        self.steps_after_skip = steps_after_skip
        self.steps_after_checkpoint = steps_after_checkpoint
        self.steps_after_eval = steps_after_eval
        self._excluded: set[tuple[int, int]] = set()  # (attempt, step); attempt -1: any
        self._excluded_order: deque[tuple[int, int]] = deque()
        self._warm: dict[int, int] = {}  # attempt -> last step of its warm-up
        self._first_step: dict[int, int] = {}  # attempt -> first step seen
        self.finished = False
        self.finished_ts: float | None = None
        self.closed = np.zeros(0, bool)
        self.closed_s: float | None = None  # when (the pass's `now`) a rank's agent last closed
        self._now = 0.0
        self.exits: list[RankExit] = []  # not yet taken by the crash detector
        self._reruns: deque[tuple[int, int]] = deque(maxlen=_RERUN_MEMORY)  # (attempt, step) of diagnosis reruns

    # -- queries ---------------------------------------------------------------
    def is_rerun(self, attempt: int, step: int) -> bool:
        """The step is a rollback's diagnosis rerun of its suspect step (in the attempt it made)."""
        return (attempt, step) in self._reruns

    def is_excluded(self, attempt: int, step: int, topo: Topology) -> bool:
        if step <= self._warm.get(attempt, -1):
            return True
        if (attempt, step) in self._excluded or (-1, step) in self._excluded:
            return True
        for every, after in ((topo.eval_every, self.steps_after_eval), (topo.ckpt_every, self.steps_after_checkpoint)):
            if every > 0 and step > 0 and (step % every) <= after and step >= every:
                return True
        return False

    def is_closed(self, rank: int) -> bool:
        return 0 <= rank < len(self.closed) and bool(self.closed[rank])

    # -- updates ---------------------------------------------------------------
    def _exclude(self, attempt: int, first: int, last: int) -> None:
        for s in range(first, last + 1):
            k = (attempt, s)
            if k not in self._excluded:
                self._excluded.add(k)
                self._excluded_order.append(k)
        while len(self._excluded_order) > _EXCLUDED_MEMORY:
            self._excluded.discard(self._excluded_order.popleft())

    def _warm_up(self, attempt: int, from_step: int) -> None:
        self._warm[attempt] = max(self._warm.get(attempt, -1), from_step + self.steps_after_start)

    def update(self, f: Frames, now: float) -> None:
        self._now = now
        if f.steps is not None and f.steps.height:
            attempts = ints(f.steps["attempt"])
            steps = ints(f.steps["step"])
            for attempt in np.unique(attempts).tolist():
                if attempt < 0:
                    continue
                step = int(steps[attempts == attempt].min()) if len(attempts) > 1 else int(steps[0])
                if attempt not in self._first_step or step < self._first_step[attempt]:
                    self._first_step[attempt] = step
                    self._warm_up(attempt, step - 1)
            self._skipped_steps(f.steps)
        if f.runs is not None and has(f.runs, "status"):
            if "running" in f.runs["status"].cast(pl.String).to_list() and self.finished:
                self.finished, self.finished_ts = False, None
        if f.events is not None and f.events.height:
            self._from_events(f.events)
        if f.scalars is not None and f.scalars.height:
            ev = f.scalars.filter(pl.col("name").cast(pl.String).str.starts_with("eval"))
            for attempt, step in ev.select("attempt", "step").unique().iter_rows():
                if step is not None:
                    self._exclude(-1 if attempt is None else attempt, step, step + self.steps_after_eval)

    def _skipped_steps(self, steps: pl.DataFrame) -> None:
        """Steps some rank reported skipped or with a non-finite loss or grad norm."""
        odd = _odd_rows(steps)
        if steps["step"].null_count():
            odd &= steps["step"].is_not_null().to_numpy()
        if not odd.any():
            return
        pairs = np.unique(np.stack([ints(steps["attempt"])[odd], ints(steps["step"])[odd]]), axis=1)
        for attempt, step in pairs.T.tolist():
            self._exclude(attempt, step, step + self.steps_after_skip)

    def note_phases(self, live, ranks: np.ndarray) -> None:
        """Heartbeats just in: a rank in phase eval or checkpoint at step s marks s (and after)."""
        if not len(ranks):
            return
        for name, after in (("eval", self.steps_after_eval), ("checkpoint", self.steps_after_checkpoint)):
            codes = live.phase_codes([name])
            if not codes:
                continue
            at = ranks[live.phase[ranks] == codes[0]]
            for step in np.unique(live.hb_step[at]).tolist():
                if step >= 0 and (-1, step) not in self._excluded:
                    self._exclude(-1, step, step + after)

    def _from_events(self, events: pl.DataFrame) -> None:
        kinds = events["kind"].cast(pl.String)
        wanted = kinds.is_in(["run_finished", "run_started", "restart", "checkpoint_loaded", "checkpoint_saved",
                              "agent_closed", "rank_exited", "rollback_started", "rebalanced"])
        if not wanted.any():
            return
        cols = ["ts", "rank", "step", "kind", "data"] + (["attempt"] if "attempt" in events.columns else [])
        rows = events.filter(wanted).with_columns(pl.col("kind").cast(pl.String)).select(cols).sort("ts")
        for row in rows.iter_rows(named=True):
            kind, step, rank = row["kind"], row["step"], row["rank"]
            attempt = row.get("attempt")
            if kind == "run_finished":
                self.finished, self.finished_ts = True, row["ts"]
            elif kind in ("run_started", "restart", "checkpoint_loaded"):
                if kind == "run_started" or kind == "restart":
                    self.finished, self.finished_ts = False, None
                    if rank is not None and 0 <= rank < len(self.closed):
                        self.closed[rank] = False  # a new process for this rank (a restart): it is live
                if step is not None and step >= 0:
                    if attempt is None:
                        for a in list(self._warm) or [0]:
                            self._warm_up(a, step)
                    else:
                        self._warm_up(attempt, step)
            elif kind == "rebalanced":
                if step is not None and step >= 0:
                    self._exclude(-1, max(0, step - 1), step + self.steps_after_start)
            elif kind == "checkpoint_saved":
                data = _data(row["data"])
                s = data.get("step", step)
                if isinstance(s, int) and s >= 0:
                    self._exclude(-1, s, s + self.steps_after_checkpoint)
            elif kind == "rollback_started":
                data = _data(row["data"])
                a, s = data.get("attempt", attempt), data.get("suspect_step")
                if data.get("diagnose") and isinstance(a, int) and isinstance(s, int) and (a, s) not in self._reruns:
                    self._reruns.append((a, s))
            elif kind == "agent_closed":
                if rank is not None and rank >= 0:
                    self.closed = _grow(self.closed, rank + 1, False)
                    self.closed[rank] = True
                    self.closed_s = self._now
            elif kind == "rank_exited":
                data = _data(row["data"])
                r = data.get("rank", rank)
                if not isinstance(r, int) or r < 0:
                    continue
                code = data.get("exit_code")
                sig = data.get("signal")
                self.exits.append(RankExit(ts=float(row["ts"] or 0.0), rank=r,
                                           exit_code=int(code) if isinstance(code, int) else None,
                                           signal=str(sig) if sig is not None else None,
                                           cause=str(data.get("cause") or "exited")))
