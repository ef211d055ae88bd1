"""Turn a campaign config into one ordinary run config per condition x seed (pure).

Layout of a campaign directory::

    {campaign_dir}/manifest.json
    {campaign_dir}/base_config.toml
    {campaign_dir}/tinker_throttle/            (tinker backend with concurrent workers)
    {campaign_dir}/runs/{condition}_s{seed}/   the run's log_dir: run.toml, console.log,
                                               metrics.jsonl, emergence/, run.json, ...
    {campaign_dir}/runs/{condition}_s{seed}/adapter/   its adapter_path (checkpoints, final/)

`{condition}` is the condition's label (`maxrl+gtpo_sepa`, with overrides
`maxrl+gtpo_sepa~lr=0.0001`), made safe for a directory name by
`retrain.logs.rundir.run_dir_name`; the manifest, metrics rows and run.json keep the label.

The campaign directory is `campaign_YYYYMMDD_HHMMSS` inside the parent directory of
`[logging] log_dir` (so the default `logs/train` gives `logs/campaign_...`); a log_dir
without a parent directory (`log_dir = "results"`) holds the campaign itself.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from retrain.campaign.conditions import STANDARD_CONDITIONS, campaign_conditions
from retrain.config.conditions import Condition, condition_label
from retrain.config.schema import Config
from retrain.config.toml_writer import config_to_toml
from retrain.logs.rundir import run_dir_name

__all__ = [
    "STANDARD_CONDITIONS",
    "Condition",
    "RunSpec",
    "campaign_conditions",
    "check_runs",
    "condition_label",
    "expand_campaign",
    "expand_entries",
    "expand_run",
]

RUN_CONFIG = "run.toml"
CONSOLE_LOG = "console.log"
THROTTLE_DIR = "tinker_throttle"


@dataclass(frozen=True)
class RunSpec:
    """One run of a campaign: its identity, where it writes, and its full config."""

    name: str  # {condition}_s{seed}, the label made safe for a directory name
    condition: str  # the label: {advantage_mode}+{transform_mode}[~{key}={value},...]
    advantage_mode: str
    transform_mode: str
    seed: int
    log_dir: str
    adapter_path: str
    config_path: str  # runs/{name}/run.toml
    config: Config
    overrides: dict[str, Any] = field(default_factory=dict)  # {key as written: value}

    @property
    def console_log(self) -> str:
        return str(Path(self.log_dir) / CONSOLE_LOG)

    def toml(self) -> str:
        return config_to_toml(
            self.config,
            header=f"Run {self.name} of a retrain campaign (generated; edit the campaign TOML instead).",
        )


def run_name(condition: str, seed: int) -> str:
    return run_dir_name(condition, seed)


def campaign_root(config: Config) -> Path:
    """The directory that receives `campaign_YYYYMMDD_HHMMSS/`."""
    log_dir = Path(config.logging.log_dir)
    return log_dir.parent if log_dir.parent != Path(".") else log_dir


def campaign_dir_name(now: datetime) -> str:
    return f"campaign_{now:%Y%m%d_%H%M%S}"


def uses_throttle(config: Config) -> bool:
    """Tinker runs that may run at the same time share the throttle."""
    camp = config.campaign
    if camp is None or config.backend.backend != "tinker":
        return False
    return camp.parallel or camp.executor == "ray"


def expand_run(base: Config, condition: Condition, seed: int, campaign_dir: str | Path) -> RunSpec:
    """The run config for one condition x seed (the base is not modified). The
    condition's overrides are applied after the campaign's max_steps, so a condition may
    set its own max_steps."""
    campaign_dir = Path(campaign_dir)
    label = condition.label
    name = run_name(label, seed)
    run_dir = campaign_dir / "runs" / name
    cfg = copy.deepcopy(base)
    cfg.campaign = None
    cfg.squeeze = None
    cfg.algorithm.advantage_mode = condition.advantage_mode
    cfg.algorithm.transform_mode = condition.transform_mode
    cfg.algorithm.algorithm_mode = ""  # it would override the condition
    cfg.training.seed = seed
    if base.campaign is not None:
        cfg.training.max_steps = base.campaign.max_steps
    condition.apply(cfg)
    if condition.overrides or condition.name:
        _carry_label(cfg, label)
    cfg.resume.from_ = ""  # the campaign passes --resume per run when a checkpoint exists
    cfg.logging.log_dir = str(run_dir)
    cfg.backend.adapter_path = str(run_dir / "adapter")
    cfg.logging.wandb_run_name = name
    cfg.logging.wandb_group = label
    # wandb_tags is comma-separated: the modes and each override are tags of their own
    tags = [condition_label(condition.advantage_mode, condition.transform_mode)]
    tags += [f"{k}={v}" for k, v in condition.raw_overrides.items()] + [f"seed{seed}"]
    tags += [t.strip() for t in cfg.logging.wandb_tags.split(",") if t.strip() not in ("", *tags)]
    cfg.logging.wandb_tags = ",".join(tags)
    if base.campaign is not None and uses_throttle(_with_campaign(cfg, base)):
        cfg.backend.throttle_dir = cfg.backend.throttle_dir or str(campaign_dir / THROTTLE_DIR)
    return RunSpec(
        name=name,
        condition=label,
        advantage_mode=condition.advantage_mode,
        transform_mode=condition.transform_mode,
        seed=seed,
        log_dir=str(run_dir),
        adapter_path=str(run_dir / "adapter"),
        config_path=str(run_dir / RUN_CONFIG),
        config=cfg,
        overrides=condition.raw_overrides,
    )


def _with_campaign(cfg: Config, base: Config) -> Config:
    """The run config with the base's [campaign] table (shallow), for `uses_throttle`."""
    return dataclasses.replace(cfg, campaign=base.campaign)


def _carry_label(cfg: Config, label: str) -> None:
    """Metrics rows and run.json record `Config.condition`; a condition with overrides
    records its full label through `[logging] condition_label`, and so does a named one."""
    cfg.logging.condition_label = label


def expand_campaign(base: Config, campaign_dir: str | Path) -> list[RunSpec]:
    """Every condition x seed, condition-major (all seeds of the first condition first)."""
    if base.campaign is None:
        raise ValueError("expand_campaign needs a config with a [campaign] table")
    return [
        expand_run(base, condition, seed, campaign_dir)
        for condition in campaign_conditions(base)
        for seed in base.campaign.seeds
    ]


def expand_entries(
    base: Config, entries: Iterable[tuple[Condition, int]], campaign_dir: str | Path
) -> list[RunSpec]:
    """Runs for explicit (condition, seed) entries (a resumed manifest)."""
    return [expand_run(base, condition, seed, campaign_dir) for condition, seed in entries]


def check_runs(runs: Iterable[RunSpec]) -> list[str]:
    """Reload each run's TOML the way the run will, and collect every problem."""
    import tomllib

    from retrain.config.load import config_from_dict
    from retrain.errors import ConfigError

    problems: list[str] = []
    for run in runs:
        try:
            config_from_dict(tomllib.loads(run.toml()))
        except ConfigError as exc:
            problems.extend(f"{run.name}: {p}" for p in exc.problems)
    return problems
