"""`collector replay`: rerun the detectors over a closed run, offline.

    collector replay --db run/telemetry.duckdb [--rules my.toml] [--truth run/injections.jsonl]

The file is opened read-only and never written. Each run's rows (collector/read/queries.py
`run_tables`) are cut back into the commits a live collector would have seen
(analysis/replay.py `replay_commits`), fed through the same `Analyzer` the live
collector's detection thread runs (collector/live/detection.py), and its findings are
collapsed into incidents by the live collector's own `OpenIncidents`
(collector/store/incidents.py), kept in memory instead of in the `incidents` table. So
what this prints is what `collector serve --rules FILE` would have written for the
run: the way to tune thresholds on runs that already happened.

With `--truth` (the `injections.jsonl` trainer/faults.py writes; only this command
and the tests read it) the incidents are scored (analysis/scoring.py): precision,
recall, latency in seconds and steps, and culprit accuracy, by kind. And the actions
are judged (analysis/judging.py): for each injected fault, what the policy would do
on the replayed incident (analysis/policy.py, in the `--policy` mode) and what it did
in the live run (the file's `actions` and the rerun verdict), each against what was
right for that fault (for a bitflip that depends on what its matched incident found:
the replayed incident's evidence, else the stored one's).

The cost model's decisions are scored on what came of them, with or without `--truth`:
each live action the model chose (`detail.predicted`: an isolation to replace or
shrink) against what it realized (`detail.realized`, measured 20 steps after the job
caught up): the gain it predicted and the gain it got, in seconds of the run's time
to finish, and whether it paid (a realized gain above zero). A decision to keep the
node leaves no action row, and is not scored here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis import Analyzer, Finding, Frames, Rules, Score, load_rules, replay_commits, score, truths_from_rows
from analysis.judging import Judgement, judge, summary
from analysis.kinds import COSTED
from analysis.policy import Policy, RunPolicy, apply_cost_inputs
from analysis.scoring import Incident as ScoredIncident
from analysis.scoring import Truth, cause_of, opened_step_of, suspects_of
from collector.offline.retention import DAY_S
from collector.read import fleet, queries
from collector.store.incidents import OpenIncidents, RecordFindings


@dataclass(slots=True)
class RunReplay:
    """One run's replay: its incidents as the live collector would have written them."""

    run_id: str
    incidents: list[dict[str, Any]]  # incidents rows (id, kind, rank, node, step_from, ...)
    opened_step: dict[int, int | None] = field(default_factory=dict)  # id -> newest step at opening
    num_passes: int = 0
    num_findings: int = 0
    num_stored: int = 0  # incidents the file itself holds for the run (what the live collector wrote)
    cost_inputs: dict[str, Any] = field(default_factory=dict)  # queries.cost_inputs: the policy's cost model


class IncidentLedger:
    """The `incidents` table of one replay, in memory: the collector's OpenIncidents
    plans each pass's findings exactly as its writer does, and the plan is applied to
    rows here instead of inside a transaction."""

    def __init__(self) -> None:
        self.book = OpenIncidents()
        self.rows: dict[int, dict[str, Any]] = {}
        self.opened_step: dict[int, int | None] = {}
        self._next_id = 1

    def record(self, run_id: str, findings: list[Finding], *, now: float) -> None:
        if not findings:
            return
        plan = self.book.plan([RecordFindings(run_id, tuple(findings))], now=now, next_id=self._next_id)
        for row in plan.inserts:
            self.rows[row["id"]] = {**row, "closed_ts": None}
        for iid, values in plan.updates:
            self.rows[iid].update(values)
        for f, iid in zip(findings, plan.results[0]):
            if iid is not None and iid not in self.opened_step:
                self.opened_step[iid] = _opened_step(f)
        self.book.apply(plan)
        self._next_id = plan.next_id


