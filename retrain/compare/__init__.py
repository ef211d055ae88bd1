"""Comparing training conditions across seeds: the analysis behind `retrain compare`.

- :mod:`retrain.compare.stats`: t and Welch intervals, permutation and Fisher tests, Holm
  (scipy.stats, imported on use);
- :mod:`retrain.compare.runs`: the runs to compare, read through
  :mod:`retrain.logs.rundir`;
- :mod:`retrain.compare.comparison`: one metric over the conditions of those runs;
- :mod:`retrain.compare.render` and :mod:`retrain.compare.plots`: tables, markdown, PNGs.

Unit of analysis: one run (one condition x one seed). For a metric (default
``correct_rate``) and a step horizon H shared by every run (steps 0..H-1), each run gives
two numbers:

- **final**: the mean of the metric over the run's last ``final_window`` logged steps
  before H (one step's batch is noisy; a short window steadies it);
- **AUC**: the mean of the metric over all logged steps before H, i.e. the area under
  the learning curve divided by its length (a normalised AUC in the metric's own units).

Per condition, the mean of these over seeds gets a 95% t interval (none with one seed).
Each condition is compared with the baseline by the difference of means (condition -
baseline) with Welch's t interval (unequal variances, Welch-Satterthwaite degrees of
freedom) and a two-sided permutation test of the difference of means (exact when the
number of relabellings is small, Monte Carlo otherwise). The seeds are the replicates,
so with n seeds per side the smallest attainable permutation p-value is
1 / C(2n, n) x 2 (0.1 for 3 vs 3, 0.0002 for 8 vs 8).

Fisher's exact test on pooled counts, for ``correct_rate`` and ``eval_correct_rate`` only
(the metrics that are counts): every completion of every compared step is a
Bernoulli trial (correct or not); the counts of a condition are pooled over its seeds
and steps, and the 2x2 table condition/baseline x correct/incorrect is tested. It has
much more power than the seed-level tests but treats completions as independent, which
they are not (they share a run's weights and prompts): read it as a descriptive check
and trust the seed-level tests for claims. Per-step counts come from ``metrics.jsonl``'s
``num_correct`` and ``num_completions``; for rows written before those fields,
``round(correct_rate * batch_size * group_size)`` of ``batch_size * group_size``, or
``emergence/generations.jsonl`` when the sizes are missing or dynamic sampling took
extra rounds.

Holm's step-down correction is applied within each family of p-values (final, AUC,
Fisher) over the conditions compared with the baseline.
"""

from retrain.compare.comparison import DEFAULT_FINAL_WINDOW, Comparison, compare_runs
from retrain.compare.plots import plot_curves, plot_finals
from retrain.compare.render import render_markdown, render_text
from retrain.compare.runs import RunData, collect_runs, load_run
from retrain.compare.stats import DEFAULT_RESAMPLES

__all__ = [
    "DEFAULT_FINAL_WINDOW",
    "DEFAULT_RESAMPLES",
    "Comparison",
    "RunData",
    "collect_runs",
    "compare_runs",
    "load_run",
    "plot_curves",
    "plot_finals",
    "render_markdown",
    "render_text",
]
