"""What each action would cost: the time left to finish the run under each candidate.

The healing policy (analysis/policy.py) asks this before it takes a node out for a
slow-down (a straggler, a slow link, a data stall). Shrinking a job to save a slow
node's cost is not free: the nodes left do the departed one's share of every step,
the restart costs its seconds, and the steps since the newest checkpoint are run
again. On 2 nodes, isolating one to save 12% of a step halves the throughput; on
64 it costs 1/63 more per step and is right. Pure: numbers in, predictions out.

For `steps_left` steps at today's step time `step_s`, of which `excess_s` is the
slow-down's cost (its incident's `cost_s_per_step`: the others wait that long for
it every step), on `nodes` healthy nodes, the predicted seconds to finish are:

    keep       steps_left x step_s                                   (alert only)
    rebalance  steps_left x (step_s + t x (max(m_s x ratio, m_o) - M x ratio))   (in place)
    replace    restart_s + (redo_steps + steps_left) x healthy_s      (a spare takes the node's place)
    shrink     restart_s + (redo_steps + steps_left) x healthy_s x nodes / (nodes - 1)

where `healthy_s = step_s - excess_s` is the step without the slow-down, and the
nodes left share the departed node's work with the global batch kept (each
replica's compute grows by nodes / (nodes - 1); the communication per step is
taken as unchanged). `restart_s` is this run's measured restart cost when one has
happened (the actions' recovery_s), else the rules' prior. `redo_steps` are the
steps since the newest checkpoint, which a restart runs again. A run without a
known end is judged over `horizon_steps`. Replace needs a spare.

Rebalance moves micro-batches from the slow replica to the others, in place
(trainer/control.py): of the global batch's `micro_batches` (all replicas'), each
of the `dp` replicas holds M = micro_batches / dp; the slow one computes `ratio`
times a healthy one's per micro-batch (its straggler's `compute_ratio`), so a
healthy micro-batch takes t = excess_s / (M x (ratio - 1)). `balanced_shares`
gives the slow replica m_s and the busiest other m_o, the split whose slowest
replica finishes first, each at least one (the trainer splits by the same rule).
A rebalance applies to a compute straggler only (a slow link moves the same bytes
whatever the split), and needs dp >= 2 and the job's micro-batch count. Rollback
and stop do not apply to a slow-down; they are not candidates here.

The policy takes the cheapest candidate when it beats keep by `min_gain_share` of
keep's time (a prediction is an estimate: a bare win on noisy inputs is not worth a
restart); `Prediction.gain_s` is what it expects to save.

How long to watch a slow-down before acting on it is the ski-rental problem: a
host's passing contention ends by itself, a fault does not, and which one it is
shows only in hindsight. `regret_s` is what the action would cost were the
slow-down to end the moment it is taken (its seconds to finish on a healthy run
less keep's): a replacement's restart and redone steps; a shrink's, and the rest
of the run on one node fewer; a rebalance's split for a slowness that is gone
until its undo. Acting once the slow-down has cost that much (its share of each
step times the time watched) never loses more than twice what the best choice in
hindsight would have (the policy, analysis/policy.py, caps the wait at its rules'
`<kind>_persist_s`): a 4x slow link on a run whose restart costs 1.5 s is acted on
after 2 s, a 1.2x straggler weighed for a shrink waits the whole cap.
"""

from __future__ import annotations

from dataclasses import dataclass

KEEP, REPLACE, SHRINK, REBALANCE = "keep", "replace", "shrink", "rebalance"


@dataclass(frozen=True, slots=True)
class Situation:
    steps_left: int  # steps the run has left (or the horizon, when its end is not known)
    step_s: float  # the step time now, slow-down included
    excess_s: float  # what the slow-down costs each step
    nodes: int  # healthy nodes now (the slow one among them)
    restart_s: float  # what a restart costs (measured on this run, or the prior)
    redo_steps: int = 0  # steps since the newest checkpoint: a restart runs them again
    spares: int = 0  # standby nodes that can take a node's place
    # rebalance's inputs (0 / 1: not a candidate): data-parallel replicas now, the global batch's
    # micro-batches (every replica's), the slow replica's compute per micro-batch over a healthy one's
    dp: int = 0
    micro_batches: int = 0
    ratio: float = 1.0

    @property
    def healthy_s(self) -> float:
        return max(0.0, self.step_s - max(0.0, self.excess_s))