def _opened_step(f: Finding) -> int | None:
    """The newest step the run had reported when the incident opened (a straggler's or a
    slow link's counts from the step it fired at): scoring's latency in steps."""
    return opened_step_of(f.kind, f.evidence, f.detected_step)


def _evidence(row: dict[str, Any]) -> dict[str, Any]:
    ev = row.get("evidence")
    return (json.loads(ev) if isinstance(ev, str) else ev) or {}


def replay_run(cur: queries.Cursor, run_id: str, *, rules: Rules | None = None, window_s: float = 1.0,
               tail_s: float = 30.0, archive_dir: str | None = None) -> RunReplay:
    """Every pass the live collector would have run over `run_id`, in order: a fresh
    analyzer fed the run's commits as the live detection runner feeds it
    (collector/live/detection.py: `Analyzer.feed_run`, one run at a time). Its nodes'
    history is what the file's other runs (and `archive_dir`'s) held before it began."""
    analyzer = Analyzer(rules)
    tables = queries.run_tables(cur, run_id)
    if any(d.name == "node_history" for d in analyzer.detectors):
        begun = queries.run_begun_ts(cur, run_id)
        if begun is not None:
            tables["node_history"] = fleet.history(
                cur, run_id, since_ts=begun - DAY_S * analyzer.rules.node_history.window_days, until_ts=begun,
                archive_dir=archive_dir)
    frames = Frames.from_arrow(tables)
    ledger = IncidentLedger()
    out = RunReplay(run_id=run_id, incidents=[])
    for now, commit in replay_commits(frames, window_s=window_s, tail_s=tail_s):
        findings = analyzer.feed_run(run_id, commit, now=now)
        out.num_passes += 1
        out.num_findings += len(findings)
        ledger.record(run_id, findings, now=now)
    out.incidents = [ledger.rows[i] for i in sorted(ledger.rows)]
    out.opened_step = ledger.opened_step
    out.num_stored = len(queries.incidents(cur, run_id))
    out.cost_inputs = queries.cost_inputs(cur, run_id)
    return out


def scored_incidents(replays: Iterable[RunReplay]) -> list[ScoredIncident]:
    """The replayed incidents rows as analysis/scoring.py's incidents."""
    return [ScoredIncident(kind=row["kind"], key=f"{r.run_id}/{row['cause_key']}", run_id=r.run_id,
                           rank=row["rank"], node=row["node"], step_from=row["step_from"], step_to=row["step_to"],
                           opened_ts=row["opened_ts"], opened_step=r.opened_step.get(row["id"]),
                           closed_ts=row.get("closed_ts"),
                           suspects=suspects_of(row["kind"], row["rank"], _evidence(row)),
                           cause=cause_of(row["kind"], _evidence(row)))
            for r in replays for row in r.incidents]


def stored_incidents(cur: queries.Cursor, run_ids: Iterable[str]) -> tuple[list[ScoredIncident], dict[str, dict]]:
    """The incidents the live collector wrote, as scoring's incidents, and each by key."""
    scored, rows = [], {}
    for run_id in run_ids:
        for row in queries.incidents(cur, run_id):
            key = f"{run_id}/live/{row['id']}"
            rows[key] = row
            scored.append(ScoredIncident(kind=row["kind"], key=key, run_id=run_id, rank=row["rank"], node=row["node"],
                                         step_from=row["step_from"], step_to=row["step_to"],
                                         opened_ts=row["opened_ts"], opened_step=None,
                                         closed_ts=row.get("closed_ts"),
                                         suspects=suspects_of(row["kind"], row["rank"], _evidence(row)),
                           cause=cause_of(row["kind"], _evidence(row))))
    return scored, rows


