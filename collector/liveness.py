"""Keeping `ranks` and `runs` current without an upsert per request.

An `INSERT ... ON CONFLICT DO UPDATE` costs DuckDB ~2 ms however few rows it
touches; doing one per group commit for `ranks` and one for `runs` cost more
than inserting the data rows. The writer instead remembers what the tables
hold and writes:

- at once (inside the batch's transaction): a rank never seen, a rank whose
  identity changed (node, pid, incarnation, mesh coordinates), a batch that
  reports agent drops (so drop counts stay exact across a crash), a new run;
- every `sweep_s` seconds: `ranks.last_seen_ts` and `runs.updated_ts` of
  everything that reported since the previous sweep, in one UPDATE each.

So `last_seen_ts`/`updated_ts` lag the truth by at most `sweep_s` (and by up to
that much after a crash); heartbeats hold the exact times.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import duckdb

from collector.decode import DecodedBatch

RankKey = tuple[str, int]
Identity = tuple


def identity(b: DecodedBatch) -> Identity:
    c = b.coords
    return (b.node, b.pid, b.incarnation, c.dp if c else None, c.tp if c else None, c.pp if c else None)


@dataclass(slots=True)
class LivenessPlan:
    rank_rows: list[DecodedBatch] = field(default_factory=list)  # latest batch of ranks to upsert now
    drops: dict[RankKey, int] = field(default_factory=dict)
    new_runs: list[str] = field(default_factory=list)
    last_seen: dict[RankKey, float] = field(default_factory=dict)  # the sweep (empty between sweeps)
    pending: dict[RankKey, float] = field(default_factory=dict)
    swept: bool = False


class Liveness:
    """What `ranks` and `runs` hold. Owned by the writer thread."""

    def __init__(self, con: duckdb.DuckDBPyConnection, sweep_s: float = 2.0) -> None:
        self.sweep_s = sweep_s
        rows = con.execute("SELECT run_id, rank, node, pid, incarnation, dp, tp, pp FROM ranks").fetchall()
        self._identity: dict[RankKey, Identity] = {(r[0], r[1]): tuple(r[2:]) for r in rows}
        self._runs = {r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()}
        self._pending: dict[RankKey, float] = {}
        self._last_sweep = float("-inf")

    def plan(self, fresh: list[DecodedBatch], now: float) -> LivenessPlan:
        latest: dict[RankKey, DecodedBatch] = {}
        drops: dict[RankKey, int] = defaultdict(int)
        for b in fresh:
            key = (b.run_id, b.rank)
            latest[key] = b
            drops[key] += b.num_drops
        plan = LivenessPlan(drops=dict(drops))
        plan.rank_rows = [b for k, b in latest.items()
                          if drops[k] or self._identity.get(k) != identity(b)]
        plan.new_runs = sorted({b.run_id for b in fresh} - self._runs)
        plan.pending = {**self._pending, **{k: now for k in latest}}
        if plan.pending and now - self._last_sweep >= self.sweep_s:
            plan.last_seen, plan.swept = plan.pending, True
        return plan

    def apply(self, plan: LivenessPlan, now: float) -> None:
        """After the commit: remember what the tables now hold."""
        for b in plan.rank_rows:
            self._identity[(b.run_id, b.rank)] = identity(b)
        self._runs.update(plan.new_runs)
        if plan.swept:
            self._pending = {}
            self._last_sweep = now
        else:
            self._pending = plan.pending
