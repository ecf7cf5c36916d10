"""Goodput: the share of a run's wall time spent on steps that counted.

    goodput = productive_s / wall_s
    productive_s = sum over the steps steps_effective keeps and the optimizer did
                   not skip of the step's duration (its slowest rank's step_s)
    wall_s = the run's last step or event - its start (runs.started_ts, or its
             first row when that came earlier: a restart moves started_ts)

What is not productive is named: skipped steps (a NaN, an fp16 overflow), steps
of attempts a rollback or a restart replaced, and time outside any step (start-up,
checkpoint stalls, restarts). Stragglers slow steps that still count, so goodput
does not subtract them; `goodput_without_stragglers` does, with their cost.

By cause: the `goodput` view (collector/store/schema.py GOODPUT_SQL; `queries.goodput_causes`
for one run) splits the wall time into `CAUSES`, which add up to it: the steps that
counted less the slow-downs, each slow-down incident's cost, and every second the
run spent on anything else, named.

Pure: the rows come from collector/read/queries.py (`step_time_parts`, `run_span`); the
postmortem report, the query API (`GET /v1/runs/<run>/goodput`) and the benches
compute it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the `goodput` view's causes, in the order a report lists them, with what each one is
CAUSES: dict[str, str] = {
    "productive": "steps that counted, less what the slow-downs cost",
    "slowdown": "a straggler, slow link or data stall: its cost per step over the steps it slowed",
    "skipped": "steps the optimizer skipped (a NaN, an fp16 overflow)",
    "detection": "steps a rollback replaced that ran after the fault and before its incident opened",
    "redone": "the other steps a rollback or a restart replaced",
    "recovery": "between steps, while ranks exited, restarted or rolled back",
    "checkpoint": "between steps, stalled on a checkpoint's snapshot",
    "idle": "the rest outside steps: start-up, evaluation, the end of the run",
}


def cause_label(row: dict[str, Any]) -> str:
    """A `goodput` row's name for a reader: its cause, and a slow-down's incident."""
    cause = row.get("cause")
    return f"slow-down (incident {row['incident_id']})" if cause == "slowdown" and row.get("incident_id") is not None \
        else str(cause)


def ordered_causes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`goodput` rows in CAUSES' order (a slow-down per incident, by id)."""
    order = {c: i for i, c in enumerate(CAUSES)}
    return sorted(rows, key=lambda r: (order.get(r.get("cause"), len(order)), r.get("incident_id") or 0))


@dataclass(slots=True)
class Goodput:
    wall_s: float
    productive_s: float
    skipped_s: float
    superseded_s: float  # steps of attempts a rollback replaced
    outside_steps_s: float  # start-up, checkpoints, restarts: wall time in no step
    straggler_lost_s: float
    num_steps: int  # productive steps
    num_skipped: int
    num_superseded: int
    useful_tokens: int

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    @property
    def goodput_without_stragglers(self) -> float | None:
        if self.wall_s <= 0:
            return None
        return max(0.0, self.productive_s - self.straggler_lost_s) / self.wall_s

    @property
    def tokens_per_s(self) -> float | None:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else None


def goodput(parts: list[dict[str, Any]], span: dict[str, Any], *, straggler_lost_s: float = 0.0) -> Goodput:
    """From read.step_time_parts rows and read.run_span (see the module doc)."""
    def total(key: str, effective: bool | None, skipped: bool | None) -> float:
        return sum(p[key] for p in parts
                   if (effective is None or bool(p["effective"]) == effective)
                   and (skipped is None or bool(p["skipped"]) == skipped))

    start, end = span.get("start_ts"), span.get("end_ts")
    wall_s = float(end - start) if start is not None and end is not None else 0.0
    steps_s = total("step_s", None, None)
    return Goodput(wall_s=wall_s, productive_s=total("step_s", True, False), skipped_s=total("step_s", True, True),
                   superseded_s=total("step_s", False, None), outside_steps_s=max(0.0, wall_s - steps_s),
                   straggler_lost_s=straggler_lost_s, num_steps=int(total("num_steps", True, False)),
                   num_skipped=int(total("num_steps", True, True)),
                   num_superseded=int(total("num_steps", False, None)),
                   useful_tokens=int(total("tokens", True, False)))


