"""What `retrain status` reports: every run and campaign under a log directory.

A run directory holds any of metrics.jsonl, run.json, trainer_state.json; a campaign
directory holds manifest.json (its runs live in `runs/`). Both are read through
:mod:`retrain.logs.rundir`, tolerantly: a torn last JSONL line is skipped and reported, an
unreadable JSON file becomes a warning, and a run killed without a word shows up as
`stale` once its heartbeat is old.

States: finished, failed, interrupted, running (heartbeat fresh), dead (run.json says
running, was written on this host, and its process is gone: killed without a word),
stale (run.json says running but the heartbeat is older than `stale_after`: by default
3 x the median step time, at least 300 s; the process may live on another host or hang),
pending (a campaign run that has not started), unknown. A dead or stale run carries its
last step, its last checkpoint's step and the command that resumes it.
"""

from __future__ import annotations

import os
import shlex
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrain.logs.metrics import read_eval_rows
from retrain.logs.ownership import MIN_STALE_S, log_dir_holds, run_process_alive, typed_in
from retrain.logs.rundir import (
    MANIFEST,
    METRICS,
    RUN_INFO,
    RUN_MARKERS,
    TRAINER_STATE,
    CampaignDir,
    RunDir,
    as_int,
    as_number,
    is_run_dir,
)

RESUMABLE = ("dead", "stale", "interrupted")
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
    # The last held-out evaluation ([eval]): after how many steps, and its results.
    last_eval_step: int | None = None
    last_eval_correct_rate: float | None = None
    last_eval_pass_at_k: float | None = None
    median_step_s: float | None = None
    eta_s: float | None = None
    heartbeat_age_s: float | None = None
    exit_code: int | None = None
    pid: int | None = None
    host: str | None = None
    last_step: int | None = None  # the last logged step (0-based)
    checkpoint_step: int | None = None  # steps the last checkpoint holds
    resume_command: str | None = None  # for a dead, stale or interrupted run
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
    # The runs' last held-out correct rates ([eval]), when they evaluate.
    final_eval_correct_rates: list[float] = field(default_factory=list)

    @property
    def eval_mean(self) -> float | None:
        rates = self.final_eval_correct_rates
        return statistics.fmean(rates) if rates else None

    @property
    def eval_std(self) -> float | None:
        rates = self.final_eval_correct_rates
        return statistics.stdev(rates) if len(rates) >= 2 else (0.0 if rates else None)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "eval_mean": self.eval_mean, "eval_std": self.eval_std}


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


def _fill_eval(st: RunStatus, run: RunDir) -> None:
    """The last held-out evaluation: eval.jsonl, else the eval_* fields of metrics rows."""
    rows = read_eval_rows(run.path, run.metrics)
    if rows:
        last = rows[-1]
        st.last_eval_step = as_int(last.get("step"))
        st.last_eval_correct_rate = as_number(last.get("eval_correct_rate"))
        st.last_eval_pass_at_k = as_number(last.get("eval_pass_at_k"))


def _process_gone(st: RunStatus, started_at: object) -> bool:
    """run.json was written on this host by a process that no longer exists (or whose pid
    another process has taken since). Without a host (an older run.json) or from another
    host nothing is known: the heartbeat decides."""
    if st.pid is None or st.host != socket.gethostname():
        return False
    return not run_process_alive(st.pid, started_at)


def resume_command(run: RunDir) -> str:
    """The command that continues the run: its resolved config with `--resume` when a
    checkpoint exists, else the config alone: the run starts over, with `--overwrite` when
    it logged rows (moved aside: a run never writes into another run's files). It starts
    with `cd` into the directory the run was started in, when that is known: the relative
    paths of its config and checkpoints are read from there, so the command works from
    any directory and the run goes on writing where it did."""
    from retrain.checkpoint import STATE_FILE, run_workdir

    workdir = run_workdir(run.path, (RUN_INFO, STATE_FILE))  # the resolved config's
    resolved = run.path / "config.resolved.toml"
    configured = run.run_info.get("config")
    if resolved.is_file():
        config = typed_in(workdir, resolved)
    elif isinstance(configured, str) and configured:
        config = configured  # as typed where the run started
    else:
        config = "CONFIG.toml"
    command = f"retrain {shlex.quote(config)}"
    if (run.path / TRAINER_STATE).is_file():
        command += f" --resume {shlex.quote(typed_in(workdir, run.path))}"
    elif log_dir_holds(run.path)[0]:
        command += " --overwrite"
    return f"cd {shlex.quote(str(workdir))} && {command}" if workdir is not None else command


