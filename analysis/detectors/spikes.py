"""`loss_spike` and `grad_spike`: a value far above a robust rolling baseline.

The baseline is robust and follows the trend: over the last `window_steps`
unflagged steps of log(value), the *level* is the median of the newest
`level_steps` and the *noise* the MAD of successive differences (divided by
sqrt 2). A plain median/MAD over the window would lag a descending loss and the
descent would widen its MAD until a real spike hides in it; differences do not
see a slow trend. A step is flagged when its log value is `z_threshold` noise
sigmas above the level *and* `min_ratio` times the level's value: the z-score
alone would fire on tiny wiggles of a very quiet curve, the ratio alone on noise
of a noisy one. One-sided: the early descent (values below the level) never
fires, and nothing is judged before `min_history_steps` values are in (the
warm-up). Flagged values stay out of the baseline; a shift that lasts
`rebaseline_after_steps` is taken as the new level (the incident closes and the
baseline is relearned). A new attempt (a rollback, or a restart resumed from a
checkpoint) rewinds the baseline to its values of the steps before the attempt's
first one: the replayed stretch is judged against the curve as it was there, not
against the lower level the run had reached later. A baseline whose newest value
is more than `window_steps` steps before the step judged is stale and warms up
again: the steps between never came in clean (non-finite, skipped), and the
curve that resumes after them is not the one it measured (a device NaN skipped
steps 30-94; the job, restarted without the device, resumed step-29 weights at
step 95's data and learning rate, twice as noisy, and a 1.18x step 12 steps in,
judged against steps 1-29, was a loss spike).

Verdicts come at first sight of a step (its first rows: loss and grad-norm are
global), so a spike is reported at the step it happens. When the step is
complete, the loss spike's evidence gains what only all ranks together tell:
which data-parallel replica's `local_loss` jumped, against its own baseline
(or against the other replicas while that is short), and that replica's sample
window (`sample_epoch/from/to`), which the healing skips.

A job we did not write reports no global loss (`loss` NULL: it is not known
without a new collective) but each replica's `local_loss`. Its steps are judged
when complete, not at first sight: the global series is then the mean of the
replicas' local losses (and the grad norm the median of the complete rows).
A poisoned batch on one replica of many hardly moves that mean (1.7x on one of
eight is 1.09x), so such a step is also judged replica against replicas: each
replica's log local loss less the leave-one-out median of the others' (its
*peer ratio*), less that replica's own usual offset (an EWMA over its unflagged
steps: shards differ in difficulty), against a robust per-run scale (the median
over the last `window_steps` complete steps of each step's median |adjusted
peer ratio|, as a sigma; at least `replica_min_log_scale`). Replicas' local
losses differ by batch noise every step, heavier-tailed than a normal, so the
bar is high: `replica_z_threshold` sigmas and `replica_min_ratio` times the
peers' median, after the same warm-up (`min_history_steps` complete steps). The
replica highest above it opens a `loss_spike` naming it (and its rank, when the
replica is one rank) at that step, with its local loss and the peers' median.
Our trainer's rows carry the global loss and take the path above unchanged.

A grad-norm spike at a step whose loss spiked too, or at the step right after
one (the poisoned update's aftermath), is the same cause: it is added to the
loss spike's evidence rather than opened on its own; a grad-norm spike alone is a
`grad_spike`, and needs `alone_z_threshold` (grad norms are heavier-tailed than
losses: a lone 3x excursion in small-batch training is common and benign). This holds however the steps arrive: when a backlog brings the
spike and the clean steps that close it in one pass, the loss spike closes at
the start of the next pass (after the grad-norm detector has seen the same
steps), so one cause is one incident.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import numpy as np
import polars as pl

from analysis.findings import Finding, json_number
from analysis.frames import has, iter_steps
from analysis.registry import register
from analysis.robust import MAD_TO_SIGMA, RollingBaseline, RollingBaselines, loo_median, median1
from analysis.topology import _grow

_HISTORY_STEPS = 1024  # unflagged (step, log value) kept for a rollback to rebuild the baseline from


class _Episode:
    __slots__ = ("key", "attempt", "first", "last", "clean", "peak", "steps", "unenriched", "extra", "closing")

    def __init__(self, key: str, attempt: int, step: int) -> None:
        self.key = key
        self.attempt = attempt
        self.first = self.last = step
        self.clean = 0
        self.closing = False  # met its close criteria; closes at the start of the next pass (loss only)
        self.peak: dict = {}
        self.steps: dict[tuple[int, int], dict] = {}  # flagged steps -> their numbers (bounded: rebaseline)
        self.unenriched: set[tuple[int, int]] = set()  # flagged steps whose complete rows are not in yet
        self.extra: dict = {}  # replica, samples (loss); folded grad-norm numbers


class _State:
    __slots__ = ("baseline", "history", "attempt", "replicas", "ep", "consecutive", "num_flagged", "peer_spread",
                 "peer_offset", "peer_seen", "peer_flags", "peer_streak")

    def __init__(self, window: int) -> None:
        self.baseline = RollingBaseline(window)  # the newest `window` values of `history`
        # the lineage's unflagged (step, log value), further back than the window: a rollback dozens of
        # steps back rebuilds its baseline from them (from the window alone it found nothing before its
        # first step)
        self.history: deque[tuple[int, float]] = deque(maxlen=max(_HISTORY_STEPS, window))
        self.attempt = -1  # the newest attempt judged
        self.replicas = RollingBaselines(1, window)
        self.ep: _Episode | None = None
        self.consecutive = 0
        self.num_flagged = 0
        # replica against replicas (a job without a global loss)
        self.peer_spread = RollingBaseline(window)  # per complete step: median |adjusted peer ratio|
        self.peer_offset = np.zeros(0)  # per replica: EWMA of its peer ratio (its usual offset)
        self.peer_seen = np.zeros(0, np.int64)  # per replica: steps in that EWMA
        self.peer_flags: dict[tuple[int, int], dict] = {}  # steps flagged replica against replicas, not enriched
        self.peer_streak = (-1, -1, 0)  # (replica, last step, consecutive steps) it was flagged against its peers

    def footprint(self) -> dict[str, int]:
        return {"baseline": len(self.baseline), "history": len(self.history), "episode_steps": len(self.ep.steps) if self.ep else 0,
                "replica_series": self.replicas.num_series, "peer_replicas": len(self.peer_offset),
                "peer_flags": len(self.peer_flags)}


class _SpikeDetector:
    column = ""
    kind = ""
    defer_close = False  # close at the start of the next pass (a later detector may fold into it)

    def __init__(self, rules) -> None:
        self.cfg = rules[self.kind]

    def new_state(self) -> _State:
        return _State(self.cfg.window_steps)

    def carry_over(self, old: _State) -> _State:
        """The state for a restart round of the run. The training curve goes on from the
        checkpoint, so the run-wide baseline is kept (a spike a few steps after a restart
        is judged against it, not lost to a new warm-up); the replicas' series (the old
        round's ranks) and an open episode are not."""
        st = self.new_state()
        st.baseline, st.history, st.attempt = old.baseline, old.history, old.attempt
        return st

    def run(self, p, st: _State) -> None:
        if st.ep is not None and st.ep.closing:
            self._close(p, st)
        for sight in p.first_sight:
            if sight.loss is None:
                continue  # no global loss in its first rows (a job we did not write): judged when complete
            self._judge(p, st, sight.attempt, sight.step, getattr(sight, self.column))
        rel = p.released
        if rel is not None and rel.height and rel["loss"].null_count():
            for attempt, step, rows in iter_steps(rel):
                if rows["loss"].null_count() == rows.height:
                    self._judge_complete(p, st, attempt, step, rows)
        self._complete(p, st)

    def _judge_complete(self, p, st: _State, attempt: int, step: int, rows: pl.DataFrame) -> None:
        """A complete step without a global loss: the column's median over its rows."""
        v = rows[self.column].drop_nulls().to_numpy().astype(float)
        v = v[np.isfinite(v)]
        got = self._judge(p, st, attempt, step, median1(v) if len(v) else None, report=False,
                          count_clean=False)
        if got is False:
            self._clean(p, st, step)

    # -- verdicts at first sight ------------------------------------------------------
    def _judge(self, p, st: _State, attempt: int, step: int, value, *, report: bool = True,
               count_clean: bool = True) -> bool | None:
        """Judge one step's value: True flagged, False clean, None not judged (no value, the
        warm-up, an old attempt). `report` False: a complete step, reported once enriched in
        this pass (`_complete`); `count_clean` False: the caller counts a clean step itself."""
        cfg = self.cfg
        if attempt != st.attempt:
            if attempt < st.attempt:
                return None  # a late row of a lineage a rollback replaced
            self._rewind(st, step)
            st.attempt = attempt
        if value is None or not math.isfinite(value) or value <= 0:
            return None  # non-finite: the nan detector's
        if p.run.marks.is_rerun(attempt, step):
            return None  # a rollback's diagnosis rerun: its verdict says what a spike there is
        lx = math.log(value)
        if st.history and step - st.history[-1][0] > cfg.window_steps:
            st.baseline.clear()  # stale: the steps since its last value never came in clean
            st.history.clear()
        if len(st.baseline) < cfg.min_history_steps:
            self._add(st, step, lx)
            return None
        med, scale = st.baseline.level_scale(cfg.level_steps)
        scale = max(scale, cfg.min_log_scale)
        z = (lx - med) / scale
        ratio = math.exp(lx - med)
        if z >= cfg.z_threshold and ratio >= cfg.min_ratio and \
                self._flag(p, st, attempt, step, report=report, value=value, z=z, ratio=ratio,
                           baseline=math.exp(med)):
            return True
        self._add(st, step, lx)
        if count_clean:
            self._clean(p, st)
        return False

    def _clean(self, p, st: _State, step: int | None = None) -> None:
        """An unflagged step: the open episode is one step closer to its close. `step`: a
        complete step, which counts only when after the episode's last (complete steps may
        come out of order: one whose rows were flushed at once is complete before older ones)."""
        st.consecutive = 0
        ep = st.ep
        if ep is not None and (step is None or step > ep.last):
            ep.clean += 1
            self._maybe_resolve(p, st)

    def _flag(self, p, st: _State, attempt: int, step: int, *, report: bool = True, **numbers) -> bool:
        """Flag the step; False: not a spike after all (the value joins the baseline)."""
        folded = self._fold(p, attempt, step, numbers)
        if not folded and not self._alone(numbers):
            return False
        st.num_flagged += 1
        st.consecutive += 1
        if folded:
            return True
        ep = st.ep
        if ep is not None and ep.closing:
            self._close(p, st)
            ep = None
        if ep is None:
            ep = st.ep = _Episode(p.book.new_key(self.kind), attempt, step)
        ep.first, ep.last = min(ep.first, step), max(ep.last, step)
        ep.clean = 0
        info = {"attempt": attempt, "step": step, **{k: json_number(v, 4) for k, v in numbers.items()}}
        ep.steps[(attempt, step)] = info
        ep.unenriched.add((attempt, step))
        if not ep.peak or numbers["z"] > ep.peak["z"]:
            ep.peak = info
        rebaseline = st.consecutive >= self.cfg.rebaseline_after_steps
        if report or rebaseline:
            self._report(p, ep)
        if rebaseline:  # not a spike: a new level
            p.resolve(ep.key, evidence={**p.book.get(ep.key).evidence, "resolved_because": "level shift"})
            st.ep, st.consecutive = None, 0
            st.baseline.clear()
            st.history.clear()
        return True

    @staticmethod
    def _add(st: _State, step: int, lx: float) -> None:
        st.baseline.add(lx)
        st.history.append((step, lx))

    @staticmethod
    def _rewind(st: _State, first_step: int) -> None:
        """A new attempt from `first_step` on (a rollback or a restart resumed from a
        checkpoint): the baseline is what the curve was before that step, rebuilt from the
        lineage's history (the window holds only the newest values: a rollback from step 124
        to 37 found none before 37 in it, and the replay went unjudged for its warm-up, a
        spike at 43 with it). Without the rewind the replay of a steep early stretch, judged
        against the level the run had reached later, looked like a spike (and a rollback
        answered it: a loop). The replaced stretch leaves the history."""
        kept = [(step, lx) for step, lx in st.history if step < first_step]
        if len(kept) == len(st.history):
            return  # nothing at or after it: the baseline stands
        st.history.clear()
        st.history.extend(kept)
        st.baseline.clear()
        for _, lx in kept[-st.baseline.capacity:]:
            st.baseline.add(lx)

    def _fold(self, p, attempt: int, step: int, numbers: dict) -> bool:
        """Whether this flag belongs to another incident (the grad detector folds into loss)."""
        return False

    def _alone(self, numbers: dict) -> bool:
        """Whether a flag that folds into nothing is strong enough to be an incident of its own."""
        return True

    def _maybe_resolve(self, p, st: _State) -> None:
        ep = st.ep
        if ep is not None and not ep.closing and ep.clean >= self.cfg.resolve_after_steps and not ep.unenriched:
            ep.closing = True
            if not self.defer_close:
                self._close(p, st)

    def _close(self, p, st: _State) -> None:
        ep, st.ep = st.ep, None
        if ep is not None and p.book.is_open(ep.key):
            p.resolve(ep.key, evidence={**p.book.get(ep.key).evidence,
                                        "resolved_because": f"{ep.clean} steps back on the baseline"})

    def _report(self, p, ep: _Episode) -> None:
        peak = ep.peak
        z = float(peak["z"])
        cfg = self.cfg
        evidence = {"column": self.column, "peak": peak, "steps": list(ep.steps.values())[-8:],
                    "num_steps_flagged": len(ep.steps), "z_threshold": cfg.z_threshold, "min_ratio": cfg.min_ratio,
                    "window_steps": cfg.window_steps, **ep.extra}
        root = ep.extra.get("_root") or self._default_root(peak)
        rank = ep.extra.get("_rank")  # named only for a suspect replica of one rank
        evidence.pop("_root", None)
        evidence.pop("_rank", None)
        p.report(Finding(kind=self.kind, key=ep.key, run_id=p.run.run_id,
                         severity="critical" if float(peak["ratio"]) >= 2.0 else "warning",
                         rank=rank, node=p.topo.node_name(rank),
                         step_from=ep.first, step_to=ep.last, evidence=evidence, root_cause=root,
                         confidence=round(0.6 + 0.4 * min(1.0, (z - cfg.z_threshold) / cfg.z_threshold), 3)))

    def _default_root(self, peak: dict) -> str:
        return f"{self.column} {peak['ratio']}x its baseline at step {peak['step']} (z {peak['z']})"

    # -- when steps are complete ------------------------------------------------------
    def _complete(self, p, st: _State) -> None:
        ep = st.ep
        if ep is not None and ep.unenriched and not ep.closing:
            rel = p.released
            if rel is not None and rel.height:
                keys = set(rel.select("attempt", "step").unique().iter_rows())
                for k in sorted(ep.unenriched & keys):
                    rows = rel.filter((pl.col("attempt") == k[0]) & (pl.col("step") == k[1]))
                    self._enrich(p, st, ep, k, rows)
                    ep.unenriched.discard(k)
                self._report(p, ep)
            self._maybe_resolve(p, st)

    def _enrich(self, p, st: _State, ep: _Episode, key: tuple[int, int], rows: pl.DataFrame) -> None:
        return None


