"""Fleet memory: each node's record across runs, and which nodes a new run should not trust.

A run starts on nodes other runs used before. Their incidents and isolations live on
in the collector's file (a long-lived collector holds many runs) and in the Parquet
archive (`collector archive`); collector/read/fleet.py reads both into one frame of
*history rows*, one per thing that happened to a node in a past run:

    run_id       the run the history is for (the rows are about other runs)
    past_run_id  the run it happened in
    node         the node (its hostname)
    ts           when (s): the node's first row in that run, an isolation, an incident's opening
    what         "seen" (the node held ranks of that run), "isolated" (the policy took it
                 out), or an incident kind (straggler, slow_link, hang, ...)
    incident_id  the incident's id in that run (null for the others)
    hw_id        the node's hardware id in that run (its GPUs' UUID; null when not known)

A node is its hardware where both sides know it, else its hostname (`mine`): a host
renamed since keeps its record, and a host whose hardware was replaced starts anew.

`summarize` turns them into one record per node; `flagged` says which of them have
failed in too many runs lately; `grid` is every run on every node (the Fleet page). Pure: polars in, polars out; the window and the
thresholds are the rules' `[node_history]` (analysis/rules.toml).

Counting runs, not incidents: a straggler that reopened five times in one bad run is
one run's fault (maybe the job's), while faults in two different runs within a week
follow the node (a "lemon").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import polars as pl

SEEN, ISOLATED = "seen", "isolated"

HISTORY_SCHEMA = {"run_id": pl.String, "past_run_id": pl.String, "node": pl.String, "ts": pl.Float64,
                  "what": pl.String, "incident_id": pl.Int64, "hw_id": pl.String}

SUMMARY_SCHEMA = {"node": pl.String, "runs": pl.UInt32, "fault_runs": pl.UInt32, "faults": pl.UInt32,
                  "isolations": pl.UInt32, "first_seen_ts": pl.Float64, "last_seen_ts": pl.Float64,
                  "last_fault_ts": pl.Float64, "last_fault_kind": pl.String, "last_fault_run": pl.String}


def history_frame(rows: Iterable[dict[str, Any]] | None = None) -> pl.DataFrame:
    """History rows as a frame of HISTORY_SCHEMA (for tests and for a source with none); a
    row without `hw_id` has none."""
    return pl.DataFrame([{"hw_id": None, **r} for r in rows or []], schema=HISTORY_SCHEMA)


def mine(history: pl.DataFrame, node: str, hw_ids: Iterable[str] = ()) -> pl.DataFrame:
    """The rows about this node: by hardware id where the row and the node both have one, else by
    hostname."""
    hw = sorted({h for h in hw_ids if h})
    if not hw or "hw_id" not in history.columns:
        return history.filter(pl.col("node") == node)
    known = pl.col("hw_id").is_not_null()
    return history.filter((known & pl.col("hw_id").is_in(hw)) | (~known & (pl.col("node") == node)))


def summarize(history: pl.DataFrame, *, since_ts: float, fault_kinds: Iterable[str],
              exclude_run: str | None = None) -> pl.DataFrame:
    """One row per node of `history` (rows at or after `since_ts`, none of `exclude_run`):
    `runs` it was seen in, `fault_runs` of them where it had a fault (an incident of one of
    `fault_kinds`, or an isolation), `faults` (those incidents), `isolations`, when it was
    first and last seen, and its latest fault. Nodes with the most fault runs first."""
    kinds = sorted(set(fault_kinds))
    if history is None or not history.height:
        return pl.DataFrame(schema=SUMMARY_SCHEMA)
    h = history.filter(pl.col("ts") >= since_ts)
    if exclude_run is not None:
        h = h.filter(pl.col("past_run_id") != exclude_run)
    h = h.with_columns(pl.col("what").is_in(kinds).alias("_incident"),
                       (pl.col("what") == ISOLATED).alias("_isolated"))
    h = h.with_columns((pl.col("_incident") | pl.col("_isolated")).alias("_fault"))
    fault = pl.col("_fault")
    out = h.group_by("node").agg(
        pl.col("past_run_id").n_unique().alias("runs"),
        pl.col("past_run_id").filter(fault).n_unique().alias("fault_runs"),
        pl.col("_incident").sum().alias("faults"),
        pl.col("_isolated").sum().alias("isolations"),
        pl.col("ts").min().alias("first_seen_ts"),
        pl.col("ts").max().alias("last_seen_ts"),
        pl.col("ts").filter(fault).max().alias("last_fault_ts"),
        pl.col("what").filter(fault).sort_by(pl.col("ts").filter(fault)).last().alias("last_fault_kind"),
        pl.col("past_run_id").filter(fault).sort_by(pl.col("ts").filter(fault)).last().alias("last_fault_run"),
    )
    return out.select([pl.col(c).cast(t) for c, t in SUMMARY_SCHEMA.items()]).sort(
        ["fault_runs", "isolations", "faults", "node"], descending=[True, True, True, False])


def _least_fault_runs(flag_runs: int) -> int:
    return max(1, int(flag_runs))  # a node with no fault is never flagged


def is_flagged(fault_runs: int, flag_runs: int) -> bool:
    """A node with faults in `flag_runs` runs or more is flagged."""
    return fault_runs >= _least_fault_runs(flag_runs)


def flagged(summary: pl.DataFrame, *, flag_runs: int) -> pl.DataFrame:
    """The nodes of `summary` that are flagged (`is_flagged`)."""
    return summary.filter(pl.col("fault_runs") >= _least_fault_runs(flag_runs))


def node_record(history: pl.DataFrame, node: str, *, since_ts: float, fault_kinds: Iterable[str],
                exclude_run: str | None = None, max_faults: int = 10, hw_ids: Iterable[str] = ()) -> dict[str, Any]:
    """One node's record for an incident's evidence (its rows by `mine`): its summary row, its
    faults by kind, its latest `max_faults` faults (run, what, when, incident id), newest first,
    and `past_names`: other hostnames its hardware had."""
    kinds = set(fault_kinds)
    rows = mine(history, node, hw_ids).filter(pl.col("ts") >= since_ts)
    if exclude_run is not None:
        rows = rows.filter(pl.col("past_run_id") != exclude_run)
    names = sorted(set(rows["node"].to_list()) - {node})
    rows = rows.with_columns(pl.lit(node).alias("node"))  # one record, under today's name
    summary = summarize(rows, since_ts=since_ts, fault_kinds=kinds)
    out: dict[str, Any] = summary.row(0, named=True) if summary.height else {"node": node}
    faults = rows.filter(pl.col("what").is_in(sorted(kinds | {ISOLATED}))).sort("ts", descending=True)
    out["by_kind"] = faults_by_kind(rows, since_ts=since_ts, fault_kinds=kinds).get(node, {})
    out["past_names"] = names
    out["latest_faults"] = [{"run_id": r["past_run_id"], "what": r["what"], "ts": r["ts"],
                             "incident_id": r["incident_id"]}
                            for r in faults.head(max_faults).iter_rows(named=True)]
    return out


def faults_by_kind(history: pl.DataFrame, *, since_ts: float, fault_kinds: Iterable[str]) -> dict[str, dict[str, int]]:
    """Per node, its faults (of `fault_kinds`, and isolations) by kind, most first."""
    if history is None or not history.height:
        return {}
    counted = sorted(set(fault_kinds) | {ISOLATED})
    got = history.filter((pl.col("ts") >= since_ts) & pl.col("what").is_in(counted)) \
        .group_by("node", "what").len().sort(["node", "len", "what"], descending=[False, True, False])
    out: dict[str, dict[str, int]] = {}
    for node, what, n in got.iter_rows():
        out.setdefault(node, {})[what] = n
    return out


def grid(history: pl.DataFrame, fault_kinds) -> tuple[list[dict], list[dict]]:
    """(cells, runs): per (run, node) its faults (incidents of `fault_kinds`), their kinds and
    whether it was isolated there; per run when it began (its nodes' first rows) and its nodes."""
    if not history.height:
        return [], []
    kinds = sorted(set(fault_kinds))
    h = history.with_columns(pl.col("what").is_in(kinds).alias("_fault"))
    cells = h.group_by("past_run_id", "node").agg(
        pl.col("_fault").sum().alias("faults"),
        pl.col("what").filter(pl.col("_fault")).unique().sort().alias("kinds"),
        (pl.col("what") == ISOLATED).any().alias("isolated"),
        pl.col("ts").filter(pl.col("what") == SEEN).min().alias("seen_ts"),
    ).sort("past_run_id", "node")
    runs = h.group_by("past_run_id").agg(pl.col("ts").min().alias("first_ts"), pl.col("node").n_unique().alias("nodes")) \
        .sort("first_ts", "past_run_id")
    return ([{"run_id": c["past_run_id"], "node": c["node"], "faults": int(c["faults"]), "kinds": c["kinds"],
              "isolated": bool(c["isolated"]), "seen": c["seen_ts"] is not None} for c in cells.iter_rows(named=True)],
            [{"run_id": r["past_run_id"], "first_ts": r["first_ts"], "nodes": int(r["nodes"])}
             for r in runs.iter_rows(named=True)])
