"""Collectives summarized per step at flush time: a large job's rows, from ~20 a rank-step to 2-3.

A rank records every communication op (`Recorder.collective`, the hot path, unchanged).
An FSDP job issues a few hundred a step: at one row per op, 100,000 ranks offer
millions of rows a second, past any one collector (docs/scale.md). So an agent that
summarizes ships, instead of a step's op rows, one `collective_summary` row per
(attempt, step, op, axis, group_id, peer): the op count, the sums of bytes, durations
and waits and their maxima, the first entry and the last completion, the mean entry and
the mean completion (what who-waited-for-whom and the links' transfer times are read
from), and the highest `seq` and `group_seq`. The collector stores them in `collectives_rollup` (where
its own rollup puts old op rows, docs/scale.md) and its detectors read them as one op
each (analysis/frames.py `ops_from_summaries`).

Op rows still go out, flagged `sampled`, for
- every `raw_every_steps`-th step (the same steps on every rank: a sampled step is
  whole, so the cookbook's op-level recipes and `comm_waits` have complete steps), and
- every step while the collector asks (`raw_ops_s` in an ingest answer: an incident a
  detector has open on the run, whose evidence is worth the op-level detail).
A step's ops are shipped one way or the other, never both, so the tables' totals stay
exact.

Ops without a measured wait (torch's Flight Recorder's, agent/flight.py: a job we did not
write) go out as they are, unflagged: who waited for whom is inferred from their arrivals
op by op (analysis/attribution.py), and from the means of a summary it is not (a DDP
loop's straggler went unnamed: its peer's inferred waits exceeded its step).

When: `AgentConfig.collectives` ("ops", "summary", or "auto": summarize in a job of
`summarize_from_ranks` ranks or more). Below that every op row is cheap: a 256-rank
job at 1 step/s and 20 ops a step offers 5,000 rows/s, a few per cent of one
collector's budget.

Cost: pure Python on the flusher thread, ~1 us per op row; the training thread pays
nothing more. Stdlib only, as the rest of the agent.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable

from agent import wire
from agent.wire import NULL_F64

MODES = ("ops", "summary", "auto")

_SUMMARY_COLS = wire.SCHEMA[wire.COLLECTIVE_SUMMARY]
_OP_COLS = wire.RECORDED[wire.COLLECTIVE]


def summarize(rows: Iterable[tuple], raw_step: Callable[[int], bool], hold_after: float = math.inf
              ) -> tuple[list[tuple], dict[str, memoryview], int, list[tuple], list[tuple]]:
    """Op rows (tuples in `wire.RECORDED[COLLECTIVE]` order) as (the rows to ship as sampled
    op rows, the summary section's columns, its row count, the rows held back, the rows
    without a measured wait, shipped as plain op rows). `raw_step(step)`: this step's ops go
    out as op rows. Rows of a step after `hold_after` (the newest step the rank finished) are
    held back for the next batch: a step is summarized whole, so every member's row of it
    stands for the same ops (a row per flush would cut each rank's step at its own point)."""
    raw: list[tuple] = []
    held: list[tuple] = []
    plain: list[tuple] = []
    acc: dict[tuple, list] = {}
    raw_of: dict[int, bool] = {}
    for row in rows:
        step, attempt, seq, gseq, op, axis, gid, peer, nbytes, start, dur, wait = row
        if wait != wait:  # not measured: inferred from op-level arrivals at the collector
            plain.append(row)
            continue
        if step > hold_after:
            held.append(row)
            continue
        keep = raw_of.get(step)
        if keep is None:
            keep = raw_of[step] = bool(raw_step(step))
        if keep:
            raw.append(row)
            continue
        key = (step, attempt, op, axis, gid, peer)
        end = start + dur if dur == dur else start
        a = acc.get(key)
        if a is None:
            # num, bytes, dur sum, dur max, wait sum, wait max, first start, last end, base (the first row's
            # start), sum of starts and of ends from the base (means exact to the ns), max seq, max gseq
            acc[key] = [1, nbytes, dur, dur, wait, wait, start, end, start, 0.0, end - start, seq, gseq]
            continue
        a[0] += 1
        a[1] += nbytes
        a[2] += dur  # a NULL (NaN) makes the sum NULL: "not every op measured"
        if dur > a[3]:
            a[3] = dur
        a[4] += wait
        if wait > a[5]:
            a[5] = wait
        if start < a[6]:
            a[6] = start
        if end > a[7]:
            a[7] = end
        a[9] += start - a[8]
        a[10] += end - a[8]
        if seq > a[11]:
            a[11] = seq
        if gseq > a[12]:
            a[12] = gseq
    out = {c.name: array(c.fmt) for c in _SUMMARY_COLS}
    o = [out[c.name] for c in _SUMMARY_COLS]
    for (step, attempt, op, axis, gid, peer), a in acc.items():
        num, nbytes, dsum, dmax, wsum, wmax, first, last_end, base, starts, ends, mseq, mgseq = a
        dnull, wnull = dsum != dsum, wsum != wsum
        for col, value in zip(o, (step, attempt, op, axis, gid, peer, num, nbytes,
                                  NULL_F64 if dnull else dsum, NULL_F64 if dnull else dmax,
                                  NULL_F64 if wnull else wsum, NULL_F64 if wnull else wmax,
                                  first, last_end, base + starts / num, base + ends / num, mseq, mgseq)):
            col.append(value)
    return raw, {k: memoryview(v) for k, v in out.items()}, len(acc), held, plain


def op_section(rows: list[tuple], plain: int = 0) -> dict[str, memoryview]:
    """The op section's columns of `rows`, flagged `sampled` but for the last `plain` of them."""
    out = {c.name: memoryview(array(c.fmt, col)) for c, col in zip(_OP_COLS, zip(*rows))}
    out["sampled"] = memoryview(array("b", [1]) * (len(rows) - plain) + array("b", [wire.NOT_MEASURED]) * plain)
    return out


def summarizes(mode: str, world_size: int, from_ranks: int) -> bool:
    """Whether an agent in `mode` (one of MODES, checked by AgentConfig) summarizes in a job of
    `world_size` ranks."""
    return mode == "summary" or (mode == "auto" and world_size >= from_ranks)
