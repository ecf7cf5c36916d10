"""Precision, recall, latency and culprit accuracy of findings against injected faults.

    truths = truths_from_rows(json.loads(line) for line in open("injections.jsonl"))   # the caller reads
    report = score(findings, truths)
    print(report.table())

The ground truth is what trainer/faults.py writes to `injections.jsonl`: one row
per (fault, rank that fired it), with `kind` (nan, spike, straggler, hang,
crash, overflow: an fp16 overflow that the loss-scale collapse must find;
slowlink, slowio, bitflip, devhealth), `rank` (-1: every rank), `node`, `step`,
`attempt`, `ts` (slowio also `what`: data | ckpt; devhealth: ecc | thermal |
memory). Rows of one fault fired on several
ranks (a spike on every rank) are one truth. Background conditions (`jitter`,
`BACKGROUND_KINDS`) are recorded there too but are no fault: they are left out
of the truths. Only `collector replay`, the bench and tests read that file; this
module takes its rows.

A truth is scored under its `label`: its kind, or for a slowio `slowio:data` (found
as a `data_stall`) and `slowio:ckpt` (a `checkpoint_slow`), two faults the
detectors tell apart, and for a devhealth `devhealth:ecc`, `devhealth:thermal`
and `devhealth:memory`, each found as a `device_health` incident of its own
cause (`TRUTH_CAUSES`: the incident's evidence `cause`, `ecc`, `thermal_throttle`
or `memory_pressure`; an incident whose cause is not known, None, matches any).
`TRUTH_KINDS`, `TRUTH_CAUSES` and `WINDOWS` are by label.

Findings are first collapsed into incidents (one per key: first open, widest
step range, last culprit named). An incident matches a truth when its kind is
the truth's (spike: `loss_spike` or `grad_spike`; slowlink: `slow_link`; bitflip:
`replica_divergence`) and its step range meets the truth's step window
(`WINDOWS`: a straggler, a slow link or a data stall is found some steps after
onset, a crash's last reported step is before the one it died in, a slow
checkpoint at the first checkpoint after onset, a bit flip's range runs from the
last agreeing checksum before it to the first disagreeing one after it, and a
device-health incident's range starts at the first sample that shows the fault:
samples come once per heartbeat, so a few heartbeats' steps after onset at
most, whatever the detector's window in seconds before it opens).
Matching is one to one, nearest first; an incident matching no truth is a false
positive (a second incident for one fault too).

- precision = matched incidents / incidents, recall = matched truths / truths;
- latency: seconds from the truth's `ts` to the incident's first finding `ts`
  (when the truth has a `ts`), and steps from the truth's step to the newest step
  the run had reported then (`detected_step`, or, for the kinds of
  `FIRED_AT_KINDS`, the `fired_at_step` of their evidence);
- culprit accuracy, over matched truths that name a rank: the incident names the
  same rank, or (a node incident, rank not named; or a node's condition,
  `NODE_LABELS`: memory pressure names the node and its lowest reporting rank,
  not the one injected) the same node, or (an incident
  that names no single rank but its suspects: a `replica_divergence` without a
  majority, dp = 2, whose evidence lists `divergent_ranks`; a `loss_scale_collapse`
  whose overflow tensor-parallel partners shared, `overflow_suspects`) the rank is
  among its suspects. Two checksums that differ cannot say which replica is corrupted: the
  detector names both and says why, and that is the most it can be right about.
  Those are counted apart too (`num_culprit_among_suspects`), so that a figure of
  1.0 made of them is visible as such; a bench that wants the one rank named
  draws dp >= 3.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from analysis.findings import Finding

# truth label -> the incident kinds that find it (a label not here: the incident kind of its name)
TRUTH_KINDS = {"nan": ("nan",), "spike": ("loss_spike", "grad_spike"), "straggler": ("straggler",),
               "hang": ("hang",), "crash": ("crash",), "loss_scale_collapse": ("loss_scale_collapse",),
               "overflow": ("loss_scale_collapse",), "loss_spike": ("loss_spike",), "grad_spike": ("grad_spike",),
               "slowlink": ("slow_link",), "slowio:data": ("data_stall",), "slowio:ckpt": ("checkpoint_slow",),
               "slowio": ("data_stall", "checkpoint_slow"), "bitflip": ("replica_divergence",),
               "devhealth:ecc": ("device_health",), "devhealth:thermal": ("device_health",),
               "devhealth:memory": ("device_health",), "devhealth": ("device_health",)}
# truth label -> the causes (an incident's evidence `cause`) that find it, for kinds with several
TRUTH_CAUSES = {"devhealth:ecc": ("ecc",), "devhealth:thermal": ("thermal_throttle",),
                "devhealth:memory": ("memory_pressure",)}
# a node's condition, not a rank's: the culprit is right when the node is
NODE_LABELS = frozenset({"devhealth:memory"})
# steps around a truth's step an incident's range may meet: (before, after). A slow checkpoint opens at
# the first checkpoint after onset (--ckpt-every steps later at most); a bit flip's range starts at the
# last agreeing checksum (before the flip) and ends at the first disagreeing one (--checksum-every after);
# a device-health incident's at its first faulty sample, one per heartbeat (1 s; a flusher held up by a
# slow POST samples later): never before onset, and within ~3 heartbeats' steps after it at the tiny CPU
# runs' 45-60 steps/s (seen: 49-56 steps after onset). A real model's step of >= 0.1 s: 30 steps at most
WINDOWS = {"nan": (0, 2), "spike": (0, 2), "straggler": (-1, 12), "hang": (-2, 2), "crash": (-6, 2),
           "loss_scale_collapse": (-60, 60), "overflow": (-1, 6), "loss_spike": (0, 2), "grad_spike": (0, 2),
           "slowlink": (-1, 12), "slowio:data": (-1, 12), "slowio:ckpt": (-1, 25), "slowio": (-1, 25),
           "bitflip": (0, 25), "devhealth:ecc": (0, 150), "devhealth:thermal": (0, 150),
           "devhealth:memory": (0, 150), "devhealth": (0, 150)}
# incident kinds whose latency in steps counts from the step they fired at (their evidence's
# `fired_at_step`): they judge a window of steps, and report some passes later
FIRED_AT_KINDS = frozenset({"straggler", "slow_link"})
# background conditions an injection may set (trainer/faults.py `jitter`): in the ground truth
# file for the record, nothing to detect; truths_from_rows leaves them out
BACKGROUND_KINDS = frozenset({"jitter"})


@dataclass(frozen=True, slots=True)
class Truth:
    kind: str
    rank: int  # -1: not about one rank
    node: str | None
    step: int
    attempt: int = 0
    ts: float | None = None
    run_id: str | None = None  # None: matches an incident of any run
    mode: str | None = None  # a nan's data | transient | device
    what: str | None = None  # a slowio's data | ckpt; a devhealth's ecc | thermal | memory
    on: str | None = None  # "place": a slow-down that stays with the rank, whatever node holds it (faults.py)

    @property
    def label(self) -> str:
        """The kind it is scored under (TRUTH_KINDS, TRUTH_CAUSES, WINDOWS, Score.by_kind)."""
        return f"{self.kind}:{self.what}" if self.kind in ("slowio", "devhealth") and self.what else self.kind


@dataclass(slots=True)
class Incident:
    kind: str
    key: str
    run_id: str
    rank: int | None
    node: str | None
    step_from: int | None
    step_to: int | None
    opened_ts: float
    opened_step: int | None
    closed_ts: float | None = None
    suspects: tuple[int, ...] = ()  # named no single rank: the ranks it suspects (suspects_of)
    cause: str | None = None  # of a kind with several (cause_of): device_health's; None: not known


@dataclass(slots=True)
class KindScore:
    kind: str
    num_truths: int = 0
    num_incidents: int = 0
    num_matched: int = 0  # truths matched (= incidents matched)
    num_culprit_checked: int = 0
    num_culprit_right: int = 0
    num_culprit_among_suspects: int = 0  # right as one of the several ranks an incident suspects
    latency_s: list[float] = field(default_factory=list)
    latency_steps: list[int] = field(default_factory=list)

    @property
    def precision(self) -> float | None:
        return self.num_matched / self.num_incidents if self.num_incidents else None

    @property
    def recall(self) -> float | None:
        return self.num_matched / self.num_truths if self.num_truths else None

    @property
    def culprit_accuracy(self) -> float | None:
        return self.num_culprit_right / self.num_culprit_checked if self.num_culprit_checked else None


@dataclass(slots=True)
class Score:
    by_kind: dict[str, KindScore]
    matches: list[tuple[Truth, Incident]]
    false_positives: list[Incident]
    missed: list[Truth]

    def table(self) -> str:
        def f(x, fmt="{:.3f}"):
            return "-" if x is None else fmt.format(x)

        lines = [f"{'kind':<20}{'truths':>7}{'found':>7}{'FP':>5}{'prec':>7}{'recall':>7}{'lat_s p50':>10}"
                 f"{'lat_steps p50':>14}{'culprit':>9}"]
        for k in sorted(self.by_kind):
            s = self.by_kind[k]
            lat_s = statistics.median(s.latency_s) if s.latency_s else None
            lat_st = statistics.median(s.latency_steps) if s.latency_steps else None
            lines.append(f"{k:<20}{s.num_truths:>7}{s.num_matched:>7}{s.num_incidents - s.num_matched:>5}"
                         f"{f(s.precision):>7}{f(s.recall):>7}{f(lat_s, '{:.2f}'):>10}{f(lat_st, '{:.0f}'):>14}"
                         f"{f(s.culprit_accuracy):>9}")
        return "\n".join(lines)


def _node(x) -> str | None:
    """Node names compare as written, or by number ("node1" == 1)."""
    if x is None:
        return None
    s = str(x)
    return s[4:] if s.startswith("node") and s[4:].isdigit() else s


def suspects_of(kind: str, rank: int | None, evidence: Mapping | None) -> tuple[int, ...]:
    """The ranks an incident that names no single rank suspects: a replica_divergence
    without a majority lists its `divergent_ranks` (dp = 2: both replicas), a
    loss_scale_collapse whose overflow tensor-parallel partners shared its `overflow_suspects`."""
    if rank is not None or not evidence:
        return ()
    key = {"replica_divergence": "divergent_ranks", "loss_scale_collapse": "overflow_suspects"}.get(kind)
    return tuple(int(r) for r in evidence.get(key) or ()) if key else ()


def cause_of(kind: str, evidence: Mapping | None) -> str | None:
    """The cause of an incident of a kind with several (TRUTH_CAUSES): a device_health
    incident's evidence `cause`; None for the other kinds."""
    if kind != "device_health" or not evidence or evidence.get("cause") is None:
        return None
    return str(evidence["cause"])


