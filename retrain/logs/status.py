"""What `retrain status` reports: every run and campaign under a log directory.

A run directory holds any of metrics.jsonl, run.json, trainer_state.json; a campaign
directory holds manifest.json (its runs live in `runs/`). Both are read through
:mod:`retrain.logs.rundir`, tolerantly: a torn last JSONL line is skipped and reported, an
unreadable JSON file becomes a warning, and a run killed without a word shows up as
`stale` once its heartbeat is old.

States: finished, failed, interrupted, running (heartbeat fresh), stale (run.json says
running but the heartbeat is older than `stale_after`: by default 3 x the median step
time, at least 300 s), pending (a campaign run that has not started), unknown.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrain.logs.rundir import (
    MANIFEST,
    METRICS,
    RUN_MARKERS,
    CampaignDir,
    RunDir,
    as_int,
    as_number,
    is_run_dir,
)

MIN_STALE_S = 300.0
STALE_STEP_FACTOR = 3.0


@dataclass
class RunStatus:
    path: str
    name: str
    condition: str | None = None
    seed: int | None = None
    state: str = "unknown"
    steps_done: int = 0
    max_steps: int | None = None
    last_correct_rate: float | None = None
    running_correct_rate: float | None = None
    mean_reward: float | None = None  # over the logged steps
    last_reward: float | None = None
    median_step_s: float | None = None
    eta_s: float | None = None
    heartbeat_age_s: float | None = None
    exit_code: int | None = None
    corrupt_lines: dict[str, list[int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ConditionSummary:
    condition: str
    runs: int
    finished: int
    final_correct_rates: list[float]
    mean: float | None
    std: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CampaignStatus:
    path: str
    name: str
    state: str
    runs: list[RunStatus]
    conditions: list[ConditionSummary]
    squeeze: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "name": self.name,
            "state": self.state,
            "conditions": [c.as_dict() for c in self.conditions],
            "runs": [r.as_dict() for r in self.runs],
            "squeeze": self.squeeze,
            "warnings": self.warnings,
        }


@dataclass
class StatusReport:
    root: str
    runs: list[RunStatus]
    campaigns: list[CampaignStatus]
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "runs": [r.as_dict() for r in self.runs],
            "campaigns": [c.as_dict() for c in self.campaigns],
            "warnings": self.warnings,
        }


# ------------------------------------------------------------------ reading


def _fill_metrics(st: RunStatus, rows: list[dict[str, Any]]) -> None:
    """Correct rates and reward of the last row, mean reward and median step time."""
    if not rows:
        return
    last = rows[-1]
    st.last_correct_rate = as_number(last.get("correct_rate"))
    st.running_correct_rate = as_number(last.get("running_correct_rate"))
    st.last_reward = as_number(last.get("mean_reward"))
    rewards = [v for r in rows if (v := as_number(r.get("mean_reward"))) is not None]
    st.mean_reward = statistics.fmean(rewards) if rewards else None
    times = [v for r in rows if (v := as_number(r.get("step_time_s"))) is not None]
    st.median_step_s = statistics.median(times) if times else None


def _state(run: RunDir, st: RunStatus, stale_after: float | None) -> str:
    limit = stale_after
    if limit is None:
        limit = max(MIN_STALE_S, STALE_STEP_FACTOR * (st.median_step_s or 0.0))
    status = run.run_info.get("status")
    if run.finished or status == "finished":
        return "finished"
    if status in ("failed", "interrupted"):
        return status
    if status == "running" or (not run.run_info and run.metrics):
        fresh = st.heartbeat_age_s is not None and st.heartbeat_age_s <= limit
        return "running" if fresh else "stale"
    if run.trainer_state:
        return "interrupted"  # a checkpoint but no live process record
    return "unknown"


def read_run(
    run_dir: str | Path,
    *,
    now: float | None = None,
    stale_after: float | None = None,
    name: str | None = None,
) -> RunStatus:
    """The status of one run directory."""
    run = RunDir(run_dir)
    now = time.time() if now is None else now
    st = RunStatus(path=str(run.path), name=name or run.path.name, warnings=run.warnings)
    if run.corrupt_lines:
        st.corrupt_lines[str(run.path / METRICS)] = run.corrupt_lines
    st.condition = run.condition
    st.max_steps = run.max_steps
    st.steps_done = run.steps_done
    _fill_metrics(st, run.metrics)
    heartbeat = run.heartbeat
    st.heartbeat_age_s = max(0.0, now - heartbeat) if heartbeat is not None else None
    st.state = _state(run, st, stale_after)
    if st.state == "running" and st.max_steps and st.median_step_s is not None:
        st.eta_s = st.median_step_s * max(0, st.max_steps - st.steps_done)
    elif st.state == "finished":
        st.eta_s = 0.0
    return st


def _summarise(runs: list[RunStatus]) -> list[ConditionSummary]:
    groups: dict[str, list[RunStatus]] = {}
    for r in runs:
        groups.setdefault(r.condition or "?", []).append(r)
    out = []
    for cond, members in groups.items():
        finals = [r.last_correct_rate for r in members if r.last_correct_rate is not None]
        mean = statistics.fmean(finals) if finals else None
        std = statistics.stdev(finals) if len(finals) >= 2 else (0.0 if finals else None)
        out.append(
            ConditionSummary(
                condition=cond,
                runs=len(members),
                finished=sum(1 for r in members if r.state == "finished"),
                final_correct_rates=finals,
                mean=mean,
                std=std,
            )
        )
    return out


def _listed_run(
    campaign: CampaignDir, entry: dict[str, Any], now: float | None, stale_after: float | None
) -> RunStatus:
    """A run the manifest lists; `pending` until its directory holds a run."""
    name = str(entry["name"])
    run_dir = campaign.run_dir(entry)
    if run_dir is not None and is_run_dir(run_dir):
        st = read_run(run_dir, now=now, stale_after=stale_after, name=name)
        if entry.get("status") == "failed" and st.state in ("running", "stale", "unknown"):
            st.state = "failed"  # the process died without updating run.json
    else:
        st = RunStatus(path=str(run_dir or campaign.path / "runs" / name), name=name)
        st.state = "failed" if entry.get("status") == "failed" else "pending"
    label = entry.get("condition")  # the campaign's label (with its overrides) comes first
    st.condition = label if isinstance(label, str) and label else st.condition
    st.seed = as_int(entry.get("seed"))
    st.exit_code = as_int(entry.get("exit_code"))
    if st.max_steps is None:
        st.max_steps = as_int(campaign.manifest.get("max_steps"))
    return st


def _campaign_state(runs: list[RunStatus], manifest: dict[str, Any]) -> str:
    states = [r.state for r in runs]
    if "running" in states:
        return "running"
    if runs and all(s == "finished" for s in states):
        return "finished"
    if "failed" in states and "pending" not in states:
        return "failed"
    state = str(manifest.get("status") or "unknown")
    return "stale" if state == "running" else state


def read_campaign(
    campaign_dir: str | Path, *, now: float | None = None, stale_after: float | None = None
) -> CampaignStatus:
    campaign = CampaignDir(campaign_dir)
    entries = [e for e in campaign.entries or [] if e.get("name")]
    runs = [_listed_run(campaign, e, now, stale_after) for e in entries]
    listed = {str(e["name"]) for e in entries}
    for child in campaign.run_dirs():  # runs the manifest does not list (or no manifest)
        if child.name not in listed:
            runs.append(read_run(child, now=now, stale_after=stale_after))
    warnings = campaign.warnings + [w for r in runs for w in r.warnings]
    squeeze = campaign.manifest.get("squeeze")
    return CampaignStatus(
        path=str(campaign.path),
        name=campaign.path.name,
        state=_campaign_state(runs, campaign.manifest),
        runs=runs,
        conditions=_summarise(runs),
        squeeze=squeeze if isinstance(squeeze, dict) else None,
        warnings=warnings,
    )


# ------------------------------------------------------------------ discovery


def discover(root: str | Path) -> tuple[list[Path], list[Path]]:
    """(run dirs, campaign dirs) under root, root included; campaigns' own runs excluded
    from the first list. Sorted by path."""
    root = Path(root)
    runs: list[Path] = []
    campaigns: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        names = set(filenames)
        if MANIFEST in names:
            campaigns.append(here)
            dirnames[:] = []  # its runs are reported with it
            continue
        if names & set(RUN_MARKERS):
            runs.append(here)
        # skip folders that never hold runs
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in ("emergence", "adapter", "__pycache__")
            and not d.startswith(".")
            and not d.startswith("checkpoint_step_")
        )
    return sorted(runs), sorted(campaigns)


def collect(
    root: str | Path, *, now: float | None = None, stale_after: float | None = None
) -> StatusReport:
    run_dirs, campaign_dirs = discover(root)
    runs = [read_run(d, now=now, stale_after=stale_after) for d in run_dirs]
    campaigns = [read_campaign(d, now=now, stale_after=stale_after) for d in campaign_dirs]
    warnings = [w for r in runs for w in r.warnings] + [w for c in campaigns for w in c.warnings]
    return StatusReport(root=str(root), runs=runs, campaigns=campaigns, warnings=warnings)


# ------------------------------------------------------------------ rendering


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f}s"
    from retrain.logs.console import format_duration

    return format_duration(value)


def _run_row(r: RunStatus, name: str) -> list[str]:
    steps = f"{r.steps_done}/{r.max_steps}" if r.max_steps else str(r.steps_done)
    reward = "-" if r.mean_reward is None else f"{r.mean_reward:.3f}"
    state = r.state
    if r.state == "stale" and r.heartbeat_age_s is not None:
        state = f"stale ({_secs(r.heartbeat_age_s)} ago)"
    elif r.state == "failed" and r.exit_code is not None:
        state = f"failed (exit {r.exit_code})"
    return [
        name,
        state,
        steps,
        _pct(r.last_correct_rate),
        _pct(r.running_correct_rate),
        reward,
        _secs(r.median_step_s),
        _secs(r.eta_s) if r.state == "running" else "-",
    ]


HEADER = ["RUN", "STATE", "STEPS", "CORRECT", "RUNNING", "REWARD", "STEP", "ETA"]


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
    ]


def render(report: StatusReport) -> str:
    lines: list[str] = []
    if not report.runs and not report.campaigns:
        return f"No runs or campaigns under {report.root}."
    root = Path(report.root)

    def rel(path: str) -> str:
        try:
            text = str(Path(path).relative_to(root))
        except ValueError:
            return path
        return text if text != "." else str(root)

    if report.runs:
        lines.append(f"Runs under {report.root}:")
        lines += _table([HEADER] + [_run_row(r, rel(r.path)) for r in report.runs], "  ")
    for c in report.campaigns:
        if lines:
            lines.append("")
        counts: dict[str, int] = {}
        for r in c.runs:
            counts[r.state] = counts.get(r.state, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        lines.append(f"Campaign {rel(c.path)} [{c.state}]: {len(c.runs)} runs ({summary})")
        for cond in c.conditions:
            final = (
                "final correct -"
                if cond.mean is None
                else f"final correct {100 * cond.mean:.1f}% +- {100 * (cond.std or 0.0):.1f}% "
                f"(n={len(cond.final_correct_rates)})"
            )
            lines.append(f"  {cond.condition}: {cond.finished}/{cond.runs} finished, {final}")
            members = [r for r in c.runs if (r.condition or "?") == cond.condition]
            lines += _table([HEADER] + [_run_row(r, r.name) for r in members], "    ")
        if c.squeeze:
            if c.squeeze.get("error"):
                lines.append(f"  squeeze: failed ({c.squeeze['error']})")
            elif c.squeeze.get("recommended_rank") is not None:
                lines.append(
                    f"  squeeze: recommended rank {c.squeeze['recommended_rank']}"
                    f" (of {c.squeeze.get('source_rank', '?')}, from {c.squeeze.get('run', '?')})"
                )
    if report.warnings:
        lines.append("")
        lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
