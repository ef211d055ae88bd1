"""Comparing the conditions of a set of runs on one metric.

For a metric and a step horizon H shared by every run (steps 0..H-1), each run gives
two numbers: **final**, the mean of the metric over its last `final_window` logged
steps before H, and **AUC**, the mean over all logged steps before H. Per condition the
mean of each over seeds gets a t interval; each condition is compared with the baseline
by the difference of means (Welch's t interval and permutation test) and by Fisher's
exact test on correct counts pooled over seeds and steps. Holm's correction is applied
within each family of p-values (final, AUC, Fisher) over the conditions compared.

A held-out metric (`eval_correct_rate`, `eval_pass_at_k`, ...; `[eval]`) is compared the
same way over its evaluations up to H steps done, except that **final** is the last
evaluation (the adapter after the most training) and Fisher's test uses that
evaluation's counts.

Counts exist only for a share of correct completions (COUNTED: correct_rate,
eval_correct_rate): for any other metric there are no pooled counts and no Fisher test.
A run without a value of the metric in the compared steps is left out of its condition
with a warning, so a condition's n is the number of values its statistics use.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retrain.compare.runs import RunData, is_eval_metric
from retrain.compare.setup_differences import setup_differences
from retrain.compare.stats import (
    DEFAULT_RESAMPLES,
    Interval,
    curve_band,
    fisher_exact_test,
    holm,
    json_float,
    moving_average,
    permutation_test,
    scipy_stats,
    t_ci,
    welch_ci,
)
from retrain.errors import UsageError

DEFAULT_FINAL_WINDOW = 10
STANDARD_BASELINE = "grpo+none"
# The metrics that are a share of correct completions, with counts behind them: the
# training steps' (metrics.jsonl) and the held-out evaluations' (eval_num_correct of
# eval_num_completions, both counted, so exact).
COUNTED = ("correct_rate", "eval_correct_rate")


class NoValues(UsageError):
    """The metric has no values where the comparison needs them (in no run, or not in
    the baseline's runs): `retrain compare` skips a metric it added by default."""


@dataclass
class ConditionSummary:
    condition: str
    seeds: list[int | None]
    runs: list[str]
    final_values: list[float]
    auc_values: list[float]
    final: Interval
    auc: Interval
    correct: int | None = None
    completions: int | None = None

    @property
    def n(self) -> int:
        return len(self.final_values)

    @property
    def pooled_rate(self) -> float | None:
        if not self.completions:
            return None
        return (self.correct or 0) / self.completions

    def as_dict(self) -> dict[str, Any]:
        return {
            "condition": self.condition,
            "n": self.n,
            "seeds": self.seeds,
            "runs": self.runs,
            "final_values": [json_float(v) for v in self.final_values],
            "auc_values": [json_float(v) for v in self.auc_values],
            "final": self.final.as_dict(),
            "auc": self.auc.as_dict(),
            "pooled_correct": self.correct,
            "pooled_completions": self.completions,
            "pooled_correct_rate": self.pooled_rate,
        }


@dataclass
class PairwiseResult:
    condition: str
    baseline: str
    final_diff: Interval
    final_p: float
    auc_diff: Interval
    auc_p: float
    fisher_odds_ratio: float | None = None
    fisher_p: float | None = None
    final_p_holm: float = math.nan
    auc_p_holm: float = math.nan
    fisher_p_holm: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            "condition": self.condition,
            "baseline": self.baseline,
            "final_diff": self.final_diff.as_dict(),
            "final_p": json_float(self.final_p),
            "final_p_holm": json_float(self.final_p_holm),
            "auc_diff": self.auc_diff.as_dict(),
            "auc_p": json_float(self.auc_p),
            "auc_p_holm": json_float(self.auc_p_holm),
            "fisher_odds_ratio": json_float(self.fisher_odds_ratio),
            "fisher_p": json_float(self.fisher_p),
            "fisher_p_holm": json_float(self.fisher_p_holm),
        }


@dataclass
class Curve:
    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    n: np.ndarray

    def as_dict(self) -> dict[str, list]:
        return {
            "steps": self.steps.tolist(),
            "mean": [json_float(v) for v in self.mean],
            "low": [json_float(v) for v in self.low],
            "high": [json_float(v) for v in self.high],
            "n": self.n.tolist(),
        }