def _fits(label: str, inc: Incident) -> bool:
    """`inc` is of a kind and cause that find truths of `label`."""
    causes = TRUTH_CAUSES.get(label)
    return (inc.kind in TRUTH_KINDS.get(label, (label,))
            and (causes is None or inc.cause is None or inc.cause in causes))


def opened_step_of(kind: str, evidence: Mapping | None, detected_step: int | None) -> int | None:
    """The step an incident's latency in steps counts to: `fired_at_step` for FIRED_AT_KINDS."""
    fired = (evidence or {}).get("fired_at_step") if kind in FIRED_AT_KINDS else None
    return int(fired) if fired is not None else detected_step


def truths_from_rows(rows: Iterable[Mapping], run_id: str | None = None) -> list[Truth]:
    """injections.jsonl rows -> truths, one per fault occurrence (kind, step, attempt,
    and rank unless it fired everywhere). `run_id`: the run they belong to (the file
    is per run directory), so that several runs can be scored together."""
    seen: dict[tuple, Truth] = {}
    for r in rows:
        kind = str(r.get("kind", ""))
        if kind in BACKGROUND_KINDS or r.get("probe"):
            continue  # a fault firing again in a rollback's rerun of its step: the diagnosis, not a fault
        rank = int(r.get("rank", -1) if r.get("rank") is not None else -1)
        key = (kind, int(r.get("step", -1)), int(r.get("attempt", 0) or 0), rank, run_id, r.get("what"))
        if kind == "nan" and r.get("mode") == "device":
            key = (kind, "device", rank, run_id)  # one fault of one device, whatever the attempts it spans
        if key in seen:
            continue
        ts = r.get("ts")
        node = r.get("node")
        seen[key] = Truth(kind=kind, rank=rank, node=None if node is None or rank < 0 else str(node),
                          step=int(r.get("step", -1)), attempt=int(r.get("attempt", 0) or 0),
                          ts=float(ts) if ts is not None else None, run_id=run_id,
                          mode=str(r["mode"]) if r.get("mode") is not None else None,
                          what=str(r["what"]) if r.get("what") is not None else None,
                          on=str(r["on"]) if r.get("on") is not None else None)
    return list(seen.values())


