"""The runs `retrain compare` analyses, read through :mod:`retrain.logs.rundir`.

A path given to `retrain compare` is a run directory (metrics.jsonl), a campaign
directory (manifest.json, its runs under `runs/`: those the manifest lists, a warning
naming the others), or a folder holding either a few levels down. Each run becomes a
:class:`RunData`: its condition, seed and one metrics row per step, plus its held-out
evaluations (eval.jsonl, `[eval]`): an `eval_*` metric is read from those, by the number
of training steps done when each ran (0 = before training), so its curve starts at the
base model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from retrain.errors import UsageError
from retrain.logs.metrics import read_eval_rows
from retrain.logs.rundir import MANIFEST, METRICS, CampaignDir, RunDir, as_int, as_number
from retrain.logs.status import read_run, with_manifest

MAX_SEARCH_DEPTH = 5
EVAL_PREFIX = "eval_"
FINISHED = "finished"


def is_eval_metric(metric: str) -> bool:
    """Whether `metric` is a held-out evaluation field (eval.jsonl) rather than a step's."""
    return metric.startswith(EVAL_PREFIX)


@dataclass
class RunData:
    """One run (one condition x one seed) as compare sees it."""

    source: RunDir
    condition: str
    seed: int | None
    listed_status: str | None = None  # the campaign manifest's status of this run

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One metrics row per step, by step."""
        return self.source.step_rows

    @property
    def label(self) -> str:
        return f"{self.condition}_s{self.seed}" if self.seed is not None else str(self.path)

    @property
    def num_steps(self) -> int:
        """Steps logged (the horizon this run reaches: last step + 1)."""
        return self.rows[-1]["step"] + 1 if self.rows else 0

    @property
    def problems(self) -> list[str]:
        """What could not be read of this run's files (torn or corrupt metrics or eval
        lines, an unreadable run.json, ...): reading them here, so nothing damaged passes
        unsaid."""
        _ = self.source.metrics, self.source.run_info, self.source.trainer_state, self.eval_rows
        return list(self.source.warnings)

    @cached_property
    def unfinished(self) -> str | None:
        """How the run stands when its records say it did not finish ("failed, 12 of 20
        steps done"), as `retrain status` reads it (a "running" run whose process is gone is
        dead); None when it finished or nothing records how it stands (no run.json,
        checkpoint or manifest status)."""
        source, listed = self.source, self.listed_status
        if listed == FINISHED or not (source.run_info or source.trainer_state or listed):
            return None
        st = read_run(source)  # the files compare has read already
        state = with_manifest(st.state, listed)
        if state == FINISHED:
            return None
        steps = f"{st.steps_done} of {st.max_steps}" if st.max_steps else str(st.steps_done)
        return f"{state}, {steps} steps done"

    def missing_steps(self, metric: str, horizon: int) -> list[int]:
        """The steps < horizon without a value of `metric` (a lost or corrupt row)."""
        steps, _ = self.series(metric, horizon)
        return sorted(set(range(horizon)) - set(steps.tolist()))

    @cached_property
    def eval_rows(self) -> list[dict[str, Any]]:
        """One row per held-out evaluation, by the number of training steps done."""
        return read_eval_rows(self.path, self.source.metrics, self.source.warnings)

    def _rows_for(self, metric: str) -> list[dict[str, Any]]:
        return self.eval_rows if is_eval_metric(metric) else self.rows

    def has_metric(self, metric: str) -> bool:
        return any(as_number(r.get(metric)) is not None for r in self._rows_for(metric))

    def series(self, metric: str, horizon: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the metric for steps < horizon, non-finite values dropped.
        An eval_* metric's steps count the training steps done, so its evaluations up to
        and including `horizon` (the one after the last compared step) are kept."""
        steps, values = [], []
        limit = None if horizon is None else horizon + int(is_eval_metric(metric))
        for r in self._rows_for(metric):
            if limit is not None and r["step"] >= limit:
                break
            v = as_number(r.get(metric))
            if v is not None:
                steps.append(r["step"])
                values.append(v)
        return np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64)

    def correct_counts(
        self, horizon: int | None = None, metric: str = "correct_rate"
    ) -> tuple[int, int] | None:
        """(correct, completions) pooled over steps < horizon, or None when unknown. For an
        eval_* metric: the counts of the last held-out evaluation up to `horizon`."""
        if not is_eval_metric(metric):
            return self.source.correct_counts(horizon)
        rows = [r for r in self.eval_rows if horizon is None or r["step"] <= horizon]
        if not rows:
            return None
        correct = as_int(rows[-1].get("eval_num_correct"))
        total = as_int(rows[-1].get("eval_num_completions"))
        return (correct, total) if correct is not None and total else None


