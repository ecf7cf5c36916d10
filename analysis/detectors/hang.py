"""`hang`: a rank that stopped entering collectives while its peers moved on and now wait.

Live signal: the heartbeat's `last_seq` (the collective a rank entered last). The
agent's flusher thread keeps heartbeating while the training thread is stuck, so
a hung rank is alive and stagnant; a crashed one is silent (the crash detector's,
which runs first: while any rank of the run is silent, hangs are not judged, the
peers of a dead rank are waiting for it, not hung by themselves).

A rank's progress is `(step in progress, ops entered but not completed)`: the
heartbeat's `step`, and `last_seq` minus the highest `seq` among its completed
collectives rows. The culprit is the alive rank with the least progress, when
some rank has strictly more (its peers moved past it), it has not advanced for
the timeout, and a rank ahead of it has been stuck for half the timeout (they
wait for it). The timeout is learned: `timeout_intervals` x the run's step
interval, at least `timeout_floor_s`; `startup_timeout_s` until the interval is
known, `long_phase_timeout_s` for a rank whose heartbeat says checkpoint/eval.
A rank whose agent says its heartbeat interval is judged over `[crash]
silence_beats` of them at least (and its waiting peers over one): its `last_seq`
can only be seen to stand still from one heartbeat to the next. Alive is the crash
detector's: a heartbeat within `silence_s`, or within `silence_beats` intervals.

The collective the group waits in is the culprit's next op: with the
heartbeats' optional `last_op/last_axis/last_group_id/last_group_seq` it is
read from its waiting peers (of the collectives they are in, the one of the
culprit's groups it would enter first; the others are listed), and where they
entered past the culprit's next one in that group (async ops: DDP's buckets,
enqueued one after another before the rank blocks at the end of backward) it is
the one after the culprit's own last there, its op from the prediction below;
without, it is
predicted from the culprit's previous step
(its ops repeat every step: same position, `group_seq` advanced by that group's
ops per step) and checked against what its group's members completed. The
collectives rows of the last `_KEEP_STEPS` steps are kept for that.

Resolves when the culprit enters a collective again, goes silent (a crash now),
or the run finishes. When a rank's agent closes (a run shutting down, a rank
isolated and stopped), the others' stagnation counts from that moment: the
peers of a rank that left stop entering collectives too, and that is no new
hang until a whole timeout passes after it.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import polars as pl

from analysis.findings import Finding, json_number
from analysis.frames import has
from analysis.registry import register

_KEEP_STEPS = 3
_HB_FOLD_ROWS = 64  # heartbeat rows held unfolded at most (or twice the ranks')
_OPS_COLS = ["rank", "step", "seq", "group_seq", "op", "axis", "group_id", "peer"]


class _OpsMemory:
    """Collectives rows of the last few steps, as the chunks they arrived in (no copies)."""

    __slots__ = ("_chunks", "newest_step")

    def __init__(self) -> None:
        self._chunks: deque[tuple[int, pl.DataFrame]] = deque()
        self.newest_step = -1

    def add(self, coll: pl.DataFrame | None) -> None:
        if coll is None or not coll.height:
            return
        top = int(coll["step"].max())
        self.newest_step = max(self.newest_step, top)
        self._chunks.append((top, coll.select(_OPS_COLS)))  # a select shares the buffers; the rest is let go
        while self._chunks and self._chunks[0][0] < self.newest_step - _KEEP_STEPS:
            self._chunks.popleft()

    def rows(self, expr: pl.Expr) -> pl.DataFrame | None:
        parts = [df.filter(expr) for _, df in self._chunks]
        as_str = (pl.col("op").cast(pl.String), pl.col("axis").cast(pl.String))
        parts = [d.with_columns(*as_str) for d in parts if d.height]
        if not parts:
            return None
        return pl.concat(parts, how="vertical_relaxed")

    def footprint(self) -> int:
        return sum(df.height for _, df in self._chunks)


class _State:
    __slots__ = ("ops", "key", "culprit", "culprit_seq", "_hb_ops", "_hb_fresh", "_hb_fresh_rows")

    def __init__(self) -> None:
        self.ops = _OpsMemory()
        self.key: str | None = None
        self.culprit = -1
        self.culprit_seq = -1
        self._hb_ops: pl.DataFrame | None = None  # latest optional last_op/... per rank, when the agent sends them
        self._hb_fresh: list[pl.DataFrame] = []  # heartbeats since, folded in when read or when they pile up
        self._hb_fresh_rows = 0

    def add_heartbeats(self, hb: pl.DataFrame) -> None:
        """A commit's heartbeats with the op each rank is in. Folded in only when `hb_ops` is read
        (a hang is suspected) or they hold twice the ranks' rows: a sort and a unique every pass
        were ~0.5 ms of a small job's pass."""
        self._hb_fresh.append(hb.select("rank", "ts", pl.col("last_op").cast(pl.String),
                                        pl.col("last_axis").cast(pl.String), "last_group_id", "last_group_seq"))
        self._hb_fresh_rows += hb.height
        if self._hb_fresh_rows > max(_HB_FOLD_ROWS, 2 * (0 if self._hb_ops is None else self._hb_ops.height)):
            self._fold()

    @property
    def hb_ops(self) -> pl.DataFrame | None:
        """The latest heartbeat's op of each rank that sent one (None: no rank did)."""
        if self._hb_fresh:
            self._fold()
        return self._hb_ops

    def _fold(self) -> None:
        parts = ([] if self._hb_ops is None else [self._hb_ops]) + self._hb_fresh
        self._hb_ops = pl.concat(parts, how="vertical_relaxed").sort("ts").unique(subset="rank", keep="last")
        self._hb_fresh, self._hb_fresh_rows = [], 0

    def footprint(self) -> dict[str, int]:
        return {"ops_rows": self.ops.footprint(),
                "hb_ops_rows": (0 if self._hb_ops is None else self._hb_ops.height) + self._hb_fresh_rows}


