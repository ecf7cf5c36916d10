"""`crash`: a rank whose heartbeats stopped entirely (a hung rank keeps beating).

Three sources, most certain first:

- the launcher's `rank_exited` event with a non-zero exit code or a signal
  (`cause` "stopped" marks the ranks that went down with the job afterwards): the rank is
  named at once;
- silence: no heartbeat for `silence_s` while another rank of the run still
  beats: the rank that went silent first is named. Not while another rank
  that still beats reports steps two or more past the silent one's newest (the
  newest of them within `silence_s`, and after the silent rank was last
  heard): in a synchronous job nobody completes step s + 2 without every rank
  through step s + 1, so the silent rank is alive and what went quiet is its
  telemetry (an overloaded collector made two ranks' agents time out and
  spool, one after the other, and each was named a crash for a moment); once
  its peers stop going on, or another rank is silent too without that excuse
  (then the first to go silent is named, as ever: peers that fail right after
  a dead rank), the silence counts. A rank that has not begun
  its first step yet gets `startup_silence_s`: imports, the rendezvous and a
  compile hold its interpreter for seconds at a time, so its agent's heartbeat
  thread can miss a few beats there without anything being wrong (a rank that
  dies at start-up is named at once by its launcher's exit report anyway);
- the whole run silent for `run_silence_s` without a `run_finished` event: the
  job died (or the collector lost all of it); a rank is named only when it went
  silent clearly (`cascade_s`) before the others.

Each of these times is the rules' or `silence_beats` of the rank's own heartbeat
interval, whichever is longer (`Liveness.quiet_after`): an agent that beats every
30 s (a 100,000-rank job's, flushing as rarely) is not silent after 3 s, and ranks
that die together went quiet up to an interval apart (`cascade_s` likewise).

Never a crash: a rank whose agent closed cleanly (`agent_closed`), any rank of
a run that ended normally (`run_finished`): an incident opened on silence is
closed again if the run turns out to have finished. One incident per cause:
ranks that go silent while a crash is open (peers killed by the launcher or
failing on the dead rank's connection) are added to it, not opened anew. It
resolves when its ranks heartbeat again (a restart), or when its culprit fails
again: a rank exits once a round, so that is the restarted job's crash, a new
incident (a rank crashing half a second into its round had not beaten yet, and
its second crash was folded into the first: the policy never saw it).
"""

from __future__ import annotations

import numpy as np

from analysis.findings import Finding, json_number
from analysis.registry import register


class _State:
    __slots__ = ("key", "culprit", "source", "opened_s", "first_silent_s", "members", "exit", "stopped",
                 "silent_for_s")

    def __init__(self) -> None:
        self.key: str | None = None
        self.culprit: int | None = None
        self.source = ""
        self.opened_s = 0.0
        self.first_silent_s = 0.0  # last arrival of the first rank to go silent
        # the incident's silent ranks, sorted (an array: a job's every rank can go silent at once)
        self.members = np.zeros(0, np.int64)
        self.exit: dict | None = None
        self.stopped: set[int] = set()  # ranks the launcher stopped (not culprits)
        self.silent_for_s = 0.0  # the culprit's silence when the incident opened (or its culprit changed)

    def footprint(self) -> dict[str, int]:
        return {"members": len(self.members), "stopped": len(self.stopped)}


