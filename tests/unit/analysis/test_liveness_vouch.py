"""`Liveness.vouched_for`: a silent rank is alive when a rank still beating reported, after
the silent rank's last heartbeat, a step two past its newest. Checked against the rule
written as the silent x fresh matrix it used to be, on random states with ties."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.liveness import MAX_INTERVAL_S, Liveness


def by_the_rule(live: Liveness, silent: np.ndarray, alive: np.ndarray, now: float, within_s) -> np.ndarray:
    """`within_s`: one time, or each vouching rank's own (its heartbeat cadence's)."""
    out = np.zeros(len(live.arrival_s), bool)
    within = np.broadcast_to(within_s, out.shape)
    for i in np.flatnonzero(silent):
        known = max(live.last_step[i], live.hb_step[i])
        out[i] = any(alive[j] and now - live.last_step_s[j] < within[j] and live.last_step[j] >= known + 2
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
    # each rank's own time (the crash detector's: silence_beats of the rank's declared heartbeat interval)
    live.interval_s[:] = np.where(rng.random(n) < 0.5, rng.choice([1.0, 2.0, 4.0], n), np.nan)
    within = live.quiet_after(3.0, 3.0)
    assert within.tolist() == [max(3.0, 3.0 * i) if np.isfinite(i) else 3.0 for i in live.interval_s]
    got = live.vouched_for(silent, alive, 12.0, within)
    assert got.tolist() == by_the_rule(live, silent, alive, 12.0, within).tolist()


def test_a_heartbeat_says_its_interval_and_one_that_does_not_keeps_what_was_said():
    from analysis.frames import heartbeats_frame

    def beat(rank, ts, interval):
        return {"run_id": "r", "rank": rank, "ts": ts, "node": "n", "pid": 1, "phase": "train", "step": 1,
                "last_seq": int(ts), "interval_s": interval}
    live = Liveness()
    live.update_heartbeats(heartbeats_frame([beat(0, 1.0, 30.0), beat(1, 1.0, None), beat(2, 1.0, 0.5)]), now=1.0)
    assert np.isnan(live.interval_s[1]) and live.interval_s[[0, 2]].tolist() == [30.0, 0.5]
    assert live.quiet_after(3.0, 3.0).tolist() == [90.0, 3.0, 3.0]  # a short beat: the rules' time
    # an older agent's heartbeat (NULL) after a newer one's: the interval stays; a new one replaces it
    live.update_heartbeats(heartbeats_frame([beat(0, 2.0, None), beat(2, 2.0, 10.0)]), now=2.0)
    assert live.interval_s[[0, 2]].tolist() == [30.0, 10.0]
    # an interval past any real cadence (a broken or hostile agent) cannot hide a rank's silence for days
    live.update_heartbeats(heartbeats_frame([beat(1, 3.0, 1e9), beat(2, 3.0, float("inf"))]), now=3.0)
    assert live.interval_s[[1, 2]].tolist() == [MAX_INTERVAL_S, 10.0]


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
