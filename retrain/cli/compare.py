"""`retrain compare LOGDIR... [--metric M] [--baseline C] [--out DIR]`: compare conditions
across seeds with t intervals, permutation tests, a Fisher test and learning curves.

The analysis lives in the :mod:`retrain.compare` package; this module parses arguments
and writes the terminal table, `compare.md`, `compare.json` and the PNG plots.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from retrain.compare import (
    DEFAULT_FINAL_WINDOW,
    DEFAULT_RESAMPLES,
    Comparison,
    collect_runs,
    compare_runs,
    plot_curves,
    plot_finals,
    render_markdown,
    render_text,
)
from retrain.compare.comparison import NoValues
from retrain.compare.runs import RunData
from retrain.errors import RetrainError, UsageError
from retrain.logs.rundir import run_dir_holding


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="retrain compare",
        description=(
            "Compare conditions across seeds: final and AUC means with 95% t intervals, "
            "differences against a baseline with Welch intervals and permutation p-values, a "
            "Fisher test on pooled correct counts (correct rates), and learning-curve plots. "
            "LOGDIR is a run directory (metrics.jsonl), a campaign directory (manifest.json), "
            "or a folder holding them."
        ),
    )
    p.add_argument("logdirs", nargs="+", metavar="LOGDIR")
    p.add_argument(
        "--metric",
        action="append",
        default=None,
        help="metrics.jsonl field to compare (repeatable or comma-separated; default correct_rate, "
        "plus the held-out eval_correct_rate when the runs evaluated)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="condition the others are compared with (default grpo+none if present, else the "
        "first); a metric added by default that it has no values of is skipped with a warning",
    )
    p.add_argument(
        "--out",
        default=None,
        help="write compare.md, compare.json and PNGs here (never into a run's log directory)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="compare steps 0..N-1 (default: the steps every run has); shorter runs are dropped",
    )
    p.add_argument(
        "--final-window",
        type=int,
        default=DEFAULT_FINAL_WINDOW,
        help=f"'final' = mean of the last N steps (default {DEFAULT_FINAL_WINDOW})",
    )
    p.add_argument(
        "--resamples",
        type=int,
        default=DEFAULT_RESAMPLES,
        help=f"Monte Carlo permutations, when there are too many relabellings to enumerate "
        f"(default {DEFAULT_RESAMPLES})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the resampling (default 0)")
    p.add_argument(
        "--smooth", type=int, default=1, help="trailing moving average for the curves (steps)"
    )
    p.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG files")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _metrics(values: list[str] | None, runs: Sequence[RunData] = ()) -> tuple[list[str], bool]:
    """(the metrics asked for, whether they are the default): by default correct_rate,
    plus the held-out eval_correct_rate when any run evaluated ([eval])."""
    default = ["correct_rate"]
    if any(r.has_metric("eval_correct_rate") for r in runs):
        default.append("eval_correct_rate")
    out: list[str] = []
    for v in values or []:
        out += [m.strip() for m in v.split(",") if m.strip()]
    return (list(dict.fromkeys(out)), False) if out else (default, True)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _check(args: argparse.Namespace) -> None:
    if args.final_window < 1:
        raise UsageError("--final-window must be >= 1")
    if args.resamples < 100:
        raise UsageError("--resamples must be >= 100")
    if args.steps is not None and args.steps < 1:
        raise UsageError("--steps must be >= 1")
    if args.smooth < 1:
        raise UsageError("--smooth must be >= 1")
    run = run_dir_holding(args.out) if args.out else None
    if run is not None:
        raise UsageError(
            f"--out {args.out} is inside the log directory of a run ({run}); a command never "
            "writes into a run's files. Fix: --out another directory, e.g. --out compare_out"
        )


def _write_plots(comparisons: list[Comparison], out: Path) -> dict[str, list[Path]]:
    """The PNGs of each metric; none (with a warning) when matplotlib is missing."""
    plots: dict[str, list[Path]] = {}
    for comp in comparisons:
        try:
            curve = plot_curves(comp, out / f"curves_{_safe(comp.metric)}.png")
            final = plot_finals(comp, out / f"final_{_safe(comp.metric)}.png")
        except RetrainError as exc:
            print(f"warning: {exc}; no plots written", file=sys.stderr)
            break
        plots[comp.metric] = [curve, final]
    return plots


def _write_report(comparisons: list[Comparison], out: Path, plots: bool) -> list[Path]:
    """compare.md, compare.json and (unless `plots` is false) the PNGs; what was written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RetrainError(f"cannot create {out}: {exc.strerror or exc}") from exc
    pngs = _write_plots(comparisons, out) if plots else {}
    images = {metric: [p.name for p in paths] for metric, paths in pngs.items()}
    md = out / "compare.md"
    md.write_text(render_markdown(comparisons, images), encoding="utf-8")
    js = out / "compare.json"
    js.write_text(
        json.dumps({"comparisons": [c.as_dict() for c in comparisons]}, indent=2) + "\n",
        encoding="utf-8",
    )
    return [md, js, *(p for paths in pngs.values() for p in paths)]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    warnings: list[str] = []
    runs, order = collect_runs(args.logdirs, warnings)
    metrics, by_default = _metrics(args.metric, runs)
    comparisons, skipped = [], []
    for metric in metrics:
        try:
            comp = compare_runs(
                runs,
                metric,
                order=order,
                baseline=args.baseline,
                n_resamples=args.resamples,
                seed=args.seed,
                final_window=args.final_window,
                horizon=args.steps,
                smooth=args.smooth,
            )
        except NoValues as exc:
            if not by_default:  # a metric the user named fails
                raise
            skipped.append(exc)  # one retrain added: said, and the others compared
            warnings.append(f"{metric} not compared: {exc}")
            continue
        comparisons.append(comp)
    if not comparisons:
        raise skipped[0]
    for comp in comparisons:
        comp.warnings[:0] = warnings
    written = _write_report(comparisons, Path(args.out), not args.no_plots) if args.out else []

    if args.json:
        print(json.dumps({"comparisons": [c.as_dict(curves=False) for c in comparisons]}, indent=2))
        return 0
    # the runs and conditions the comparisons use, not those found and skipped
    used = {path for comp in comparisons for c in comp.conditions for path in c.runs}
    conditions = ", ".join(
        dict.fromkeys(c.condition for comp in comparisons for c in comp.conditions)
    )
    print(f"{len(used)} runs, conditions: {conditions}")
    for comp in comparisons:
        print()
        print(render_text(comp))
    if written:
        print()
        print("Wrote " + ", ".join(str(p) for p in written))
    return 0
