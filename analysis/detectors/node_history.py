"""`node_history`: a run starts on a node that failed in other runs lately.

The collector hands each run, with its meta rows, the history of the run's nodes in
other runs (analysis/fleet.py: incidents, isolations, and the runs each node was
seen in, from its own file and the Parquet archive; collector/read/fleet.py). Each
node of the run is judged once, when both its ranks and the history are known:
a node that had a fault (an incident of one of `fault_kinds`, or an isolation) in
`flag_runs` or more different runs within the last `window_days` (judged once
every rank of the node has reported, with its hardware id) opens an incident
at step 0, its record in the evidence (runs seen, fault runs, faults by kind, its
latest faults with their runs and incident ids). A node is its hardware where the
history and the run both know its ranks' hardware ids (their GPUs' UUIDs, from the
agents), else its hostname: a host renamed since keeps its record (`past_names`),
and one whose hardware was replaced starts anew.

The incident stays open while the node is in the run: it is not a fault of this
run, but the run is on a suspect node. The policy (`[policy]
replace_flagged_nodes`) hands it to a spare when the run has one: a restart round
without the node, where the open incidents close. Without a spare it is an alert.
Runs are counted, not incidents: one bad run that reopened a straggler five times
is one run, while faults in two runs in a week follow the node.

No history given (a collector with no past runs and no archive): nothing is judged.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analysis import fleet
from analysis.findings import Finding
from analysis.frames import key_order
from analysis.registry import register

DAY_S = 86400.0


class _State:
    __slots__ = ("history", "suspects", "judged", "hw_ids", "ranked")

    def __init__(self) -> None:
        self.history: pl.DataFrame | None = None  # the latest history given (bounded by the window)
        # the hostnames and hardware ids of the history's faults in other runs: a node with neither
        # has a record of no fault (not flagged), read without a query per node
        self.suspects: tuple[set[str], set[str]] = (set(), set())
        self.judged: set[str] = set()  # nodes judged (each once a round)
        self.hw_ids: dict[str, set[str]] = {}  # node -> its ranks' hardware ids (the meta rows')
        self.ranked: set[int] | None = None  # ranks whose rows came (None: this source sends none)

    def footprint(self) -> dict[str, int]:
        return {"history_rows": 0 if self.history is None else self.history.height, "judged_nodes": len(self.judged)}


@register
class NodeHistoryDetector:
    name = "node_history"
    kinds = ("node_history",)

    def __init__(self, rules) -> None:
        self.cfg = rules.node_history
        self.kinds_counted = tuple(self.cfg.fault_kinds)

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        given = p.frames.node_history
        if given is not None and given.height:
            st.history = given
            st.suspects = _suspects(given, set(self.kinds_counted) | {fleet.ISOLATED}, p.run.run_id)
        ranks = p.frames.ranks
        if ranks is not None and ranks.height:
            if st.ranked is None:
                st.ranked = set()
            st.ranked.update(ranks["rank"].to_list())
            if "hw_id" in ranks.columns:
                for node, hw in ranks.select("node", "hw_id").drop_nulls().iter_rows():
                    st.hw_ids.setdefault(str(node), set()).add(str(hw))
        if st.history is None:
            return
        topo = p.topo
        held = np.flatnonzero(topo.node_of >= 0)
        if not len(held):
            return
        since = p.now - self.cfg.window_days * DAY_S
        # the ranks by node, each node's in rank order (one sort: a mask per node was 12,500 passes
        # over 100,000 ranks, every pass until the last rank reported)
        codes = topo.node_of[held].astype(np.int64)
        order, starts = key_order([codes])
        names, hws = st.suspects
        for code, lo, hi in zip(codes[order[starts]].tolist(), starts.tolist(), [*starts[1:].tolist(), len(order)]):
            node = topo.node_names[code]
            if node in st.judged:
                continue
            mine = held[order[lo:hi]]
            if st.ranked is not None and not set(mine.tolist()) <= st.ranked:
                continue  # its ranks' rows (their hardware ids) are not all in yet: the run's node map came first
            st.judged.add(node)
            if node not in names and not st.hw_ids.get(node, set()) & hws:
                continue  # no fault in another run under its name or its hardware: its record flags nothing
            record = fleet.node_record(st.history, node, since_ts=since, fault_kinds=self.kinds_counted,
                                       exclude_run=p.run.run_id, hw_ids=st.hw_ids.get(node, ()))
            if fleet.is_flagged(record.get("fault_runs", 0), self.cfg.flag_runs):
                self._report(p, node, int(mine.min()), record)

    def _report(self, p, node: str, rank: int, record: dict) -> None:
        n, runs = int(record["fault_runs"]), int(record["runs"])
        kinds = ", ".join(f"{k} x{c}" for k, c in record["by_kind"].items())
        latest = record["latest_faults"][0] if record["latest_faults"] else None
        renamed = f" (as {', '.join(record['past_names'])})" if record.get("past_names") else ""
        root = (f"node {node}{renamed} had faults in {n} of its {runs} runs in the last {self.cfg.window_days:g} days "
                f"({kinds})"
                + (f"; the latest: {latest['what']} in run {latest['run_id']}" if latest else "")
                + ": this run starts on a suspect node")
        evidence = {**record, "hw_ids": sorted(p.run.detectors[self.name].hw_ids.get(node, ())),
                    "window_days": self.cfg.window_days, "flag_runs": self.cfg.flag_runs,
                    "fault_kinds": list(self.kinds_counted), **p.topo.coords(rank)}
        p.report(Finding(kind="node_history", key=p.book.new_key(f"node_history:{node}"), run_id=p.run.run_id,
                         severity="warning", rank=rank, node=node, step_from=0, step_to=0, evidence=evidence,
                         root_cause=root, confidence=min(0.9, 0.4 + 0.1 * n)))


def _suspects(history: pl.DataFrame, counted: set[str], run_id: str) -> tuple[set[str], set[str]]:
    """The hostnames and hardware ids of `history`'s rows of `counted` kinds (faults, isolations)
    in runs other than `run_id`, whenever they were: every node `fleet.node_record` could flag
    has one of them (`fleet.mine` matches rows by one or the other)."""
    rows = history.filter(pl.col("what").is_in(sorted(counted)) & (pl.col("past_run_id") != run_id))
    hws = set(rows["hw_id"].drop_nulls().to_list()) if "hw_id" in rows.columns else set()
    return set(rows["node"].drop_nulls().to_list()), hws