def policy_decisions(replays: Iterable[RunReplay], rules: Rules, mode: str | None) -> dict[str, list[str]]:
    """What the policy decides on each replayed incident (by scoring key), fed in the
    order they opened: a straggler, a slow link or a data stall (analysis/kinds.py
    COSTED: their cost must persist past the rules' `<kind>_persist_s`) is looked at
    again when it closed (or at its last update), as the live runner looks at open ones
    while they last."""
    policy = Policy(rules, mode=mode if mode and mode != "off" else "shadow")
    out: dict[str, list[str]] = {}
    for r in replays:
        st = RunPolicy(run_id=r.run_id, nodes=list(r.cost_inputs.get("nodes") or [])
                       or sorted({row["node"] for row in r.incidents if row.get("node")}))
        for row in sorted(r.incidents, key=lambda x: (x["opened_ts"], x["id"])):
            key = f"{r.run_id}/{row['cause_key']}"
            inc = {**row, "evidence": _evidence(row), "status": "open"}
            if row["kind"] in COSTED:  # the cost model's inputs as they stood when it opened
                apply_cost_inputs(st, r.cost_inputs, reached=r.opened_step.get(row["id"]) or row.get("step_from"))
            decided = policy.on_incident(st, inc, row["opened_ts"])
            end = row.get("closed_ts") or row.get("updated_ts")
            if not decided and row["kind"] in COSTED and end is not None:
                apply_cost_inputs(st, r.cost_inputs, reached=row.get("step_to"))  # and when it last changed
                decided = policy.on_incident(st, inc, end)
            out[key] = [d.kind for d in decided if d.refused is None]
    return out


def matched_evidence(truths: Iterable[Truth], replays: Iterable[RunReplay], replay_match: Mapping[Truth, str],
                     live_match: Mapping[Truth, dict[str, Any]]) -> dict[Truth, dict[str, Any] | None]:
    """Each truth's matched incident's evidence, for the judging of what should have
    come of it (a bitflip's repair or rollback): the replayed incident's (`replay_match`:
    scoring keys), else the stored one's, else None."""
    rows = {f"{r.run_id}/{row['cause_key']}": row for r in replays for row in r.incidents}
    out: dict[Truth, dict[str, Any] | None] = {}
    for t in truths:
        row = rows.get(replay_match.get(t)) or live_match.get(t)
        out[t] = _evidence(row) if row is not None else None
    return out


def cost_decisions(live_actions: Mapping[int, list[dict]]) -> list[dict[str, Any]]:
    """The live actions the cost model chose, each with its predicted and realized gain
    (None when it was not measured: the run ended first, or the action failed) and
    whether it paid, in action order."""
    out = []
    for acts in live_actions.values():
        for a in acts:
            detail = a.get("detail")
            if isinstance(detail, str):
                try:
                    detail = json.loads(detail)
                except ValueError:
                    detail = None
            predicted = (detail or {}).get("predicted") if isinstance(detail, dict) else None
            if not isinstance(predicted, dict):
                continue
            realized = detail.get("realized") if isinstance(detail.get("realized"), dict) else {}
            gain = realized.get("gain_s")
            out.append({"id": a.get("id"), "run_id": a.get("run_id"), "kind": a.get("kind"), "node": a.get("node"),
                        "status": a.get("status"), "best": predicted.get("best"),
                        "predicted_gain_s": predicted.get("gain_s"), "realized_gain_s": gain,
                        "step_s_before": realized.get("step_s_before"), "step_s_after": realized.get("step_s_after"),
                        "recovery_s": realized.get("recovery_s"), "paid": None if gain is None else gain > 0})
    return sorted(out, key=lambda x: (str(x["run_id"]), x["id"] or 0))


def cost_lines(decisions: list[dict[str, Any]]) -> list[str]:
    def num(x: Any, unit: str = " s") -> str:
        return "-" if x is None else f"{x:.3g}{unit}"

    lines = []
    for d in decisions:
        paid = "-" if d["paid"] is None else ("paid" if d["paid"] else "DID NOT PAY")
        lines.append(f"{d['kind']} {d['node'] or '-'} ({d['best']}, {d['status']}): predicted gain "
                     f"{num(d['predicted_gain_s'])}, realized {num(d['realized_gain_s'])} [{paid}]; step "
                     f"{num(d['step_s_before'])} -> {num(d['step_s_after'])}, recovery {num(d['recovery_s'])}")
    return lines


