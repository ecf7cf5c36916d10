"""`nan`: a non-finite loss, grad-norm or local signal, at its step, with its origin rank.

Reads each commit's step rows as they arrive (not waiting for the step to be
complete: the goal is one second). A row is non-finite when any of these is:

- `finite_fwd == 0`: this rank's forward went bad: signal level 0;
- a non-finite `local_loss`: its data-parallel replica's loss went bad (every
  rank of the replica reports it): level 1, names the replica, and a rank only
  when the replica is one rank;
- `finite_bwd == 0`: its local gradients: level 2 (backward runs from the last
  stage to the first, so there the *latest* stage is first in data-flow order);
- `loss` or `grad_norm`: global values, identical on every rank after the
  reductions: level 3, which says *that* it happened, not where.

Under fp16 dynamic loss scaling (a scale above 1 was seen) an infinite gradient
is the scaler's business (an overflow, a backoff: `loss_scale_collapse`), so
only the forward signals and the loss count there.

The origin is the first in data-flow order among the non-finite rows of the
episode's first step: the most local signal level, then the earlier pipeline
stage (the later one in backward), then the lowest replica and tp rank. It is named only when the signals tell: a
forward flag, a backward flag or a global value non-finite on some ranks and
finite on others (seen at that step), or a replica's loss of one rank. When
every rank has only the global values non-finite (today's agent, which records
no local signals), the finding says so and names no rank. A backward flag on
every rank seen says no more than a global value: a job we did not write checks
its gradients after DDP's all-reduce, so one rank's NaN clears `finite_bwd` on
all of them at once, and the first row to arrive must not be named for it (the
origin's own `finite_fwd` row names it when it comes).

One episode per spread: every non-finite row of the run, on any rank, from its
first step until `resolve_after_steps` complete all-finite steps, is one
incident. A row of an earlier step arriving late moves the episode's start (and
origin) back; a newer attempt (after a rollback) closes it. The rows of a rollback's diagnosis rerun are
left to its verdict (analysis/marks.py *reruns*). A non-finite row
`resolve_after_steps` or more steps after the episode's last one, with every
step between reported by some rank and none of them flagged, starts a new
episode (the old one closes first), also when a backlog brings both in one pass.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analysis.findings import Finding, json_number
from analysis.frames import finite_or_null, has, ints
from analysis.registry import register

_PHASES = ("forward", "replica loss", "backward", "reduced")
_SEEN_AFTER_MAX = 256  # steps after an episode's last one remembered as reported
_SIGNALS = ("finite_fwd", "local_loss", "finite_bwd", "loss/grad_norm")


class _Episode:
    __slots__ = ("key", "attempt", "first_step", "last_step", "cand_key", "cands", "flagged_first",
                 "num_rows_first", "seen_first", "flagged_ranks", "clean_steps", "values", "seen_after")

    def __init__(self, key: str, attempt: int) -> None:
        self.key = key
        self.attempt = attempt
        self.first_step = 1 << 62
        self.last_step = -1
        self.cand_key: tuple | None = None  # data-flow key of the best candidates at first_step
        self.cands: dict[int, dict] = {}  # rank -> its flags, for the best key (ties bounded)
        self.flagged_first: set[int] = set()  # ranks non-finite at first_step
        self.num_rows_first = 0  # ranks that reported first_step at all (from complete steps)
        self.seen_first: set[int] = set()  # ranks seen reporting first_step (any value), as rows arrive
        self.flagged_ranks: set[int] = set()  # every rank non-finite in the episode
        self.clean_steps = 0
        self.values: dict[str, object] = {}
        self.seen_after: set[int] = set()  # steps after last_step some rank reported (bounded)


class _State:
    __slots__ = ("episodes",)

    def __init__(self) -> None:
        self.episodes: dict[int, _Episode] = {}  # attempt -> open episode

    def footprint(self) -> dict[str, int]:
        return {"episodes": len(self.episodes),
                "flagged": sum(len(e.flagged_ranks) + len(e.flagged_first) for e in self.episodes.values())}


def _all_finite(df: pl.DataFrame, scaler_on: bool) -> bool:
    """The fast path: nothing to look at (Series checks, no query)."""
    if not finite_or_null(df["loss"]).all():
        return False
    if not scaler_on and not finite_or_null(df["grad_norm"]).all():
        return False
    if has(df, "finite_fwd") and (ints(df["finite_fwd"], 1) == 0).any():
        return False
    if has(df, "local_loss") and not finite_or_null(df["local_loss"]).all():
        return False
    return scaler_on or not has(df, "finite_bwd") or not (ints(df["finite_bwd"], 1) == 0).any()


def _flags(df: pl.DataFrame, scaler_on: bool) -> pl.DataFrame:
    """The non-finite rows, with their data-flow phase (0 fwd, 1 bwd, 2 reduced)."""
    if _all_finite(df, scaler_on):
        return df.clear()
    loss_bad = ~pl.col("loss").is_finite().fill_null(True)
    grad_bad = ~pl.col("grad_norm").is_finite().fill_null(True)
    fwd_bad = pl.lit(False)
    replica_bad = pl.lit(False)
    bwd_bad = pl.lit(False)
    if has(df, "finite_fwd"):
        fwd_bad = (pl.col("finite_fwd") == 0).fill_null(False)
    if has(df, "local_loss"):
        replica_bad = (~pl.col("local_loss").is_finite()).fill_null(False)
    if has(df, "finite_bwd") and not scaler_on:
        bwd_bad = (pl.col("finite_bwd") == 0).fill_null(False)
    global_bad = loss_bad if scaler_on else (loss_bad | grad_bad)
    bad = fwd_bad | replica_bad | bwd_bad | global_bad
    cols = ["attempt", "step", "rank", "loss", "grad_norm"]
    cols += [c for c in ("finite_fwd", "finite_bwd", "local_loss") if c in df.columns]
    return (df.lazy().filter(bad)
            .with_columns(pl.when(fwd_bad).then(0).when(replica_bad).then(1).when(bwd_bad).then(2).otherwise(3)
                          .alias("_phase"))
            .select(cols + ["_phase"]).collect())


def _without_reruns(p, bad: pl.DataFrame) -> pl.DataFrame:
    """The non-finite rows less those of a rollback's diagnosis rerun (analysis/marks.py):
    its reproduction is the verdict on the incident it reruns, not a new one."""
    if not bad.height:
        return bad
    keep = [not p.run.marks.is_rerun(a, s) for a, s in zip(bad["attempt"].to_list(), bad["step"].to_list())]
    return bad if all(keep) else bad.filter(pl.Series(keep))


def _flow_key(row: dict) -> tuple:
    """Data-flow order of a non-finite row (smaller first)."""
    phase, stage, replica, tp = row["_phase"], row["_stage"], row["_replica"], row["_tp"]
    if phase == 1:  # a replica-level signal: every rank of the replica ties
        return (1, 0, replica, 0)
    if phase == 2:  # backward: the last stage computes first
        return (2, -stage, replica, tp)
    return (phase, stage, replica, tp)


@register
class NanDetector:
    name = "nan"
    kinds = ("nan",)

    def __init__(self, rules) -> None:
        self.cfg = rules.nan

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        steps = p.frames.steps
        changed: set[int] = set()
        if steps is not None and steps.height:
            bad = _without_reruns(p, _flags(steps, p.run.scaler_seen))
            if bad.height:
                changed = self._absorb(p, st, bad)
            for attempt, ep in st.episodes.items():
                seen = steps.filter((pl.col("attempt") == attempt) & (pl.col("step") == ep.first_step))["rank"]
                if seen.len():
                    before = len(ep.seen_first)
                    ep.seen_first.update(seen.to_list())
                    if len(ep.seen_first) != before:
                        changed.add(attempt)
        if steps is not None and steps.height:
            for attempt, ep in st.episodes.items():
                after = steps.filter((pl.col("attempt") == attempt) & (pl.col("step") > ep.last_step))["step"]
                if after.len() and len(ep.seen_after) < _SEEN_AFTER_MAX:
                    ep.seen_after.update(after.unique().to_list()[:_SEEN_AFTER_MAX])
        for attempt in changed:  # before the complete steps: an episode is reported before it can close
            self._report(p, st.episodes[attempt])
        refined: set[int] = set()
        self._complete_steps(p, st, refined)
        for attempt in refined:
            if attempt in st.episodes:
                self._report(p, st.episodes[attempt])

    # -- state updates -----------------------------------------------------------
    def _absorb(self, p, st: _State, bad: pl.DataFrame) -> set[int]:
        topo = p.topo
        ranks = bad["rank"].to_numpy().astype(np.int64)
        stage = topo.stage_of(ranks) if len(ranks) else ranks
        replica = topo.replica_of(ranks) if len(ranks) else ranks
        tp = np.maximum(topo.tp[ranks], 0) if len(ranks) else ranks
        bad = bad.with_columns(pl.Series("_stage", stage), pl.Series("_replica", replica), pl.Series("_tp", tp))
        changed = set()
        for (attempt,), whole in bad.partition_by("attempt", as_dict=True, maintain_order=True).items():
            for cut, part in self._clusters(p, st, attempt, whole):
                if cut:
                    self._close_before(p, st, attempt, int(part["step"].min()))
                self._absorb_part(p, st, attempt, part)
                changed.add(attempt)
        return changed

    def _clusters(self, p, st: _State, attempt: int, part: pl.DataFrame) -> list[tuple[bool, pl.DataFrame]]:
        """The non-finite rows of one attempt as (starts a new episode, rows), cut where
        `resolve_after_steps` steps, all reported finite in this pass, lie between two of them:
        a backlog can bring two episodes in one pass."""
        steps = p.frames.steps
        reported = set(steps.filter(pl.col("attempt") == attempt)["step"].to_list()) if steps is not None else set()
        ep = st.episodes.get(attempt)
        prev = ep.last_step if ep is not None else None
        if ep is not None:
            reported |= ep.seen_after
        cuts = []
        for s in sorted(set(part["step"].to_list())):
            if prev is not None and s - prev - 1 >= self.cfg.resolve_after_steps and \
                    all(g in reported for g in range(prev + 1, s)):
                cuts.append(s)
            prev = s if prev is None else max(prev, s)
        if not cuts:
            return [(False, part)]
        out = []
        bounds = [None, *cuts, None]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            m = pl.lit(True)
            if lo is not None:
                m = m & (pl.col("step") >= lo)
            if hi is not None:
                m = m & (pl.col("step") < hi)
            piece = part.filter(m)
            if piece.height:
                out.append((lo is not None, piece))
        return out

    def _close_before(self, p, st: _State, attempt: int, step: int) -> None:
        ep = st.episodes.pop(attempt, None)
        if ep is not None and p.book.is_open(ep.key):
            self._report(p, ep)
            p.resolve(ep.key, evidence={**p.book.get(ep.key).evidence,
                                        "resolved_because": f"{step - ep.last_step - 1} finite steps since"})

    def _absorb_part(self, p, st: _State, attempt: int, part: pl.DataFrame) -> None:
        ep = st.episodes.get(attempt)
        if ep is None:
            ep = st.episodes[attempt] = _Episode(p.book.new_key("nan"), attempt)
        first = int(part["step"].min())
        if first < ep.first_step:  # a new (or earlier) start: the origin is decided there
            ep.first_step, ep.cand_key, ep.cands, ep.flagged_first = first, None, {}, set()
            ep.num_rows_first = 0
            ep.seen_first = set()
            row = part.filter(pl.col("step") == first).row(0, named=True)
            ep.values = {"loss": json_number(row["loss"]), "grad_norm": json_number(row["grad_norm"])}
        ep.last_step = max(ep.last_step, int(part["step"].max()))
        ep.seen_after = {x for x in ep.seen_after if x > ep.last_step}
        ep.clean_steps = 0
        ep.flagged_ranks.update(part["rank"].to_list()[:4096])
        at_first = (part.filter(pl.col("step") == ep.first_step)
                    .sort(["_phase", "_stage", "_replica", "_tp", "rank"]))
        for row in at_first.iter_rows(named=True):
            ep.flagged_first.add(row["rank"])
            k = _flow_key(row)
            if ep.cand_key is None or k < ep.cand_key:
                ep.cand_key, ep.cands = k, {}
            if k == ep.cand_key and len(ep.cands) < self.cfg.max_listed_ranks:
                ep.cands[row["rank"]] = {c: json_number(row[c]) for c in ("finite_fwd", "finite_bwd", "local_loss")
                                         if c in row and row[c] is not None}

    def _complete_steps(self, p, st: _State, changed: set[int]) -> None:
        rel = p.released
        if rel is None or not rel.height or not st.episodes:
            return
        bad = _without_reruns(p, _flags(rel, p.run.scaler_seen))
        bad_keys = set(bad.select("attempt", "step").unique().iter_rows()) if bad.height else set()
        per_step = rel.group_by("attempt", "step").agg(pl.len().alias("n")).sort("attempt", "step")
        newest_attempt = int(rel["attempt"].max())
        for attempt, step, n in per_step.iter_rows():
            ep = st.episodes.get(attempt)
            if ep is None:
                continue
            if step == ep.first_step and n != ep.num_rows_first:
                ep.num_rows_first = n
                changed.add(attempt)
            if step > ep.last_step and (attempt, step) not in bad_keys:
                ep.clean_steps += 1
        for attempt, ep in list(st.episodes.items()):
            superseded = attempt < newest_attempt
            if ep.clean_steps >= self.cfg.resolve_after_steps or superseded:
                if attempt in changed:
                    self._report(p, ep)  # what the complete steps refined, then the close
                if p.book.is_open(ep.key):
                    why = "a newer attempt runs" if superseded else f"{ep.clean_steps} finite steps since"
                    p.resolve(ep.key, evidence={**p.book.get(ep.key).evidence, "resolved_because": why})
                del st.episodes[attempt]
                changed.discard(attempt)

    # -- the finding -------------------------------------------------------------
    def _report(self, p, ep: _Episode) -> None:
        topo = p.topo
        expected = max(topo.expected_ranks, ep.num_rows_first)
        phase = ep.cand_key[0] if ep.cand_key else 3
        cands = sorted(ep.cands)
        # Global values name an origin only where some rank of the step is known finite;
        # a replica's loss names a rank only when the replica is that one rank.
        some_finite = max(len(ep.seen_first), ep.num_rows_first) > len(ep.flagged_first)
        origin: int | None = None
        if cands and (phase == 0 or (phase == 1 and len(cands) == 1) or (phase in (2, 3) and some_finite)):
            origin = cands[0]
        replica = ep.cand_key[2] if ep.cand_key and phase < 3 else None
        if origin is None:
            confidence = 0.5 if phase == 1 else 0.3
        elif len(cands) > 1:
            confidence = 0.5
        else:
            confidence = (0.9, 0.8, 0.7, 0.6)[phase]
        coords = topo.coords(origin) if origin is not None else {}
        node = topo.node_name(origin)
        evidence = {
            "attempt": ep.attempt, "first_step": ep.first_step, "last_step": ep.last_step,
            "origin": None if origin is None else {"rank": origin, "node": node, **coords, "phase": _PHASES[phase]},
            "origin_replica": replica,
            "origin_signal": _SIGNALS[phase],
            "candidates": cands[:self.cfg.max_listed_ranks],
            "num_ranks_nonfinite_first_step": len(ep.flagged_first),
            "num_ranks_nonfinite": len(ep.flagged_ranks),
            "num_ranks": expected,
            "flags": {str(r): v for r, v in ep.cands.items() if v},
            **ep.values,
        }
        if origin is None and phase == 1:
            root = (f"non-finite loss first in replica {replica} at step {ep.first_step} (ranks "
                    f"{', '.join(map(str, cands[:8]))}); the rank needs finite_fwd; data or device: a rerun decides")
        elif origin is None and phase == 2:
            root = (f"non-finite gradients on every rank seen at step {ep.first_step}: origin unknown (reduced "
                    "before they were checked, or every rank's backward went bad); a rank's finite_fwd or "
                    "local_loss names it")
        elif origin is None:
            root = (f"non-finite loss/grad-norm on every rank at step {ep.first_step}: origin unknown "
                    "without per-rank signals (finite_fwd/finite_bwd/local_loss)")
        else:
            where = ", ".join(f"{a} {v}" for a, v in coords.items() if v is not None)
            root = (f"non-finite first in rank {origin}'s {_PHASES[phase]} at step {ep.first_step}"
                    f"{f' ({where})' if where else ''}; data or device: a rerun of the step decides")
            if len(cands) > 1:
                root += f" (tied with ranks {', '.join(map(str, cands[1:4]))})"
        p.report(Finding(kind="nan", key=ep.key, run_id=p.run.run_id, severity="critical", rank=origin, node=node,
                         step_from=ep.first_step, step_to=ep.last_step, evidence=evidence, root_cause=root,
                         confidence=confidence))
