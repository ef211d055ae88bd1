"""The intervals of `retrain compare`: Student t for a mean, Welch for a difference of
means, the t band of a learning curve. Hand-worked cases, scipy.stats as the reference,
edge cases and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.compare import stats

sp = pytest.importorskip("scipy.stats")

# t_{0.975, df} from the printed tables
T975 = {
    1: 12.7062,
    2: 4.3027,
    3: 3.1824,
    4: 2.7764,
    5: 2.5706,
    7: 2.3646,
    10: 2.2281,
    30: 2.0423,
    10**7: 1.95996,
}


# ---------------------------------------------------------------- the t quantile


@pytest.mark.parametrize("df, expected", sorted(T975.items()))
def test_t_quantile_matches_the_tables(df, expected):
    assert stats.t_quantile(0.95, df) == pytest.approx(expected, abs=6e-5)


def test_t_quantile_fractional_df_arrays_and_levels():
    for df in (1.3, 2.5, 4.41818, 7.9, 13.2, 250.5):
        for confidence in (0.5, 0.9, 0.95, 0.99):
            expected = sp.t.ppf(0.5 + confidence / 2, df)
            assert stats.t_quantile(confidence, df) == pytest.approx(expected, rel=1e-12)
    # Welch's df lies between whole numbers: the quantile falls between theirs
    assert T975[5] < stats.t_quantile(0.95, 4.5) < T975[4]
    q = stats.t_quantile(0.95, np.array([1, 2, 3]))
    assert isinstance(q, np.ndarray) and q == pytest.approx([T975[1], T975[2], T975[3]], abs=6e-5)
    assert math.isnan(stats.t_quantile(0.95, 0)) and math.isnan(stats.t_quantile(0.95, math.nan))
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="confidence"):
            stats.t_quantile(bad, 3)


# ---------------------------------------------------------------- the mean


def test_t_ci_hand_worked():
    # mean 2, s = 1, half-width t_{0.975,2} / sqrt(3) = 4.3027 / 1.7321 = 2.4841
    iv = stats.t_ci([1.0, 2.0, 3.0])
    assert iv.estimate == 2.0
    assert iv.low == pytest.approx(2 - 2.4841, abs=1e-4)
    assert iv.high == pytest.approx(2 + 2.4841, abs=1e-4)
    # two seeds: mean 0.5, s = sqrt(0.02) = 0.14142, half-width 12.7062 x 0.14142 / 1.4142
    iv = stats.t_ci([0.4, 0.6])
    assert (iv.low, iv.high) == pytest.approx((0.5 - 1.27062, 0.5 + 1.27062), abs=1e-5)
    # 0..9: mean 4.5, s = 3.02765, half-width 2.26216 x 3.02765 / 3.16228 = 2.16585
    iv = stats.t_ci(np.arange(10.0))
    assert (iv.low, iv.high) == pytest.approx((4.5 - 2.16585, 4.5 + 2.16585), abs=1e-5)


def test_t_ci_matches_scipy_on_random_inputs():
    rng = np.random.default_rng(20250101)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        x = rng.normal(rng.normal(0, 5), rng.uniform(0.01, 3), size=n)
        confidence = float(rng.choice([0.8, 0.9, 0.95, 0.99]))
        iv = stats.t_ci(x, confidence=confidence)
        low, high = sp.t.interval(confidence, n - 1, loc=x.mean(), scale=sp.sem(x))
        assert iv.estimate == pytest.approx(x.mean(), rel=1e-12, abs=1e-12)
        assert (iv.low, iv.high) == pytest.approx((low, high), rel=1e-9, abs=1e-12)


def test_t_ci_edge_cases():
    one = stats.t_ci([3.0])  # one seed: the mean, no interval
    assert one.estimate == 3.0 and math.isnan(one.low) and math.isnan(one.high)
    assert not one.contains(3.0)
    assert one.as_dict() == {"estimate": 3.0, "low": None, "high": None}
    assert stats.t_ci([0.25, 0.25, 0.25]) == stats.Interval(0.25, 0.25, 0.25)
    assert stats.t_ci([0.1, 0.1, 0.1]).low == stats.t_ci([0.1, 0.1, 0.1]).high
    empty = stats.t_ci([])
    assert all(math.isnan(v) for v in (empty.estimate, empty.low, empty.high))
    # non-finite values are dropped, as before
    assert stats.t_ci([1.0, math.nan, 2.0, math.inf, 3.0]) == stats.t_ci([1.0, 2.0, 3.0])
    assert stats.t_ci([math.nan, 5.0]).estimate == 5.0
    assert math.isnan(stats.t_ci([math.nan, math.nan]).estimate)


# ---------------------------------------------------------------- the difference


def test_welch_hand_worked_equal_sizes_and_spreads():
    # s1 = s2 = 1, n1 = n2 = 3: se = sqrt(2/3) = 0.81650, df = 4, t = 2.7764
    iv = stats.welch_ci([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert iv.estimate == -3.0
    assert (iv.low, iv.high) == pytest.approx((-3 - 2.26692, -3 + 2.26692), abs=1e-4)
    assert stats.welch_df(1.0, 3, 1.0, 3) == pytest.approx(4.0, rel=1e-15)


def test_welch_hand_worked_unequal():
    # a = [1, 2, 3]: mean 2, s^2 = 1; b = [4, 6, 5, 9]: mean 6, s^2 = 14/3
    # s^2/n: 1/3 and 7/6, sum 3/2; df = (3/2)^2 / ((1/3)^2 / 2 + (7/6)^2 / 3)
    #       = (9/4) / (1/18 + 49/108) = (9/4) / (55/108) = 243/55 = 4.41818
    assert stats.welch_df(1.0, 3, 14 / 3, 4) == pytest.approx(243 / 55, rel=1e-13)
    iv = stats.welch_ci([1.0, 2.0, 3.0], [4.0, 6.0, 5.0, 9.0])
    half = sp.t.ppf(0.975, 243 / 55) * math.sqrt(1.5)
    assert iv.estimate == -4.0
    assert (iv.low, iv.high) == pytest.approx((-4 - half, -4 + half), rel=1e-12)
    # df 4.418 sits between the table's 4 and 5
    assert T975[5] * math.sqrt(1.5) < half < T975[4] * math.sqrt(1.5)


def test_welch_df_bounds():
    # between min(n) - 1 and n1 + n2 - 2: a side's n - 1 when all the variance is on that
    # side, n1 + n2 - 2 when s1^2/n1 : s2^2/n2 = (n1 - 1) : (n2 - 1)
    assert stats.welch_df(1.0, 3, 0.0, 8) == pytest.approx(2.0)
    assert stats.welch_df(0.0, 3, 1.0, 8) == pytest.approx(7.0)
    assert stats.welch_df(6.0, 3, 56.0, 8) == pytest.approx(9.0)
    # equal s^2/n: (1 + 1)^2 / (1/2 + 1/7) = 56/9
    assert stats.welch_df(3.0, 3, 8.0, 8) == pytest.approx(56 / 9)
    assert stats.welch_df(3e-300, 3, 8e-300, 8) == pytest.approx(56 / 9)  # no underflow
    rng = np.random.default_rng(5)
    for _ in range(100):
        na, nb = (int(v) for v in rng.integers(2, 10, size=2))
        df = stats.welch_df(rng.uniform(0, 2), na, rng.uniform(0, 2), nb)
        assert min(na, nb) - 1 - 1e-9 <= df <= na + nb - 2 + 1e-9


def test_welch_matches_scipy_on_random_inputs():
    rng = np.random.default_rng(7)
    for _ in range(200):
        na, nb = (int(v) for v in rng.integers(2, 10, size=2))
        a = rng.normal(rng.normal(0, 1), rng.uniform(0.01, 2), size=na)
        b = rng.normal(rng.normal(0, 1), rng.uniform(0.01, 2), size=nb)
        confidence = float(rng.choice([0.9, 0.95, 0.99]))
        iv = stats.welch_ci(a, b, confidence=confidence)
        ref = sp.ttest_ind(a, b, equal_var=False).confidence_interval(confidence)
        assert iv.estimate == pytest.approx(a.mean() - b.mean(), rel=1e-12, abs=1e-12)
        assert (iv.low, iv.high) == pytest.approx((ref.low, ref.high), rel=1e-9, abs=1e-12)


def test_welch_edge_cases():
    for a, b in (([2.0], [0.5, 0.7, 0.6]), ([0.4, 0.6], [0.5]), ([2.0], [0.5])):
        iv = stats.welch_ci(a, b)  # a side with one seed: its spread is unknown
        assert iv.estimate == pytest.approx(np.mean(a) - np.mean(b))
        assert math.isnan(iv.low) and math.isnan(iv.high)
    assert stats.welch_ci([0.5, 0.5], [0.25, 0.25, 0.25]) == stats.Interval(0.25, 0.25, 0.25)
    # one side constant: the other's spread alone, with its n - 1 degrees of freedom
    iv = stats.welch_ci([1.0, 2.0, 3.0], [0.0, 0.0])
    assert (iv.low, iv.high) == pytest.approx((2 - 2.4841, 2 + 2.4841), abs=1e-4)
    for a, b in (([], [1.0, 2.0]), ([1.0, 2.0], []), ([math.nan], [1.0, 2.0])):
        iv = stats.welch_ci(a, b)
        assert all(math.isnan(v) for v in (iv.estimate, iv.low, iv.high))
    assert stats.welch_ci([1.0, math.nan, 2.0, 3.0], [4.0, -math.inf, 5.0, 6.0]) == (
        stats.welch_ci([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    )
    same = stats.welch_ci([0.3, 0.5, 0.4], [0.3, 0.5, 0.4])
    assert same.estimate == 0.0 and same.contains(0.0) and same.low == -same.high


# ---------------------------------------------------------------- the curve band


def test_curve_band_is_the_t_interval_at_each_step():
    nan = math.nan
    grid = np.array(
        [
            [1.0, 2.0, nan, 4.0, 0.5],
            [3.0, 2.0, nan, nan, 0.7],
            [2.0, 2.0, 1.0, nan, 0.3],
            [nan, 2.0, nan, nan, 0.4],
        ]
    )
    mean, low, high, k = stats.curve_band(grid)
    assert k.tolist() == [3, 4, 1, 1, 4]
    assert mean[:4].tolist() == [2.0, 2.0, 1.0, 4.0]
    # step 0: [1, 3, 2] is the hand-worked [1, 2, 3]
    assert (low[0], high[0]) == pytest.approx((2 - 2.4841, 2 + 2.4841), abs=1e-4)
    assert low[1] == high[1] == 2.0  # all seeds agree: zero width
    assert np.isnan(low[2:4]).all() and np.isnan(high[2:4]).all()  # one seed: no band
    for j in range(grid.shape[1]):
        iv = stats.t_ci(grid[:, j])
        assert mean[j] == pytest.approx(iv.estimate)
        assert (low[j], high[j]) == pytest.approx((iv.low, iv.high), nan_ok=True)


def test_curve_band_shapes():
    mean, low, high, k = stats.curve_band(np.full((3, 2), math.nan))
    assert np.isnan(mean).all() and np.isnan(low).all() and k.tolist() == [0, 0]
    mean, low, high, k = stats.curve_band(np.zeros((0, 0)))
    assert mean.size == low.size == high.size == k.size == 0
    mean, low, high, k = stats.curve_band(np.array([[1.0, 2.0, 3.0]]))  # one seed
    assert mean.tolist() == [1.0, 2.0, 3.0] and np.isnan(low).all() and np.isnan(high).all()
    with pytest.raises(ValueError, match="2-D"):
        stats.curve_band(np.zeros(3))


def test_curve_band_matches_scipy():
    rng = np.random.default_rng(11)
    grid = rng.normal(0.5, 0.1, size=(6, 30))
    grid[rng.uniform(size=grid.shape) < 0.3] = math.nan  # seeds missing some steps
    mean, low, high, k = stats.curve_band(grid, confidence=0.9)
    for j in range(grid.shape[1]):
        col = grid[:, j][np.isfinite(grid[:, j])]
        assert k[j] == col.size
        if col.size >= 2:
            ref = sp.t.interval(0.9, col.size - 1, loc=col.mean(), scale=sp.sem(col))
            assert (low[j], high[j]) == pytest.approx(ref, rel=1e-10)


# ---------------------------------------------------------------- properties

samples = st.lists(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=2, max_size=12
)


@settings(max_examples=80)
@given(samples)
def test_t_ci_contains_the_mean_and_widens_with_confidence(x):
    ivs = [stats.t_ci(x, confidence=c) for c in (0.5, 0.8, 0.95, 0.99)]
    for iv in ivs:
        assert iv.low <= iv.estimate <= iv.high
    widths = [iv.high - iv.low for iv in ivs]
    assert widths == sorted(widths)


@settings(max_examples=80)
@given(samples, samples)
def test_welch_ci_contains_the_difference_and_widens_with_confidence(a, b):
    ivs = [stats.welch_ci(a, b, confidence=c) for c in (0.5, 0.8, 0.95, 0.99)]
    for iv in ivs:
        assert iv.low <= iv.estimate <= iv.high
    widths = [iv.high - iv.low for iv in ivs]
    assert widths == sorted(widths)


@settings(max_examples=60)
@given(samples, st.integers(min_value=2, max_value=4))
def test_fewer_seeds_with_the_same_spread_give_a_wider_interval(x, copies):
    # the same values repeated: same mean, nearly the same s, more seeds: narrower
    small, large = stats.t_ci(x), stats.t_ci(x * copies)
    assert large.estimate == pytest.approx(small.estimate, rel=1e-9, abs=1e-9)
    assert large.high - large.low <= small.high - small.low