def action_lines(judgements: list[Judgement]) -> list[str]:
    def mark(ok: bool | None) -> str:
        return "-" if ok is None else ("right" if ok else "WRONG")

    lines = []
    for j in judgements:
        t = j.truth
        what = f"{t.kind}({t.mode or t.what})" if t.mode or t.what else t.kind
        exp = ", then ".join(j.expected.actions) or "no action"
        if j.expected.verdict:
            exp += f", verdict {j.expected.verdict}"
        did = "; ".join(f"{a['kind']} {a['status']}" + (f" {a['recovery_s']:.1f} s" if a.get("recovery_s") else "")
                        for a in j.did) or "nothing"
        if j.verdict:
            did += f", verdict {j.verdict}"
        lines.append(f"fault {what} step {t.step} rank {t.rank} node {_dash(t.node)}: expected {exp} | "
                     f"would: {', '.join(j.would) or 'nothing'} [{mark(j.would_right)}] | "
                     f"did: {did} [{mark(j.did_right)}]")
    return lines


def load_truths(path: str | Path, *, run_id: str | None):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return truths_from_rows(rows, run_id=run_id)


def incident_line(row: dict[str, Any]) -> str:
    lo, hi = row.get("step_from"), row.get("step_to")
    steps = "-" if lo is None else (f"step {lo}" if hi in (None, lo) else f"steps {lo}-{hi}")
    rank = "-" if row.get("rank") is None else str(row["rank"])
    closed = "" if row.get("status") == "open" else f" [{row.get('status')}]"
    return (f"{row['kind']:<20} {steps:<14} rank {rank:<4} {row.get('node') or '-':<8} "
            f"{row.get('root_cause') or ''}{closed}")


def _dash(x) -> str:
    return "-" if x is None else str(x)


def score_json(s: Score) -> dict[str, Any]:
    def median(xs):
        return statistics.median(xs) if xs else None

    return {
        "by_kind": {k: {"truths": v.num_truths, "incidents": v.num_incidents, "matched": v.num_matched,
                        "precision": v.precision, "recall": v.recall, "culprit_accuracy": v.culprit_accuracy,
                        "latency_s_p50": median(v.latency_s), "latency_steps_p50": median(v.latency_steps),
                        "culprit_among_suspects": v.num_culprit_among_suspects,
                        "latency_s": v.latency_s, "latency_steps": v.latency_steps}
                    for k, v in sorted(s.by_kind.items())},
        "missed": [{"kind": t.label, "rank": t.rank, "step": t.step} for t in s.missed],
        "false_positives": [{"kind": i.kind, "rank": i.rank, "node": i.node, "step_from": i.step_from}
                            for i in s.false_positives],
        "matches": [{"truth": {"kind": t.label, "rank": t.rank, "node": t.node, "step": t.step},
                     "incident": {"kind": i.kind, "rank": i.rank, "node": i.node, "step_from": i.step_from,
                                  "suspects": list(i.suspects)}}
                    for t, i in s.matches],
    }


