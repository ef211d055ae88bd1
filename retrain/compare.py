"""Comparing training conditions across seeds: loading runs, statistics, learning curves.

This is the analysis behind `retrain compare`. It is plain numpy (scipy only for Fisher's
exact test, matplotlib only for the plots, both imported on use).

Unit of analysis: one run (one condition x one seed). For a metric (default
``correct_rate``) and a step horizon H shared by every run (steps 0..H-1), each run gives
two numbers:

- **final**: the mean of the metric over the run's last ``final_window`` logged steps
  before H (one step's batch is noisy; a short window steadies it);
- **AUC**: the mean of the metric over all logged steps before H, i.e. the area under
  the learning curve divided by its length (a normalised AUC in the metric's own units).

Per condition, the mean of these over seeds gets a 95% percentile-bootstrap confidence
interval. Each condition is compared with the baseline by the difference of means
(condition - baseline) with a bootstrap CI (seeds resampled independently within each
condition) and a two-sided permutation test of the difference of means (exact when the
number of relabellings is small, Monte Carlo otherwise). The seeds are the replicates,
so with n seeds per side the smallest attainable permutation p-value is
1 / C(2n, n) x 2 (0.1 for 3 vs 3, 0.0002 for 8 vs 8).

Fisher's exact test on pooled counts: every completion of every compared step is a
Bernoulli trial (correct or not); the counts of a condition are pooled over its seeds
and steps, and the 2x2 table condition/baseline x correct/incorrect is tested. It has
much more power than the seed-level tests but treats completions as independent, which
they are not (they share a run's weights and prompts): read it as a descriptive check
and trust the seed-level tests for claims. Per-step counts come from ``metrics.jsonl``
(``round(correct_rate * batch_size * group_size)`` out of ``batch_size * group_size``,
exact because the rate was computed from those counts), or from
``emergence/generations.jsonl`` when the metrics lack batch or group sizes.

Holm's step-down correction is applied within each family of p-values (final, AUC,
Fisher) over the conditions compared with the baseline.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import tomllib
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retrain.errors import RetrainError, UsageError

DEFAULT_RESAMPLES = 10_000
DEFAULT_FINAL_WINDOW = 10
EXACT_PERMUTATION_LIMIT = 100_000
STANDARD_BASELINE = "grpo+none"
_SEED_SUFFIX = re.compile(r"^(?P<cond>.+)_s(?P<seed>-?\d+)$")

# ----------------------------------------------------------------------------- statistics


def _rng(seed: int, label: str = "") -> np.random.Generator:
    """A generator that depends only on (seed, label), never on call order."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(label.encode())])


def _as_array(values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(values), dtype=np.float64).reshape(-1)
    return arr[np.isfinite(arr)]


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
            k: _json_float(v)
            for k, v in (("estimate", self.estimate), ("low", self.low), ("high", self.high))
        }


NAN_INTERVAL = Interval(math.nan, math.nan, math.nan)


def _resampled_means(x: np.ndarray, rng: np.random.Generator, n_resamples: int) -> np.ndarray:
    """Means of `n_resamples` bootstrap resamples (with replacement) of `x`."""
    return x[rng.integers(0, x.size, size=(n_resamples, x.size))].mean(axis=1)


def _percentile_interval(point: float, samples: np.ndarray, confidence: float) -> Interval:
    """The central `confidence` percentile interval of bootstrap `samples`, widened to
    contain the point estimate."""
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(samples, [alpha, 1.0 - alpha])
    return Interval(point, float(min(low, point)), float(max(high, point)))


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
    means = _resampled_means(x, _rng(seed, "ci:" + label), n_resamples)
    return _percentile_interval(mean, means, confidence)


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
    rng = _rng(seed, "diff:" + label)
    ma = _resampled_means(a, rng, n_resamples)
    mb = _resampled_means(b, rng, n_resamples)
    return _percentile_interval(diff, ma - mb, confidence)


