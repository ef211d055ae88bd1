"""The statistics of `retrain compare`, through scipy.stats.

Seeds are the replicates: every function here takes one value per run. The confidence
interval of a mean is the Student t interval, mean +- t_{0.975, n-1} * s / sqrt(n); that
of a difference of two conditions' means is Welch's t interval (unpaired seeds, unequal
variances, Welch-Satterthwaite degrees of freedom); the learning-curve band is the t
interval at each step over the seeds that have it. They assume roughly normal per-seed
values and hold their level at 2-8 seeds, where a percentile bootstrap covers far less
(about 48% of the time at 2 seeds, 75% at 3, 85% at 8 for a nominal 95%). Tests of a
difference of means are two-sided permutation tests (`scipy.stats.permutation_test`),
pooled correct counts get Fisher's exact test (`scipy.stats.fisher_exact`), and Holm's
step-down correction adjusts a family of p-values.

Every Monte Carlo permutation test draws from a generator seeded by (seed, label), so a
number does not depend on what else was computed before it. scipy is imported on use:
`retrain --help` and `retrain status` work without it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrain.errors import RetrainError

DEFAULT_RESAMPLES = 10_000
# Permutation tests enumerate every relabelling when there are at most this many.
EXACT_PERMUTATION_LIMIT = 100_000
SCIPY_HINT = "pip install 'retrain[plots]' (scipy for the statistics, matplotlib for the plots)"


def scipy_stats() -> Any:
    """scipy.stats, or a RetrainError saying what to install."""
    try:
        import scipy.stats
    except ImportError as exc:
        raise RetrainError(f"retrain compare needs scipy: {SCIPY_HINT}") from exc
    return scipy.stats


def json_float(value: float | None) -> float | None:
    """A float for JSON: NaN and infinities (and None) become None."""
    return float(value) if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class Interval:
    """An estimate with its confidence interval (NaN when there is no data)."""

    estimate: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def as_dict(self) -> dict[str, float | None]:
        return {
            "estimate": json_float(self.estimate),
            "low": json_float(self.low),
            "high": json_float(self.high),
        }


NAN_INTERVAL = Interval(math.nan, math.nan, math.nan)


def _rng(seed: int, label: str) -> np.random.Generator:
    """A generator that depends only on (seed, label), never on call order."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(label.encode())])


def _as_array(values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(values), dtype=np.float64).reshape(-1)
    return arr[np.isfinite(arr)]


def _check_confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence!r}")
    return float(confidence)


def t_quantile(confidence: float, df: float | np.ndarray) -> float | np.ndarray:
    """The two-sided Student t critical value t_{(1 + confidence) / 2, df}: 4.303 for a
    95% interval with df = 2, 2.262 with df = 9, 1.960 as df grows. `df` may be
    fractional (Welch) or an array; df <= 0 or NaN gives NaN."""
    level = 0.5 + _check_confidence(confidence) / 2
    with np.errstate(invalid="ignore"):
        q = scipy_stats().t.ppf(level, np.where(np.asarray(df, dtype=np.float64) > 0, df, np.nan))
    return float(q) if np.ndim(q) == 0 else np.asarray(q, dtype=np.float64)


def t_ci(values: Iterable[float], *, confidence: float = 0.95) -> Interval:
    """Student t confidence interval of the mean of the finite values:
    mean +- t_{(1 + confidence) / 2, n - 1} * s / sqrt(n), s the sample standard deviation
    (ddof = 1). One value: the mean with no interval (NaN bounds); values all equal: the
    zero-width [mean, mean]; none: NAN_INTERVAL. Non-finite values are dropped."""
    x = _as_array(values)
    if x.size == 0:
        return NAN_INTERVAL
    mean = float(x.mean())
    if x.size == 1:
        return Interval(mean, math.nan, math.nan)
    if np.ptp(x) == 0:
        return Interval(mean, mean, mean)
    half = float(t_quantile(confidence, x.size - 1)) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half)


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """Welch-Satterthwaite degrees of freedom of mean(a) - mean(b), from the sample
    variances (ddof = 1) and sizes (each >= 2; not both variances 0):
    (va/na + vb/nb)^2 / ((va/na)^2 / (na - 1) + (vb/nb)^2 / (nb - 1))."""
    wa, wb = var_a / n_a, var_b / n_b
    scale = max(wa, wb)  # the ratio is scale-free; dividing first keeps the squares finite
    wa, wb = wa / scale, wb / scale
    return (wa + wb) ** 2 / (wa**2 / (n_a - 1) + wb**2 / (n_b - 1))


