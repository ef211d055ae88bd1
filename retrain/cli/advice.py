"""Settings that are valid but probably not what was meant: `retrain explain` prints
these as warnings (nothing here refuses a run: the startup checks do that)."""

from __future__ import annotations

from retrain import hardware, registry
from retrain.cli.summaries import builtin_transform
from retrain.config import Config
from retrain.config.schema import away_from_defaults
from retrain.config.validate import asked_gpus
from retrain.logs import ownership


def advice(config: Config) -> list[str]:
    """Settings that are valid but probably not what was meant."""
    warnings = []
    algo = config.algorithm
    # a campaign's runs take their seeds from [campaign] seeds
    if config.campaign is None and config.training.seed == -1:
        warnings.append(
            "[training] seed = -1: the run is not reproducible; set a seed to compare conditions"
        )
    if config.campaign is not None and -1 in config.campaign.seeds:
        warnings.append(
            "[campaign] seeds include -1: those runs are unseeded and not reproducible; set a "
            "seed to compare conditions"
        )
    if algo.transform_mode.startswith("gtpo") and config.gtpo.beta == 0 and not algo.algorithm_mode:
        warnings.append("[gtpo] beta = 0: GTPO weighting is off, the transform reduces to its base")
    if algo.transform_mode == "gtpo_hicra" and config.hicra.alpha == 0:
        warnings.append("[hicra] alpha = 0: gtpo_hicra behaves exactly like gtpo")
    if config.reward.type == "gym" and config.data.source != "reasoning_gym":
        warnings.append(
            "[reward] type = gym scores with reasoning-gym's task scorer; it needs [data] source = reasoning_gym"
        )
    if config.eval.every > 0 and config.eval.temperature <= 0 and config.eval.samples > 1:
        warnings.append(
            f"[eval] samples = {config.eval.samples} with temperature 0: greedy samples are identical, "
            "so pass@k equals the correct rate; raise [eval] temperature for pass@k"
        )
    warnings += _data_keys_unread(config) + _eval_keys_unread(config)
    warnings += _flow_keys_unread(config) + _search_paths_advice(config)
    warnings += _wandb_advice(config) + _driver_advice(config)
    if config.data.source == "reasoning_gym" and config.reward.type == "math":
        warnings.append(
            "reasoning-gym answers are plain strings: reward 'match' or 'gym' fits them better than 'math'"
        )
    return warnings


def _driver_advice(config: Config) -> list[str]:
    """A GPU run whose torch is built for a newer CUDA major version than the driver
    runs: torch will see no GPU (the backend then refuses the devices), unless CUDA's
    forward-compatibility package stands in for the driver, hence a warning here."""
    info = registry.BACKENDS.entry(config.backend.backend)
    if info is None or "[backend] devices" in info.ignores:
        return []
    if not asked_gpus(config.backend.devices):
        return []
    build = hardware.torch_build()
    old = hardware.driver_too_old(build, hardware.driver_cuda()) if build and build.cuda else None
    if old is None:
        return []
    return [
        f"[backend] devices: {old[0]}, unless CUDA's forward-compatibility package is "
        f"installed. Fix: {old[1]}"
    ]


def resume_advice(config: Config, launch: ownership.Launch) -> list[str]:
    """How far `[resume] from` trains now, where its max_steps changed, and the settings
    it continues with changed (a batch or group size the checkpoint would override is an
    error of the startup checks)."""
    from retrain.checkpoint import load_state
    from retrain.config.diff import KEPT_BY_CHECKPOINT, resumed_with
    from retrain.errors import CheckpointError
    from retrain.startup import resume_changes, resume_horizon

    try:
        state = load_state(config.resume.from_) if config.resume.from_ else None
    except CheckpointError:  # an error of the startup checks
        return []
    if state is None:
        return []
    horizon = resume_horizon(config, launch.origin("training", "max_steps"))
    changes = [c for c in resume_changes(config) if (c.table, c.key) not in KEPT_BY_CHECKPOINT]
    return ([horizon] if horizon else []) + ([resumed_with(changes, state.step)] if changes else [])


def _wandb_advice(config: Config) -> list[str]:
    """`[logging] wandb_project` where wandb will not take the run (doctor says it too):
    wandb missing, or no login. The run goes on, logging to JSONL only."""
    import importlib.util

    from retrain.logs.wandb import LOGIN_FIX, login, not_logged_in

    project = config.logging.wandb_project
    if not project:
        return []
    if importlib.util.find_spec("wandb") is None:
        return [
            "[logging] wandb_project: is set but wandb is not installed, so the run logs to "
            "JSONL only. Fix: pip install 'retrain[wandb]'"
        ]
    if login()[0]:
        return []
    return [f"[logging] wandb_project: {not_logged_in(project)}. Fix: {LOGIN_FIX}"]