@dataclass
class Comparison:
    metric: str
    horizon: int
    final_window: int
    baseline: str
    conditions: list[ConditionSummary]
    pairwise: list[PairwiseResult]
    curves: dict[str, Curve]
    n_resamples: int
    warnings: list[str] = field(default_factory=list)
    incomplete: int = 0  # runs that lack some compared steps or evaluations (see the warnings)

    @property
    def counted(self) -> bool:
        """Whether the metric has correct counts behind it (pooled counts, Fisher)."""
        return self.metric in COUNTED

    def as_dict(self, *, curves: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "metric": self.metric,
            "horizon_steps": self.horizon,
            "final_window": self.final_window,
            "baseline": self.baseline,
            "n_resamples": self.n_resamples,
            "confidence": 0.95,
            "conditions": [c.as_dict() for c in self.conditions],
            "pairwise": [p.as_dict() for p in self.pairwise],
            "warnings": list(self.warnings),
            "runs_missing_steps": self.incomplete,
        }
        if curves:
            out["curves"] = {k: v.as_dict() for k, v in self.curves.items()}
        return out


@dataclass(frozen=True)
class _Settings:
    """What every per-condition and pairwise computation of one comparison shares."""

    metric: str
    horizon: int
    final_window: int
    n_resamples: int
    seed: int
    smooth: int


def pick_baseline(
    order: Sequence[str],
    requested: str | None,
    metric: str = "",
    everywhere: Sequence[str] = (),
) -> str:
    """The baseline among the conditions `order` (those with values of `metric`);
    `everywhere`: the conditions of all the runs, so that a requested one left without
    values is told apart from a name that is not a condition at all."""
    if requested:
        if requested in order:
            return requested
        if requested in everywhere:
            raise NoValues(
                f"--baseline {requested!r} has no values of {metric!r} (its runs lack them); "
                f"conditions with values: {', '.join(order)}"
            )
        from retrain.registry import suggest

        raise UsageError(
            f"--baseline {requested!r} is not among the conditions{suggest(requested, order)}; "
            f"found: {', '.join(order)}"
        )
    return STANDARD_BASELINE if STANDARD_BASELINE in order else order[0]


def learning_curve(series: Sequence[tuple[np.ndarray, np.ndarray]], smooth: int = 1) -> Curve:
    """Mean and 95% t band over seeds at each step (`stats.curve_band`: no band, NaN
    bounds, at a step only one seed has)."""
    all_steps = np.unique(np.concatenate([s for s, _ in series])) if series else np.zeros(0, int)
    grid = np.full((len(series), all_steps.size), np.nan)
    for i, (steps, values) in enumerate(series):
        grid[i, np.searchsorted(all_steps, steps)] = moving_average(values, smooth)
    mean, low, high, n = curve_band(grid)
    return Curve(all_steps, mean, low, high, n)


# ----------------------------------------------------------------------------- steps


def _usable_runs(runs: Sequence[RunData], metric: str, warnings: list[str]) -> list[RunData]:
    usable, unreadable = [], []
    for run in runs:
        if not run.rows:
            # empty, or every line damaged: then the file, not the metric's name, is at fault
            why = "; ".join(run.problems) or "metrics.jsonl is empty"
            unreadable.append(f"{run.label}: {why}")
            warnings.append(f"{run.label}: no readable metrics row; skipped")
        elif not run.has_metric(metric):
            warnings.append(f"{run.label}: no values of {metric!r}; skipped")
        else:
            usable.append(run)
    if not usable and len(unreadable) == len(runs):
        raise UsageError("no run has a readable metrics row: " + " | ".join(unreadable))
    if not usable:
        raise NoValues(
            f"no run logs the metric {metric!r}; check the name (e.g. correct_rate, mean_reward)"
        )
    return usable


