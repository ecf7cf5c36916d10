"""Every incident kind and every action kind, in one place: what each is, what the
policy does about it, and how an action ends.

Incident kinds are the `kind` of an `incidents` row (a detector's `kinds` name the
ones it emits). Their traits:

- `costed`: the incident costs the job a steady share of every step while it lasts
  (its evidence carries `cost_s_per_step`): the policy acts only once that cost has
  persisted (`<kind>_persist_s`), `collector replay` looks such an incident up again
  while it lasts, and a postmortem prices it per step;
- `acted_when_closed`: the damage is done the moment it happens (a NaN, a spike, a
  crash): the policy acts on it even when its incident closed in the pass that
  opened it; any other kind only while its incident is open;
- `rule`: the policy's rule for it (analysis/policy.py `Policy.RULES` maps each rule
  to its method; `alert` does nothing but the alert every incident is);
- `taints_weights`: the model's parameters after its first step may be bad (a NaN, a
  spike's update, a corrupted replica): a checkpoint from then on is not known-good
  while the incident is open (analysis/watermark.py);
- `weighs_spares`: its rule takes the node out when a spare can take its place, so the
  policy reads the run's inputs (its spares) first, as for a `costed` kind.

Action kinds are the `kind` of an `actions` row and of the command it sends. Their
lifecycle says who ends one, and when:

- `IN_PLACE`: the ranks carry it out and go on in the same attempt; done once every
  rank acked it (repair, checkpoint, rebalance);
- `NEW_ATTEMPT`: the ranks go back to a checkpoint and go on as a new attempt; done
  once every rank acked it (rollback);
- `BY_RESTART`: the job's restart completes it, not its ranks (isolate: a new round
  without the node; restart: the supervisor's own after a crash); a command of that
  kind is never handed again to a restart round;
- `ENDS_RUN`: the ranks stop (stop).

`carried_by` is `ranks` (a handler in trainer/control.py `default_handlers`) or
`launcher` (the supervisor, trainer/supervisor.py). Adding an action is an entry here,
a handler there and a rule in the policy; tests/unit/test_kinds.py ties the three.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

IN_PLACE, NEW_ATTEMPT, BY_RESTART, ENDS_RUN = "in_place", "new_attempt", "by_restart", "ends_run"
LIFECYCLES = (IN_PLACE, NEW_ATTEMPT, BY_RESTART, ENDS_RUN)
RULES = ("rollback", "persist", "hang", "crash", "divergence", "device_health", "history", "preflight", "alert")


@dataclass(frozen=True, slots=True)
class IncidentKind:
    name: str
    summary: str
    rule: str = "alert"
    costed: bool = False
    acted_when_closed: bool = False
    taints_weights: bool = False
    weighs_spares: bool = False


@dataclass(frozen=True, slots=True)
class ActionKind:
    name: str
    summary: str
    lifecycle: str
    carried_by: str = "ranks"


def _index(items) -> MappingProxyType:
    return MappingProxyType({i.name: i for i in items})


INCIDENTS = _index([
    IncidentKind("nan", "a non-finite loss or gradient, with the rank it started on", "rollback",
                 acted_when_closed=True, taints_weights=True),
    IncidentKind("loss_spike", "the loss far above its recent level", "rollback", acted_when_closed=True,
                 taints_weights=True),
    IncidentKind("grad_spike", "the gradient norm far above its recent level", "rollback", acted_when_closed=True,
                 taints_weights=True),
    IncidentKind("loss_scale_collapse", "fp16's loss scale backing off again and again (overflows)"),
    IncidentKind("straggler", "a rank whose compute is slower than its peers'", "persist", costed=True),
    IncidentKind("slow_link", "a rank whose communication on one axis is slow", "persist", costed=True),
    IncidentKind("hang", "a rank that stopped entering collectives", "hang"),
    IncidentKind("crash", "a rank that died", "crash", acted_when_closed=True),
    IncidentKind("device_health", "a device's own signals: ECC errors, throttling, memory pressure",
                 "device_health"),
    IncidentKind("data_stall", "a rank waiting for its data loader", "persist", costed=True),
    IncidentKind("checkpoint_slow", "a rank whose checkpoint writes are slow"),
    IncidentKind("replica_divergence", "replicas whose parameters differ (silent data corruption)", "divergence",
                 taints_weights=True),
    IncidentKind("preflight", "a node that failed its pre-flight checks (compute or links) before the first step",
                 "preflight", weighs_spares=True),
    IncidentKind("node_history", "a run starts on a node that failed in other runs lately (fleet memory)",
                 "history", weighs_spares=True),
])

ACTIONS = _index([
    ActionKind("rollback", "restore the newest verified checkpoint before the incident, rerun to diagnose",
               NEW_ATTEMPT),
    ActionKind("isolate", "checkpoint, leave the node out, restart without it", BY_RESTART),
    ActionKind("stop", "stop the run", ENDS_RUN),
    ActionKind("restart", "the supervisor's restart after a crash (recorded, not sent)", BY_RESTART, "launcher"),
    ActionKind("repair", "copy a healthy replica's parameters and optimizer state over a corrupted one",
               IN_PLACE),
    ActionKind("checkpoint", "checkpoint now", IN_PLACE),
    ActionKind("rebalance", "move micro-batches from a slow data-parallel replica to the others (or back), in place",
               IN_PLACE),
])

INCIDENT_KINDS = tuple(INCIDENTS)
ACTION_KINDS = tuple(ACTIONS)
COSTED = tuple(k for k, v in INCIDENTS.items() if v.costed)
ACTED_WHEN_CLOSED = frozenset(k for k, v in INCIDENTS.items() if v.acted_when_closed)
TAINTS_WEIGHTS = frozenset(k for k, v in INCIDENTS.items() if v.taints_weights)
# the kinds whose decision reads the run's side of the cost model's inputs (its spares among them)
NEEDS_RUN_INPUTS = frozenset(k for k, v in INCIDENTS.items() if v.costed or v.weighs_spares)
DONE_IN_PLACE = frozenset(k for k, v in ACTIONS.items() if v.lifecycle == IN_PLACE)
ENDED_BY_RESTART = frozenset(k for k, v in ACTIONS.items() if v.lifecycle == BY_RESTART)


def rule_of(kind: str | None) -> str:
    """The policy's rule for an incident kind (`alert` for one it does not know)."""
    got = INCIDENTS.get(kind or "")
    return got.rule if got is not None else "alert"


def _check() -> None:
    for i in INCIDENTS.values():
        assert i.rule in RULES, i
    for a in ACTIONS.values():
        assert a.lifecycle in LIFECYCLES and a.carried_by in ("ranks", "launcher"), a


_check()