def incidents(findings: Iterable[Finding]) -> list[Incident]:
    """One incident per key: opened by its first finding, its range the widest, its
    culprit the last one named."""
    out: dict[str, Incident] = {}
    for f in findings:
        key = f"{f.run_id}/{f.key}"
        inc = out.get(key)
        if inc is None:
            out[key] = Incident(kind=f.kind, key=key, run_id=f.run_id, rank=f.rank, node=f.node, step_from=f.step_from,
                                step_to=f.step_to, opened_ts=f.ts,
                                opened_step=opened_step_of(f.kind, f.evidence, f.detected_step),
                                closed_ts=f.ts if f.resolved else None,
                                suspects=suspects_of(f.kind, f.rank, f.evidence),
                                cause=cause_of(f.kind, f.evidence))
            continue
        if f.step_from is not None:
            inc.step_from = f.step_from if inc.step_from is None else min(inc.step_from, f.step_from)
        if f.step_to is not None:
            inc.step_to = f.step_to if inc.step_to is None else max(inc.step_to, f.step_to)
        if not f.resolved:
            inc.rank, inc.node = f.rank, f.node
            inc.suspects = suspects_of(f.kind, f.rank, f.evidence)
        else:
            inc.closed_ts = f.ts
    return list(out.values())


def _distance(t: Truth, inc: Incident) -> int | None:
    before, after = WINDOWS.get(t.label, (0, 2))
    lo, hi = t.step + before, t.step + after
    a = inc.step_from if inc.step_from is not None else inc.step_to
    b = inc.step_to if inc.step_to is not None else a
    if a is None:
        return None
    if b < lo or a > hi:
        return None
    return abs(a - t.step)


