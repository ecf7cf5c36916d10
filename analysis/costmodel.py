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

    keep     steps_left x step_s                                   (alert only)
    replace  restart_s + (redo_steps + steps_left) x healthy_s      (a spare takes the node's place)
    shrink   restart_s + (redo_steps + steps_left) x healthy_s x nodes / (nodes - 1)

where `healthy_s = step_s - excess_s` is the step without the slow-down, and the
nodes left share the departed node's work with the global batch kept (each
replica's compute grows by nodes / (nodes - 1); the communication per step is
taken as unchanged). `restart_s` is this run's measured restart cost when one has
happened (the actions' recovery_s), else the rules' prior. `redo_steps` are the
steps since the newest checkpoint, which a restart runs again. A run without a
known end is judged over `horizon_steps`. Replace needs a spare. Rebalancing
micro-batches in place (no restart) and rollback and stop do not apply to a
slow-down; they are not candidates here.

The policy takes the cheapest candidate when it beats keep by `min_gain_share` of
keep's time (a prediction is an estimate: a bare win on noisy inputs is not worth a
restart); `Prediction.gain_s` is what it expects to save.
"""

from __future__ import annotations

from dataclasses import dataclass

KEEP, REPLACE, SHRINK = "keep", "replace", "shrink"


@dataclass(frozen=True, slots=True)
class Situation:
    steps_left: int  # steps the run has left (or the horizon, when its end is not known)
    step_s: float  # the step time now, slow-down included
    excess_s: float  # what the slow-down costs each step
    nodes: int  # healthy nodes now (the slow one among them)
    restart_s: float  # what a restart costs (measured on this run, or the prior)
    redo_steps: int = 0  # steps since the newest checkpoint: a restart runs them again
    spares: int = 0  # standby nodes that can take a node's place

    @property
    def healthy_s(self) -> float:
        return max(0.0, self.step_s - max(0.0, self.excess_s))


@dataclass(frozen=True, slots=True)
class Prediction:
    best: str  # keep | replace | shrink
    seconds: dict[str, float]  # candidate -> predicted seconds to finish
    gain_s: float  # keep's seconds less the best's (0 when keeping)

    def detail(self, situation: Situation) -> dict:
        """What an action's detail records: the candidates, the expected gain, the inputs."""
        return {"best": self.best, "gain_s": round(self.gain_s, 3),
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "inputs": {"steps_left": situation.steps_left, "step_s": round(situation.step_s, 6),
                           "excess_s": round(situation.excess_s, 6), "nodes": situation.nodes,
                           "restart_s": round(situation.restart_s, 3), "redo_steps": situation.redo_steps,
                           "spares": situation.spares}}


def predict(s: Situation, *, min_gain_share: float = 0.05) -> Prediction:
    """The seconds to finish under each candidate the run can take, and the one to take."""
    steps_left = max(0, s.steps_left)
    seconds = {KEEP: steps_left * s.step_s}
    after = (max(0, s.redo_steps) + steps_left) * s.healthy_s
    if s.spares > 0:
        seconds[REPLACE] = s.restart_s + after
    if s.nodes >= 2:
        seconds[SHRINK] = s.restart_s + after * s.nodes / (s.nodes - 1)
    best = min(seconds, key=lambda k: (seconds[k], k != KEEP))
    gain = seconds[KEEP] - seconds[best]
    if best != KEEP and gain < min_gain_share * seconds[KEEP]:
        best, gain = KEEP, 0.0
    return Prediction(best=best, seconds=seconds, gain_s=gain)