@register
class CrashDetector:
    name = "crash"
    kinds = ("crash",)

    def __init__(self, rules) -> None:
        self.cfg = rules.crash

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        live, marks = p.run.live, p.run.marks
        exits, marks.exits = marks.exits, []
        st.stopped.update(e.rank for e in exits if e.cause == "stopped")
        failed = sorted((e for e in exits if e.failed), key=lambda e: e.ts)
        n = len(live.arrival_s)
        closed = np.zeros(n, bool)
        closed[:min(n, len(marks.closed))] = marks.closed[:n]
        known = live.known & ~closed
        age = p.now - live.arrival_s
        beats = self.cfg.silence_beats
        quiet = live.quiet_after(self.cfg.silence_s, beats)
        silent = known & (age >= np.where(live.started, quiet, live.quiet_after(self.cfg.startup_silence_s, beats)))
        alive = known & ~silent
        if st.key is not None:
            self._follow(p, st, failed, silent, age)
            return
        if marks.finished:
            return
        if failed:
            e = failed[0]
            self._open(p, st, e.rank, source="launcher", silent=silent, age=age, exit_info=e)
            return
        if not silent.any():
            return
        if not (silent & ~live.vouched_for(silent, alive, p.now, quiet)).any():
            return  # the silent ranks' peers went on two steps past them since: alive, their telemetry late
        order = np.flatnonzero(silent)
        order = order[np.argsort(live.arrival_s[order], kind="stable")]
        candidates = [int(r) for r in order if int(r) not in st.stopped] or [int(r) for r in order]
        if alive.any():
            self._open(p, st, candidates[0], source="silence", silent=silent, age=age)
        elif (age[known] >= live.quiet_after(self.cfg.run_silence_s, beats)[known]).all():
            first = live.arrival_s[order]
            clear = len(first) == 1 or first[1] - first[0] >= self._cascade_s(live, order[:2])
            self._open(p, st, candidates[0] if clear else None, source="run", silent=silent, age=age)

    def _open(self, p, st: _State, culprit: int | None, *, source: str, silent, age, exit_info=None) -> None:
        live = p.run.live
        if culprit is not None:
            live.ensure(culprit + 1)
            age = np.concatenate([age, np.full(max(0, culprit + 1 - len(age)), np.nan)])
        st.key = p.book.new_key("crash")
        st.culprit, st.source, st.opened_s = culprit, source, p.now
        st.members = np.flatnonzero(silent).astype(np.int64)
        if culprit is not None:
            st.members = np.union1d(st.members, [culprit])
        arrivals = live.arrival_s[st.members] if len(st.members) else np.array([p.now])
        st.first_silent_s = float(np.nanmin(arrivals)) if np.isfinite(arrivals).any() else p.now
        st.exit = ({"exit_code": exit_info.exit_code, "signal": exit_info.signal, "ts": exit_info.ts}
                   if exit_info is not None else None)  # not an earlier incident's
        st.silent_for_s = float(age[culprit]) if culprit is not None and np.isfinite(age[culprit]) else 0.0
        self._report(p, st, age)

    def _follow(self, p, st: _State, failed, silent, age) -> None:
        live = p.run.live
        again = [e for e in failed if st.exit is not None and st.exit.get("ts") is not None
                 and e.rank == st.culprit and e.ts > st.exit["ts"]]
        if again:  # a rank exits once a round: the job restarted, and it failed again before it beat
            p.resolve(st.key, evidence={**p.book.get(st.key).evidence,
                                        "resolved_because": "the job restarted, and the rank failed again"})
            st.key, st.exit = None, None
            self._open(p, st, again[0].rank, source="launcher", silent=silent, age=age, exit_info=again[0])
            return
        if failed and st.source != "launcher":
            e = failed[0]
            live.ensure(e.rank + 1)
            st.culprit, st.source = e.rank, "launcher"
            st.exit = {"exit_code": e.exit_code, "signal": e.signal, "ts": e.ts}
            st.silent_for_s = float(age[e.rank]) if e.rank < len(age) and np.isfinite(age[e.rank]) else 0.0
        st.members = np.union1d(st.members, np.flatnonzero(silent))
        back = st.members[live.arrival_s[st.members] > st.opened_s]
        if p.run.marks.finished and st.source != "launcher":
            p.resolve(st.key, evidence={**p.book.get(st.key).evidence, "resolved_because": "the run finished normally"})
            st.key = None
            return
        if len(st.members) and len(back) == len(st.members):
            pids = {str(r): int(live.pid[r]) for r in back[:16].tolist()}
            p.resolve(st.key, evidence={**p.book.get(st.key).evidence, "resolved_because": "heartbeats again",
                                        "pids": pids})
            st.key = None
            return
        self._report(p, st, age)

    def _cascade_s(self, live, ranks: np.ndarray) -> float:
        """How close together ranks went quiet to have gone together: `cascade_s`, or the
        longest heartbeat interval among `ranks` (their last beats were that far apart)."""
        said = live.interval_s[ranks] if len(ranks) else np.zeros(0)
        said = said[np.isfinite(said)]
        return max(self.cfg.cascade_s, float(said.max())) if len(said) else self.cfg.cascade_s

    def _report(self, p, st: _State, age) -> None:
        live, topo = p.run.live, p.topo
        c = st.culprit
        members = st.members
        together_s = self._cascade_s(live, members if c is None else np.array([c]))
        cascade = members[(members != c) & (live.arrival_s[members] - st.first_silent_s <= together_s)]
        if st.source == "launcher":
            confidence = 1.0
        elif st.source == "silence":
            confidence = 0.9 if not len(cascade) else 0.5
        else:
            confidence = 0.5 if c is not None else 0.3
        node = topo.node_name(c)
        step = live.died_in_step(c) if c is not None else None
        # the step the job stalled in: synchronous training finishes no step without every rank
        stalled = int(live.last_step.max()) + 1 if len(live.last_step) and live.last_step.max() >= 0 else step
        step_to = max(step, stalled) if step is not None and stalled is not None else (step or stalled)
        # the culprit's own threshold
        silence_s = self.cfg.silence_s if c is None else float(
            live.quiet_after(self.cfg.silence_s, self.cfg.silence_beats, c))
        evidence = {"source": st.source, "silence_s": silence_s,
                    "silent_ranks": members[:32].tolist(), "num_silent": len(members),
                    "went_silent_together": cascade[:32].tolist(),
                    "exit": st.exit}
        if c is not None:
            evidence["culprit"] = {"rank": c, "node": node, "silent_for_s": json_number(st.silent_for_s, 3),
                                   "step": step, "last_step_reported": int(live.last_step[c]),
                                   "phase": live.phase_name(c), "pid": int(live.pid[c]),
                                   "heartbeat_interval_s": (json_number(float(live.interval_s[c]), 3)
                                                            if np.isfinite(live.interval_s[c]) else None),
                                   **topo.coords(c)}
        if st.source == "launcher":
            how = f"signal {st.exit['signal']}" if st.exit and st.exit.get("signal") else \
                f"exit code {st.exit['exit_code'] if st.exit else '?'}"
            root = f"rank {c} exited with {how}"
        elif c is not None:
            root = f"rank {c} stopped heartbeating (silent {st.silent_for_s:.1f} s, at step {step})"
        else:
            root = f"every rank of the run went silent at once ({len(members)} ranks): the job died or was cut off"
        if len(members) > 1 and c is not None:
            root += f"; {len(members) - 1} more rank(s) silent since"
        p.report(Finding(kind="crash", key=st.key, run_id=p.run.run_id, severity="critical", rank=c, node=node,
                         step_from=step if step is not None else step_to, step_to=step_to, evidence=evidence,
                         root_cause=root, confidence=confidence))
