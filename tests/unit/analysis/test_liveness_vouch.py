"""`Liveness.vouched_for`: a silent rank is alive when a rank still beating reported, after
the silent rank's last heartbeat, a step two past its newest. Checked against the rule
written as the silent x fresh matrix it used to be, on random states with ties."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.liveness import Liveness


def by_the_rule(live: Liveness, silent: np.ndarray, alive: np.ndarray, now: float, within_s: float) -> np.ndarray:
    out = np.zeros(len(live.arrival_s), bool)
    for i in np.flatnonzero(silent):
        known = max(live.last_step[i], live.hb_step[i])
        out[i] = any(alive[j] and now - live.last_step_s[j] < within_s and live.last_step[j] >= known + 2
                     and live.last_step_s[j] > live.arrival_s[i] for j in range(len(out)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_vouched_for_is_the_rule_on_random_states(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    live = Liveness()
    live.ensure(n)
    live.arrival_s[:] = rng.integers(0, 10, n).astype(float)  # whole seconds: ties with the steps' times
    live.arrival_s[rng.random(n) < 0.1] = np.nan  # no heartbeat yet
    live.last_step[:] = rng.integers(-1, 8, n)
    live.last_step_s[:] = np.where(live.last_step >= 0, rng.integers(0, 12, n).astype(float), np.nan)
    live.hb_step[:] = rng.integers(-1, 8, n)
    silent, alive = rng.random(n) < 0.5, rng.random(n) < 0.6
    got = live.vouched_for(silent, alive, 12.0, 6.0)
    assert got.tolist() == by_the_rule(live, silent, alive, 12.0, 6.0).tolist()


def test_a_peer_two_steps_ahead_after_the_silence_vouches_and_one_before_it_does_not():
    live = Liveness()
    live.ensure(3)
    live.arrival_s[:] = [100.0, 100.0, 100.0]
    live.last_step[:] = [10, 12, 12]
    live.hb_step[:] = [10, 12, 12]
    silent, alive = np.array([True, False, False]), np.array([False, True, True])
    live.last_step_s[:] = [99.0, 100.0, 99.5]  # step 12 reported when rank 0 last beat: no proof
    assert not live.vouched_for(silent, alive, 101.0, 10.0)[0]
    live.last_step_s[1] = 100.5  # after it: rank 0 lived through step 11
    assert live.vouched_for(silent, alive, 101.0, 10.0).tolist() == [True, False, False]
    live.last_step[1] = 11  # one step ahead only
    assert not live.vouched_for(silent, alive, 101.0, 10.0)[0]


def test_a_hundred_thousand_silent_ranks_are_vouched_for_without_a_matrix():
    n = 100_000
    live = Liveness()
    live.ensure(n)
    live.arrival_s[:] = 50.0
    live.last_step[:] = 10
    live.hb_step[:] = 10
    live.last_step_s[:] = 55.0
    live.last_step[::2] = 12  # the even ranks reported step 12 after the odd ones went quiet
    silent = np.zeros(n, bool)
    silent[1::2] = True
    got = live.vouched_for(silent, ~silent, 56.0, 30.0)  # 50,000 x 50,000 booleans before: 2.5 GB
    assert got[1::2].all() and not got[::2].any()