def _shown(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (" ..." if len(steps) > 10 else "")


def _with_values(
    runs: list[RunData], metric: str, horizon: int, warnings: list[str]
) -> list[RunData]:
    """The runs with a value of the metric in the compared steps; a warning for each
    other one (it has values, but only later), which would otherwise be a NaN final."""
    kept = []
    for run in runs:
        if run.series(metric, horizon)[0].size:
            kept.append(run)
            continue
        first = int(run.series(metric)[0][0])
        where = (
            f"up to {horizon} steps done (its first evaluation is after {first})"
            if is_eval_metric(metric)
            else f"in steps 0..{horizon - 1} (its first is at step {first})"
        )
        warnings.append(f"{run.label}: no value of {metric!r} {where}; left out of {run.condition}")
    if not kept:
        raise NoValues(f"no run has a value of {metric!r} in the compared steps 0..{horizon - 1}")
    return kept


def _step_gaps(runs: list[RunData], metric: str, horizon: int) -> list[str]:
    """A warning for each run that lacks some of the compared steps: its final and AUC
    (and, for correct_rate, its pooled counts) are then over fewer steps than the
    header's range says."""
    out = []
    for run in runs:
        missing = run.missing_steps(metric, horizon)
        if missing:
            out.append(
                f"{run.label}: {horizon - len(missing)} of the {horizon} steps 0..{horizon - 1} "
                f"have a value of {metric!r}; missing step(s) {_shown(missing)}"
            )
    return out


def _eval_gaps(runs: list[RunData], metric: str, horizon: int) -> list[str]:
    """A warning for each run that lacks some of the evaluations the other runs have:
    its AUC is then over other points, and when its last evaluation is missing its
    final (and Fisher counts) come from an earlier one."""
    steps = {run.label: run.series(metric, horizon)[0].tolist() for run in runs}
    everyone = sorted(set().union(*steps.values()))
    out = []
    for run in runs:
        mine = steps[run.label]
        missing = sorted(set(everyone) - set(mine))
        if not missing:
            continue
        text = (
            f"{run.label}: {len(mine)} of the {len(everyone)} evaluations the runs have "
            f"(after {_shown(everyone)} steps) have a value of {metric!r}; missing after "
            f"{_shown(missing)} steps, so its AUC is over other points"
        )
        if mine[-1] < everyone[-1]:
            text += (
                f"; its final is its last evaluation, after {mine[-1]} steps, where other "
                f"runs' is after {everyone[-1]}"
            )
        out.append(text)
    return out


def _unfinished(runs: list[RunData], horizon: int) -> list[str]:
    """A warning for each run its records say did not finish, and a note when the
    compared steps stop before the runs' max_steps."""
    out = [f"{r.label}: not finished ({state})" for r in runs if (state := r.unfinished)]
    planned = max((m for r in runs if (m := r.source.max_steps)), default=0)
    if planned > horizon:
        out.append(
            f"compared over steps 0..{horizon - 1}, fewer than the {planned} steps the runs "
            "are configured for (max_steps): the results describe training part way"
        )
    return out


def _common_horizon(runs: list[RunData], warnings: list[str]) -> int:
    """The steps every run has; a warning when some runs have more."""
    horizon = min(r.num_steps for r in runs)
    if horizon < max(r.num_steps for r in runs):
        short = [r.label for r in runs if r.num_steps == horizon]
        warnings.append(
            f"runs differ in length: compared over the first {horizon} steps that every run has "
            f"(shortest: {', '.join(short[:3])}); pass --steps N to choose, dropping shorter runs"
        )
    return horizon


def _reaching(runs: list[RunData], horizon: int, warnings: list[str]) -> list[RunData]:
    """The runs with at least `horizon` steps; a warning for each other one."""
    for r in runs:
        if r.num_steps < horizon:
            warnings.append(f"{r.label}: only {r.num_steps} steps (< --steps {horizon}); skipped")
    kept = [r for r in runs if r.num_steps >= horizon]
    if not kept:
        raise UsageError(f"no run reaches {horizon} steps")
    return kept


def _condition_order(runs: list[RunData], order: Sequence[str] | None) -> list[str]:
    """`order`'s conditions that have runs, then the others by first appearance."""
    present = {r.condition for r in runs}
    first = [c for c in (order or []) if c in present]
    return list(dict.fromkeys([*first, *(r.condition for r in runs)]))


def _pooled_counts(
    members: list[RunData], horizon: int, metric: str, warnings: list[str]
) -> tuple[int, int] | None:
    """Correct counts summed over the runs; None, with a warning naming the runs, when
    some run's counts are unknown (a pool of the others would be another sample)."""
    if metric not in COUNTED:
        return None
    counts = [run.correct_counts(horizon, metric) for run in members]
    unknown = [run.label for run, c in zip(members, counts) if not c]
    if unknown:
        where = (
            "its evaluation rows lack eval_num_correct / eval_num_completions"
            if is_eval_metric(metric)
            else "its metrics rows lack num_correct / num_completions (or batch_size and "
            "group_size, without extra dynamic sampling rounds) and it has no readable "
            "emergence/generations.jsonl"
        )
        warnings.append(
            f"{members[0].condition}: no pooled correct counts or Fisher test: the counts of "
            f"{', '.join(unknown)} are unknown ({where})"
        )
        return None
    return sum(c[0] for c in counts if c), sum(c[1] for c in counts if c)


def _summarise(
    cond: str, members: list[RunData], s: _Settings, warnings: list[str]
) -> tuple[ConditionSummary, Curve]:
    seeds = [r.seed for r in members]
    dup = [seed for seed, c in Counter(seeds).items() if c > 1 and seed is not None]
    if dup:
        warnings.append(f"{cond}: several runs share seed(s) {dup}; each counts as a replicate")
    series = [r.series(s.metric, s.horizon) for r in members]  # none empty: _with_values
    finals = [float(values[-s.final_window :].mean()) for _, values in series]
    aucs = [float(values.mean()) for _, values in series]
    counts = _pooled_counts(members, s.horizon, s.metric, warnings)
    summary = ConditionSummary(
        cond,
        seeds,
        [str(r.path) for r in members],
        finals,
        aucs,
        t_ci(finals),
        t_ci(aucs),
        counts[0] if counts else None,
        counts[1] if counts else None,
    )
    return summary, learning_curve(series, s.smooth)


def _difference(a: list[float], b: list[float], s: _Settings, label: str) -> tuple[Interval, float]:
    """mean(a) - mean(b) with its confidence interval, and the permutation p-value."""
    return (
        welch_ci(a, b),
        permutation_test(a, b, n_permutations=s.n_resamples, seed=s.seed, label=label),
    )


def _versus(treated: ConditionSummary, base: ConditionSummary, s: _Settings) -> PairwiseResult:
    """One condition against the baseline: differences of final and AUC means, and
    Fisher's test on the pooled counts when both conditions have them."""
    label = f"{s.metric}:{treated.condition}-vs-{base.condition}"
    final_diff, final_p = _difference(treated.final_values, base.final_values, s, label + ":final")
    auc_diff, auc_p = _difference(treated.auc_values, base.auc_values, s, label + ":auc")
    result = PairwiseResult(treated.condition, base.condition, final_diff, final_p, auc_diff, auc_p)
    if treated.completions and base.completions:
        result.fisher_odds_ratio, result.fisher_p = fisher_exact_test(
            treated.correct or 0, treated.completions, base.correct or 0, base.completions
        )
    return result


def _apply_holm(pairwise: list[PairwiseResult]) -> None:
    for attr in ("final_p", "auc_p", "fisher_p"):
        values = [getattr(p, attr) for p in pairwise]
        adjusted = holm([math.nan if v is None else v for v in values])
        for p, adj in zip(pairwise, adjusted):
            setattr(p, attr + "_holm", adj)


def compare_runs(
    runs: Sequence[RunData],
    metric: str = "correct_rate",
    *,
    order: Sequence[str] | None = None,
    baseline: str | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    final_window: int = DEFAULT_FINAL_WINDOW,
    horizon: int | None = None,
    smooth: int = 1,
) -> Comparison:
    """Compare the conditions of `runs` on `metric` over steps 0..horizon-1 (default: the
    steps every run has; with a horizon, shorter runs are dropped)."""
    scipy_stats()  # fail before any work when scipy is missing
    warnings: list[str] = []
    usable = _usable_runs(runs, metric, warnings)
    if horizon is None:
        horizon = _common_horizon(usable, warnings)
    else:
        usable = _reaching(usable, horizon, warnings)
    usable = _with_values(usable, metric, horizon, warnings)
    held_out = is_eval_metric(metric)
    gaps = (_eval_gaps if held_out else _step_gaps)(usable, metric, horizon)
    warnings += gaps
    warnings += _unfinished(usable, horizon)
    # what "final" averages: the last evaluation of a held-out metric, else the last
    # final_window steps, no more than there are
    final_window = 1 if held_out else min(final_window, horizon)
    conditions = _condition_order(usable, order)
    warnings += setup_differences(usable, conditions)
    everywhere = _condition_order(list(runs), order)
    base = pick_baseline(conditions, baseline, metric, everywhere)
    if baseline is None and base != STANDARD_BASELINE and STANDARD_BASELINE in everywhere:
        warnings.append(
            f"{STANDARD_BASELINE} has no values of {metric!r}: the baseline is {base} instead"
        )
    settings = _Settings(metric, horizon, final_window, n_resamples, seed, smooth)
    summaries: dict[str, ConditionSummary] = {}
    curves: dict[str, Curve] = {}
    for cond in conditions:
        members = [r for r in usable if r.condition == cond]
        summaries[cond], curves[cond] = _summarise(cond, members, settings, warnings)
    pairwise = [_versus(summaries[c], summaries[base], settings) for c in conditions if c != base]
    _apply_holm(pairwise)
    warnings += [
        f"{c}: a single seed; its mean has no interval and tests against it are weak"
        for c, s in summaries.items()
        if s.n < 2
    ]
    # what could not be read of the runs' files (asked last: the counts read files too)
    # comes first, as it qualifies all the rest
    warnings[:0] = dict.fromkeys(p for run in runs for p in run.problems)
    return Comparison(
        metric,
        horizon,
        final_window,
        base,
        list(summaries.values()),
        pairwise,
        curves,
        n_resamples,
        warnings,
        incomplete=len(gaps),
    )