@register
class HangDetector:
    name = "hang"
    kinds = ("hang",)

    def __init__(self, rules) -> None:
        self.cfg = rules.hang
        self.silence_s = rules.crash.silence_s
        self.beats = rules.crash.silence_beats

    def new_state(self) -> _State:
        return _State()

    def timeout_s(self, interval_s: float | None) -> float:
        cfg = self.cfg
        if interval_s is None:
            return cfg.startup_timeout_s
        return max(cfg.timeout_floor_s, cfg.timeout_intervals * interval_s)

    def run(self, p, st: _State) -> None:
        st.ops.add(p.frames.collectives)
        hb = p.frames.heartbeats
        if has(hb, "last_group_seq"):
            st.add_heartbeats(hb)
        live, marks = p.run.live, p.run.marks
        n = len(live.arrival_s)
        if n == 0:
            return
        closed = np.zeros(n, bool)
        closed[:min(n, len(marks.closed))] = marks.closed[:n]
        known = live.known & ~closed
        age = p.now - live.arrival_s
        alive = known & (age < live.quiet_after(self.silence_s, self.beats))
        silent = known & ~alive
        if st.key is not None:
            self._follow(p, st, alive)
            return
        if marks.finished or silent.any() or alive.sum() < 2:
            return
        interval = p.run.clock.interval_s
        timeout = self.timeout_s(interval)
        long = np.isin(live.phase, live.phase_codes(self.cfg.long_phases))
        # a rank's `last_seq` is seen to stand still only from one of its heartbeats to the next: an
        # agent that beats every 30 s is judged over `beats` of them (an interval not said: the timeout alone)
        tmo = live.quiet_after(np.where(long, self.cfg.long_phase_timeout_s, timeout), self.beats)
        since = live.seq_since_s
        if marks.closed_s is not None:  # a rank closed: the others' stagnation counts from then, not before
            since = np.maximum(since, marks.closed_s)
        stuck_s = p.now - since
        stagnant = alive & (stuck_s >= tmo)
        if not stagnant.any():
            return
        pending = np.maximum(live.seq - live.done_seq, 0)
        progress = np.where(alive, live.hb_step * (1 << 20) + np.minimum(pending, (1 << 20) - 1),
                            np.iinfo(np.int64).max)
        least = progress.min()
        culprits = np.flatnonzero(alive & (progress == least))
        ahead = alive & (progress > least)
        if not ahead.any() or not stagnant[culprits].all():
            return
        waiting = np.flatnonzero(ahead & (stuck_s >= live.quiet_after(0.5 * timeout, 1)))
        if not len(waiting):
            return
        # the timeout the evidence names: the learned one, or the culprits' beats when longer
        timeout = float(live.quiet_after(timeout, self.beats, culprits).max())
        self._open(p, st, culprits, waiting, timeout=timeout, interval=interval, stuck_s=stuck_s, pending=pending)

    # -- an open hang ----------------------------------------------------------------
    def _follow(self, p, st: _State, alive: np.ndarray) -> None:
        live, c = p.run.live, st.culprit
        why = None
        if p.run.marks.finished:
            why = "the run finished"
        elif not alive[c]:
            why = "the rank went silent (a crash now)"
        elif live.seq[c] != st.culprit_seq:
            why = "the rank entered a collective again"
        if why is not None:
            p.resolve(st.key, evidence={**p.book.get(st.key).evidence, "resolved_because": why})
            st.key = None

    def _open(self, p, st: _State, culprits, waiting, *, timeout, interval, stuck_s, pending) -> None:
        live, topo = p.run.live, p.topo
        c = int(culprits[0])
        node = topo.node_name(c)
        collective = self._waited_in(st, c, live, waiting)
        step = live.died_in_step(c)
        peers = {str(int(r)): {"last_seq": int(live.seq[r]), "step": int(live.hb_step[r]),
                               "pending_ops": int(pending[r]), "stuck_s": json_number(stuck_s[r], 3),
                               "phase": live.phase_name(int(r))}
                 for r in waiting[:16]}
        evidence = {"timeout_s": json_number(timeout, 3), "step_interval_s": json_number(interval, 4),
                    "stuck_s": json_number(stuck_s[c], 3),
                    "culprit": {"rank": c, "node": node, "last_seq": int(live.seq[c]), "step": int(live.hb_step[c]),
                                "pending_ops": int(pending[c]), "phase": live.phase_name(c), **topo.coords(c)},
                    "collective": collective, "num_waiting": int(len(waiting)), "waiting": peers,
                    "tied_with": [int(r) for r in culprits[1:8]]}
        if collective and collective.get("op"):
            what = (f"{collective['op']} on {collective['axis']} group {collective['group_id']} "
                    f"(group_seq {collective['group_seq']})")
        elif collective:
            what = f"the next collective on {collective['axis']} group {collective['group_id']}" + (
                f" (group_seq {collective['group_seq']})" if collective.get("group_seq") is not None else "")
        else:
            what = "its next collective"
        root = (f"rank {c} never entered {what}; {len(waiting)} peer(s) wait there, "
                f"stuck {stuck_s[c]:.1f} s (timeout {timeout:.1f} s)")
        st.key = p.book.new_key("hang")
        st.culprit, st.culprit_seq = c, int(live.seq[c])
        p.report(Finding(kind="hang", key=st.key, run_id=p.run.run_id, severity="critical", rank=c, node=node,
                         step_from=step, step_to=step, evidence=evidence, root_cause=root,
                         confidence=0.9 if len(culprits) == 1 else 0.5))

    # -- which collective ------------------------------------------------------------
    def _waited_in(self, st: _State, c: int, live, waiting: np.ndarray) -> dict | None:
        rows = st.ops.rows(pl.col("rank") == c)
        pred = _predict(rows.sort("seq"), int(live.hb_step[c]), int(live.seq[c])) if rows is not None else None
        told = self._told(st, c, rows, waiting)
        if told:
            # peers may wait in several of the culprit's groups; its next op comes first
            best = next((t for t in told if pred and (t["axis"], t["group_id"]) == (pred["axis"], pred["group_id"])),
                        told[0])
            best = self._first_missed(st, c, rows, best, pred)
            return {**best, "source": "heartbeats", "also_waited_in": told[1:8] if len(told) > 1 else []}
        if pred is None:
            return None
        members = st.ops.rows((pl.col("axis").cast(pl.String) == pred["axis"])
                              & (pl.col("group_id") == pred["group_id"]))
        done = {}
        if members is not None:
            if pred["peer"] >= 0:  # a p2p pair: only the two ends (their counter is not the group's)
                ends = [c, pred["peer"]]
                members = members.filter(pl.col("rank").is_in(ends) & pl.col("peer").is_in(ends))
            else:
                members = members.filter(pl.col("peer") < 0)
            for r, g in members.group_by("rank").agg(pl.col("group_seq").max()).sort("rank").head(16).iter_rows():
                done[str(r)] = int(g)
        mine = done.get(str(c), pred["group_seq"] - 1)
        if any(g >= pred["group_seq"] for r, g in done.items() if r != str(c)) or mine >= pred["group_seq"]:
            pred = {**pred, "op": None, "group_seq": mine + 1, "source": "completed rows"}
        pred.pop("peer")
        return {**pred, "members_done_group_seq": done}

    @staticmethod
    def _first_missed(st: _State, c: int, rows: pl.DataFrame | None, best: dict, pred: dict | None) -> dict:
        """The collective of `best`'s group the culprit never entered: the one after its own last
        there (its completed rows, or its heartbeat's last op). The peers' heartbeats name the
        op they entered *last*; with async ops (DDP's buckets) they enqueued several past the
        culprit's before blocking, and the first of those is the one it never entered."""
        axis, gid = best["axis"], best["group_id"]
        mine = -1
        if rows is not None:
            got = rows.filter((pl.col("axis") == axis) & (pl.col("group_id") == gid) & (pl.col("peer") < 0))
            if got.height:
                mine = int(got["group_seq"].max())
        if st.hb_ops is not None:
            hb = st.hb_ops.filter((pl.col("rank") == c) & (pl.col("last_axis") == axis)
                                  & (pl.col("last_group_id") == gid)).drop_nulls("last_group_seq")
            if hb.height:
                mine = max(mine, int(hb["last_group_seq"].max()))
        if mine < 0 or best["group_seq"] <= mine + 1:
            return best
        nxt = mine + 1
        same = pred is not None and (pred["axis"], pred["group_id"], pred["group_seq"]) == (axis, gid, nxt)
        return {**best, "op": pred["op"] if same else None, "group_seq": nxt,
                "peers_entered_up_to_group_seq": best["group_seq"]}

    @staticmethod
    def _told(st: _State, c: int, rows: pl.DataFrame | None, waiting: np.ndarray) -> list[dict]:
        """The collectives the waiting peers' heartbeats say they are in, among the culprit's
        groups (when its groups are known), in the order the culprit's step enters them."""
        if st.hb_ops is None:
            return []
        told = st.hb_ops.filter(pl.col("rank").is_in(waiting.tolist())).drop_nulls("last_group_seq")
        if not told.height:
            return []
        found = (told.group_by("last_op", "last_axis", "last_group_id", "last_group_seq").len()
                 .sort("len", descending=True).iter_rows())
        out = [{"op": op, "axis": axis, "group_id": int(gid), "group_seq": int(gseq), "num_ranks_in_it": int(n)}
               for op, axis, gid, gseq, n in found]
        if rows is not None:
            order = {}
            for axis, gid in rows.sort("seq").select("axis", "group_id").iter_rows():
                order.setdefault((axis, gid), len(order))
            mine = [t for t in out if (t["axis"], t["group_id"]) in order]
            out = sorted(mine, key=lambda t: order[(t["axis"], t["group_id"])]) or out
        return out