@register
class LossSpikeDetector(_SpikeDetector):
    name = "loss_spike"
    kind = "loss_spike"
    kinds = ("loss_spike",)
    column = "loss"
    defer_close = True

    def run(self, p, st: _State) -> None:
        super().run(p, st)
        self._learn_replicas(p, st)

    def _judge_complete(self, p, st: _State, attempt: int, step: int, rows: pl.DataFrame) -> None:
        """A complete step without a global loss: the mean of its replicas' local losses,
        then each replica against the others."""
        if not has(rows, "local_loss"):
            self._judge(p, st, attempt, step, None, report=False)
            return
        per = self._replica_losses(p, rows)
        val = per["local_loss"].to_numpy().astype(float)
        got = self._judge(p, st, attempt, step, float(np.mean(val)) if len(val) else None, report=False,
                          count_clean=False)
        if attempt != st.attempt:
            return  # a late step of a lineage a rollback replaced
        if not self._against_peers(p, st, attempt, step, per, flagged=got is True) and got is False:
            self._clean(p, st, step)

    def _against_peers(self, p, st: _State, attempt: int, step: int, per: pl.DataFrame, *, flagged: bool) -> bool:
        """Flag the replica whose local loss is far above its peers' at this step (see the module
        doc); otherwise learn the step's spread and each replica's usual offset. `flagged`: the
        global mean spiked at this step already; a replica far above its peers is then its
        suspect (no second flag), and the step is kept out of what is learned. True: a
        replica was flagged here."""
        cfg = self.cfg
        rep = per["replica"].to_numpy().astype(np.int64)
        val = per["local_loss"].to_numpy().astype(float)
        ok = np.isfinite(val) & (val > 0)
        rep, val = rep[ok], val[ok]
        if len(rep) < 2:
            return False
        lv = np.log(val)
        ref, _ = loo_median(lv)
        d = lv - ref
        n = int(rep.max()) + 1
        st.peer_offset = _grow(st.peer_offset, n, 0.0)
        st.peer_seen = _grow(st.peer_seen, n, 0)
        known = st.peer_seen[rep] >= cfg.min_history_steps
        adj = d - np.where(known, st.peer_offset[rep], 0.0)
        if len(st.peer_spread) >= cfg.min_history_steps:
            scale = max(MAD_TO_SIGMA * st.peer_spread.level_scale(cfg.level_steps)[0], cfg.replica_min_log_scale)
            z = adj / scale
            i = int(np.argmax(z))
            if z[i] >= cfg.replica_z_threshold and math.exp(adj[i]) >= cfg.replica_min_ratio \
                    and not self._new_level(p, st, step, int(rep[i]), float(d[i]), flagged):
                info = {"replica": int(rep[i]), "local_loss": json_number(val[i], 5),
                        "peers_median": json_number(math.exp(ref[i]), 5),
                        "ratio_to_peers": json_number(math.exp(d[i]), 4),
                        "usual_ratio": json_number(math.exp(d[i] - adj[i]), 4), "z": json_number(z[i], 4),
                        "scale": json_number(scale, 4), "num_replicas": int(len(rep))}
                if flagged or self._flag(p, st, attempt, step, report=False, value=float(val[i]), z=float(z[i]),
                                         ratio=math.exp(float(adj[i])), baseline=math.exp(float(ref[i]))):
                    st.peer_flags[(attempt, step)] = info
                    while len(st.peer_flags) > 64:  # bounded: each is popped when its step is enriched
                        st.peer_flags.pop(next(iter(st.peer_flags)))
                    return not flagged
        if flagged:
            return False
        st.peer_spread.add(median1(np.abs(adj)))
        a = 1.0 / cfg.window_steps
        st.peer_offset[rep] = np.where(st.peer_seen[rep] > 0, (1 - a) * st.peer_offset[rep] + a * d, d)
        st.peer_seen[rep] += 1
        return False

    def _new_level(self, p, st: _State, step: int, replica: int, d: float, flagged: bool) -> bool:
        """Whether `replica`, far above its peers for `rebaseline_after_steps` complete steps in a
        row, is there to stay (a harder shard, not a spike): its usual offset becomes this
        step's and the incident closes, as a level shift of the global loss does."""
        last_replica, last_step, n = st.peer_streak
        n = n + 1 if (last_replica, last_step) == (replica, step - 1) else 1
        st.peer_streak = (replica, step, n)
        if n < self.cfg.rebaseline_after_steps or flagged:
            return False
        st.peer_offset[replica] = d
        st.peer_streak = (-1, -1, 0)
        ep, st.ep = st.ep, None
        if ep is not None and p.book.is_open(ep.key):
            p.resolve(ep.key, evidence={**p.book.get(ep.key).evidence,
                                        "resolved_because": f"replica {replica}'s level shift"})
        return True

    def _learn_replicas(self, p, st: _State) -> None:
        """Per-replica baselines of log(local_loss), from complete unflagged steps."""
        rel = p.released
        if rel is None or not has(rel, "local_loss"):
            return
        flagged = set(st.ep.steps) if st.ep else set()
        per = self._replica_losses(p, rel)
        for (attempt, step), part in per.partition_by("attempt", "step", as_dict=True).items():
            if (attempt, step) in flagged:
                continue
            rep = part["replica"].to_numpy()
            val = part["local_loss"].to_numpy()
            ok = np.isfinite(val) & (val > 0)
            if ok.any():
                st.replicas.add(rep[ok], np.log(val[ok]))

    def _replica_losses(self, p, rows: pl.DataFrame) -> pl.DataFrame:
        ranks = rows["rank"].to_numpy().astype(np.int64)
        return (rows.with_columns(pl.Series("replica", p.topo.replica_of(ranks)))
                .group_by("attempt", "step", "replica").agg(pl.col("local_loss").median())
                .sort("replica"))

    def _enrich(self, p, st: _State, ep: _Episode, key: tuple[int, int], rows: pl.DataFrame) -> None:
        peer = st.peer_flags.pop(key, None)
        if peer is not None:
            self._enrich_peer(p, ep, key, rows, peer)
            return
        ep.extra.pop("replica_vs_peers", None)
        ep.extra.pop("_rank", None)
        self._enrich_global(p, st, ep, key, rows)
        if rows["loss"].null_count() == rows.height and ep.extra.get("suspect_replica") is not None:
            d = ep.extra["suspect_replica"]  # no global loss: name the replica's rank, show its peers
            per = self._replica_losses(p, rows)
            mine = per.filter(pl.col("replica") == d)["local_loss"]
            others = per.filter(pl.col("replica") != d)["local_loss"].drop_nans().drop_nulls()
            ep.extra["replica_vs_peers"] = {
                "replica": d, "local_loss": json_number(mine[0], 5) if mine.len() else None,
                "peers_median": json_number(others.median(), 5) if others.len() else None}
            ep.extra["_rank"] = self._only_rank(p, rows, d)

    def _enrich_peer(self, p, ep: _Episode, key: tuple[int, int], rows: pl.DataFrame, peer: dict) -> None:
        """A step flagged replica against replicas: that replica is the suspect."""
        d, step = peer["replica"], key[1]
        rank = self._only_rank(p, rows, d)
        w = self._windows(p, rows).get(d)
        ep.extra.update({"suspect_replica": d, "replica_vs_peers": peer, "samples": w, "_rank": rank,
                         "num_replicas": peer["num_replicas"]})
        who = f"replica {d}" + (f" (rank {rank})" if rank is not None else "")
        where = f"samples {w['from']}-{w['to'] - 1} (epoch {w['epoch']})" if w else "batch"
        ep.extra["_root"] = (f"data: {who}'s {where} at step {step}: local loss {peer['local_loss']}, "
                             f"{peer['ratio_to_peers']}x its peers' median {peer['peers_median']}")

    @staticmethod
    def _only_rank(p, rows: pl.DataFrame, replica: int) -> int | None:
        """The rank of a replica of one rank (None: several ranks, or none)."""
        ranks = rows["rank"].to_numpy().astype(np.int64)
        mine = ranks[p.topo.replica_of(ranks) == replica]
        return int(mine[0]) if len(mine) == 1 else None

    def _enrich_global(self, p, st: _State, ep: _Episode, key: tuple[int, int], rows: pl.DataFrame) -> None:
        cfg = self.cfg
        suspects: list[int] = []
        num_replicas = 0
        if has(rows, "local_loss"):
            per = self._replica_losses(p, rows)
            rep = per["replica"].to_numpy()
            val = per["local_loss"].to_numpy()
            ok = np.isfinite(val) & (val > 0)
            rep, val = rep[ok], val[ok]
            num_replicas = len(rep)
            if num_replicas:
                lv = np.log(val)
                known = st.replicas.count(rep) >= cfg.min_history_steps
                med, scale = st.replicas.median_scale(rep)
                scale = np.maximum(np.nan_to_num(scale, nan=cfg.min_log_scale), cfg.min_log_scale)
                cross = float(np.median(lv))
                base = np.where(known, np.nan_to_num(med, nan=cross), cross)
                ratio = np.exp(lv - base)
                z = np.where(known, (lv - base) / scale, np.inf)
                jumped = (ratio >= cfg.min_ratio) & (z >= cfg.z_threshold)
                order = np.argsort(-ratio)
                suspects = [int(rep[i]) for i in order if jumped[i]]
                if not suspects and num_replicas >= 2:
                    suspects = self._above_peers(st, rep, lv)
                ep.extra["replicas"] = [{"replica": int(rep[i]), "local_loss": json_number(val[i], 5),
                                         "ratio": json_number(ratio[i], 4),
                                         "z": json_number(z[i], 4) if np.isfinite(z[i]) else None}
                                        for i in order[:8]]
                ep.extra["num_replicas"] = num_replicas
        windows = self._windows(p, rows)
        whole = not suspects or len(suspects) == num_replicas
        step = key[1]
        if suspects and not whole:
            d = suspects[0]
            ep.extra["suspect_replica"] = d
            ep.extra["_rank"] = self._only_rank(p, rows, d)
            w = windows.get(d)
            ep.extra["samples"] = w
            where = (f"replica {d}'s samples {w['from']}-{w['to'] - 1} (epoch {w['epoch']})" if w
                     else f"replica {d}'s batch")
            ep.extra["_root"] = f"data: {where} at step {step}"
        else:
            ep.extra["suspect_replica"] = None
            if windows:
                lo = min(w["from"] for w in windows.values())
                hi = max(w["to"] for w in windows.values())
                epoch = min(w["epoch"] for w in windows.values())
                ep.extra["samples"] = {"epoch": epoch, "from": lo, "to": hi}
                ep.extra["_root"] = f"data: the global batch of step {step}, samples {lo}-{hi - 1} (epoch {epoch})"
            else:
                ep.extra["samples"] = None
                ep.extra["_root"] = (f"data: the batch of step {step} (loss {ep.peak['ratio']}x its baseline; "
                                     "no sample positions recorded)")
        if windows:
            ep.extra["sample_windows"] = {str(d): w for d, w in list(windows.items())[:8]}

    def _above_peers(self, st: _State, rep: np.ndarray, lv: np.ndarray) -> list[int]:
        """At a step whose global loss spiked, the one replica far above its peers there
        (`replica_min_ratio` over their median, beyond its usual offset; and
        `replica_z_threshold` sigmas of the replicas' usual spread where that was learned),
        as a list of none or one. A replica's own baseline lags a steeply falling curve,
        so early in a run a poisoned replica is plain against its peers and not yet against
        its own past."""
        cfg = self.cfg
        ref, _ = loo_median(lv)
        adj = lv - ref
        n = len(st.peer_offset)
        known = (rep < n) & (st.peer_seen[np.minimum(rep, max(n - 1, 0))] >= cfg.min_history_steps) if n else \
            np.zeros(len(rep), bool)
        adj = adj - np.where(known, st.peer_offset[np.minimum(rep, max(n - 1, 0))] if n else 0.0, 0.0)
        i = int(np.argmax(adj))
        if math.exp(adj[i]) < cfg.replica_min_ratio or np.sort(adj)[-2] >= math.log(cfg.replica_min_ratio):
            return []  # not one replica: several jumped, or none far enough
        if len(st.peer_spread) >= cfg.min_history_steps:
            scale = max(MAD_TO_SIGMA * st.peer_spread.level_scale(cfg.level_steps)[0], cfg.replica_min_log_scale)
            if adj[i] / scale < cfg.replica_z_threshold:
                return []
        return [int(rep[i])]

    def _windows(self, p, rows: pl.DataFrame) -> dict[int, dict]:
        if not has(rows, "sample_from") or not has(rows, "sample_to"):
            return {}
        ranks = rows["rank"].to_numpy().astype(np.int64)
        epoch = pl.col("sample_epoch") if "sample_epoch" in rows.columns else pl.lit(0)
        per = (rows.with_columns(pl.Series("replica", p.topo.replica_of(ranks)), epoch.alias("_epoch"))
               .drop_nulls(["sample_from", "sample_to"]).filter(pl.col("sample_from") >= 0)  # -1: not known
               .group_by("replica")
               .agg(pl.col("_epoch").first(), pl.col("sample_from").min(), pl.col("sample_to").max())
               .sort("replica"))
        return {int(d): {"epoch": int(e or 0), "from": int(a), "to": int(b)} for d, e, a, b in per.iter_rows()}


@register
class GradSpikeDetector(_SpikeDetector):
    name = "grad_spike"
    kind = "grad_spike"
    kinds = ("grad_spike",)
    column = "grad_norm"

    def _alone(self, numbers: dict) -> bool:
        return numbers["z"] >= self.cfg.alone_z_threshold

    def _fold(self, p, attempt: int, step: int, numbers: dict) -> bool:
        """A flag at a step the loss spike flagged, or at the step after one of them:
        evidence of that loss spike (while it is open: it is closed one pass late
        for this), not an incident of its own."""
        loss = p.run.detectors.get(LossSpikeDetector.name)
        ep = loss.ep if isinstance(loss, _State) else None
        if ep is None or ep.attempt != attempt or not any((attempt, s) in ep.steps for s in (step, step - 1)):
            return False
        f = p.book.get(ep.key)
        if f is not None:
            ev = {**f.evidence, "grad_norm": {"step": step, **{k: json_number(v, 4) for k, v in numbers.items()}}}
            p.report(replace(f, evidence=ev))
        return True
