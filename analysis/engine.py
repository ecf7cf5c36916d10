"""One detector pass per commit: `Analyzer.feed(frames, now=...)` -> findings.

    analyzer = Analyzer(load_rules(path))          # once, at start
    # after each commit, on the detection thread:
    findings = analyzer.feed(Frames.from_arrow(tables), now=commit_ts)
    # when no commit came for a while (silence is what crashes look like):
    findings = analyzer.tick(now=clock())

`now` is the collector's clock at the commit (the replay passes the batches'
`received_ts`). A pass runs for every run the analyzer knows, also when the
commit had no rows of it: hangs and crashes are detected from what does *not*
arrive. The analyzer keeps one `RunState` per run (`analyzer.runs`); the caller
may `drop_run` one it no longer needs (finished and closed incidents).
"""

from __future__ import annotations

from analysis.findings import Finding
from analysis.frames import Frames
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
    state.live.update_steps(frames.steps)
    if frames.steps is not None and frames.steps.height:
        if not state.scaler_seen and (frames.steps["loss_scale"] > 1.0).any():
            state.scaler_seen = True
        newest = frames.steps["step"].max()
        if newest is not None and (state.newest_step is None or newest > state.newest_step):
            state.newest_step = int(newest)
    first_sight = state.assembler.add(frames.steps, now)
    released = state.assembler.release(now, state.topo.expected_ranks)
    state.clock.update(released)
    state.shared.clear()
    p = Pass(run=state, rules=rules, now=now, frames=frames, first_sight=first_sight, released=released)
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
        for run_id in per_run:
            self.run_state(run_id)
        out: list[Finding] = []
        for run_id, state in self.runs.items():
            out.extend(run_pass(state, per_run.get(run_id, _EMPTY), now=now, rules=self.rules,
                                detectors=self.detectors))
        return out

    def tick(self, *, now: float) -> list[Finding]:
        """A pass without new rows: timers only (silence, stagnation, step timeouts)."""
        return self.feed(_EMPTY, now=now)

    def continue_run(self, run_id: str, old: "Analyzer") -> None:
        """A restart round of `run_id` (maybe on fewer nodes): this analyzer's state of the
        run starts afresh, as its rank numbers now name other hardware, but a detector
        with `carry_over(old_state)` keeps what is about the run as a whole (the spike
        detectors' baseline of the training curve)."""
        prev = old.runs.get(run_id)
        st = self.run_state(run_id)
        if prev is None:
            return
        for d in self.detectors:
            carry = getattr(d, "carry_over", None)
            if carry is not None and d.name in prev.detectors:
                st.detectors[d.name] = carry(prev.detectors[d.name])

    def drop_run(self, run_id: str) -> None:
        self.runs.pop(run_id, None)


_EMPTY = Frames()
