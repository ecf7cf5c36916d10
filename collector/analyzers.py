"""The analysis package as a detector of the collector's DetectionRunner.

`analysis` is pure (frames and a clock value in, findings out); this adapter is
the collector's side of it. One `Analyzer` per run (the runner keeps it as the
run's state). Each pass hands it the commit's Arrow tables of that run as polars
frames (zero copy), plus the run's `runs` and `ranks` rows, read through the read
side when the run is new and again until its mesh is known (the run info comes
with rank 0's first batch, the ranks' coordinates with each rank's first), so
steps can be assembled across ranks and peers compared within a pipeline stage.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from analysis import Analyzer, Frames, load_rules
from collector import read

Reader = Callable[..., Any]  # Storage.read: read(fn, *args) on a cursor of its own
_META_TABLES = ("runs", "ranks", "nodes")


class AnalysisDetector:
    name = "analysis"

    def __init__(self, reader: Reader, *, rules_path: str | Path | None = None) -> None:
        """`reader(fn, *args)` runs a collector.read function (Storage.read);
        `rules_path`: a rules file overriding analysis/rules.toml (--rules)."""
        self.rules = load_rules(rules_path)
        self._read = reader

    def new_state(self, run_id: str) -> dict[str, Any]:
        return {"run_id": run_id, "analyzer": Analyzer(self.rules), "meta": None, "complete": False}

    def __call__(self, state: dict[str, Any], tables: Mapping[str, pa.Table], now: float) -> list:
        run_id = state["run_id"]
        ended: list = []
        if _restarted(tables):
            ended = self._new_layout(state, now)

        if not state["complete"]:
            meta = self._meta(run_id)
            state["complete"] = _complete(meta)
            tables = {**tables, **meta}
        return ended + state["analyzer"].feed(Frames.from_arrow(tables), now=now)

    def _new_layout(self, state: dict[str, Any], now: float) -> list:
        """A restart round (maybe on fewer nodes: rank numbers now name other hardware).
        The open incidents of the old round are closed, and the run's analysis starts
        over on the new layout: its detectors' state was about the old ranks (a
        straggler's rank number now belongs to its healthy successor), except the
        baselines of the training curve, which goes on from the checkpoint (a loss
        spike right after the restart is still judged)."""
        run_id, old = state["run_id"], state["analyzer"]
        out: list = []
        book = old.runs[run_id].book if run_id in old.runs else None
        if book is not None:
            for key in book.open_keys():
                f = book.get(key)
                book.resolve(key, out, ts=now, evidence={**(f.evidence or {}),
                                                         "resolved_because": "the job restarted (a new round)"})
        state["analyzer"] = Analyzer(self.rules)
        state["analyzer"].continue_run(run_id, old)  # the training curve's baselines go on
        if book is not None:
            state["analyzer"].run_state(run_id).book.continue_keys(book)
        state["meta"], state["complete"] = None, False  # another world size, node map and mesh
        return out

    def _meta(self, run_id: str) -> dict[str, pa.Table]:
        return self._read(read.run_meta_tables, run_id)


def _restarted(tables: Mapping[str, pa.Table]) -> bool:
    """A commit holding a rank 0 `run_started` event of a restart round."""
    events = tables.get("events")
    if events is None or not events.num_rows:
        return False
    for e in events.select(["kind", "rank", "data"]).to_pylist():
        if e["kind"] == "run_started" and e["rank"] == 0:
            try:
                data = json.loads(e["data"]) if isinstance(e["data"], str) else (e["data"] or {})
            except ValueError:
                continue
            if int(data.get("restart") or 0) > 0:
                return True
    return False


def _complete(meta: Mapping[str, pa.Table]) -> bool:
    """The run's size is known and every rank has reported its coordinates."""
    runs, ranks = meta.get("runs"), meta.get("ranks")
    if runs is None or not runs.num_rows or ranks is None:
        return False
    world = runs.column("world_size")[0].as_py()
    return bool(world) and ranks.num_rows >= world


def policy_for(rules, *, mode: str | None = None, min_nodes: int | None = None):
    """The healing policy (analysis/policy.py) of `collector serve`: the rules' [policy],
    `--policy` and `--min-nodes` over it."""
    from analysis.policy import Policy
    from analysis.rules import Rules, merge_rules

    if min_nodes is not None:
        rules = Rules(merge_rules(rules.as_dict(), {"policy": {"min_nodes": int(min_nodes)}}), source=rules.source)
    return Policy(rules, mode=mode)


def detectors_for(reader: Reader, *, rules_path: str | Path | None = None, enabled: bool = True) -> list:
    """What `collector serve` runs: the analysis detectors, or nothing (--no-detect)."""
    return [AnalysisDetector(reader, rules_path=rules_path)] if enabled else []