# [data] keys only some built-in sources read; set for another source, they do nothing.
_DATA_KEY_READERS = {
    "path": ("jsonl", "math"),
    "task": ("reasoning_gym",),
    "args": ("reasoning_gym",),
    "size": ("reasoning_gym",),
    "split": ("math",),
    "prompt_field": ("jsonl",),
    "answer_field": ("jsonl",),
}


def _data_keys_unread(config: Config) -> list[str]:
    """`[data]` keys set away from their defaults that the configured built-in source
    does not read (a plugin source may read any; an environment brings its own data)."""
    d = config.data
    if config.environment.provider or d.source not in ("jsonl", "math", "reasoning_gym"):
        return []
    changed = away_from_defaults(d, tuple(_DATA_KEY_READERS))
    return [
        f"[data] {key} is read by source {' and '.join(readers)} only; source "
        f"{d.source!r} ignores it (remove it, or set the source that reads it)"
        for key, readers in _DATA_KEY_READERS.items()
        if d.source not in readers and key in changed
    ]


def _eval_keys_unread(config: Config) -> list[str]:
    """`[eval]` keys set away from their defaults that no evaluation reads: any with
    `every = 0` (warned, not refused, so `--eval-every 0` turns a configured evaluation
    off), and `path` and `split` where the held-out set does not come from them."""
    e = config.eval
    if e.every <= 0:
        unread = [k for k in away_from_defaults(e) if k != "every"]
        if not unread:
            return []
        return [
            f"[eval] {', '.join(unread)}: read only with [eval] every > 0, and every = 0 "
            "turns the held-out evaluation off (remove them, or set every)"
        ]
    # evaluate.held_out_data: jsonl reads [eval] path, reasoning_gym draws from a seed
    # stream, an environment has its own eval dataset; math and plugin sources load split
    source, provider = config.data.source, config.environment.provider
    where = (
        "the environment's eval dataset"
        if provider
        else {"jsonl": "[eval] path", "reasoning_gym": "reasoning-gym's held-out seed stream"}.get(
            source, f"[data] source {source!r}"
        )
    )
    readers = {
        "path": "for [data] source 'jsonl' only",
        "split": "for [data] source 'math' and plugin sources only",
    }
    reads = {
        "path": source == "jsonl" and not provider,
        "split": source not in ("jsonl", "reasoning_gym") and not provider,
    }
    return [
        f"[eval] {key} is read {readers[key]}; the held-out set comes from {where} "
        "(remove it, or set the source that reads it)"
        for key in away_from_defaults(e, tuple(readers))
        if not reads[key]
    ]


def _search_paths_advice(config: Config) -> list[str]:
    """`[plugins] search_paths` entries that are no directory: nothing is imported from
    them (the default `plugins` is only there when a project has one)."""
    from pathlib import Path

    default = type(config.plugins)().search_paths
    bad = [
        p
        for p in config.plugins.search_paths
        if p not in default and not Path(p).expanduser().is_dir()
    ]
    return [
        f"[plugins] search_paths: {p!r} "
        f"{'is a file, not a directory' if Path(p).expanduser().is_file() else 'does not exist'} "
        "(relative paths are read from the directory retrain runs in); nothing is imported "
        "from it (remove it, or fix the path)"
        for p in bad
    ]


def _flow_keys_unread(config: Config) -> list[str]:
    """`[gtpo] beta`, `[hicra] alpha` and `[sepa]` keys set away from their defaults
    that the flow's built-in transform does not read. Not for a campaign (a condition
    may use them) nor a plugin transform or algorithm (it may read any)."""
    transform = builtin_transform(config)
    if config.campaign is None and transform is not None:
        return _unread_by(config, transform)
    return []


def _unread_by(config: Config, transform: str) -> list[str]:
    warnings = []
    fix = "(remove it, or set the transform that reads it)"
    if transform == "none" and away_from_defaults(config.gtpo, ("beta",)):
        warnings.append(
            f"[gtpo] beta = {config.gtpo.beta:g} is read by every transform but 'none'; "
            f"transform 'none' ignores it {fix}"
        )
    if transform != "gtpo_hicra" and away_from_defaults(config.hicra, ("alpha",)):
        warnings.append(
            f"[hicra] alpha = {config.hicra.alpha:g} is read by transform 'gtpo_hicra' only; "
            f"{transform!r} ignores it {fix}"
        )
    sepa = away_from_defaults(config.sepa)
    if "sepa" not in transform and sepa:
        warnings.append(
            f"[sepa] {', '.join(sepa)}: read by the SEPA transforms (gtpo_sepa, gtpo_sepa_amp, "
            f"gtpo_sepa_amp_c) only; {transform!r} ignores them (remove them, or set a SEPA "
            "transform)"
        )
    return warnings