def _predict(rows: pl.DataFrame, cur_step: int, last_seq: int) -> dict | None:
    """The op a rank would enter after `last_seq`, from its own previous step: same
    position in the step, `group_seq` advanced by that group's ops per step."""
    firsts = rows.group_by("step").agg(pl.col("seq").min().alias("first"), pl.col("seq").max().alias("last"))
    first = dict(zip(firsts["step"].to_list(), firsts["first"].to_list()))
    last = dict(zip(firsts["step"].to_list(), firsts["last"].to_list()))
    steps = sorted(s for s in first if s <= cur_step) or sorted(first)
    b = steps[-1]
    t = b - 1 if (b - 1) in first else b
    n_t = first[b] - first[t] if t != b else last[b] - first[b] + 1
    idx = last_seq + 1 - first[b]
    if n_t <= 0 or idx < 0:
        return None
    ahead, pos = divmod(idx, n_t)
    tmpl = rows.filter(pl.col("step") == t)
    hit = tmpl.filter(pl.col("seq") == first[t] + pos)
    if not hit.height:
        return None
    row = hit.row(0, named=True)
    per_step = tmpl.filter((pl.col("axis") == row["axis"]) & (pl.col("group_id") == row["group_id"])
                           & (pl.col("peer") == row["peer"])).height
    return {"op": row["op"], "axis": row["axis"], "group_id": int(row["group_id"]), "peer": int(row["peer"]),
            "group_seq": int(row["group_seq"]) + per_step * ((b - t) + ahead), "source": "predicted"}
