"""The healing policy: which action an incident or a rerun verdict calls for.

Pure, like the detectors: incidents and verdicts in (plain dicts), `Decision`s
out, a clock value given. The collector's `PolicyRunner` (collector/live/policy.py)
feeds it and carries the decisions out; `collector replay` can run it over a
stored run to say what it would have done.

What calls for what (DESIGN.md section 7, the keys are `[policy]` in rules.toml):

- `nan`, `loss_spike`, `grad_spike` (`rollback_on`): **rollback** to the newest
  verified checkpoint before the incident's first step; the rerun of that step
  with the replicas swapped is the diagnosis (trainer/diagnosis.py). Its verdict
  comes back as an event (`on_verdict`):
  - `data`: nothing more (the trainer skipped the samples). But when an incident of
    the same kind opens after it within `recur_within_steps` steps of the skipped
    step, the skip did not help: it is not the data, and another rollback would loop;
    the run is **stopped** with that reason (the rollback refused, as past
    `max_rollbacks`);
  - `device`: **isolate** the node. When a guard rail refuses that (`min_nodes`), the
    run is **stopped** with the reason: the device fails every step whatever its data,
    and each rollback would replay into it;
  - `transient`: counted against the node; `transient_limit` of them within
    `transient_window_s` isolate it.
- `straggler` whose cost stays at or above `straggler_cost_s` seconds per step and
  `straggler_min_share` of its step for `straggler_persist_s` and `persist_steps`
  steps is weighed by the cost model (analysis/costmodel.py: the seconds to finish
  the run keeping the node, or without it on the nodes left): **isolate** its node
  when that saves `min_gain_share` of the time left, else keep it (an alert). The
  model's inputs are the run's (`RunPolicy`: the steps it has left, its newest
  checkpoint, its measured restart cost, its replicas and micro-batches) and the
  incident's (`step_s`, its cost, the rank's `compute_ratio`). When moving micro-batches
  from the straggler's replica to the others is the best candidate (`rebalance`), it
  is a **rebalance** in place (trainer/control.py), and when its incident closes (the
  rank recovered, or its node left) a rebalance back to the job's own split undoes it.
  One rebalance is in force in a run at a time: while it is, a rebalance is not a
  candidate for another straggler (its split names one slow replica). A rebalanced
  straggler is weighed again when its rank gets `rebalance_retune` times slower
  per micro-batch than the split was made for, and stays so for its persistence:
  against going on under the split in force (its measured step time), a split for
  the new ratio, a replacement or a shrink (the healthy step time the first
  weighing measured); the cheapest that saves `min_gain_share` of the time left is
  carried out (a straggler that went from 2x to 12x ends up isolated).
- `slow_link` the same, with `slow_link_cost_s`, `slow_link_min_share` and
  `slow_link_persist_s`: **isolate** the node of the rank whose link is slow.
- `data_stall` the same, with `data_stall_cost_s`, `data_stall_min_share` and
  `data_stall_persist_s`: **isolate** the node whose data loading stalls.
- `checkpoint_slow`: an alert only (every incident is one). Moving that node's
  checkpoints to the persist tier alone would need a per-node checkpoint target,
  which the checkpointer does not have (trainer/checkpoint.py writes to `dir`,
  then copies to `persist_dir`).
- `hang`: **isolate** the culprit's node (`isolate_on_hang`).
- `device_health` (analysis/detectors/device_health.py), by its evidence's `cause`:
  - `ecc`: **isolate** the node (`isolate_on_ecc`): its GPU's memory corrupts data,
    so the node is drained rather than trusted again. With `isolate_on_ecc` false
    the fault is counted against the node as a transient verdict is
    (`transient_limit` within `transient_window_s` isolate it);
  - `memory_pressure`: a **checkpoint** now (`checkpoint_on_memory_pressure`), so
    that the OOM kill that may come next loses the least (trainer/control.py; a run
    without --ckpt-dir rejects it, and the action fails with that reason);
  - `thermal_throttle`, `power_throttle`: an alert only; the straggler detector
    prices the slowness a throttled GPU causes, and its policy isolates the node
    when that costs enough.
- `preflight` (a node whose pre-flight checks failed, trainer/preflight.py):
  **isolate** it (`isolate_on_preflight`): a spare takes its place, or the job goes
  on without it.
- `node_history` (a node that failed in other runs lately, analysis/fleet.py):
  **isolate** it when the run has a spare to take its place (`replace_flagged_nodes`),
  before it costs the run anything; else an alert only.
- `crash`: **restart** (the supervisor's own; recorded), and the
  `crashes_to_isolate`-th crash on one node **isolates** it. A crash that comes
  after `restarts_without_progress` restarts (isolations restart the job too) in a
  row with no progress, the highest step the run reached (`RunPolicy.reached`) no
  further than before the first of them, **stops** the run: it crashes where it
  crashed before, and a restart would loop. Not the known-good watermark: it lags
  the steps by a detection pass, and the one a first crash saw rose after it (a
  loop crashing at step 30 every time looked like progress from 18 to 25).
- `replica_divergence` (silent data corruption): with a majority and caught at
  the first checksum after the last agreeing one (`caught_within_steps` <=
  `checksum_every`, and `replica_repair`): **repair** in place (a healthy
  replica's parameters and optimizer state broadcast over its dp group,
  trainer/control.py); otherwise (dp = 2: no majority; or caught late) **rollback**
  to the newest verified checkpoint before the last agreeing step, without a
  rerun. Either way the fault counts against the suspect node(s) as a transient
  verdict does (the action's `faults`: node -> count): `transient_limit` within
  `transient_window_s` isolate it. One held back by the cooldown is asked again
  while it stays open (`waiting`).

Guard rails: a `cooldown_s` between two actions of one kind in a run (the next
one waits for it: `waiting`, and the runner asks again); and, each a `refused`
decision with the reason (recorded and alerted, not done), at most
`max_rollbacks` within `rollback_window_s` (past it: **stop** the run rather than
loop) and never an isolation below `min_nodes` healthy nodes. Nothing at all once
the run has finished. Modes: `auto` acts, `shadow` records what it would do, `off`
does nothing; `mode` for all, `rollback_mode` / `isolate_mode` per action.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from analysis import costmodel, kinds

MODES = ("auto", "shadow", "off")
# the action kinds (analysis/kinds.py holds each one's lifecycle)
ROLLBACK, ISOLATE, STOP, RESTART = "rollback", "isolate", "stop", "restart"
REPAIR, CHECKPOINT, REBALANCE = "repair", "checkpoint", "rebalance"


@dataclass(frozen=True, slots=True)
class Decision:
    kind: str  # rollback | isolate | stop | restart | repair | checkpoint | rebalance
    run_id: str
    reason: str
    incident_id: int | None = None
    args: dict[str, Any] = field(default_factory=dict)  # the command's arguments
    node: str | None = None
    rank: int | None = None
    mode: str = "auto"  # auto | shadow
    refused: str | None = None  # a guard rail said no: why
    faults: dict[str, int] = field(default_factory=dict)  # node -> device faults counted within the window
    predicted: dict[str, Any] = field(default_factory=dict)  # the cost model's candidates and gain (costmodel.py)

    def detail(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reason": self.reason, "args": self.args}
        if self.refused:
            out["refused"] = self.refused
        if self.faults:
            out["faults"] = self.faults
        if self.predicted:
            out["predicted"] = self.predicted
        return out


@dataclass(slots=True)
class RunPolicy:
    """What the policy remembers of one run."""

    run_id: str
    nodes: list[str] = field(default_factory=list)  # every node of the run's first layout
    isolated: set[str] = field(default_factory=set)
    finished: bool = False
    rollbacks: deque = field(default_factory=deque)  # times of rollbacks issued
    last_ts: dict[str, float] = field(default_factory=dict)  # action kind -> when last issued
    transients: dict[str, deque] = field(default_factory=dict)  # node -> times of transient verdicts
    crashes: dict[str, int] = field(default_factory=dict)  # node -> crash incidents
    acted: set[int] = field(default_factory=set)  # incidents an action was decided for
    # the latest data verdicts, (kind, skipped step, when): what a recurrence comes back after
    skips: deque = field(default_factory=lambda: deque(maxlen=16))
    stopping: bool = False  # a stop was decided (auto): no rollback after it
    slow_since: dict[int, tuple] = field(default_factory=dict)  # slow-down incident -> (costly since, at step)
    # the highest step the run reached (the runner's; None: not known), and what it was at each
    # restart decided (a crash's restart or isolation): progress between them
    reached: int | None = None
    restart_marks: deque = field(default_factory=lambda: deque(maxlen=16))
    # the cost model's inputs from the run: its last step (None: open-ended), its newest
    # checkpoint's step, the seconds from each restart decided to its first new step, its start-up
    steps_total: int | None = None
    ckpt_step: int | None = None
    restart_costs: list[float] = field(default_factory=list)
    startup_s: float | None = None
    spares: int = 0  # standby nodes the run's launcher has left: one takes an isolated node's place
    dp: int = 0  # data-parallel replicas now (0: not known, or not our trainer: no rebalance)
    micro_batches: int = 0  # the global batch's micro-batches, every replica's
    rebalanced: dict[int, int] = field(default_factory=dict)  # incident -> rank, while its rebalance holds
    # incident -> (the per-micro-batch ratio its split was made for, the job's healthy step time then)
    rebalance_basis: dict[int, tuple[float, float]] = field(default_factory=dict)
    worse_since: dict[int, tuple] = field(default_factory=dict)  # rebalanced incident -> (slower since, at step)
    replaced: dict[tuple[str, int], str] = field(default_factory=dict)  # (slow-down kind, rank) -> node a spare replaced
    # the most the run itself allows ("shadow", "off"; None: the policy's mode): a job we did not
    # write (llmwatch-instrument) is acted on in shadow unless it opts in
    mode_cap: str | None = None


def apply_cost_inputs(st: RunPolicy, inputs: dict[str, Any], *, reached: int | None = None) -> None:
    """The run's side of the cost model's inputs (collector/read/queries.py `cost_inputs`) into
    its policy state; `reached` (default the state's) picks the newest checkpoint at or before it."""
    if reached is not None:
        st.reached = reached
    st.steps_total, st.startup_s = inputs.get("steps_total"), inputs.get("startup_s")
    st.restart_costs = list(inputs.get("restart_costs") or [])
    at = st.reached if st.reached is not None else 1 << 62
    st.ckpt_step = max((s for s in inputs.get("ckpt_steps") or [] if s <= at), default=None)
    if inputs.get("nodes"):  # every node that held ranks: a spare that took a node's place counts from then on
        st.nodes = sorted(set(st.nodes) | set(inputs["nodes"]))
    st.spares = len(inputs.get("spares") or [])
    st.dp, st.micro_batches = int(inputs.get("dp") or 0), int(inputs.get("micro_batches") or 0)


def _rank_ratio(evidence: dict[str, Any], rank: int | None) -> float | None:
    """The slow rank's compute ratio (per micro-batch) from a straggler's evidence: its own
    row's, else the incident's."""
    mine = ((evidence.get("per_rank") or {}).get(str(rank)) or {}).get("compute_ratio")
    return _number(mine if mine is not None else evidence.get("compute_ratio"))


def _take_out_gain(best: str, gain_s: float) -> str:
    """The reason's tail for taking a node out: what the cost model expects it to save."""
    if best == costmodel.REPLACE:
        return f"; the job finishes ~{gain_s:.1f} s sooner with a spare in its node's place (replace)"
    return f"; the job finishes ~{gain_s:.1f} s sooner without its node ({best})"


def _number(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class Policy:
    def __init__(self, rules, *, mode: str | None = None) -> None:
        """`rules`: the whole Rules object (its `policy` section is read); `mode`
        overrides `policy.mode` (the --policy flag)."""
        self.cfg = rules.policy
        self.spikes = {"loss_spike": rules.loss_spike, "grad_spike": rules.grad_spike}
        self.mode = mode or self.cfg.mode
        if self.mode not in MODES:
            raise ValueError(f"policy mode {self.mode!r}: one of {', '.join(MODES)}")

    def mode_of(self, kind: str) -> str:
        own = {ROLLBACK: self.cfg.rollback_mode, ISOLATE: self.cfg.isolate_mode}.get(kind, "")
        if self.mode == "off":
            return "off"
        return own if own in MODES else self.mode

    # -- inputs --------------------------------------------------------------
    def on_incident(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """An incident opened or changed (the row as it is now). A spike or a NaN is acted
        on even when its incident closed in the pass that opened it (the damage is done
        all the same); a straggler or a hang only while it is open."""
        if inc.get("id") in st.rebalanced and not st.finished:
            if inc.get("status", "open") != "open":
                return self._undo_rebalance(st, inc, now)
            return self._reweigh_rebalanced(st, inc, now)
        if st.finished or inc.get("id") in st.acted:
            return []
        kind = inc.get("kind")
        # `rollback_on` may add or take away the rollback kinds; any other kind goes by its rule
        rule = "rollback" if kind in self.cfg.rollback_on else kinds.rule_of(kind)
        if rule == "rollback" and kind not in self.cfg.rollback_on:
            rule = "alert"
        if inc.get("status", "open") != "open" and rule != "rollback" and kind not in kinds.ACTED_WHEN_CLOSED:
            return []
        return getattr(self, self.RULES[rule])(st, inc, now)

    # the method each of analysis/kinds.py's rules calls (tests/unit/test_kinds.py: one per rule)
    RULES = {"rollback": "_rollback", "persist": "_persist", "hang": "_hang", "crash": "_crash",
             "divergence": "_divergence", "device_health": "_device_health", "history": "_history",
             "preflight": "_preflight", "alert": "_alert"}

    def _alert(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        return []  # the incident is its own alert

    def _hang(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        if not self.cfg.isolate_on_hang:
            return []
        return self._isolate(st, inc, inc.get("node"), now,
                             f"hang: rank {inc.get('rank')} stopped entering collectives")

    def _preflight(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """A node that failed its pre-flight checks: out before it costs the run (a spare takes its
        place when there is one; without one the job goes on with the others, min_nodes allowing)."""
        if not self.cfg.isolate_on_preflight:
            return []
        ev = inc.get("evidence") or {}
        return self._isolate(st, inc, inc.get("node"), now,
                             f"preflight: node {inc.get('node')} failed its pre-flight checks ({ev.get('verdict')})")

    def _history(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """A node that failed in other runs lately (node_history): a spare takes its place
        before it costs this run anything; without a spare the run keeps it (an alert)."""
        if not self.cfg.replace_flagged_nodes or st.spares <= 0:
            return []
        ev = inc.get("evidence") or {}
        days = _number(ev.get("window_days"))
        reason = (f"node_history: node {inc.get('node')} had faults in {ev.get('fault_runs')} of its "
                  f"{ev.get('runs')} runs" + (f" in the last {days:g} days" if days is not None else "")
                  + "; a spare takes its place")
        return self._isolate(st, inc, inc.get("node"), now, reason)

    def _device_health(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """ECC errors isolate the node (or count against it); memory pressure checkpoints
        now; throttling is an alert only (the module doc)."""
        ev = inc.get("evidence") or {}
        cause, node, rank = ev.get("cause"), inc.get("node"), inc.get("rank")
        if cause == "ecc":
            n = ev.get("new_errors")
            reason = (f"ecc: rank {rank}'s GPU reported {'' if n is None else f'{n} '}new uncorrectable ECC "
                      f"error(s): its memory corrupts data")
            if self.cfg.isolate_on_ecc:
                return self._isolate(st, inc, node, now, reason)
            if node is None or self.mode == "off":
                return []
            if inc.get("id") is not None:
                st.acted.add(inc["id"])  # counted once, however often the open incident is updated
            return self._count_fault(st, inc, node, now)
        if cause == "memory_pressure" and self.cfg.checkpoint_on_memory_pressure:
            share = _number(ev.get("mem_available_share"))
            reason = (f"memory_pressure: node {node}'s memory available"
                      + (f" is {100 * share:.1f}%" if share is not None else " is low")
                      + ": checkpoint before an OOM kill")
            return self._decision(st, CHECKPOINT, inc, reason, now, node=node,
                                  args={"incident_id": inc.get("id"), "reason": reason})
        return []

    def _divergence(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """Repair in place when a majority holds the healthy bits and the corruption was
        caught at the first checksum after the last agreeing one; else roll back (no
        rerun: a memory fault is not in the data). Then count it against the node(s):
        the action's `faults` say how many each has within the window."""
        ev = inc.get("evidence") or {}
        if self._divergence_action(inc) == REPAIR:
            within = _number(ev.get("caught_within_steps"))
            reason = (f"replica_divergence of shard {ev.get('shard')}: rank(s) {ev.get('divergent_ranks')} differ from "
                      f"the majority at step {ev.get('first_disagreeing_step')} (caught within {within:g} steps)")
            out = self._decision(st, REPAIR, inc, reason, now, node=inc.get("node"),
                                 args={"src_dp": int(ev["src_dp"]), "ranks": list(ev.get("divergent_ranks") or []),
                                       "incident_id": inc.get("id"), "step": inc.get("step_to")})
        else:
            out = [replace(d, args={**d.args, "diagnose": False}) if d.kind == ROLLBACK else d
                   for d in self._rollback(st, inc, now)]
        if out and out[0].refused is None:
            faults, isolations = {}, []
            for node in ev.get("suspect_nodes") or ([inc["node"]] if inc.get("node") else []):
                isolations += self._count_fault(st, inc, node, now)
                faults[node] = len(st.transients[node])
            out = [replace(out[0], faults=faults), *out[1:], *isolations]
        return out

    def _divergence_action(self, inc: dict[str, Any]) -> str:
        """What a `replica_divergence` calls for: REPAIR with a majority (a healthy
        `src_dp`) caught within `checksum_every` steps of the last agreeing checksum
        (and `replica_repair`), else ROLLBACK."""
        ev = inc.get("evidence") or {}
        within, every = _number(ev.get("caught_within_steps")), _number(ev.get("checksum_every"))
        if (self.cfg.replica_repair and ev.get("majority") and ev.get("src_dp") is not None
                and within is not None and every is not None and within <= every):
            return REPAIR
        return ROLLBACK

    def _count_fault(self, st: RunPolicy, inc: dict[str, Any], node: str, now: float) -> list[Decision]:
        """A fault of `node`'s device that was healed (a transient verdict's counter):
        the `transient_limit`-th within `transient_window_s` isolates the node."""
        times = st.transients.setdefault(node, deque())
        times.append(now)
        while times and now - times[0] > self.cfg.transient_window_s:
            times.popleft()
        if len(times) < self.cfg.transient_limit:
            return []
        return self._isolate(st, inc, node, now,
                             f"{len(times)} device faults within {self.cfg.transient_window_s:g} s")

    def on_verdict(self, st: RunPolicy, verdict: dict[str, Any], node: str | None, now: float, *,
                   at: float | None = None) -> list[Decision]:
        """A rerun's verdict (the trainer's `rerun_verdict` event); `node`: its rank's; `at`: when
        the trainer reached it (the event's ts; default `now`): an incident opened after that is
        the next one, even when the collector read the verdict later (a busy collector opened the
        recurring spike before it read the verdict that skipped its forerunner's batch)."""
        what = verdict.get("verdict")
        step = _number((verdict.get("probe") or {}).get("step"))
        if what == "data" and step is not None and verdict.get("incident_kind"):
            when = now if at is None else at
            st.skips.append((str(verdict["incident_kind"]), int(step), when))
        if st.finished or node is None:
            return []
        inc = {"id": verdict.get("incident_id"), "rank": verdict.get("rank"), "node": node}
        if what == "device":
            out = self._isolate(st, inc, node, now, f"device: {verdict.get('evidence', 'the fault stayed on it')}")
            if out and out[0].kind == ISOLATE and out[0].refused:
                why = (f"device: rank {inc['rank']} on {node} fails whatever its data, and its isolation was refused "
                       f"({out[0].refused}): stopping the run rather than rolling back into it")
                out += self._stop(st, inc, why, now, shadow=out[0].mode == "shadow", node=node)
            return out
        if what == "transient":
            times = st.transients.setdefault(node, deque())
            times.append(now)
            while times and now - times[0] > self.cfg.transient_window_s:
                times.popleft()
            if len(times) >= self.cfg.transient_limit:
                return self._isolate(st, inc, node, now, f"{len(times)} transient faults within "
                                                         f"{self.cfg.transient_window_s:g} s")
        return []

    def on_finished(self, st: RunPolicy) -> None:
        st.finished = True

    # -- decisions -------------------------------------------------------------
    def _decision(self, st: RunPolicy, kind: str, inc: dict[str, Any], reason: str, now: float, *,
                  args: dict[str, Any] | None = None, node: str | None = None, refused: str | None = None,
                  cooldown: bool = True) -> list[Decision]:
        mode = self.mode_of(kind)
        if mode == "off" or st.mode_cap == "off":
            return []
        if st.mode_cap == "shadow":
            mode = "shadow"
        if refused is None and cooldown and self.cooling(st, kind, now):
            return []  # not now: decided when the cooldown is over (the incident is not marked acted)
        if inc.get("id") is not None:
            st.acted.add(inc["id"])
        if refused is None:
            st.last_ts[kind] = now
        return [Decision(kind=kind, run_id=st.run_id, reason=reason, incident_id=inc.get("id"), args=args or {},
                         node=node, rank=inc.get("rank"), mode=mode, refused=refused)]

    def cooling(self, st: RunPolicy, kind: str, now: float) -> bool:
        """A `kind` action was issued less than `cooldown_s` ago in this run."""
        return now - st.last_ts.get(kind, -math.inf) < self.cfg.cooldown_s

    @staticmethod
    def watching(st: RunPolicy) -> bool:
        """Whether an action may be decided for the run any moment: a slow-down (or a rebalanced
        one that got slower) is being watched for its wait, or a rebalance is in force (its undo
        comes the moment its incident closes). The collector then asks the run's deciding rank to
        fetch its commands more often (collector/live/policy.py)."""
        return bool(st.slow_since or st.worse_since or st.rebalanced) and not st.finished

    def waiting(self, st: RunPolicy, inc: dict[str, Any], now: float) -> bool:
        """An incident the policy has not decided on yet, and will when asked again: a
        NaN settling for its culprit, or a rollback (or an open replica_divergence's
        repair or rollback) waiting out the cooldown."""
        if st.finished or inc.get("id") in st.acted:
            return False
        kind = inc.get("kind")
        if kind == "replica_divergence":
            action = self._divergence_action(inc)
            if inc.get("status", "open") != "open" or (action == ROLLBACK and inc.get("node") in st.isolated):
                return False
            return self.mode_of(action) != "off" and self.cooling(st, action, now)
        if kind not in self.cfg.rollback_on:
            return False
        if self._recurrence(st, inc) is not None:
            return False  # stopped now: a cooldown is for the next rollback, and there is none
        return self.settling(inc, now) or (self.mode_of(ROLLBACK) != "off" and self.cooling(st, ROLLBACK, now))

    def settling(self, inc: dict[str, Any], now: float) -> bool:
        """A NaN whose first rows came from ranks that only saw it arrive (the culprit's
        rows not in yet) names no rank: wait up to `nan_settle_s` for the culprit, whom
        the rerun compares against; then decide without one."""
        opened = _number(inc.get("opened_ts"))
        return (inc.get("kind") == "nan" and inc.get("rank") is None and opened is not None
                and now - opened < self.cfg.nan_settle_s)

    def _rollback(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        if inc.get("node") in st.isolated:
            return []  # its node is on its way out: the isolation is the action
        if st.stopping:
            return []  # the run is being stopped: nothing to roll back into
        if self.settling(inc, now):
            return []  # asked again on the incident's next update, or by the runner's tick
        step = inc.get("step_from")
        reason = f"{inc['kind']} at step {step}" + (f" on rank {inc['rank']}" if inc.get("rank") is not None else "")
        if step is None:
            return self._decision(st, ROLLBACK, inc, reason, now, refused="the incident names no step")
        args: dict[str, Any] = {"step": int(step), "incident_id": inc.get("id"), "kind": inc["kind"],
                                "skip_batches": int(self.cfg.skip_batches)}
        if inc.get("rank") is not None:
            args["rank"] = int(inc["rank"])
        args.update(self._reproduce_thresholds(inc))
        recur = self._recurrence(st, inc)
        if recur is not None:  # shadowed: the skip it counts was never carried out
            stop = self._stop(st, inc, recur, now, shadow=self.mode_of(ROLLBACK) == "shadow")
            return self._decision(st, ROLLBACK, inc, reason, now, args=args, refused=recur) + stop
        while st.rollbacks and now - st.rollbacks[0] > self.cfg.rollback_window_s:
            st.rollbacks.popleft()
        if len(st.rollbacks) >= self.cfg.max_rollbacks:
            cap = f"{len(st.rollbacks)} rollbacks within {self.cfg.rollback_window_s:g} s (max_rollbacks " \
                  f"{self.cfg.max_rollbacks}): stopping the run instead of looping"
            # shadowed: the rollbacks it counts were never carried out
            stop = self._stop(st, inc, cap, now, shadow=self.mode_of(ROLLBACK) == "shadow")
            return self._decision(st, ROLLBACK, inc, reason, now, args=args, refused=cap) + stop
        out = self._decision(st, ROLLBACK, inc, reason, now, args=args, node=inc.get("node"))
        if out and out[0].refused is None:
            st.rollbacks.append(now)
        return out

    def _recurrence(self, st: RunPolicy, inc: dict[str, Any]) -> str | None:
        """Why the incident is its kind coming back after a data verdict skipped its samples
        (opened after that verdict, at or within `recur_within_steps` steps after the skipped
        step), None when it is not."""
        within, step = self.cfg.recur_within_steps, _number(inc.get("step_from"))
        opened = _number(inc.get("opened_ts"))
        if within <= 0 or step is None:
            return None
        for kind, skipped, when in reversed(st.skips):
            if kind == inc.get("kind") and 0 <= step - skipped <= within and (opened is None or opened > when):
                return (f"{kind} at step {int(step)} came back {int(step - skipped)} step(s) after the samples of step "
                        f"{skipped} were skipped (a data verdict): not the data, and another rollback would loop "
                        f"(recur_within_steps {within}): stopping the run")
        return None

    def _stop(self, st: RunPolicy, inc: dict[str, Any], why: str, now: float, *, shadow: bool,
              node: str | None = None) -> list[Decision]:
        """A stop of the run for `why` (in shadow when what it answers was shadowed); once one
        is carried out for real, no rollback follows it."""
        out = self._decision(st, STOP, inc, why, now, args={"reason": why}, cooldown=False, node=node)
        if shadow:
            out = [replace(d, mode="shadow") for d in out]
        st.stopping |= any(d.mode == "auto" for d in out)
        return out

    def _reproduce_thresholds(self, inc: dict[str, Any]) -> dict[str, float]:
        """What a reproduced spike looks like in the rerun: above the geometric midpoint of
        the detector's own bar (level x min_ratio) and the spike's peak."""
        spec = self.spikes.get(inc.get("kind"))
        peak = (inc.get("evidence") or {}).get("peak") or {}
        level = _number(peak.get("baseline", peak.get("level")))  # the spike detector's level at the peak
        value = _number(peak.get("value"))
        if spec is None or level is None or value is None or level <= 0:
            return {}
        bar = level * spec.min_ratio
        above = math.sqrt(bar * max(value, bar))
        return {"loss_above" if inc["kind"] == "loss_spike" else "grad_norm_above": round(above, 6)}

    def _persist(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """A straggler, a slow link or a data stall (`<kind>_cost_s`, `_min_share`, `_persist_s`)."""
        evidence = inc.get("evidence") or {}
        kind = inc.get("kind", "straggler")
        min_cost, min_share, persist_s = (self.cfg[f"{kind}_{k}"] for k in ("cost_s", "min_share", "persist_s"))
        cost, share = _number(evidence.get("cost_s_per_step")), _number(evidence.get("share_of_step"))
        iid = inc["id"]
        if cost is None or cost < min_cost or (share is not None and share < min_share):
            st.slow_since.pop(iid, None)
            return []
        rank, node = inc.get("rank"), inc.get("node")
        situation = self._situation(st, evidence, cost, kind=kind, rank=rank) if self.cfg.weigh_cost else None
        p = costmodel.predict(situation, min_gain_share=self.cfg.min_gain_share) if situation is not None else None
        wait = self._wait_s(situation, p, persist_s)
        if not self._persisted(st, st.slow_since, iid, now, wait):
            return []
        since, since_step = st.slow_since[iid]
        steps = st.reached - since_step if st.reached is not None and since_step is not None else None
        what = {"slow_link": f"slow {evidence.get('axis')} link", "data_stall": "data stall"}.get(kind, "straggler")
        was = st.replaced.get((kind, rank)) if rank is not None else None
        if was is not None and node is not None and node != was:  # the spare in its place is slow there too
            st.slow_since.pop(iid, None)
            why = (f"{what} again at rank {rank}: {node} took {was}'s place and is as slow there: the slowness "
                   f"stays with the place (its data, its stage, its links), not the node, and another "
                   f"replacement would loop: stopping the run")
            return self._stop(st, inc, why, now, shadow=self.mode_of(ISOLATE) == "shadow", node=node)
        lasted = f" for {now - since:.1f} s" + (f" ({steps} steps)" if steps is not None else "")
        reason = (f"{what}: rank {inc.get('rank')} costs {cost:.3g} s/step"
                  + (f" ({100 * share:.0f}% of its step)" if share is not None else "") + lasted)
        predicted = None
        if situation is not None and p is not None:
            if p.best == costmodel.KEEP:
                return []  # weighed again on its next update: the steps left, the costs measured change
            predicted = {**p.detail(situation), "at_step": st.reached, "watched_s": round(now - since, 3),
                         "wait_s": round(wait, 3)}
            if p.best == costmodel.REBALANCE:
                st.slow_since.pop(iid, None)
                return self._rebalance(st, inc, now, reason, situation, predicted)
            reason += _take_out_gain(p.best, p.gain_s)
        st.slow_since.pop(iid, None)
        return self._take_out(st, inc, kind, rank, node, now, reason, predicted)[0]

    def _take_out(self, st: RunPolicy, inc: dict[str, Any], kind: str, rank: int | None, node: str | None,
                  now: float, reason: str, predicted: dict[str, Any] | None) -> tuple[list[Decision], bool]:
        """Isolate a slow-down's node (replaced by a spare when one is left, which is then
        remembered for the place loop); (the decisions, whether it went out for real)."""
        spare = st.spares > 0
        out = self._isolate(st, inc, node, now, reason)
        gone = any(d.kind == ISOLATE and d.refused is None and d.mode == "auto" for d in out)
        if gone and spare and rank is not None:
            st.replaced[(kind, rank)] = node  # a spare takes its ranks: the same place
        return [replace(d, predicted=predicted) if predicted and d.kind == ISOLATE else d for d in out], gone

    def _wait_s(self, situation: costmodel.Situation | None, p: costmodel.Prediction | None,
                persist_s: float) -> float:
        """How long a slow-down is watched before its best action is taken: until it has cost what
        that action would cost were it to end then (costmodel.regret_s: the ski-rental rule), at
        most `persist_s` (and `persist_steps` steps, always)."""
        if situation is None or p is None or p.best == costmodel.KEEP or situation.step_s <= 0:
            return persist_s
        lost = min(1.0, max(0.0, situation.excess_s) / situation.step_s)  # of each second watched
        if lost <= 0:
            return persist_s
        return min(persist_s, costmodel.regret_s(situation, p.best, undo_steps=self.cfg.persist_steps) / lost)

    def _persisted(self, st: RunPolicy, book: dict[int, tuple], iid: int, now: float, persist_s: float) -> bool:
        """Whether the condition `book` times for incident `iid` has held `persist_s` and
        `persist_steps` (its clock starts at the first call)."""
        since, since_step = book.setdefault(iid, (now, st.reached))
        steps = st.reached - since_step if st.reached is not None and since_step is not None else None
        return not (now - since < persist_s or (steps is not None and steps < self.cfg.persist_steps))

    def _rebalance(self, st: RunPolicy, inc: dict[str, Any], now: float, reason: str,
                   situation: costmodel.Situation, predicted: dict[str, Any]) -> list[Decision]:
        """Move micro-batches from the straggler's replica to the others, in place."""
        rank = inc.get("rank")
        reason += (f"; the job finishes ~{predicted['gain_s']:.1f} s sooner with its replica's micro-batches "
                   f"moved to the others (rebalance, {situation.ratio:.2f}x slower per micro-batch)")
        out = self._decision(st, REBALANCE, inc, reason, now, node=inc.get("node"), cooldown=False,
                             args={"rank": int(rank), "ratio": round(situation.ratio, 4),
                                   "incident_id": inc.get("id")})
        if out and out[0].refused is None and out[0].mode == "auto":
            st.rebalanced[inc["id"]] = int(rank)
            st.rebalance_basis[inc["id"]] = (situation.ratio, situation.healthy_s)
        return [replace(d, predicted=predicted) for d in out]

    def _reweigh_rebalanced(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """A rebalanced straggler that got `rebalance_retune` times slower per micro-batch
        than its split was made for, for its persistence: weighed again (the module doc)."""
        iid, evidence = inc["id"], inc.get("evidence") or {}
        basis = st.rebalance_basis.get(iid)
        rank = st.rebalanced[iid]
        ratio = _rank_ratio(evidence, rank)
        cost, step_s = _number(evidence.get("cost_s_per_step")), _number(evidence.get("step_s"))
        if (basis is None or not self.cfg.weigh_cost or ratio is None or cost is None or step_s is None
                or ratio < basis[0] * self.cfg.rebalance_retune):
            st.worse_since.pop(iid, None)
            return []
        if not self._persisted(st, st.worse_since, iid, now, self.cfg.straggler_persist_s):
            return []
        st.worse_since.pop(iid, None)
        # the candidates from the job's healthy step time the first weighing measured: the straggler's excess
        # at an even share on top of it (evidence: compute at even share, judged per micro-batch)
        unsplit = self._situation(st, {**evidence, "step_s": basis[1] + cost}, cost, kind="straggler", rank=None)
        if unsplit is None:
            return []
        unsplit = replace(unsplit, ratio=ratio)
        p = costmodel.predict(unsplit, min_gain_share=0.0)
        seconds = dict(p.seconds)
        seconds[costmodel.KEEP] = unsplit.steps_left * step_s  # going on under the split in force
        best = min(seconds, key=lambda k: (seconds[k], k != costmodel.KEEP))
        gain = seconds[costmodel.KEEP] - seconds[best]
        if best == costmodel.KEEP or gain < self.cfg.min_gain_share * seconds[costmodel.KEEP]:
            return []
        p = costmodel.Prediction(best=best, seconds=seconds, gain_s=gain)
        predicted = {**p.detail(unsplit), "at_step": st.reached, "rebalanced_from": round(basis[0], 4)}
        reason = (f"straggler: rank {rank} got slower under its rebalance ({ratio:.2f}x per micro-batch, the split "
                  f"was made for {basis[0]:.2f}x)")
        if best == costmodel.REBALANCE:
            out = self._decision(st, REBALANCE, inc, reason + f"; the job finishes ~{gain:.1f} s sooner split for "
                                 f"{ratio:.2f}x (rebalance)", now, node=inc.get("node"), cooldown=False,
                                 args={"rank": rank, "ratio": round(ratio, 4), "incident_id": iid})
            if out and out[0].refused is None and out[0].mode == "auto":
                st.rebalance_basis[iid] = (ratio, basis[1])
            return [replace(d, predicted=predicted) for d in out]
        out, gone = self._take_out(st, inc, "straggler", rank, inc.get("node"), now,
                                   reason + _take_out_gain(best, gain), predicted)
        if gone:  # the restart goes back to the job's own split: nothing to undo when the incident closes
            st.rebalanced.pop(iid, None)
            st.rebalance_basis.pop(iid, None)
        return out

    def _undo_rebalance(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        """The rebalanced straggler's incident closed: back to the job's own split."""
        rank = st.rebalanced.pop(inc["id"])
        st.rebalance_basis.pop(inc["id"], None)
        st.worse_since.pop(inc["id"], None)
        reason = (f"{inc.get('kind', 'straggler')} on rank {rank} is over: its replica takes its own share of the "
                  f"micro-batches again (the rebalance undone)")
        return self._decision(st, REBALANCE, inc, reason, now, node=inc.get("node"), cooldown=False,
                              args={"rank": rank, "ratio": 1.0, "incident_id": inc.get("id"), "undo": True})

    def _situation(self, st: RunPolicy, evidence: dict[str, Any], cost: float, *, kind: str = "straggler",
                   rank: int | None = None) -> costmodel.Situation | None:
        """The cost model's inputs for a slow-down now; None when the run's size or step time
        is not known (the thresholds alone then decide, as before the model). A rebalance is a
        candidate for a compute straggler whose rank is known, with `rebalance` on, the run's
        replicas and micro-batches known, and no other rebalance in force."""
        step_s = _number(evidence.get("step_s"))
        if step_s is None or step_s <= 0 or not st.nodes:
            return None
        reached = st.reached if st.reached is not None else 0
        left = st.steps_total - reached if st.steps_total is not None else self.cfg.horizon_steps
        if st.restart_costs:
            restart_s = sum(st.restart_costs) / len(st.restart_costs)
        else:
            restart_s = (st.startup_s + self.cfg.restart_overhead_s if st.startup_s is not None
                         else self.cfg.restart_prior_s)
        redo = reached - st.ckpt_step if st.ckpt_step is not None else reached
        ratio = 1.0
        if kind == "straggler" and rank is not None and self.cfg.rebalance and not st.rebalanced:
            ratio = _rank_ratio(evidence, rank) or 1.0
        return costmodel.Situation(steps_left=max(0, left), step_s=step_s, excess_s=cost,
                                   nodes=len([n for n in st.nodes if n not in st.isolated]),
                                   restart_s=restart_s, redo_steps=max(0, redo), spares=st.spares,
                                   dp=st.dp, micro_batches=st.micro_batches, ratio=ratio)

    def _crash(self, st: RunPolicy, inc: dict[str, Any], now: float) -> list[Decision]:
        node = inc.get("node")
        stalled = self._stalled(st)
        if stalled is not None:
            stop = self._stop(st, inc, stalled, now, shadow=self.mode_of(RESTART) == "shadow", node=node)
            return self._decision(st, RESTART, inc, f"crash on {node or 'an unknown node'}", now, node=node,
                                  refused=stalled, cooldown=False) + stop
        if node is None:
            out = self._decision(st, RESTART, inc, "crash: the job restarts from its last checkpoint", now,
                                 cooldown=False)
        else:
            st.crashes[node] = st.crashes.get(node, 0) + 1
            if st.crashes[node] >= self.cfg.crashes_to_isolate:
                out = self._isolate(st, inc, node, now, f"crash #{st.crashes[node]} on {node}")
            else:
                out = self._decision(st, RESTART, inc, f"crash on {node}: the job restarts from its last "
                                     "checkpoint", now, node=node, cooldown=False)
        if out and out[0].refused is None:
            st.restart_marks.append(st.reached)
        return out

    def _stalled(self, st: RunPolicy) -> str | None:
        """Why another restart would loop: the last `restarts_without_progress` restarts got the
        run no further (the highest step it reached is where it was before the first of them);
        None when they did, when there were fewer, or when the steps reached are not known."""
        n = self.cfg.restarts_without_progress
        if n <= 0 or len(st.restart_marks) < n or st.reached is None:
            return None
        first = st.restart_marks[-n]
        if first is None or st.reached > first:
            return None
        return (f"{n} restart(s) in a row made no progress: the run got no further than step {st.reached}, as "
                f"before them (restarts_without_progress {n}); another restart would crash there again: "
                f"stopping the run")

    def _isolate(self, st: RunPolicy, inc: dict[str, Any], node: str | None, now: float,
                 reason: str) -> list[Decision]:
        if node is None:
            return self._decision(st, ISOLATE, inc, reason, now, refused="no node to isolate")
        if node in st.isolated:
            return []
        healthy = [n for n in st.nodes if n not in st.isolated and n != node] if st.nodes else None
        refused = None
        if healthy is not None and len(healthy) + min(1, st.spares) < self.cfg.min_nodes:  # a spare takes its place
            refused = (f"min_nodes: isolating {node} would leave {len(healthy)} healthy node(s), fewer than "
                       f"{self.cfg.min_nodes}")
        out = self._decision(st, ISOLATE, inc, reason, now, node=node, cooldown=False, refused=refused,
                             args={"node": node, "reason": reason, "incident_id": inc.get("id")})
        if out and out[0].refused is None and out[0].mode == "auto":
            st.isolated.add(node)
            st.spares = max(0, st.spares - 1)  # the launcher puts a spare in its place while it has one
        return out
