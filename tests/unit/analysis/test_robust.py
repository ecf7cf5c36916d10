"""Robust statistics: leave-one-out medians, trend-following baselines."""

import numpy as np

from analysis.robust import RollingBaseline, RollingBaselines, loo_median, median_of, popcount, row_medians


def test_row_medians_and_median_of_match_numpy():
    rng = np.random.default_rng(1)
    for _ in range(50):
        m = rng.normal(size=(int(rng.integers(1, 40)), int(rng.integers(1, 33))))
        m[rng.random(m.shape) < 0.3] = np.nan
        least = int(rng.integers(1, 6))
        got = row_medians(m, least)
        for row, g in zip(m, got):
            finite = row[np.isfinite(row)]
            if len(finite) >= least:
                assert np.isclose(g, np.median(finite))
                assert np.isclose(median_of(list(finite)), np.median(finite))
            else:
                assert np.isnan(g)
    assert median_of([]) is None and median_of([1.0, 2.0], least=3) is None
    assert np.isnan(median_of([1.0, float("nan"), 3.0]))


def test_loo_median_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        values = rng.normal(size=n)
        groups = rng.integers(0, 3, n)
        got, peers = loo_median(values, groups)
        for i in range(n):
            others = values[(groups == groups[i]) & (np.arange(n) != i)]
            assert peers[i] == len(others)
            if len(others):
                assert np.isclose(got[i], np.median(others))
            else:
                assert np.isnan(got[i])


def test_loo_median_is_exact_with_ties_nan_and_one_group_or_many():
    """Equal values (which an unstable sort may put either way round), NaN and one group or
    several: each element's answer is the median of its group's others, to the bit."""
    rng = np.random.default_rng(3)
    for trial in range(600):
        n = int(rng.integers(0, 6)) if trial % 10 == 9 else int(rng.integers(3, 40))
        values = np.round(rng.normal(size=n), 1)
        if trial % 3 == 0:
            values[rng.random(n) < 0.1] = np.nan
        # one group (given, or None), several, or every element alone (a pp1 job's pipelines)
        groups = [np.zeros(n, np.int64), rng.integers(0, 4, n), np.arange(n)[::-1].copy(), None][trial % 4]
        got, peers = loo_median(values, groups)
        if groups is None:
            groups = np.zeros(n, np.int64)
        for i in range(n):
            others = values[(groups == groups[i]) & (np.arange(n) != i)]
            assert peers[i] == len(others)
            want = np.sort(others)  # NaN last, as the sort inside
            k = len(want)
            if not k:
                assert np.isnan(got[i])
            else:
                expect = 0.5 * (want[(k - 1) // 2] + want[k // 2])
                assert got[i] == expect or (np.isnan(got[i]) and np.isnan(expect)), (trial, i)


def test_level_follows_a_descent_and_noise_ignores_the_trend():
    b = RollingBaseline(50)
    rng = np.random.default_rng(1)
    for i in range(50):
        b.add(np.log(8.0 * np.exp(-i / 30)) + rng.normal(0, 0.01))
    level, noise = b.level_scale(10)
    med, mad = b.median_scale()
    assert abs(level - np.log(8.0 * np.exp(-45 / 30))) < 0.05  # near the newest values
    assert noise < 0.03 < mad  # the window's MAD is inflated by the descent, differences are not


def test_many_baselines_and_popcount():
    m = RollingBaselines(2, 4)
    m.add(np.array([0, 1, 3]), np.array([1.0, 2.0, 3.0]))  # grows to 4 series
    assert m.count(np.array([0, 1, 2, 3])).tolist() == [1, 1, 0, 1]
    med, _ = m.median_scale(np.array([3]))
    assert med[0] == 3.0
    assert popcount(np.array([0, 1, 7, 255])).tolist() == [0, 1, 3, 8]


def test_median1_is_numpys_median_of_a_step_s_few_values():
    """The detectors' per-step median: the very value of np.median, NaN included."""
    from analysis.robust import median1

    rng = np.random.default_rng(3)
    for _ in range(400):
        v = rng.normal(size=int(rng.integers(1, 10)))
        if rng.random() < 0.3:
            v[rng.random(len(v)) < 0.3] = rng.choice([np.nan, np.inf, -np.inf])
        if rng.random() < 0.3:
            v = np.round(v)  # ties
        want = float(np.median(v))
        got = median1(v)
        assert (np.isnan(got) and np.isnan(want)) or got == want, (v, got, want)
    assert np.isnan(median1(np.zeros(0)))


def test_loo_median_of_a_pair_is_each_the_other_and_of_one_nothing():
    """The shortcut a dp2 job takes on every call: two members of one group are each other's
    median, exactly; one alone has none; two of different groups neither."""
    for a, b in ((3.0, 1.5), (np.nan, 2.0), (np.inf, -1.0), (7, 7)):
        got, peers = loo_median(np.array([a, b]), np.zeros(2, np.int64))
        assert got.dtype == float and peers.tolist() == [1, 1]
        assert np.array_equal(got, [b, a], equal_nan=True)
    got, peers = loo_median(np.array([1.0]), np.zeros(1, np.int64))
    assert np.isnan(got).all() and peers.tolist() == [0]
    got, peers = loo_median(np.array([1.0, 2.0]), np.array([0, 1]))
    assert np.isnan(got).all() and peers.tolist() == [0, 0]
    got, peers = loo_median(np.zeros(0), np.zeros(0, np.int64))
    assert len(got) == 0 and len(peers) == 0


def test_median_of_a_long_window_is_numpys_median():
    """A window past 32 values takes numpy's sort: the same value, NaN when one is NaN."""
    from collections import deque

    rng = np.random.default_rng(5)
    for n in (33, 100, 256):
        window = deque(rng.normal(size=n).tolist(), maxlen=n)
        assert median_of(window) == float(np.median(np.array(window)))
        window.append(float("nan"))
        assert np.isnan(median_of(window))
    assert median_of(deque(range(40))) == 19.5  # ints too
