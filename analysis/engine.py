"""One detector pass per commit: `Analyzer.feed(frames, now=...)` -> findings.

    analyzer = Analyzer(load_rules(path))          # once, at start
    # after each commit, on the detection thread:
    findings = analyzer.feed(Frames.from_arrow(tables), now=commit_ts)
    # when no commit came for a while (silence is what crashes look like):
    findings = analyzer.tick(now=clock())

`now` is the collector's clock at the commit (the replay passes the batches'
`received_ts`). A pass runs for every run the analyzer knows, also when the
commit had no rows of it: hangs and crashes are detected from what does *not*
arrive. `feed_run` is the same for one run's rows, a pass of that run only (the
collector's detection runner cuts each commit per run). The analyzer keeps one
`RunState` per run (`analyzer.runs`); the caller may `drop_run` one it no longer
needs (finished and closed incidents).

A restart round of a run (rank 0's `run_started` event with `restart > 0`) starts
the run's analysis over on the new layout: `new_round`.
"""

from __future__ import annotations

import json

from analysis import watermark
from analysis.findings import Finding
from analysis.frames import Frames, StepColumns
from analysis.registry import build_detectors
from analysis.rules import Rules, load_rules
from analysis.state import Pass, RunState, new_run_state


def run_pass(state: RunState, frames: Frames, *, now: float, rules: Rules, detectors: list) -> list[Finding]:
    """Update `state` with one run's rows of a commit and run `detectors` over them."""
    state.num_passes += 1
    state.last_now = now
    state.topo.update(frames)
    state.marks.update(frames, now)
    beat = state.live.update_heartbeats(frames.heartbeats, now)
    state.marks.note_phases(state.live, beat)
    state.live.update_collectives(frames.collectives)
    state.live.update_steps(frames.steps, now)
    if frames.steps is not None and frames.steps.height:
        if not state.scaler_seen and (frames.steps["loss_scale"] > 1.0).any():
            state.scaler_seen = True
        newest = frames.steps["step"].max()
        if newest is not None and (state.newest_step is None or newest > state.newest_step):
            state.newest_step = int(newest)
    first_sight = state.assembler.add(frames.steps, now)
    released = state.assembler.release(now, state.topo.expected_ranks)
    steps = StepColumns(released) if released is not None and released.height else None
    state.clock.update(steps)
    state.shared.clear()
    p = Pass(run=state, rules=rules, now=now, frames=frames, first_sight=first_sight, released=released, steps=steps)
    for d in detectors:
        d.run(p, state.detectors[d.name])
    return p.out


class Analyzer:
    """The detectors and one state per run. Pure: no clock, no I/O, no threads."""

    def __init__(self, rules: Rules | None = None, *, detectors: list[str] | None = None) -> None:
        self.rules = rules if rules is not None else load_rules()
        self.detectors = build_detectors(self.rules, detectors)
        self.runs: dict[str, RunState] = {}

    def run_state(self, run_id: str) -> RunState:
        state = self.runs.get(run_id)
        if state is None:
            state = self.runs[run_id] = new_run_state(run_id, self.rules, self.detectors)
        return state

    def feed(self, frames: Frames, *, now: float) -> list[Finding]:
        """One commit's rows (any number of runs); findings of every run, in order."""
        frames.check()
        per_run = frames.split_runs()
        out: list[Finding] = []
        for run_id, run_frames in per_run.items():
            self._enter(run_id, run_frames, now, out)
        for run_id, state in self.runs.items():
            out.extend(run_pass(state, per_run.get(run_id, _EMPTY), now=now, rules=self.rules,
                                detectors=self.detectors))
        return out

    def feed_run(self, run_id: str, frames: Frames, *, now: float) -> list[Finding]:
        """One pass of `run_id` alone over `frames`, which hold that run's rows only."""
        frames.check()
        out: list[Finding] = []
        self._enter(run_id, frames, now, out)
        out.extend(run_pass(self.runs[run_id], frames, now=now, rules=self.rules, detectors=self.detectors))
        return out

    def _enter(self, run_id: str, frames: Frames, now: float, out: list[Finding]) -> None:
        """The run's state, a new round's when these rows start one (the first of its ranks
        to say so: rank 0's start can come in a later commit than another rank's first steps,
        which must be judged in the new round's state, not the old one's)."""
        started = restart_round(frames)
        if run_id in self.runs and started > self.runs[run_id].round:
            out.extend(self.new_round(run_id, now=now))
        st = self.run_state(run_id)
        st.round = max(st.round, started)

    def new_round(self, run_id: str, *, now: float) -> list[Finding]:
        """A restart round of `run_id`, maybe on fewer nodes: its rank numbers now name
        other hardware (a straggler's rank number belongs to its healthy successor), so
        the run's open incidents close and its state starts over, keys numbered on after
        the old ones. A detector with `carry_over(old_state)` keeps what is about the
        run as a whole: the spike detectors' baseline of the training curve, which goes
        on from the checkpoint (a loss spike right after the restart is still judged)."""
        prev = self.runs.pop(run_id, None)
        st = self.run_state(run_id)
        out: list[Finding] = []
        if prev is None:
            return out
        for key in prev.book.open_keys():
            f = prev.book.get(key)
            prev.book.resolve(key, out, ts=now, evidence={**(f.evidence or {}),
                                                          "resolved_because": "the job restarted (a new round)"})
        st.book.continue_keys(prev.book)
        for d in self.detectors:
            carry = getattr(d, "carry_over", None)
            if carry is not None and d.name in prev.detectors:
                st.detectors[d.name] = carry(prev.detectors[d.name])
        return out

    def clean_through(self, run_id: str) -> watermark.Watermark | None:
        """The run's clean-through watermark (analysis/watermark.py), or None."""
        state = self.runs.get(run_id)
        return None if state is None else watermark.clean_through(state)

    def tick(self, *, now: float) -> list[Finding]:
        """A pass without new rows: timers only (silence, stagnation, step timeouts)."""
        return self.feed(_EMPTY, now=now)

    def drop_run(self, run_id: str) -> None:
        self.runs.pop(run_id, None)


def restart_round(frames: Frames) -> int:
    """The highest restart round whose start these rows hold (any rank's `run_started`
    event with `restart` > 0); 0 when none."""
    ev = frames.events
    if ev is None or not ev.height:
        return 0
    out = 0
    for data in ev.filter((ev["kind"] == "run_started") & (ev["rank"] >= 0))["data"].to_list():
        try:
            out = max(out, int((json.loads(data) if isinstance(data, str) else data or {}).get("restart") or 0))
        except (ValueError, AttributeError, TypeError):
            continue
    return out


def is_new_round(frames: Frames) -> bool:
    """Rows holding the start of a restart round (any of its ranks')."""
    return restart_round(frames) > 0


_EMPTY = Frames()