def permutation_test(
    treatment: Iterable[float],
    baseline: Iterable[float],
    *,
    n_permutations: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    label: str = "",
) -> float:
    """Two-sided permutation p-value for a difference of means.

    Every relabelling of the pooled values into groups of the original sizes is
    enumerated when there are at most EXACT_PERMUTATION_LIMIT of them (the observed
    labelling included, so p >= 1 / count); otherwise ``n_permutations`` random
    relabellings give p = (1 + hits) / (1 + n_permutations)."""
    a = _as_array(treatment)
    b = _as_array(baseline)
    if a.size == 0 or b.size == 0:
        return math.nan
    pooled = np.concatenate([a, b])
    n, k = pooled.size, a.size
    total = pooled.sum()
    observed = abs(a.mean() - b.mean())
    tol = 1e-12 * max(1.0, float(np.abs(pooled).max()))
    if math.comb(n, k) <= EXACT_PERMUTATION_LIMIT:
        idx = np.fromiter(
            itertools.chain.from_iterable(itertools.combinations(range(n), k)),
            dtype=np.int64,
        ).reshape(-1, k)
        sum_a = pooled[idx].sum(axis=1)
        stats = np.abs(sum_a / k - (total - sum_a) / (n - k))
        return float(np.mean(stats >= observed - tol))
    rng = _rng(seed, "perm:" + label)
    order = rng.random((n_permutations, n)).argsort(axis=1)[:, :k]
    sum_a = pooled[order].sum(axis=1)
    stats = np.abs(sum_a / k - (total - sum_a) / (n - k))
    hits = int(np.sum(stats >= observed - tol))
    return (1 + hits) / (1 + n_permutations)


def fisher_exact_test(
    correct_a: int, total_a: int, correct_b: int, total_b: int
) -> tuple[float, float]:
    """Two-sided Fisher exact test of two proportions: (odds ratio, p-value).
    Needs scipy (the `plots` extra)."""
    try:
        from scipy.stats import fisher_exact
    except ImportError as exc:
        raise RetrainError(
            "Fisher's exact test needs scipy: pip install 'retrain[plots]' (matplotlib + scipy)"
        ) from exc
    table = [[int(correct_a), int(total_a - correct_a)], [int(correct_b), int(total_b - correct_b)]]
    odds, p = fisher_exact(table, alternative="two-sided")
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


# ----------------------------------------------------------------------------- runs