def welch_ci(
    treatment: Iterable[float], baseline: Iterable[float], *, confidence: float = 0.95
) -> Interval:
    """Welch's t confidence interval of d = mean(treatment) - mean(baseline), the two
    samples independent (unpaired seeds) with possibly unequal variances:
    d +- t_{(1 + confidence) / 2, df} * sqrt(sa^2 / na + sb^2 / nb), df from `welch_df`.
    A side with one value: d with no interval (NaN bounds; its variance is unknown); both
    sides constant: the zero-width [d, d]; a side empty: NAN_INTERVAL. Non-finite values
    are dropped."""
    a = _as_array(treatment)
    b = _as_array(baseline)
    if a.size == 0 or b.size == 0:
        return NAN_INTERVAL
    diff = float(a.mean() - b.mean())
    if a.size == 1 or b.size == 1:
        return Interval(diff, math.nan, math.nan)
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return Interval(diff, diff, diff)
    var_a, var_b = float(a.var(ddof=1)), float(b.var(ddof=1))
    se = math.sqrt(var_a / a.size + var_b / b.size)
    if se == 0:  # spreads too small for a float's square
        return Interval(diff, diff, diff)
    half = float(t_quantile(confidence, welch_df(var_a, a.size, var_b, b.size))) * se
    return Interval(diff, diff - half, diff + half)


def curve_band(
    grid: np.ndarray, *, confidence: float = 0.95
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per column of `grid` (rows: seeds, columns: steps, NaN: no value), the mean over
    the k seeds that have a value and its t interval, mean +- t_{(1 + confidence) / 2, k - 1}
    * s / sqrt(k), as `t_ci` computes it: (mean, low, high, k). Where k < 2 there is no
    band (NaN low and high); where the values are all equal, low = high = mean."""
    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 2:
        raise ValueError(f"curve_band needs a 2-D grid (seeds x steps), got shape {grid.shape}")
    grid = np.where(np.isfinite(grid), grid, np.nan)
    k = np.sum(np.isfinite(grid), axis=0)
    mean = np.full(grid.shape[1], np.nan)
    some, several = k >= 1, k >= 2
    if some.any():
        mean[some] = np.nanmean(grid[:, some], axis=0)
    half = np.full(grid.shape[1], np.nan)
    if several.any():
        cols = grid[:, several]
        spread = np.nanmax(cols, axis=0) - np.nanmin(cols, axis=0)
        sd = np.where(spread == 0, 0.0, np.nanstd(cols, axis=0, ddof=1))
        half[several] = t_quantile(confidence, k[several] - 1) * sd / np.sqrt(k[several])
    return mean, mean - half, mean + half, k


def _abs_mean_difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.abs(np.mean(x, axis=axis) - np.mean(y, axis=axis))


def _one_against_many(single: np.ndarray, others: np.ndarray) -> float:
    """The exact permutation p-value when one group holds a single value (scipy wants two
    or more per group): the relabellings put each pooled value alone in turn."""
    pooled = np.concatenate([others, single])
    stats = np.abs(pooled - (pooled.sum() - pooled) / others.size)
    observed = stats[-1]
    return float(np.mean(stats >= observed - 100 * np.finfo(float).eps * observed))


def permutation_test(
    treatment: Iterable[float],
    baseline: Iterable[float],
    *,
    n_permutations: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    label: str = "",
) -> float:
    """Two-sided permutation p-value for a difference of means: the share of relabellings
    whose |difference of means| is at least the observed one.

    Exact (every relabelling into groups of the original sizes, the observed one
    included, so p >= 1 / count) when there are at most EXACT_PERMUTATION_LIMIT of them
    or no more than `n_permutations`; otherwise `n_permutations` random relabellings give
    p = (1 + hits) / (1 + n_permutations)."""
    a = _as_array(treatment)
    b = _as_array(baseline)
    if a.size == 0 or b.size == 0:
        return math.nan
    if min(a.size, b.size) == 1:
        return _one_against_many(a, b) if a.size == 1 else _one_against_many(b, a)
    relabellings = math.comb(a.size + b.size, a.size)
    result = scipy_stats().permutation_test(
        (a, b),
        _abs_mean_difference,
        permutation_type="independent",
        vectorized=True,
        n_resamples=relabellings if relabellings <= EXACT_PERMUTATION_LIMIT else n_permutations,
        alternative="greater",
        rng=_rng(seed, "perm:" + label),
    )
    return float(result.pvalue)


def fisher_exact_test(
    correct_a: int, total_a: int, correct_b: int, total_b: int
) -> tuple[float, float]:
    """Two-sided Fisher exact test of two proportions: (odds ratio, p-value)."""
    table = [[int(correct_a), int(total_a - correct_a)], [int(correct_b), int(total_b - correct_b)]]
    odds, p = scipy_stats().fisher_exact(table, alternative="two-sided")
    return float(odds), float(p)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (NaN entries stay NaN and are not counted)."""
    valid = [(p, i) for i, p in enumerate(p_values) if p is not None and math.isfinite(p)]
    adjusted = [math.nan] * len(p_values)
    m = len(valid)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(valid)):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    if window <= 1 or values.size == 0:
        return values
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, values.size + 1)
    start = np.maximum(idx - window, 0)
    return (csum[idx] - csum[start]) / (idx - start)
