"""The statistics of `retrain compare`, through scipy.stats.

Seeds are the replicates: every function here takes one value per run. Confidence
intervals are percentile bootstraps of the mean (`scipy.stats.bootstrap`), tests of a
difference of means are two-sided permutation tests (`scipy.stats.permutation_test`),
pooled correct counts get Fisher's exact test (`scipy.stats.fisher_exact`), and Holm's
step-down correction adjusts a family of p-values.

Every resampling draws from a generator seeded by (seed, label), so a number does not
depend on what else was computed before it. scipy is imported on use: `retrain --help`
and `retrain status` work without it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Sequence
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


def _mean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis)


def _percentile_bootstrap(
    data: tuple[np.ndarray, ...],
    statistic: Callable[..., np.ndarray],
    estimate: float,
    *,
    n_resamples: int,
    confidence: float,
    rng: np.random.Generator,
) -> Interval:
    """The percentile-bootstrap interval of `statistic` (each sample resampled on its
    own), widened to contain the point estimate."""
    result = scipy_stats().bootstrap(
        data,
        statistic,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        vectorized=True,
        rng=rng,
    )
    low, high = result.confidence_interval
    return Interval(estimate, float(min(low, estimate)), float(max(high, estimate)))


def bootstrap_ci(
    values: Iterable[float],
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    label: str = "",
) -> Interval:
    """Percentile-bootstrap CI of the mean. One value gives a zero-width interval."""
    x = _as_array(values)
    if x.size == 0:
        return NAN_INTERVAL
    mean = float(x.mean())
    if x.size == 1 or np.ptp(x) == 0:
        return Interval(mean, mean, mean)
    return _percentile_bootstrap(
        (x,),
        _mean,
        mean,
        n_resamples=n_resamples,
        confidence=confidence,
        rng=_rng(seed, "ci:" + label),
    )


def _difference_of_means(
    a: np.ndarray, b: np.ndarray
) -> tuple[tuple[np.ndarray, ...], Callable[..., np.ndarray]] | None:
    """(samples to resample, statistic) of mean(a) - mean(b). A single value is a
    constant (resampling it changes nothing, and scipy needs two or more); None when
    both sides are single values."""
    if a.size > 1 and b.size > 1:
        return (a, b), lambda x, y, axis=-1: np.mean(x, axis=axis) - np.mean(y, axis=axis)
    if a.size > 1:
        return (a,), lambda x, axis=-1: np.mean(x, axis=axis) - b[0]
    if b.size > 1:
        return (b,), lambda y, axis=-1: a[0] - np.mean(y, axis=axis)
    return None


def bootstrap_diff_ci(
    treatment: Iterable[float],
    baseline: Iterable[float],
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    label: str = "",
) -> Interval:
    """Percentile-bootstrap CI of mean(treatment) - mean(baseline), each side resampled
    independently (unpaired seeds)."""
    a = _as_array(treatment)
    b = _as_array(baseline)
    if a.size == 0 or b.size == 0:
        return NAN_INTERVAL
    diff = float(a.mean() - b.mean())
    problem = _difference_of_means(a, b)
    if problem is None:
        return Interval(diff, diff, diff)
    data, statistic = problem
    return _percentile_bootstrap(
        data,
        statistic,
        diff,
        n_resamples=n_resamples,
        confidence=confidence,
        rng=_rng(seed, "diff:" + label),
    )


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