@dataclass
class RunData:
    """One run's metrics, one row per step (the last row wins for a repeated step)."""

    path: Path
    condition: str
    seed: int | None
    rows: list[dict[str, Any]]
    status: str | None = None

    @property
    def label(self) -> str:
        return f"{self.condition}_s{self.seed}" if self.seed is not None else str(self.path)

    @property
    def steps(self) -> np.ndarray:
        return np.array([int(r["step"]) for r in self.rows], dtype=np.int64)

    @property
    def num_steps(self) -> int:
        """Steps logged (the horizon this run reaches: last step + 1)."""
        return int(self.rows[-1]["step"]) + 1 if self.rows else 0

    def has_metric(self, metric: str) -> bool:
        return any(_finite(r.get(metric)) is not None for r in self.rows)

    def series(self, metric: str, horizon: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the metric for steps < horizon, non-finite values dropped."""
        steps, values = [], []
        for r in self.rows:
            step = int(r["step"])
            if horizon is not None and step >= horizon:
                break
            v = _finite(r.get(metric))
            if v is not None:
                steps.append(step)
                values.append(v)
        return np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64)

    def correct_counts(self, horizon: int | None = None) -> tuple[int, int] | None:
        """(correct, completions) pooled over steps < horizon, or None when unknown."""
        correct = total = 0
        counted = False
        missing = False
        for r in self.rows:
            step = int(r["step"])
            if horizon is not None and step >= horizon:
                break
            rate, bs, gs = _finite(r.get("correct_rate")), r.get("batch_size"), r.get("group_size")
            if rate is None or not isinstance(bs, int) or not isinstance(gs, int):
                missing = True
                break
            n = bs * gs
            correct += int(round(rate * n))
            total += n
            counted = True
        if not missing:
            return (correct, total) if counted else None
        return _counts_from_generations(self.path, horizon)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _json_float(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _counts_from_generations(run_dir: Path, horizon: int | None) -> tuple[int, int] | None:
    path = run_dir / "emergence" / "generations.jsonl"
    if not path.is_file():
        return None
    correct = total = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict) or "correct" not in row:
                continue
            if horizon is not None and int(row.get("step", 0)) >= horizon:
                continue
            total += 1
            correct += bool(row["correct"])
    return (correct, total) if total else None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    from retrain.logs.jsonl import read_jsonl

    rows, _ = read_jsonl(path)
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        step = row.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = row
    return [by_step[s] for s in sorted(by_step)]


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def load_run(
    run_dir: str | Path,
    *,
    condition: str | None = None,
    seed: int | None = None,
    status: str | None = None,
) -> RunData:
    """Read a run directory (metrics.jsonl, run.json, config.resolved.toml)."""
    d = Path(run_dir)
    rows = _read_rows(d / "metrics.jsonl")
    resolved = _read_toml(d / "config.resolved.toml")
    run_json = _read_json(d / "run.json")
    name_match = _SEED_SUFFIX.match(d.name)
    if condition is None:
        labels = Counter(r["condition"] for r in rows if isinstance(r.get("condition"), str))
        if labels:
            condition = labels.most_common(1)[0][0]
        elif isinstance(run_json.get("condition"), str):
            condition = run_json["condition"]
        elif isinstance(resolved.get("algorithm"), dict):
            algo = resolved["algorithm"]
            condition = algo.get("algorithm_mode") or (
                f"{algo.get('advantage_mode', 'maxrl')}+{algo.get('transform_mode', 'gtpo_sepa')}"
            )
        elif name_match:
            condition = name_match.group("cond")
        else:
            condition = d.name
    if seed is None:
        cfg_seed = resolved.get("training", {}).get("seed") if resolved else None
        if isinstance(cfg_seed, int) and cfg_seed >= 0:
            seed = cfg_seed
        elif name_match:
            seed = int(name_match.group("seed"))
    if status is None and isinstance(run_json.get("status"), str):
        status = run_json["status"]
    return RunData(d, condition, seed, rows, status)


def _resolve_manifest_dir(campaign: Path, entry: dict[str, Any]) -> Path | None:
    candidates: list[Path] = []
    log_dir = entry.get("log_dir")
    if isinstance(log_dir, str) and log_dir:
        p = Path(log_dir)
        candidates += (
            [p] if p.is_absolute() else [campaign / p, Path.cwd() / p, campaign / "runs" / p.name]
        )
    cond, seed = entry.get("condition"), entry.get("seed")
    if cond is not None and seed is not None:
        candidates.append(campaign / "runs" / f"{cond}_s{seed}")
    for c in candidates:
        if c.is_dir():
            return c
    return None


def load_campaign(campaign_dir: str | Path, warnings: list[str]) -> tuple[list[RunData], list[str]]:
    """The runs of a campaign (manifest.json + runs/*) and its condition order."""
    d = Path(campaign_dir)
    manifest = _read_json(d / "manifest.json")
    entries = manifest.get("runs")
    runs: list[RunData] = []
    order: list[str] = []
    if not isinstance(entries, list):
        warnings.append(f"{d / 'manifest.json'} has no 'runs' list; scanning {d / 'runs'} instead")
        entries = [{"log_dir": str(p)} for p in sorted((d / "runs").glob("*")) if p.is_dir()]
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        run_dir = _resolve_manifest_dir(d, entry)
        label = f"{entry.get('condition', '?')}_s{entry.get('seed', '?')}"
        if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
            warnings.append(
                f"campaign {d.name}: run {label} has no metrics.jsonl yet (status {entry.get('status', 'unknown')}); skipped"
            )
            continue
        seed = entry.get("seed")
        run = load_run(
            run_dir,
            condition=entry.get("condition") if isinstance(entry.get("condition"), str) else None,
            seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
            status=entry.get("status") if isinstance(entry.get("status"), str) else None,
        )
        runs.append(run)
        if run.condition not in order:
            order.append(run.condition)
    return runs, order


def collect_runs(
    paths: Sequence[str | Path], warnings: list[str]
) -> tuple[list[RunData], list[str]]:
    """Runs from run dirs, campaign dirs, or directories holding either (searched a few
    levels deep). Returns (runs, condition order of first appearance)."""
    runs: list[RunData] = []
    order: list[str] = []
    seen: set[Path] = set()

    def add(run: RunData) -> None:
        key = run.path.resolve()
        if key in seen:
            return
        seen.add(key)
        runs.append(run)
        if run.condition not in order:
            order.append(run.condition)

    for raw in paths:
        p = Path(raw)
        if p.is_file() and p.name in ("metrics.jsonl", "manifest.json"):
            p = p.parent
        if not p.exists():
            raise UsageError(f"{raw}: no such file or directory")
        if (p / "manifest.json").is_file():
            found, _ = load_campaign(p, warnings)
            for run in found:
                add(run)
            continue
        if (p / "metrics.jsonl").is_file():
            add(load_run(p))
            continue
        found_any = False
        for root, dirs, files in os.walk(p):
            depth = len(Path(root).relative_to(p).parts)
            dirs.sort()
            if depth >= 5:
                dirs[:] = []
            if "manifest.json" in files:
                for run in load_campaign(Path(root), warnings)[0]:
                    add(run)
                found_any = True
                dirs[:] = []
            elif "metrics.jsonl" in files:
                add(load_run(Path(root)))
                found_any = True
                dirs[:] = []  # runs do not nest
        if not found_any:
            warnings.append(f"{raw}: no run (metrics.jsonl) or campaign (manifest.json) found")
    if not runs:
        raise UsageError(
            "no runs to compare: pass run directories (holding metrics.jsonl) or a campaign "
            "directory (holding manifest.json), e.g. retrain compare logs/campaign_20250101_120000"
        )
    return runs, order


# ----------------------------------------------------------------------------- comparison


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
            "final_values": [_json_float(v) for v in self.final_values],
            "auc_values": [_json_float(v) for v in self.auc_values],
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
            "final_p": _json_float(self.final_p),
            "final_p_holm": _json_float(self.final_p_holm),
            "auc_diff": self.auc_diff.as_dict(),
            "auc_p": _json_float(self.auc_p),
            "auc_p_holm": _json_float(self.auc_p_holm),
            "fisher_odds_ratio": _json_float(self.fisher_odds_ratio)
            if self.fisher_odds_ratio is not None
            else None,
            "fisher_p": _json_float(self.fisher_p) if self.fisher_p is not None else None,
            "fisher_p_holm": _json_float(self.fisher_p_holm),
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
            "mean": [_json_float(v) for v in self.mean],
            "low": [_json_float(v) for v in self.low],
            "high": [_json_float(v) for v in self.high],
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
        }
        if curves:
            out["curves"] = {k: v.as_dict() for k, v in self.curves.items()}
        return out


def pick_baseline(order: Sequence[str], requested: str | None) -> str:
    if requested:
        if requested not in order:
            from retrain.registry import suggest

            raise UsageError(
                f"--baseline {requested!r} is not among the conditions{suggest(requested, order)}; "
                f"found: {', '.join(order)}"
            )
        return requested
    return STANDARD_BASELINE if STANDARD_BASELINE in order else order[0]


def learning_curve(series: Sequence[tuple[np.ndarray, np.ndarray]], smooth: int = 1) -> Curve:
    """Mean and 95% band (mean +- 1.96 standard errors over seeds) at each step."""
    all_steps = np.unique(np.concatenate([s for s, _ in series])) if series else np.zeros(0, int)
    grid = np.full((len(series), all_steps.size), np.nan)
    for i, (steps, values) in enumerate(series):
        grid[i, np.searchsorted(all_steps, steps)] = moving_average(values, smooth)
    n = np.sum(np.isfinite(grid), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nanmean(grid, axis=0) if grid.size else np.zeros(0)
        sd = np.nanstd(grid, axis=0, ddof=1) if grid.shape[0] > 1 else np.zeros(all_steps.size)
        se = np.where(n > 1, sd / np.sqrt(np.maximum(n, 1)), 0.0)
    return Curve(all_steps, mean, mean - 1.96 * se, mean + 1.96 * se, n)


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
    fisher: bool = True,
) -> Comparison:
    """Compare the conditions of `runs` on `metric` (see the module docstring)."""
    warnings: list[str] = []
    usable = []
    for run in runs:
        if not run.rows:
            warnings.append(f"{run.label}: metrics.jsonl is empty; skipped")
        elif not run.has_metric(metric):
            warnings.append(f"{run.label}: no values of {metric!r}; skipped")
        else:
            usable.append(run)
    if not usable:
        raise UsageError(
            f"no run logs the metric {metric!r}; check the name (e.g. correct_rate, mean_reward)"
        )
    if horizon is None:
        horizon = min(r.num_steps for r in usable)
        longest = max(r.num_steps for r in usable)
        if horizon < longest:
            short = [r.label for r in usable if r.num_steps == horizon]
            warnings.append(
                f"runs differ in length: compared over the first {horizon} steps that every run has "
                f"(shortest: {', '.join(short[:3])}); pass --steps N to choose, dropping shorter runs"
            )
    else:
        kept = [r for r in usable if r.num_steps >= horizon]
        for r in usable:
            if r.num_steps < horizon:
                warnings.append(
                    f"{r.label}: only {r.num_steps} steps (< --steps {horizon}); skipped"
                )
        usable = kept
        if not usable:
            raise UsageError(f"no run reaches {horizon} steps")
    cond_order = [c for c in (order or []) if any(r.condition == c for r in usable)]
    for r in usable:
        if r.condition not in cond_order:
            cond_order.append(r.condition)
    base = pick_baseline(cond_order, baseline)

    summaries: dict[str, ConditionSummary] = {}
    curves: dict[str, Curve] = {}
    values: dict[str, tuple[list[float], list[float]]] = {}
    for cond in cond_order:
        members = [r for r in usable if r.condition == cond]
        seeds = [r.seed for r in members]
        dup = [s for s, c in Counter(seeds).items() if c > 1 and s is not None]
        if dup:
            warnings.append(f"{cond}: several runs share seed(s) {dup}; each counts as a replicate")
        finals, aucs, series = [], [], []
        counts: tuple[int, int] | None = (0, 0)
        for r in members:
            steps, vals = r.series(metric, horizon)
            series.append((steps, vals))
            finals.append(float(vals[-final_window:].mean()))
            aucs.append(float(vals.mean()))
            c = r.correct_counts(horizon) if counts is not None else None
            counts = (counts[0] + c[0], counts[1] + c[1]) if (c and counts is not None) else None
        summaries[cond] = ConditionSummary(
            cond,
            seeds,
            [str(r.path) for r in members],
            finals,
            aucs,
            bootstrap_ci(
                finals, n_resamples=n_resamples, seed=seed, label=f"{metric}:final:{cond}"
            ),
            bootstrap_ci(aucs, n_resamples=n_resamples, seed=seed, label=f"{metric}:auc:{cond}"),
            counts[0] if counts else None,
            counts[1] if counts else None,
        )
        values[cond] = (finals, aucs)
        curves[cond] = learning_curve(series, smooth)

    pairwise: list[PairwiseResult] = []
    fisher_error: str | None = None
    b = summaries[base]
    for cond in cond_order:
        if cond == base:
            continue
        s = summaries[cond]
        label = f"{metric}:{cond}-vs-{base}"
        result = PairwiseResult(
            cond,
            base,
            bootstrap_diff_ci(
                s.final_values,
                b.final_values,
                n_resamples=n_resamples,
                seed=seed,
                label=label + ":final",
            ),
            permutation_test(
                s.final_values,
                b.final_values,
                n_permutations=n_resamples,
                seed=seed,
                label=label + ":final",
            ),
            bootstrap_diff_ci(
                s.auc_values, b.auc_values, n_resamples=n_resamples, seed=seed, label=label + ":auc"
            ),
            permutation_test(
                s.auc_values,
                b.auc_values,
                n_permutations=n_resamples,
                seed=seed,
                label=label + ":auc",
            ),
        )
        if fisher and fisher_error is None and s.completions and b.completions:
            try:
                result.fisher_odds_ratio, result.fisher_p = fisher_exact_test(
                    s.correct or 0, s.completions, b.correct or 0, b.completions
                )
            except RetrainError as exc:
                fisher_error = str(exc)
        pairwise.append(result)
    if fisher_error:
        warnings.append(f"Fisher test skipped: {fisher_error}")
    for attr in ("final_p", "auc_p", "fisher_p"):
        adjusted = holm(
            [getattr(p, attr) if getattr(p, attr) is not None else math.nan for p in pairwise]
        )
        for p, adj in zip(pairwise, adjusted):
            setattr(p, attr + "_holm", adj)
    for cond, s in summaries.items():
        if s.n < 2:
            warnings.append(
                f"{cond}: a single seed; its interval has zero width and tests against it are weak"
            )
    return Comparison(
        metric,
        horizon,
        final_window,
        base,
        [summaries[c] for c in cond_order],
        pairwise,
        curves,
        n_resamples,
        warnings,
    )


# ----------------------------------------------------------------------------- reports


def fmt(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.2f}"


def fmt_p(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    if value < 1e-4:
        return "<1e-4"
    return f"{value:.4f}" if value < 0.01 else f"{value:.3f}"


def _ci(iv: Interval) -> str:
    return f"{fmt(iv.estimate)} [{fmt(iv.low)}, {fmt(iv.high)}]"


def report_tables(
    comp: Comparison,
) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(header, rows) of the per-condition table and of the pairwise table."""
    head1 = ["condition", "seeds", "final mean [95% CI]", "AUC mean [95% CI]", "pooled correct"]
    rows1 = []
    for c in comp.conditions:
        pooled = (
            f"{c.correct}/{c.completions} ({100 * (c.pooled_rate or 0):.1f}%)"
            if c.completions
            else "n/a"
        )
        name = c.condition + (" (baseline)" if c.condition == comp.baseline else "")
        rows1.append([name, str(c.n), _ci(c.final), _ci(c.auc), pooled])
    head2 = [
        f"vs {comp.baseline}",
        "d final [95% CI]",
        "p perm",
        "d AUC [95% CI]",
        "p perm",
        "Fisher p",
        "Holm p (final/AUC/Fisher)",
    ]
    rows2 = []
    for p in comp.pairwise:
        rows2.append(
            [
                p.condition,
                _ci(p.final_diff),
                fmt_p(p.final_p),
                _ci(p.auc_diff),
                fmt_p(p.auc_p),
                fmt_p(p.fisher_p),
                f"{fmt_p(p.final_p_holm)} / {fmt_p(p.auc_p_holm)} / {fmt_p(p.fisher_p_holm)}",
            ]
        )
    return head1, rows1, head2, rows2


def _plain_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    def esc(x: str) -> str:
        return x.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in head) + " |"]
    lines.append("|" + "|".join("---" for _ in head) + "|")
    lines += ["| " + " | ".join(esc(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _explain(comp: Comparison) -> str:
    return (
        f"Steps 0..{comp.horizon - 1}. final = mean of the last {comp.final_window} steps; "
        f"AUC = mean over all compared steps. CIs: percentile bootstrap over seeds "
        f"({comp.n_resamples} resamples); p perm: two-sided permutation test over seeds; "
        "Fisher p: two-sided exact test on correct counts pooled over seeds and steps "
        "(treats completions as independent: descriptive). Holm: adjusted over the comparisons."
    )


def render_text(comp: Comparison) -> str:
    head1, rows1, head2, rows2 = report_tables(comp)
    parts = [f"== {comp.metric} ==", _plain_table(head1, rows1)]
    if rows2:
        parts += ["", _plain_table(head2, rows2)]
    parts += ["", _explain(comp)]
    parts += [f"warning: {w}" for w in comp.warnings]
    return "\n".join(parts)


def render_markdown(comps: Sequence[Comparison], images: dict[str, list[str]] | None = None) -> str:
    lines = ["# retrain compare", ""]
    for comp in comps:
        head1, rows1, head2, rows2 = report_tables(comp)
        lines += [f"## {comp.metric}", "", _md_table(head1, rows1), ""]
        if rows2:
            lines += [_md_table(head2, rows2), ""]
        lines += [_explain(comp), ""]
        for name in (images or {}).get(comp.metric, []):
            lines += [f"![{name}]({name})", ""]
        if comp.warnings:
            lines += [f"- warning: {w}" for w in comp.warnings] + [""]
    return "\n".join(lines)


def plot_curves(comp: Comparison, path: str | Path) -> Path:
    """Learning curves: mean +- 95% band per condition (matplotlib, Agg backend)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for summary in comp.conditions:
            curve = comp.curves[summary.condition]
            label = f"{summary.condition} (n={summary.n})"
            (line,) = ax.plot(curve.steps, curve.mean, label=label, linewidth=1.6)
            ax.fill_between(
                curve.steps, curve.low, curve.high, color=line.get_color(), alpha=0.2, linewidth=0
            )
        ax.set_xlabel("step")
        ax.set_ylabel(comp.metric)
        ax.set_title(f"{comp.metric}: mean over seeds, 95% band (mean +- 1.96 SE)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out


def plot_finals(comp: Comparison, path: str | Path) -> Path:
    """Per-seed final values per condition, with the mean and its bootstrap CI."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(comp.conditions)), 4.5))
    try:
        rng = np.random.default_rng(0)
        for i, c in enumerate(comp.conditions):
            xs = i + rng.uniform(-0.12, 0.12, size=len(c.final_values))
            ax.scatter(xs, c.final_values, s=18, alpha=0.7)
            iv = c.final
            if math.isfinite(iv.estimate):
                ax.errorbar(
                    [i + 0.3],
                    [iv.estimate],
                    yerr=[[iv.estimate - iv.low], [iv.high - iv.estimate]],
                    fmt="o",
                    color="black",
                    capsize=4,
                )
        ax.set_xticks(range(len(comp.conditions)))
        ax.set_xticklabels([c.condition for c in comp.conditions], rotation=20, ha="right")
        ax.set_ylabel(f"{comp.metric} (final, last {comp.final_window} steps)")
        ax.set_title("final value per seed; black: mean with 95% bootstrap CI")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RetrainError("plots need matplotlib: pip install 'retrain[plots]'") from exc
    return plt
