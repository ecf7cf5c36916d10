"""What a detector says: a `Finding`, and the book that keeps one incident per cause.

A detector does not write incidents; it emits findings, and the collector turns
them into `incidents` rows:

- `key` names the cause within the run (`"straggler:node1#1"`, `"nan#2"`). The
  collector keeps one incident per `(run_id, key)`: the first finding with a key
  opens it, later ones with `status="open"` update it (range extended, evidence
  added, culprit refined), the one with `status="resolved"` closes it
  (`closed_ts` = the finding's `ts`). A key is never reused after it resolved:
  the same cause coming back is a new episode with a new key.
- `evidence` holds only JSON-able values: numbers (non-finite ones as the
  strings "NaN", "Infinity", "-Infinity", see `json_number`), strings, lists
  and dicts of those.
- `ts` is the `now` of the pass that produced the finding (the collector's
  clock, passed in), `detected_step` the newest step the run had reported then:
  latency in seconds and in steps, for scoring.

`IncidentBook` is the per-run bookkeeping the detectors share: it remembers the
last finding emitted per open key and emits a new one only when something the
incident row shows has changed, so a quiet pass emits nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from analysis.kinds import INCIDENT_KINDS

KINDS = INCIDENT_KINDS  # analysis/kinds.py
SEVERITIES = ("info", "warning", "critical")
OPEN = "open"
RESOLVED = "resolved"


def json_number(x: float | int | None, digits: int = 6) -> float | int | str | None:
    """A number JSON can carry: non-finite floats become "NaN"/"Infinity"/"-Infinity"
    (JSON has no literal for them), finite ones are rounded to `digits` significant
    digits so that noise in the last bits does not count as a change."""
    if x is None:
        return None
    if isinstance(x, (bool, int)):
        return int(x)
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0.0:
        return 0.0
    return float(f"{x:.{digits}g}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    kind: str  # one of KINDS
    key: str  # the cause within the run: one incident per (run_id, key)
    run_id: str
    status: str = OPEN  # OPEN (new or updated) | RESOLVED (close the incident)
    severity: str = "warning"
    rank: int | None = None  # the culprit, when one is named
    node: str | None = None
    step_from: int | None = None
    step_to: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    root_cause: str = ""
    confidence: float = 0.5  # 0..1
    ts: float = 0.0  # the pass's `now`
    detected_step: int | None = None  # newest step the run had reported at `ts`

    @property
    def resolved(self) -> bool:
        return self.status == RESOLVED

    def summary(self) -> str:
        """One line for a terminal: kind, step, rank, node, what is known."""
        where = f"step {self.step_from}" if self.step_from == self.step_to else f"steps {self.step_from}-{self.step_to}"
        who = f"rank {self.rank}" if self.rank is not None else "rank -"
        state = " (resolved)" if self.resolved else ""
        return f"{self.kind:<20} {where:<14} {who:<8} {self.node or '-':<10} {self.root_cause}{state}"

    def incident_columns(self) -> dict[str, Any]:
        """The `incidents` columns this finding sets (the collector adds id, the
        open/updated/closed times from `ts`, and serialises `evidence`)."""
        return {"run_id": self.run_id, "kind": self.kind, "severity": self.severity, "rank": self.rank,
                "node": self.node, "step_from": self.step_from, "step_to": self.step_to,
                "status": "closed" if self.resolved else "open", "evidence": self.evidence,
                "root_cause": self.root_cause, "confidence": self.confidence}


def _shown(f: Finding) -> tuple:
    """What an incident row shows; a finding that changes none of it is not emitted."""
    return (f.status, f.severity, f.rank, f.node, f.step_from, f.step_to, f.root_cause,
            round(f.confidence, 3), repr(f.evidence))


class IncidentBook:
    """The open incidents of one run, by key. Bounded by the number of open causes."""

    __slots__ = ("run_id", "_open", "_counters", "num_emitted")

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._open: dict[str, Finding] = {}
        self._counters: dict[str, int] = {}
        self.num_emitted = 0

    def new_key(self, prefix: str) -> str:
        """A key never used before in this run: `prefix#n`."""
        n = self._counters.get(prefix, 0) + 1
        self._counters[prefix] = n
        return f"{prefix}#{n}"

    def is_open(self, key: str | None) -> bool:
        return key is not None and key in self._open

    def get(self, key: str) -> Finding | None:
        return self._open.get(key)

    def continue_keys(self, other: "IncidentBook") -> None:
        """Number new keys after `other`'s (a fresh analysis of the same run, after a
        restart on another layout): a key is never used twice in a run."""
        for prefix, n in other._counters.items():
            self._counters[prefix] = max(self._counters.get(prefix, 0), n)

    def open_keys(self, kind: str | None = None) -> list[str]:
        return [k for k, f in self._open.items() if kind is None or f.kind == kind]

    def report(self, finding: Finding, out: list[Finding]) -> None:
        """Open or update `finding.key`; appends to `out` only when the row would change."""
        if finding.run_id != self.run_id:
            finding = replace(finding, run_id=self.run_id)
        prev = self._open.get(finding.key)
        if prev is not None and _shown(prev) == _shown(finding):
            return
        self._open[finding.key] = finding
        self.num_emitted += 1
        out.append(finding)

    def resolve(self, key: str, out: list[Finding], *, ts: float, detected_step: int | None = None,
                **changes) -> None:
        """Close `key` (a no-op when it is not open): the last finding, status RESOLVED,
        with `changes` applied (evidence, root_cause, step_to...)."""
        prev = self._open.pop(key, None)
        if prev is None:
            return
        self.num_emitted += 1
        out.append(replace(prev, status=RESOLVED, ts=ts, detected_step=detected_step, **changes))