def load_run(
    run_dir: str | Path,
    *,
    condition: str | None = None,
    seed: int | None = None,
) -> RunData:
    """A run directory; condition and seed default to what the run's files say."""
    source = RunDir(run_dir)
    return RunData(
        source,
        condition or source.condition or source.path.name,
        seed if seed is not None else source.seed,
    )


def _from_entry(
    campaign: CampaignDir, entry: dict[str, Any], warnings: list[str]
) -> RunData | None:
    run_dir = campaign.run_dir(entry)
    if run_dir is None or not (run_dir / METRICS).is_file():
        label = f"{entry.get('condition', '?')}_s{entry.get('seed', '?')}"
        warnings.append(
            f"campaign {campaign.path.name}: run {label} has no metrics.jsonl yet "
            f"(status {entry.get('status', 'unknown')}); skipped"
        )
        return None
    condition, status = entry.get("condition"), entry.get("status")
    run = load_run(
        run_dir,
        condition=condition if isinstance(condition, str) else None,
        seed=as_int(entry.get("seed")),
    )
    run.listed_status = status if isinstance(status, str) else None
    return run


def load_campaign(campaign_dir: str | Path, warnings: list[str]) -> tuple[list[RunData], list[str]]:
    """The runs of a campaign (manifest.json + runs/*) and its condition order."""
    campaign = CampaignDir(campaign_dir)
    entries = campaign.entries
    if entries is None:
        # unreadable (campaign.warnings says why), or read but without a runs list
        why = "; ".join(campaign.warnings) or f"{campaign.path / MANIFEST} has no 'runs' list"
        warnings.append(f"{why}; scanning {campaign.path / 'runs'} instead")
        entries = [{"log_dir": str(p)} for p in campaign.run_dirs()]
    runs = [r for e in entries if (r := _from_entry(campaign, e, warnings)) is not None]
    listed = {d.resolve() for e in entries if (d := campaign.run_dir(e)) is not None}
    unlisted = [p.name for p in campaign.run_dirs() if p.resolve() not in listed]
    if unlisted:
        warnings.append(
            f"campaign {campaign.path.name}: left out {len(unlisted)} run(s) under runs/ that "
            f"its {MANIFEST} does not list: {', '.join(unlisted[:10])}"
            + (" ..." if len(unlisted) > 10 else "")
            + " (pass a run's directory itself to compare it)"
        )
    return runs, list(dict.fromkeys(r.condition for r in runs))


def _found_under(root: Path, warnings: list[str]) -> list[RunData]:
    """Runs and campaigns in the folders under root (a few levels; runs do not nest)."""
    found: list[RunData] = []
    for here, dirs, files in os.walk(root):
        dirs.sort()
        if len(Path(here).relative_to(root).parts) >= MAX_SEARCH_DEPTH:
            dirs[:] = []
        if MANIFEST in files:
            found += load_campaign(Path(here), warnings)[0]
            dirs[:] = []
        elif METRICS in files:
            found.append(load_run(Path(here)))
            dirs[:] = []
    return found


def _runs_at(raw: str | Path, warnings: list[str]) -> list[RunData]:
    p = Path(raw)
    if p.is_file() and p.name in (METRICS, MANIFEST):
        p = p.parent
    if not p.exists():
        raise UsageError(f"{raw}: no such file or directory")
    if (p / MANIFEST).is_file():
        return load_campaign(p, warnings)[0]
    if (p / METRICS).is_file():
        return [load_run(p)]
    found = _found_under(p, warnings)
    if not found:
        warnings.append(f"{raw}: no run (metrics.jsonl) or campaign (manifest.json) found")
    return found


def collect_runs(
    paths: Sequence[str | Path], warnings: list[str]
) -> tuple[list[RunData], list[str]]:
    """Runs from run dirs, campaign dirs, or directories holding either (searched a few
    levels deep), each run once. Returns (runs, condition order of first appearance)."""
    runs: list[RunData] = []
    seen: set[Path] = set()
    for raw in paths:
        for run in _runs_at(raw, warnings):
            key = run.path.resolve()
            if key not in seen:
                seen.add(key)
                runs.append(run)
    if not runs:
        raise UsageError(
            "no runs to compare: pass run directories (holding metrics.jsonl) or a campaign "
            "directory (holding manifest.json), e.g. retrain compare logs/campaign_20250101_120000"
        )
    return runs, list(dict.fromkeys(r.condition for r in runs))
