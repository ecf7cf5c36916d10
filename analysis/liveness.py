"""Per-rank liveness from heartbeats and collectives, as arrays indexed by rank.

Times that decide (silence, stagnation) are the collector's: `now` of the pass
in which a heartbeat arrived. The ranks' own clocks may be skewed against each
other and the collector's; arrival times are not, and the offline replay
passes the commits' `received_ts` as `now`, so it sees the same.

- `arrival_s[r]`: when rank r's latest heartbeat arrived;
- `seq[r]`, `seq_since_s[r]`: its latest `last_seq` (the collective it entered
  last) and when that value first arrived: stagnation is `now - seq_since_s`;
- `hb_step[r]`, `phase[r]`: the step in progress and what it was doing;
- `done_seq[r]`: the highest `seq` among its collectives rows (completed ops):
  `seq - done_seq` is how many ops it entered that have not completed;
- `last_step[r]`: the newest step it reported a steps row for (the step a rank
  died or hung in is the one after), and `last_step_s[r]` when that row arrived;
- `interval_s[r]`: the heartbeat interval its agent declared (NaN: an agent that
  does not say). Silence is read against it (`quiet_after`): an agent that beats
  every 30 s (a 100,000-rank job's) is not silent 3 s after its last beat.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analysis.frames import Interner, floats, has, ints
from analysis.topology import _grow

_NAN = float("nan")
# The longest heartbeat interval taken from an agent (s): beyond it a rank's silence would count
# for nothing for most of an hour, which no cadence needs (a 100,000-rank job's is 30-60 s).
MAX_INTERVAL_S = 300.0


class Liveness:
    __slots__ = ("arrival_s", "hb_ts", "seq", "seq_since_s", "hb_step", "phase", "pid", "done_seq", "last_step",
                 "_phases", "num_heartbeats", "last_step_s", "interval_s")

    def __init__(self) -> None:
        self.arrival_s = np.full(0, _NAN)
        self.hb_ts = np.full(0, _NAN)
        self.seq = np.full(0, -1, np.int64)
        self.seq_since_s = np.full(0, _NAN)
        self.hb_step = np.full(0, -1, np.int64)
        self.phase = np.full(0, -1, np.int16)
        self.pid = np.full(0, -1, np.int64)
        self.done_seq = np.full(0, -1, np.int64)
        self.last_step = np.full(0, -1, np.int64)  # newest step row the rank sent
        self.last_step_s = np.full(0, _NAN)  # when that row arrived
        self.interval_s = np.full(0, _NAN)  # the heartbeat interval its agent declared
        self._phases = Interner()  # phase name <-> code
        self.num_heartbeats = 0

    def ensure(self, n: int) -> None:
        if n <= len(self.arrival_s):
            return
        self.arrival_s = _grow(self.arrival_s, n, _NAN)
        self.hb_ts = _grow(self.hb_ts, n, _NAN)
        self.seq = _grow(self.seq, n, -1)
        self.seq_since_s = _grow(self.seq_since_s, n, _NAN)
        self.hb_step = _grow(self.hb_step, n, -1)
        self.phase = _grow(self.phase, n, -1)
        self.pid = _grow(self.pid, n, -1)
        self.done_seq = _grow(self.done_seq, n, -1)
        self.last_step = _grow(self.last_step, n, -1)
        self.last_step_s = _grow(self.last_step_s, n, _NAN)
        self.interval_s = _grow(self.interval_s, n, _NAN)

    @property
    def known(self) -> np.ndarray:
        """Ranks that ever heartbeat."""
        return ~np.isnan(self.arrival_s)

    @property
    def started(self) -> np.ndarray:
        """Ranks that have begun a step (a step row, or a step in a heartbeat): past start-up."""
        return (self.last_step >= 0) | (self.hb_step >= 0)

    def quiet_after(self, floor_s: float | np.ndarray, beats: float, ranks=None) -> np.ndarray:
        """Per rank (of `ranks`, default all): how long without a heartbeat is silence.
        `floor_s` (a number, or one per rank), or `beats` of the rank's declared heartbeat
        intervals when that is longer (a rank that never said its interval: `floor_s`).
        An agent's beats drift from its grid by a flush held up in a slow POST; `beats` of
        them leaves room for that, as `floor_s` does for the default 1 s beat."""
        interval = self.interval_s if ranks is None else self.interval_s[ranks]
        return np.fmax(floor_s, beats * interval)

    def phase_name(self, rank: int) -> str | None:
        code = int(self.phase[rank]) if 0 <= rank < len(self.phase) else -1
        return self._phases.names[code] if code >= 0 else None

    def phase_codes(self, names) -> list[int]:
        return [self._phases.index[n] for n in names if n in self._phases.index]

    def update_heartbeats(self, hb: pl.DataFrame | None, now: float) -> np.ndarray:
        """Take a commit's heartbeats; returns the ranks whose latest heartbeat changed."""
        if hb is None or not hb.height:
            return np.zeros(0, np.int64)
        self.num_heartbeats += hb.height
        rank = ints(hb["rank"], -1)
        ts = floats(hb["ts"])
        ok = (rank >= 0) & np.isfinite(ts)
        idx = np.flatnonzero(ok)
        if not len(idx):
            return np.zeros(0, np.int64)
        order = idx[np.lexsort((ts[idx], rank[idx]))]
        rs = rank[order]
        latest = order[np.r_[rs[1:] != rs[:-1], True]]  # the newest heartbeat of each rank
        r = rank[latest]
        self.ensure(int(r.max()) + 1)
        self.arrival_s[r] = now  # an old heartbeat arriving late still says the agent is alive
        newer = np.isnan(self.hb_ts[r]) | (ts[latest] > self.hb_ts[r])
        latest, r = latest[newer], r[newer]
        if not len(r):
            return r
        seq = ints(hb["last_seq"], -1)[latest]
        changed = (seq != self.seq[r]) | np.isnan(self.seq_since_s[r])
        self.seq_since_s[r[changed]] = now
        self.seq[r] = seq
        self.hb_ts[r] = ts[latest]
        self.hb_step[r] = ints(hb["step"], -1)[latest]
        self.pid[r] = ints(hb["pid"], -1)[latest]
        self.phase[r] = self._phases.codes(hb["phase"])[latest]
        if has(hb, "interval_s"):
            interval = floats(hb["interval_s"])[latest]
            given = np.isfinite(interval) & (interval > 0)  # a NULL (an older agent) keeps what was said
            self.interval_s[r[given]] = np.minimum(interval[given], MAX_INTERVAL_S)
        return r

    def update_steps(self, steps: pl.DataFrame | None, now: float) -> None:
        old = self.last_step.copy()
        self._raise_per_rank(steps, "step", "last_step")
        prev = np.full(len(self.last_step), -1, np.int64)  # the ranks may have grown: new ones had none
        prev[:len(old)] = old
        self.last_step_s[self.last_step > prev] = now

    def vouched_for(self, silent: np.ndarray, alive: np.ndarray, now: float, within_s: float) -> np.ndarray:
        """Per rank of `silent` (a mask): another rank still beating reported, within the last
        `within_s` and after the silent rank's last heartbeat arrived, a step two or more past
        the silent rank's newest known one. In a synchronous job nobody completes step s + 2
        without every rank through step s + 1: the silent rank was alive then, and what went
        quiet is its telemetry's path (an agent whose posts time out on an overloaded host
        spools them), not the rank."""
        n = len(self.arrival_s)
        out = np.zeros(n, bool)
        idx = np.flatnonzero(silent[:n])
        if not len(idx) or not alive[:n].any():
            return out
        fresh = alive[:n] & (now - self.last_step_s < within_s)
        if not fresh.any():
            return out
        # the newest step any fresh rank reported after each silent rank's last heartbeat: the fresh
        # ranks by the time of their last step, and the highest step from each on (a suffix maximum).
        # Every silent rank against every fresh one was a silent x fresh matrix: at 100,000 ranks
        # flushing every 30 s, tens of thousands of each, a third of the collector's CPU and 2 GB
        ahead_s = self.last_step_s[fresh]
        order = np.argsort(ahead_s, kind="stable")
        ahead_s = ahead_s[order]
        newest_after = np.maximum.accumulate(self.last_step[fresh][order][::-1])[::-1]
        first = np.searchsorted(ahead_s, self.arrival_s[idx], side="right")  # the first reported after it
        reached = np.where(first < len(ahead_s), newest_after[np.minimum(first, len(ahead_s) - 1)], -1)
        known = np.maximum(self.last_step[idx], self.hb_step[idx])
        out[idx] = (first < len(ahead_s)) & (reached >= known + 2)
        return out

    def died_in_step(self, rank: int) -> int | None:
        """The step a silent or stuck rank did not finish: its last step row + 1 (else
        the heartbeat's step in progress)."""
        if not 0 <= rank < len(self.last_step):
            return None
        if self.last_step[rank] >= 0:
            return int(self.last_step[rank]) + 1
        return int(self.hb_step[rank]) if self.hb_step[rank] >= 0 else None

    def update_collectives(self, coll: pl.DataFrame | None) -> None:
        self._raise_per_rank(coll, "seq", "done_seq")

    def _raise_per_rank(self, df: pl.DataFrame | None, column: str, target: str) -> None:
        """`self.<target>[rank]` = max(itself, the newest `column` of the rank's rows)."""
        if df is None or not df.height:
            return
        r = ints(df["rank"], -1)
        v = ints(df[column], -1)
        ok = r >= 0
        if not ok.all():
            r, v = r[ok], v[ok]
        if not len(r):
            return
        self.ensure(int(r.max()) + 1)
        np.maximum.at(getattr(self, target), r, v)
