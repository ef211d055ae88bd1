"""Turn a campaign config into one ordinary run config per condition x seed (pure).

Layout of a campaign directory::

    {campaign_dir}/manifest.json
    {campaign_dir}/base_config.toml
    {campaign_dir}/tinker_throttle/            (tinker backend with concurrent workers)
    {campaign_dir}/runs/{condition}_s{seed}/   the run's log_dir: run.toml, console.log,
                                               metrics.jsonl, emergence/, run.json, ...
    {campaign_dir}/runs/{condition}_s{seed}/adapter/   its adapter_path (checkpoints, final/)

The campaign directory is `campaign_YYYYMMDD_HHMMSS` inside the parent directory of
`[logging] log_dir` (so the default `logs/train` gives `logs/campaign_...`); a log_dir
without a parent directory (`log_dir = "results"`) holds the campaign itself.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from retrain.config.schema import Config
from retrain.config.toml_writer import config_to_toml

STANDARD_CONDITIONS: tuple[tuple[str, str], ...] = (
    ("grpo", "none"),
    ("maxrl", "none"),
    ("maxrl", "gtpo"),
    ("maxrl", "gtpo_hicra"),
    ("maxrl", "gtpo_sepa"),
)

RUN_CONFIG = "run.toml"
CONSOLE_LOG = "console.log"
THROTTLE_DIR = "tinker_throttle"


@dataclass(frozen=True)
class RunSpec:
    """One run of a campaign: its identity, where it writes, and its full config."""

    name: str  # {condition}_s{seed}
    condition: str  # {advantage_mode}+{transform_mode}
    advantage_mode: str
    transform_mode: str
    seed: int
    log_dir: str
    adapter_path: str
    config_path: str  # runs/{name}/run.toml
    config: Config

    @property
    def console_log(self) -> str:
        return str(Path(self.log_dir) / CONSOLE_LOG)

    def toml(self) -> str:
        return config_to_toml(
            self.config,
            header=f"Run {self.name} of a retrain campaign (generated; edit the campaign TOML instead).",
        )


def condition_pairs(config: Config) -> list[tuple[str, str]]:
    """(advantage_mode, transform_mode) pairs: `[[campaign.conditions]]`, else the five
    standard conditions."""
    conds = config.campaign.conditions if config.campaign is not None else []
    pairs = [(c["advantage_mode"], c["transform_mode"]) for c in conds]
    return pairs or list(STANDARD_CONDITIONS)


def condition_label(advantage_mode: str, transform_mode: str) -> str:
    return f"{advantage_mode}+{transform_mode}"


def run_name(condition: str, seed: int) -> str:
    return f"{condition}_s{seed}"


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


def expand_run(
    base: Config,
    advantage_mode: str,
    transform_mode: str,
    seed: int,
    campaign_dir: str | Path,
) -> RunSpec:
    """The run config for one condition x seed (the base is not modified)."""
    campaign_dir = Path(campaign_dir)
    condition = condition_label(advantage_mode, transform_mode)
    name = run_name(condition, seed)
    run_dir = campaign_dir / "runs" / name
    cfg = copy.deepcopy(base)
    cfg.campaign = None
    cfg.squeeze = None
    cfg.algorithm.advantage_mode = advantage_mode
    cfg.algorithm.transform_mode = transform_mode
    cfg.algorithm.algorithm_mode = ""  # it would override the condition
    cfg.training.seed = seed
    if base.campaign is not None:
        cfg.training.max_steps = base.campaign.max_steps
    cfg.resume.from_ = ""  # the campaign passes --resume per run when a checkpoint exists
    cfg.logging.log_dir = str(run_dir)
    cfg.backend.adapter_path = str(run_dir / "adapter")
    cfg.logging.wandb_run_name = name
    cfg.logging.wandb_group = condition
    tags = [condition, f"seed{seed}"]
    tags += [t.strip() for t in base.logging.wandb_tags.split(",") if t.strip() not in ("", *tags)]
    cfg.logging.wandb_tags = ",".join(tags)
    if uses_throttle(base):
        cfg.backend.throttle_dir = base.backend.throttle_dir or str(campaign_dir / THROTTLE_DIR)
    return RunSpec(
        name=name,
        condition=condition,
        advantage_mode=advantage_mode,
        transform_mode=transform_mode,
        seed=seed,
        log_dir=str(run_dir),
        adapter_path=str(run_dir / "adapter"),
        config_path=str(run_dir / RUN_CONFIG),
        config=cfg,
    )


def expand_campaign(base: Config, campaign_dir: str | Path) -> list[RunSpec]:
    """Every condition x seed, condition-major (all seeds of the first condition first)."""
    if base.campaign is None:
        raise ValueError("expand_campaign needs a config with a [campaign] table")
    return [
        expand_run(base, adv, transform, seed, campaign_dir)
        for adv, transform in condition_pairs(base)
        for seed in base.campaign.seeds
    ]


def expand_pairs(
    base: Config, entries: Iterable[tuple[str, str, int]], campaign_dir: str | Path
) -> list[RunSpec]:
    """Runs for explicit (advantage_mode, transform_mode, seed) entries (a resumed manifest)."""
    return [expand_run(base, adv, tr, seed, campaign_dir) for adv, tr, seed in entries]


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
