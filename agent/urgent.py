"""Which step records a detector must see now: the agent's urgent-flush test.

The agent flushes about once a second (DESIGN.md section 6) and at once for a
step a detector must see without waiting: a non-finite loss or grad norm, a
finite flag 0 (NaN origin), a skipped optimizer step, a loss-scale backoff, or a
loss far above the rank's own running baseline (a spike). The test runs on the
training thread after every `record_step` (inlined there, agent/ring.py: a
call would cost as much as the comparisons), so it is comparisons only: no
numpy, no allocation, no lock, no clock. The baseline, the one part with state
and float work (~0.3 us a loss), learns on the flusher thread from the losses
it drains and publishes a threshold (`LossBaseline.threshold`); the training
thread compares each loss with it. The threshold is at most one flush old,
which a baseline that moves over dozens of steps does not notice.

The baseline is an exponentially weighted mean of log(loss); its scale an EWMA
of the step-to-step change of log(loss), which a steadily falling curve keeps
small (a deviation from the mean would grow with the trend's lag instead).
Robust enough: an outlier updates both only up to the bound it crossed, so one
spike neither drags the mean nor inflates the scale, and a lasting shift is
learned within a few dozen steps. The first `warmup` losses only teach it
(plain running means), since a fresh run's loss falls fast. It is a cheap
trigger for a flush, not a detector: a false alarm costs one early flush (and
those are rate-limited by the agent).
"""

from __future__ import annotations

import math

_INF = math.inf
_log = math.log


class LossBaseline:
    """Running baseline of log(loss); `far(loss)` says whether `loss` is off it."""

    __slots__ = ("alpha", "warmup", "k", "floor", "n", "mean", "scale", "last")

    def __init__(self, *, alpha: float = 0.1, warmup: int = 20, k: float = 8.0, floor: float = 0.02) -> None:
        if not 0.0 < alpha <= 1.0 or warmup < 1 or k <= 0.0 or floor <= 0.0:
            raise ValueError("need 0 < alpha <= 1, warmup >= 1, k > 0, floor > 0")
        self.alpha = alpha  # EWMA weight after the warm-up
        self.warmup = warmup  # losses seen before any is judged
        self.k = k  # "far": more than k scales off the mean, in log space
        self.floor = floor  # least scale (log units: 0.02 ~ 2 %), so a flat curve does not make noise far
        self.n = 0
        self.mean = 0.0  # of log(loss)
        self.scale = 0.0  # of |change of log(loss) from one step to the next|
        self.last = 0.0  # the previous log(loss), as learned (an outlier clipped)

    @property
    def bound(self) -> float:
        return self.k * (self.scale if self.scale > self.floor else self.floor)

    def threshold(self) -> float:
        """The loss above which the next one is far: exp(mean + bound); inf while warming up."""
        if self.n <= self.warmup:
            return _INF
        return math.exp(self.mean + self.bound)

    def far(self, loss: float) -> bool:
        """Take one loss; True when it is far above the baseline (after the warm-up).
        Only upward: a spike is what a detector must see now, and a loss below the
        baseline is what a falling curve's every step looks like to a lagging mean.
        A loss that is not a positive finite number is ignored (False): the agent
        flushes for non-finite ones anyway, and log() has nothing to say of 0."""
        if not 0.0 < loss < _INF:
            return False
        x = _log(loss)
        n = self.n = self.n + 1
        mean, scale = self.mean, self.scale
        if n > self.warmup:
            a = self.alpha
            bound = self.k * (scale if scale > self.floor else self.floor)
            far = x - mean > bound
            if far:  # a spike: learn from it only up to the bound
                x = mean + bound
        elif n == 1:
            self.mean = self.last = x
            return False
        else:
            a = 1.0 / n
            far = False
        step = x - self.last
        self.mean = mean + a * (x - mean)
        self.scale = scale + a * ((step if step >= 0.0 else -step) - scale)
        self.last = x
        return far
