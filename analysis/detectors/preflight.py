"""`preflight`: a node that failed its pre-flight checks, before the first step.

`trainer --preflight` (or `python -m trainer.preflight` under torchrun) times every
node's matmuls and, in rounds of pairs, its links before training (trainer/preflight.py),
and rank 0 records the report as the `preflight` event: per node its verdict (`ok`,
`slow_compute`, `slow_link`, `no_answer`), matmul seconds and ratio to the median node,
its link times, and the pairs of each round. Each node whose verdict is not `ok` opens one
incident at step 0, the node's rows of the report in its evidence. `no_answer` (a rank
of the node did not answer a phase within the check's timeout) is the ranks' finding,
taken as it is. The others are the collector's, by the rules' `ratio`, from the report's times: a node's matmul
time over the median node's, and a suspect's time in the second round over the
first round's reference pair (the median pair's; of two pairs, the faster). The
ranks' own verdicts (printed at start) use the check's ratio, 2 by default, which
also picked the suspects the second round re-paired. It stays open
while the node is in the run; the policy isolates the node (`[policy]
isolate_on_preflight`; a spare takes its place when there is one), and the restart
round without it closes it.
"""

from __future__ import annotations

import json
import statistics

from analysis.findings import Finding, json_number
from analysis.registry import register


class _State:
    __slots__ = ("reported",)

    def __init__(self) -> None:
        self.reported: set[str] = set()  # nodes reported (once a round)

    def footprint(self) -> dict[str, int]:
        return {"reported_nodes": len(self.reported)}


def verdicts(report: dict, ratio: float) -> dict[str, str]:
    """node -> "no_answer" (as the ranks found: a fact, not a ratio), or "slow_compute" or
    "slow_link" by `ratio`, from the report's times (the others pass)."""
    out: dict[str, str] = {}
    for node, r in (report.get("nodes") or {}).items():
        if isinstance(r, dict) and r.get("verdict") == "no_answer":
            out[str(node)] = "no_answer"
        c = r.get("compute_ratio") if isinstance(r, dict) else None
        if isinstance(c, (int, float)) and c >= ratio:
            out[str(node)] = "slow_compute"
    rounds = [[p for p in rnd if isinstance(p, list) and len(p) == 3] for rnd in report.get("pairs") or []]
    first = [float(p[2]) for p in rounds[0]] if rounds else []
    if len(first) >= 2 and len(rounds) >= 2:
        ref = statistics.median(first) if len(first) >= 3 else min(first)
        for suspect, _, t in rounds[1]:
            if float(t) >= ratio * ref:
                out.setdefault(str(suspect), "slow_link")
    return out


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
            slow = verdicts(report, self.cfg.ratio)
            for node, r in nodes.items():
                if not isinstance(r, dict) or node not in slow or node in st.reported:
                    continue
                st.reported.add(node)
                self._report(p, str(node), {**r, "verdict": slow[node]}, report)

    def _report(self, p, node: str, r: dict, report: dict) -> None:
        ranks = [int(x) for x in r.get("ranks") or [] if isinstance(x, (int, float))]
        verdict = str(r.get("verdict"))
        compute = r.get("compute_ratio")
        if verdict == "no_answer":
            phases = ", ".join(r.get("silent_in") or []) or "the checks"
            who = f" (rank {', '.join(map(str, r['silent_ranks']))})" if r.get("silent_ranks") else ""
            what = f"it never answered{who}: silent in {phases} for {report.get('timeout_s')} s"
        elif verdict == "slow_compute":
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
        if verdict == "no_answer":
            evidence.update(silent_ranks=r.get("silent_ranks"), silent_in=r.get("silent_in"),
                            timeout_s=report.get("timeout_s"), unanswered=report.get("unanswered"))
        p.report(Finding(kind="preflight", key=p.book.new_key(f"preflight:{node}"), run_id=p.run.run_id,
                         severity="critical", rank=min(ranks) if ranks else None, node=node, step_from=0, step_to=0,
                         evidence=evidence, root_cause=f"pre-flight: node {node} failed ({verdict}): {what}",
                         confidence=0.8))