def _state(run: RunDir, st: RunStatus, stale_after: float | None) -> str:
    limit = stale_after
    if limit is None:
        limit = max(MIN_STALE_S, STALE_STEP_FACTOR * (st.median_step_s or 0.0))
    status = run.run_info.get("status")
    if run.finished or status == "finished":
        return "finished"
    if status in ("failed", "interrupted"):
        return status
    if status == "running" and _process_gone(st, run.run_info.get("started_at")):
        return "dead"
    if status == "running" or (not run.run_info and run.metrics):
        fresh = st.heartbeat_age_s is not None and st.heartbeat_age_s <= limit
        return "running" if fresh else "stale"
    if run.trainer_state:
        return "interrupted"  # a checkpoint but no live process record
    return "unknown"


def read_run(
    run_dir: str | Path | RunDir,
    *,
    now: float | None = None,
    stale_after: float | None = None,
    name: str | None = None,
) -> RunStatus:
    """The status of one run directory (a RunDir already read is not read again)."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    now = time.time() if now is None else now
    st = RunStatus(path=str(run.path), name=name or run.path.name, warnings=run.warnings)
    if run.corrupt_lines:
        st.corrupt_lines[str(run.path / METRICS)] = run.corrupt_lines
    st.condition = run.condition
    st.max_steps = run.max_steps
    st.steps_done = run.steps_done
    st.pid = as_int(run.run_info.get("pid"))
    host = run.run_info.get("host")
    st.host = host if isinstance(host, str) and host else None
    logged = [s for r in run.metrics if (s := as_int(r.get("step"))) is not None]
    st.last_step = max(logged) if logged else None
    st.checkpoint_step = as_int(run.trainer_state.get("step")) if run.has_checkpoint else None
    _fill_metrics(st, run.metrics)
    _fill_eval(st, run)
    heartbeat = run.heartbeat
    st.heartbeat_age_s = max(0.0, now - heartbeat) if heartbeat is not None else None
    st.state = _state(run, st, stale_after)
    if st.state == "running" and st.max_steps and st.median_step_s is not None:
        st.eta_s = st.median_step_s * max(0, st.max_steps - st.steps_done)
    elif st.state == "finished":
        st.eta_s = 0.0
    if st.state in RESUMABLE:
        st.resume_command = resume_command(run)
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
                final_eval_correct_rates=[
                    r.last_eval_correct_rate
                    for r in members
                    if r.last_eval_correct_rate is not None
                ],
            )
        )
    return out


def with_manifest(state: str, listed: Any) -> str:
    """A run's state from its own files, corrected by its campaign manifest's `listed`
    status: a run the campaign saw end (failed or interrupted) whose run.json still says
    running died without updating it, so it is what the manifest says."""
    if listed in ("failed", "interrupted") and state in ("running", "stale", "dead", "unknown"):
        return listed
    return state


def _listed_run(
    campaign: CampaignDir, entry: dict[str, Any], now: float | None, stale_after: float | None
) -> RunStatus:
    """A run the manifest lists; `pending` until its directory holds a run."""
    name = str(entry["name"])
    run_dir = campaign.run_dir(entry)
    if run_dir is not None and is_run_dir(run_dir):
        st = read_run(run_dir, now=now, stale_after=stale_after, name=name)
        st.state = with_manifest(st.state, entry.get("status"))
        st.resume_command = None  # a campaign resumes its runs itself
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
    elif r.state == "dead" and r.pid is not None:
        state = f"dead (pid {r.pid} gone)"
    elif r.state == "failed" and r.exit_code is not None:
        state = f"failed (exit {r.exit_code})"
    return [
        name,
        state,
        steps,
        _pct(r.last_correct_rate),
        _pct(r.running_correct_rate),
        _eval_cell(r),
        reward,
        _secs(r.median_step_s),
        _secs(r.eta_s) if r.state == "running" else "-",
    ]


def _eval_cell(r: RunStatus) -> str:
    """The last held-out correct rate and the step it was measured after."""
    if r.last_eval_correct_rate is None:
        return "-"
    return f"{_pct(r.last_eval_correct_rate)} @{r.last_eval_step}"


HEADER = ["RUN", "STATE", "STEPS", "CORRECT", "RUNNING", "EVAL", "REWARD", "STEP", "ETA"]
# What each column and state means: under the table (the columns, the states shown) and in
# `retrain status --help` (all of them).
COLUMNS = {
    "RUN": "the run's directory (in a campaign: CONDITION_sSEED)",
    "STATE": "see the states",
    "STEPS": "steps done / max_steps",
    "CORRECT": "correct rate of the last step (completions with reward >= 1)",
    "RUNNING": "correct rate over all the steps so far",
    "EVAL": "last held-out correct rate ([eval]) @ the steps trained before it",
    "REWARD": "mean reward over the logged steps",
    "STEP": "median time per step",
    "ETA": "time left at that pace (running runs)",
}
STATES = {
    "running": "its heartbeat in run.json is fresh",
    "finished": "it reached max_steps and saved its final adapter",
    "interrupted": "stopped by Ctrl-C or SIGTERM (or a checkpoint with no process record); "
    "resume it",
    "failed": "stopped by an error (its exit code in parentheses)",
    "dead": "run.json says running, but its process on this host is gone: killed without a "
    "word (out of memory, kill -9, a reboot); resume it",
    "stale": "run.json says running, but no heartbeat for --stale-after seconds (default 3 x "
    "its median step time, at least 300 s): on another host, or hung",
    "pending": "a campaign run that has not started",
    "unknown": "run files, but no status to read",
}


def legend(states: list[str] | None = None) -> list[str]:
    """The legend's lines: every column, and the states given (all when None)."""
    import textwrap

    columns = "; ".join(f"{k} {v}" for k, v in COLUMNS.items() if k != "STATE")
    lines = textwrap.wrap(f"Columns: {columns}.", width=96, subsequent_indent="  ")
    lines.append("States:")
    for state in (s for s in STATES if states is None or s in states):
        lines += textwrap.wrap(
            f"{state}: {STATES[state]}", width=96, initial_indent="  ", subsequent_indent="    "
        )
    return lines


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
    ]


def _resume_lines(runs: list[RunStatus], rel) -> list[str]:
    """For each run that stopped without finishing: where it stopped and how to go on."""
    lines = []
    for r in runs:
        if r.resume_command is None:
            continue
        last = "no step logged" if r.last_step is None else f"last step {r.last_step}"
        ckpt = (
            "no checkpoint: it starts over"
            if r.checkpoint_step is None
            else f"checkpoint at step {r.checkpoint_step}"
        )
        lines.append(f"  {rel(r.path)} is {r.state}: {last}, {ckpt}")
        lines.append(f"    resume: {r.resume_command}")
    return lines


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
        lines += _resume_lines(report.runs, rel)
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
            if cond.eval_mean is not None:
                final += (
                    f", held-out {100 * cond.eval_mean:.1f}% +- {100 * (cond.eval_std or 0.0):.1f}% "
                    f"(n={len(cond.final_eval_correct_rates)})"
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
    states = {r.state for r in report.runs} | {r.state for c in report.campaigns for r in c.runs}
    lines += ["", *legend(sorted(states))]
    if report.warnings:
        lines.append("")
        lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
