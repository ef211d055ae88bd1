"""Comparisons as PNG plots (matplotlib, imported on use, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from retrain.compare.comparison import Comparison
from retrain.errors import RetrainError


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RetrainError("plots need matplotlib: pip install 'retrain[plots]'") from exc
    return plt


def plot_curves(comp: Comparison, path: str | Path) -> Path:
    """Learning curves: the mean over seeds per condition, shaded with the 95% t band that
    `Curve` holds (at each step mean +- t_{0.975, k-1} * s / sqrt(k) over the k seeds that
    have it, `stats.curve_band`); the band is left out where k < 2 (NaN bounds)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for summary in comp.conditions:
            curve = comp.curves[summary.condition]
            label = f"{summary.condition} (n={summary.n})"
            (line,) = ax.plot(curve.steps, curve.mean, label=label, linewidth=1.6)
            low, high = np.asarray(curve.low, float), np.asarray(curve.high, float)
            banded = np.isfinite(low) & np.isfinite(high)
            if banded.any():
                ax.fill_between(
                    curve.steps,
                    np.where(banded, low, np.nan),
                    np.where(banded, high, np.nan),
                    where=banded,
                    color=line.get_color(),
                    alpha=0.2,
                    linewidth=0,
                )
        ax.set_xlabel(
            "training steps done (held-out evaluations)"
            if comp.metric.startswith("eval_")
            else "step"
        )
        ax.set_ylabel(comp.metric)
        ax.set_title(f"{comp.metric}: mean over seeds, 95% t band (mean +- t SE)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out


def plot_finals(comp: Comparison, path: str | Path) -> Path:
    """Per-seed final values per condition, with the mean and its 95% t interval (the
    mean alone where there is no interval: one seed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(comp.conditions)), 4.5))
    try:
        jitter = np.random.default_rng(0)
        for i, c in enumerate(comp.conditions):
            xs = i + jitter.uniform(-0.12, 0.12, size=len(c.final_values))
            ax.scatter(xs, c.final_values, s=18, alpha=0.7)
            iv = c.final
            if math.isfinite(iv.low) and math.isfinite(iv.high):
                ax.errorbar(
                    [i + 0.3],
                    [iv.estimate],
                    yerr=[[iv.estimate - iv.low], [iv.high - iv.estimate]],
                    fmt="o",
                    color="black",
                    capsize=4,
                )
            elif math.isfinite(iv.estimate):
                ax.plot([i + 0.3], [iv.estimate], "o", color="black")
        ax.set_xticks(range(len(comp.conditions)))
        ax.set_xticklabels([c.condition for c in comp.conditions], rotation=20, ha="right")
        final = (
            "the last evaluation"
            if comp.metric.startswith("eval_")
            else f"last {comp.final_window} steps"
        )
        ax.set_ylabel(f"{comp.metric} (final, {final})")
        ax.set_title("final value per seed; black: mean with 95% t CI")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out