def score(findings_or_incidents: Iterable[Finding | Incident], truths: Iterable[Truth]) -> Score:
    items = list(findings_or_incidents)
    incs = [i for i in items if isinstance(i, Incident)] + incidents(i for i in items if isinstance(i, Finding))
    truths = list(truths)
    by_kind: dict[str, KindScore] = {}

    def ks(kind: str) -> KindScore:
        return by_kind.setdefault(kind, KindScore(kind))

    labels = {t.label for t in truths}
    for t in truths:
        ks(t.label).num_truths += 1
    truth_kind_of = {}
    for inc in incs:
        tk = next((k for k in TRUTH_KINDS if k in labels and _fits(k, inc)), inc.kind)
        truth_kind_of[inc.key] = tk
        ks(tk).num_incidents += 1
    pairs = []
    for ti, t in enumerate(truths):
        for ii, inc in enumerate(incs):
            if _fits(t.label, inc) and (t.run_id is None or t.run_id == inc.run_id):
                d = _distance(t, inc)
                if d is not None:
                    pairs.append((d, ti, ii))
    pairs.sort()
    used_t, used_i, matches = set(), set(), []
    for _, ti, ii in pairs:
        if ti in used_t or ii in used_i:
            continue
        used_t.add(ti)
        used_i.add(ii)
        t, inc = truths[ti], incs[ii]
        matches.append((t, inc))
        s = ks(t.label)
        s.num_matched += 1
        if t.ts is not None:
            s.latency_s.append(inc.opened_ts - t.ts)
        if inc.opened_step is not None:
            s.latency_steps.append(int(inc.opened_step) - t.step)
        if t.rank >= 0:
            s.num_culprit_checked += 1
            by_node = inc.rank is None or t.label in NODE_LABELS
            right = inc.rank == t.rank or (by_node and inc.node is not None and _node(inc.node) == _node(t.node))
            among = not right and inc.rank is None and t.rank in inc.suspects
            s.num_culprit_right += bool(right or among)
            s.num_culprit_among_suspects += among
    return Score(by_kind=by_kind, matches=matches,
                 false_positives=[inc for ii, inc in enumerate(incs) if ii not in used_i],
                 missed=[t for ti, t in enumerate(truths) if ti not in used_t])
