"""`preflight`: a node that failed its pre-flight checks, before the first step.

`trainer --preflight` (or `python -m trainer.preflight` under torchrun) times every
node's matmuls and, in rounds of pairs, its links before training (trainer/preflight.py),
and rank 0 records the report as the `preflight` event: per node its verdict (`ok`,
`slow_compute`, `slow_link`), matmul seconds and ratio to the median node, its link
times, and the pairs of each round. Each node whose verdict is not `ok` opens one
incident at step 0, the node's rows of the report in its evidence. It stays open
while the node is in the run; the policy isolates the node (`[policy]
isolate_on_preflight`; a spare takes its place when there is one), and the restart
round without it closes it.
"""

from __future__ import annotations

import json

from analysis.findings import Finding, json_number
from analysis.registry import register


class _State:
    __slots__ = ("reported",)

    def __init__(self) -> None:
        self.reported: set[str] = set()  # nodes reported (once a round)

    def footprint(self) -> dict[str, int]:
        return {"reported_nodes": len(self.reported)}


@register
class PreflightDetector:
    name = "preflight"
    kinds = ("preflight",)

    def __init__(self, rules) -> None:
        self.cfg = rules.preflight

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        ev = p.frames.events
        if ev is None or not ev.height:
            return
        for data in ev.filter(ev["kind"] == "preflight")["data"].to_list():
            try:
                report = json.loads(data) if isinstance(data, str) else data
                nodes = dict(report.get("nodes") or {})
            except (ValueError, TypeError, AttributeError):
                continue
            for node, r in nodes.items():
                if not isinstance(r, dict) or r.get("verdict", "ok") == "ok" or node in st.reported:
                    continue
                st.reported.add(node)
                self._report(p, str(node), r, report)

    def _report(self, p, node: str, r: dict, report: dict) -> None:
        ranks = [int(x) for x in r.get("ranks") or [] if isinstance(x, (int, float))]
        verdict = str(r.get("verdict"))
        compute = r.get("compute_ratio")
        if verdict == "slow_compute":
            what = (f"its matmuls take {compute:.2f}x the median node's" if isinstance(compute, (int, float))
                    else "its matmuls are slow")
        else:
            what = (f"its links are slow: paired with another node in each of {report.get('rounds')} round(s), its "
                    f"pair was slow every time" + (f" ({r['link_ratio']:.2f}x the median pair)"
                                                    if isinstance(r.get("link_ratio"), (int, float)) else ""))
        evidence = {"verdict": verdict, "ranks": ranks, "matmul_s": json_number(r.get("matmul_s"), 6),
                    "compute_ratio": json_number(compute, 3), "link_s": r.get("link_s"),
                    "link_ratio": json_number(r.get("link_ratio"), 3), "rounds": report.get("rounds"),
                    "pairs": report.get("pairs"), "ratio": report.get("ratio"),
                    "elapsed_s": json_number(report.get("elapsed_s"), 3), "shared_host": report.get("shared_host")}
        p.report(Finding(kind="preflight", key=p.book.new_key(f"preflight:{node}"), run_id=p.run.run_id,
                         severity="critical", rank=min(ranks) if ranks else None, node=node, step_from=0, step_to=0,
                         evidence=evidence, root_cause=f"pre-flight: node {node} failed ({verdict}): {what}",
                         confidence=0.8))