@dataclass(frozen=True, slots=True)
class Prediction:
    best: str  # keep | rebalance | replace | shrink
    seconds: dict[str, float]  # candidate -> predicted seconds to finish
    gain_s: float  # keep's seconds less the best's (0 when keeping)

    def detail(self, situation: Situation) -> dict:
        """What an action's detail records: the candidates, the expected gain, the inputs."""
        return {"best": self.best, "gain_s": round(self.gain_s, 3),
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "inputs": {"steps_left": situation.steps_left, "step_s": round(situation.step_s, 6),
                           "excess_s": round(situation.excess_s, 6), "nodes": situation.nodes,
                           "restart_s": round(situation.restart_s, 3), "redo_steps": situation.redo_steps,
                           "spares": situation.spares, "dp": situation.dp, "micro_batches": situation.micro_batches,
                           "ratio": round(situation.ratio, 4)}}


def balanced_shares(total: int, slowness: list[float]) -> tuple[int, ...]:
    """Micro-batches per replica, `total` of them and each at least one, whose slowest
    replica (share x slowness) finishes soonest: one at a time to the replica that would
    finish it first, ties to the lower index. The trainer splits by the same rule
    (trainer/data.py `balanced_shares`: analysis and trainer share no code;
    tests/unit/analysis/test_costmodel.py holds them equal)."""
    n = len(slowness)
    if n < 1 or total < n:
        raise ValueError(f"{total} micro-batches cannot give each of {n} replicas one")
    shares = [1] * n
    for _ in range(total - n):
        i = min(range(n), key=lambda d: ((shares[d] + 1) * slowness[d], d))
        shares[i] += 1
    return tuple(shares)


def rebalanced_step_s(s: Situation) -> float | None:
    """The step time with the slow replica's micro-batches moved to the others (the module
    doc), or None when a rebalance does not apply or would not help."""
    if s.dp < 2 or s.micro_batches < s.dp or not s.ratio > 1.0 or not s.excess_s > 0:
        return None
    even = s.micro_batches / s.dp
    t = s.excess_s / (even * (s.ratio - 1.0))
    shares = balanced_shares(s.micro_batches, [s.ratio] + [1.0] * (s.dp - 1))
    after = s.step_s + t * (max(shares[0] * s.ratio, max(shares[1:])) - even * s.ratio)
    return after if after < s.step_s else None


def regret_s(s: Situation, action: str, *, undo_steps: int = 0) -> float:
    """What `action` costs if the slow-down ends the moment it is taken: its seconds to finish
    on a healthy run less keep's (the module doc). A rebalance's split is undone when its
    incident closes: `undo_steps` steps split for a slowness that is gone."""
    healthy, left = s.healthy_s, max(0, s.steps_left)
    redo = max(0, s.redo_steps) * healthy
    if action == REPLACE:
        return s.restart_s + redo
    if action == SHRINK and s.nodes >= 2:
        return s.restart_s + redo * s.nodes / (s.nodes - 1) + left * healthy / (s.nodes - 1)
    if action == REBALANCE and s.dp >= 2 and s.micro_batches >= s.dp and s.ratio > 1.0 and s.excess_s > 0:
        even = s.micro_batches / s.dp
        t = s.excess_s / (even * (s.ratio - 1.0))  # a healthy micro-batch
        shares = balanced_shares(s.micro_batches, [s.ratio] + [1.0] * (s.dp - 1))
        return max(0, undo_steps) * t * (max(shares) - even)
    return 0.0


def predict(s: Situation, *, min_gain_share: float = 0.05) -> Prediction:
    """The seconds to finish under each candidate the run can take, and the one to take."""
    steps_left = max(0, s.steps_left)
    seconds = {KEEP: steps_left * s.step_s}
    after = (max(0, s.redo_steps) + steps_left) * s.healthy_s
    rebalanced = rebalanced_step_s(s)
    if rebalanced is not None:
        seconds[REBALANCE] = steps_left * rebalanced
    if s.spares > 0:
        seconds[REPLACE] = s.restart_s + after
    if s.nodes >= 2:
        seconds[SHRINK] = s.restart_s + after * s.nodes / (s.nodes - 1)
    best = min(seconds, key=lambda k: (seconds[k], k != KEEP))
    gain = seconds[KEEP] - seconds[best]
    if best != KEEP and gain < min_gain_share * seconds[KEEP]:
        best, gain = KEEP, 0.0
    return Prediction(best=best, seconds=seconds, gain_s=gain)
