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

`Liveness` is the pure part (plan, apply); `LivenessProjection` puts it in the
writer's list of projections with the SQL that writes its plan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import duckdb

from collector.ingest import columns
from collector.ingest.decode import DecodedBatch
from collector.store.projection import Group, Projection

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


class LivenessProjection(Projection):
    """`ranks` and `runs` rows, written from a `Liveness` plan."""

    name = "liveness"
    writes = ("runs", "ranks")

    def __init__(self, con: duckdb.DuckDBPyConnection, sweep_s: float = 2.0) -> None:
        self.liveness = Liveness(con, sweep_s)

    def plan(self, group: Group) -> LivenessPlan:
        return self.liveness.plan(group.fresh, group.now)

    def apply(self, plan: LivenessPlan, group: Group) -> None:
        self.liveness.apply(plan, group.now)

    def write(self, con: duckdb.DuckDBPyConnection, plan: LivenessPlan, group: Group) -> None:
        """New runs and ranks, identity changes and drops now; last-seen times per sweep."""
        now = group.now
        if plan.new_runs:
            con.executemany("INSERT INTO runs (run_id, created_ts, updated_ts) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                            [(r, now, now) for r in plan.new_runs])
        if plan.rank_rows:
            con.register("__ranks", columns.ranks_table(plan.rank_rows, plan.drops, now))
            con.execute("""
                INSERT INTO ranks BY NAME SELECT * FROM __ranks
                ON CONFLICT (run_id, rank) DO UPDATE SET
                    node = excluded.node, pid = excluded.pid, incarnation = excluded.incarnation,
                    dp = coalesce(excluded.dp, ranks.dp), tp = coalesce(excluded.tp, ranks.tp),
                    pp = coalesce(excluded.pp, ranks.pp), last_seen_ts = excluded.last_seen_ts,
                    agent_drops = ranks.agent_drops + excluded.agent_drops,
                    hw_id = coalesce(excluded.hw_id, ranks.hw_id)""")
            con.unregister("__ranks")
        if plan.last_seen:
            con.register("__seen", columns.last_seen_table(plan.last_seen))
            con.execute("""
                UPDATE ranks SET last_seen_ts = greatest(ranks.last_seen_ts, s.last_seen_ts) FROM __seen s
                WHERE ranks.run_id = s.run_id AND ranks.rank = s.rank""")
            con.unregister("__seen")
            run_ts: dict[str, float] = {}
            for (run_id, _), ts in plan.last_seen.items():
                run_ts[run_id] = max(ts, run_ts.get(run_id, ts))
            con.executemany("UPDATE runs SET updated_ts = greatest(updated_ts, ?) WHERE run_id = ?",
                            [(ts, run_id) for run_id, ts in run_ts.items()])
