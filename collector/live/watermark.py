"""What the collector tells the ranks is known-good: the analysis' clean-through
watermark (analysis/watermark.py), lowered for the incidents its policy has not
settled yet.

An incident that taints the weights (a NaN, a spike, a replica divergence) can
close in the analysis before the policy has acted on it (a spike closes once the
loss is back; the policy may be holding its rollback for the cooldown). Until the
policy has settled it, the watermark stays below its first step:

- `hold(run_id, key, step)`: the detection runner, when such an incident opens;
- `release(run_id, key)`: the policy runner, once it decided to do nothing (shadow,
  refused, alert only), or once the action it took ended (done, failed, or the
  run finished first);
- without a policy runner nothing is held: the analysis alone decides.

`get(run_id)` is what an ingest answer carries (`clean_through`: the attempt it is
for, the known-good step, and `judged`, the step every detector has judged with
nothing unsettled, which a finished run waits for), read on the event loop: a dict
lookup under a lock, no I/O. `end_wait_s` (the rules' `policy.end_of_run_wait_s`
when the policy acts, else 0: nothing would come of the wait) goes with it.
"""

from __future__ import annotations

import threading
from typing import Any


class Watermarks:
    def __init__(self, *, hold_for_policy: bool, end_wait_s: float = 0.0) -> None:
        self.hold_for_policy = hold_for_policy
        self.end_wait_s = end_wait_s
        self._lock = threading.Lock()
        self._marks: dict[str, tuple[int, int, int]] = {}  # run -> (attempt, step, judged) from the analysis
        self._holds: dict[str, dict[str, int]] = {}  # run -> incident key -> its first step

    def set(self, run_id: str, mark: tuple[int, int, int] | None) -> None:
        with self._lock:
            if mark is None:
                self._marks.pop(run_id, None)
            else:
                self._marks[run_id] = mark

    def hold(self, run_id: str, key: str, step: int | None) -> None:
        if not self.hold_for_policy or step is None:
            return
        with self._lock:
            self._holds.setdefault(run_id, {}).setdefault(key, int(step))

    def release(self, run_id: str, key: str | None) -> None:
        if key is None:
            return
        with self._lock:
            held = self._holds.get(run_id)
            if held is not None:
                held.pop(key, None)
                if not held:
                    del self._holds[run_id]

    def release_run(self, run_id: str) -> None:
        with self._lock:
            self._holds.pop(run_id, None)

    def forget(self, run_id: str) -> None:
        """The analysis of the run starts over (a gap, an idle run): its watermark is unknown
        until the next pass. The holds stay: the policy still owes their incidents an end."""
        with self._lock:
            self._marks.pop(run_id, None)

    def held(self, run_id: str) -> dict[str, int]:
        with self._lock:
            return dict(self._holds.get(run_id, {}))

    def get(self, run_id: str) -> dict[str, Any] | None:
        """{"attempt", "step", "judged"}: every step of that attempt up to `step` is known-good,
        and up to `judged` judged with nothing unsettled; None: unknown."""
        with self._lock:
            mark = self._marks.get(run_id)
            if mark is None:
                return None
            attempt, step, judged = mark
            held = self._holds.get(run_id)
            if held:
                first = min(held.values()) - 1
                step, judged = min(step, first), min(judged, first)
        return {"attempt": attempt, "step": step, "judged": judged} if step >= 0 else None