def main(args: argparse.Namespace) -> int:
    import duckdb

    from analysis import RulesError
    from collector.storage import connect

    try:
        rules = load_rules(args.rules)
    except (RulesError, OSError) as e:
        print(f"collector replay: --rules: {e}", file=sys.stderr)
        return 2
    try:
        con = connect(args.db, read_only=True)
    except duckdb.Error as e:
        hint = " (a running collector holds it: replay a copy, or stop it)" if "lock" in str(e).lower() else ""
        print(f"collector replay: cannot open {args.db}: {e}{hint}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        known = queries.run_ids(con)
        run_ids = [args.run] if args.run else known
        if args.run and args.run not in known:
            print(f"collector replay: no run {args.run!r} in {args.db} (runs: {', '.join(known) or 'none'})",
                  file=sys.stderr)
            return 2
        replays = [replay_run(con, r, rules=rules, window_s=args.window_s, archive_dir=args.archive)
                   for r in run_ids]
        live_scored, live_rows = stored_incidents(con, run_ids)
        live_actions: dict[int, list[dict]] = {}
        for r in run_ids:
            for a in queries.actions(con, r):
                if a.get("incident_id") is not None:
                    live_actions.setdefault(int(a["incident_id"]), []).append(a)
    finally:
        con.close()
    elapsed_s = time.perf_counter() - t0
    s = None
    judgements: list[Judgement] = []
    if args.truth:
        try:  # one run: the truths are its own; several: a truth matches an incident of any run
            truths = load_truths(args.truth, run_id=run_ids[0] if len(run_ids) == 1 else None)
        except (OSError, ValueError) as e:
            print(f"collector replay: --truth {args.truth}: {e}", file=sys.stderr)
            return 2
        s = score(scored_incidents(replays), truths)
        live = score(live_scored, truths)
        replay_match = {t: i.key for t, i in s.matches}
        live_match = {t: live_rows[i.key] for t, i in live.matches}
        judgements = judge(truths, {t: t.mode for t in truths}, replay_match=replay_match,
                           replay_decisions=policy_decisions(replays, rules, getattr(args, "policy", None)),
                           live_match=live_match, live_actions=live_actions,
                           evidence=matched_evidence(truths, replays, replay_match, live_match),
                           crashes_to_isolate=rules.policy.crashes_to_isolate)
    costed = cost_decisions(live_actions)
    if args.json:
        print(json.dumps({"runs": {r.run_id: {"incidents": r.incidents, "num_passes": r.num_passes,
                                              "num_findings": r.num_findings, "num_stored": r.num_stored}
                                   for r in replays},
                          "cost_model": {"decisions": costed,
                                         "num_paid": sum(1 for d in costed if d["paid"]),
                                         "num_measured": sum(1 for d in costed if d["paid"] is not None)},
                          "score": score_json(s) if s is not None else None,
                          "actions": {"summary": summary(judgements), "faults": action_lines(judgements)}
                          if judgements else None, "elapsed_s": elapsed_s}, default=str))
        return 0
    for r in replays:
        print(f"run {r.run_id}: {len(r.incidents)} incidents from {r.num_findings} findings in {r.num_passes} "
              f"passes (the file holds {r.num_stored} from the live collector)")
        for row in r.incidents:
            print("  " + incident_line(row))
    if s is not None:
        print()
        print(s.table())
        for t, i in s.matches:
            among = f" (suspects {', '.join(map(str, i.suspects))})" if i.suspects else ""
            print(f"matched: {t.label} at step {t.step} on rank {t.rank} (node {_dash(t.node)}) -> {i.kind} steps "
                  f"{i.step_from}-{i.step_to}, culprit rank {_dash(i.rank)} node {_dash(i.node)}{among}")
        for t in s.missed:
            print(f"missed: {t.label} at step {t.step} on rank {t.rank}")
        for i in s.false_positives:
            print(f"false positive: {i.kind} steps {i.step_from}-{i.step_to}, rank {_dash(i.rank)} "
                  f"node {_dash(i.node)}")
        if judgements:
            m = summary(judgements)
            print()
            print(f"actions: the policy would have been right on {m['would_right']} of {m['would_judged']} faults; "
                  f"in the live run it was right on {m['did_right']} of {m['did_judged']} it acted on")
            for line in action_lines(judgements):
                print("  " + line)
    if costed:
        measured = [d for d in costed if d["paid"] is not None]
        print()
        print(f"cost model: {sum(1 for d in measured if d['paid'])} of {len(measured)} measured decisions paid "
              f"({len(costed) - len(measured)} not measured)")
        for line in cost_lines(costed):
            print("  " + line)
    print(f"(replayed in {elapsed_s:.2f} s)")
    return 0
