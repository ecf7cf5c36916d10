"""Was the right thing done? Actions and rerun verdicts judged against injected faults.

`collector replay --truth injections.jsonl` scores the incidents (analysis/scoring.py);
this module scores what came of them. For each injected fault (a `Truth`) matched to
an incident, the expected outcome (`expected`) is compared with

- what the policy *would* do on that incident (analysis/policy.py run over the
  replayed incidents: the first decision; a rerun's follow-up cannot be replayed
  without the rerun), and
- what it *did* in the live run (the file's `actions` rows of the matched stored
  incident, and the rerun verdict in its `root_cause`).

Expected outcomes:

| fault | action | verdict |
|---|---|---|
| nan mode=data, spike | rollback | data |
| nan mode=transient | rollback | transient |
| nan mode=device | rollback, then isolate its node | device |
| straggler | isolate its node, or rebalance its replica in place (naming its node) | - |
| straggler, slowlink, slowio what=data with `on=place`, again on the node that replaced the first | stop the run | - |
| hang, slowlink, slowio what=data | isolate its node | - |
| bitflip, a majority holds the healthy bits and caught within `checksum_every` steps | repair in place | - |
| bitflip, otherwise (dp = 2, no majority, a late catch, or no incident) | rollback | - |
| crash | restart; isolate its node from the `crashes_to_isolate`-th on it | - |
| devhealth what=ecc | isolate its node (its GPU's memory corrupts data) | - |
| devhealth what=memory | checkpoint now (an OOM kill may come next) | - |
| overflow, slowio what=ckpt, devhealth what=thermal | none (alert only) | - |

A bitflip's row depends on what its matched `replica_divergence` incident found
(its evidence: analysis/detectors/replica_divergence.py), which the truth alone
cannot tell: a majority holds the healthy bits when fewer than half of the `dp`
replicas are among its `divergent_ranks` (the evidence's `majority` when either is
missing), and it was caught in time when `caught_within_steps` (first disagreeing
minus last agreeing checksum step) is at most `checksum_every`. That is the
issue's rule, written here apart from analysis/policy.py's implementation of it on
purpose: the judge must not agree with the policy by construction.

This is how shadow mode earns trust: the same report over a shadow run says how
often `auto` would have been right.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from analysis.scoring import Truth, _node

VERDICTS = ("data", "device", "transient")


@dataclass(frozen=True, slots=True)
class Expected:
    actions: tuple[str, ...]  # action kinds, in order
    verdict: str | None = None
    isolate_node: str | None = None  # the node an isolate must name
    # action kinds that may stand in for the first expected one, on the same node (a straggler's
    # rebalance in place for its isolation: the cost model chooses between them)
    instead: tuple[str, ...] = ()


@dataclass(slots=True)
class Judgement:
    truth: Truth
    expected: Expected
    would: list[str] = field(default_factory=list)  # the policy's decision kinds on the replayed incident
    did: list[dict[str, Any]] = field(default_factory=list)  # the live actions rows (kind, status, node, ...)
    verdict: str | None = None  # the live rerun's verdict
    matched: bool = True  # an incident matched the truth at all

    @property
    def would_right(self) -> bool | None:
        if not self.matched:
            return False
        first = self.expected.actions[0] if self.expected.actions else None
        return (self.would[:1] == [first] or self.would[:1] in ([k] for k in self.expected.instead)) if first \
            else not self.would

    @property
    def did_right(self) -> bool | None:
        """None: no live actions to judge (a run with the policy off)."""
        if not self.matched:
            return False
        kinds = [a["kind"] for a in self.did if a.get("status") not in ("refused", "failed")]
        if not self.did:
            return None if self.expected.actions else True
        if not self.expected.actions:
            return not kinds
        if any(a.get("mode") == "shadow" for a in self.did):
            kinds = [a["kind"] for a in self.did]  # shadow: judged as decisions
        node = _node(self.expected.isolate_node)
        if any(k in kinds and any(a["kind"] == k and _node(a.get("node")) == node for a in self.did)
               for k in self.expected.instead):
            return True  # the stand-in, on the fault's node
        ok = all(k in kinds for k in self.expected.actions)
        if self.expected.isolate_node is not None:
            ok = ok and any(a["kind"] == "isolate" and _node(a.get("node")) == _node(self.expected.isolate_node)
                            for a in self.did)
        if self.expected.verdict is not None and self.verdict is not None:
            ok = ok and self.verdict == self.expected.verdict
        return ok


def expected(t: Truth, *, mode: str | None, evidence: Mapping[str, Any] | None = None, crash_number: int = 1,
             crashes_to_isolate: int = 2, place_number: int = 1) -> Expected:
    """What should come of fault `t` (`mode`: a nan's data|transient|device;
    `evidence`: the matched incident's, None when nothing matched; `place_number`: the
    how-manieth node the same place-bound slow-down (`on=place`) shows on: from the
    second, a replacement was already tried and the slowness followed the rank)."""
    if t.on == "place" and place_number >= 2 and t.kind in ("straggler", "slowlink", "slowio"):
        return Expected(("stop",))
    if t.kind == "nan":
        mode = mode or "data"
        if mode == "device":
            return Expected(("rollback", "isolate"), "device", t.node)
        return Expected(("rollback",), mode)
    if t.kind == "spike":
        return Expected(("rollback",), "data")
    if t.kind == "straggler":
        return Expected(("isolate",), None, t.node, instead=("rebalance",))
    if t.kind in ("hang", "slowlink") or (t.kind == "slowio" and t.what == "data"):
        return Expected(("isolate",), None, t.node)
    if t.kind == "bitflip":
        return Expected(("repair",) if repairable(evidence) else ("rollback",))
    if t.kind == "crash":
        if crash_number >= crashes_to_isolate:
            return Expected(("isolate",), None, t.node)
        return Expected(("restart",))
    if t.kind == "devhealth" and t.what == "ecc":
        return Expected(("isolate",), None, t.node)
    if t.kind == "devhealth" and t.what == "memory":
        return Expected(("checkpoint",))
    return Expected(())


def repairable(evidence: Mapping[str, Any] | None) -> bool:
    """A replica divergence to repair in place: a majority of the replicas holds the
    healthy bits and it was caught within `checksum_every` steps (the module doc)."""
    ev = evidence or {}
    dp, divergent = ev.get("dp"), ev.get("divergent_ranks")
    if isinstance(dp, int) and isinstance(divergent, list):
        majority = (dp - len(divergent)) * 2 > dp
    else:
        majority = ev.get("majority") is True
    within, every = ev.get("caught_within_steps"), ev.get("checksum_every")
    return (majority and isinstance(within, (int, float)) and isinstance(every, (int, float))
            and within <= every)


def verdict_of(root_cause: str | None) -> str | None:
    """The rerun verdict a root cause starts with ("data: ...": collector/live/policy.py)."""
    head = (root_cause or "").split(":", 1)[0].strip()
    return head if head in VERDICTS else None


def judge(truths: Sequence[Truth], modes: Mapping[Truth, str | None], *,
          replay_match: Mapping[Truth, Any], replay_decisions: Mapping[Any, list[str]],
          live_match: Mapping[Truth, Mapping[str, Any]], live_actions: Mapping[int, list[dict[str, Any]]],
          evidence: Mapping[Truth, Mapping[str, Any] | None] | None = None,
          crashes_to_isolate: int = 2) -> list[Judgement]:
    """One Judgement per truth. `replay_match`: truth -> replayed incident key;
    `replay_decisions`: that key -> decision kinds; `live_match`: truth -> stored
    incident row; `live_actions`: stored incident id -> its actions rows;
    `evidence`: truth -> the matched incident's evidence (the replayed one's, else
    the stored one's: what `expected` needs for a bitflip)."""
    evidence = evidence or {}
    out = []
    crashes: dict[str | None, int] = {}
    places: dict[tuple, int] = {}  # (kind, rank, what) of a place-bound slow-down -> the nodes it showed on
    for t in sorted(truths, key=lambda t: (t.ts or 0.0, t.step)):
        n = 1
        if t.kind == "crash":
            n = crashes[t.node] = crashes.get(t.node, 0) + 1
        place = 1
        if t.on == "place":
            place = places[(t.kind, t.rank, t.what)] = places.get((t.kind, t.rank, t.what), 0) + 1
        exp = expected(t, mode=modes.get(t), evidence=evidence.get(t), crash_number=n,
                       crashes_to_isolate=crashes_to_isolate, place_number=place)
        key = replay_match.get(t)
        live = live_match.get(t)
        j = Judgement(truth=t, expected=exp, matched=key is not None or live is not None)
        j.would = list(replay_decisions.get(key, [])) if key is not None else []
        if live is not None:
            j.did = list(live_actions.get(live["id"], []))
            j.verdict = verdict_of(live.get("root_cause"))
        out.append(j)
    return out


def summary(judgements: Iterable[Judgement]) -> dict[str, Any]:
    js = list(judgements)
    would = [j.would_right for j in js if j.would_right is not None]
    did = [j.did_right for j in js if j.did_right is not None]
    return {"faults": len(js), "would_right": sum(would), "would_judged": len(would),
            "did_right": sum(did), "did_judged": len(did)}
