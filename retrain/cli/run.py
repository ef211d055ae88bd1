"""`retrain [CONFIG] [--flags] [--overwrite]`: train, run a campaign, or run a standalone
squeeze."""

from __future__ import annotations

import argparse
import importlib.util
import os
import warnings
from pathlib import Path

from retrain.cli.args import split_config_args
from retrain.config import DEFAULT_CONFIG, load_config, load_dotenv
from retrain.errors import ConfigError, UsageError


def config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The config path (given anywhere among the arguments, default ./retrain.toml) and
    the flags. None when no path was given and there is no ./retrain.toml while flags
    were: the run uses the built-in defaults plus those flags (the original's `retrain
    --lr 1e-4` form). Bare `retrain` with no config still asks for one."""
    path, flags = split_config_args(argv)
    if path is None and flags and not Path(DEFAULT_CONFIG).is_file():
        return None, flags
    return path or DEFAULT_CONFIG, flags


def is_standalone_squeeze(config) -> bool:
    return (
        config.squeeze is not None and config.campaign is None and bool(config.squeeze.adapter_path)
    )


def quiet_libraries() -> None:
    """What transformers prints on every run is not the user's business: its info and
    warning logging, its own progress bars ("Loading weights", "Writing model shards") and
    the deprecation warnings raised from its (and peft's) own code, which the user cannot
    act on. retrain's lines, the hub's download bars and other warnings stay. A
    TRANSFORMERS_VERBOSITY the user set wins."""
    for library in ("transformers", "peft"):
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=rf"{library}(\.|$)")
    if importlib.util.find_spec("transformers") is None:
        return  # the run reports the missing extra itself
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    downloads_shown = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # also turns the hub's off: put those back
    if downloads_shown:
        enable_progress_bars()
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        transformers_logging.set_verbosity_error()


def refuse_overwrite(config) -> None:
    """--overwrite starts a training run over; anywhere else it would do nothing."""
    if config.campaign is not None:
        raise UsageError(
            "--overwrite: a campaign never reuses a directory (each one starts in a new "
            "campaign_YYYYmmdd-HHMMSS directory), so there is nothing to move aside. Fix: drop "
            "--overwrite; continue a campaign with --resume CAMPAIGN_DIR"
        )
    if config.resume.from_:
        raise UsageError(
            f"--overwrite with [resume] from = {config.resume.from_}: resuming continues that "
            "run in its own directory, --overwrite would move it aside and start over. Fix: "
            "drop one of the two"
        )
    if is_standalone_squeeze(config):
        raise UsageError("--overwrite applies to a training run, not to a standalone squeeze")


def own_switches(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """`--overwrite` (a switch of the run, not a config key) and the other arguments."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--overwrite", action="store_true")
    return parser.parse_known_args(argv)


def started_elsewhere(flags: list[str]) -> str | None:
    """For a config that failed to load with `--resume DIR`: when that run was started in
    another directory, the relative paths of its config (a data file, a reward module)
    were read from there; the command that resumes it from there."""
    from retrain.checkpoint import workdir_elsewhere
    from retrain.config.load import parse_overrides
    from retrain.logs.rundir import RunDir
    from retrain.logs.status import resume_command

    resume = parse_overrides(flags)[0].get("resume", {}).get("from")
    if not isinstance(resume, str) or not Path(resume).expanduser().is_dir():
        return None
    workdir = workdir_elsewhere(Path(resume).expanduser())
    if workdir is None:
        return None
    return (
        f"[resume] from: the run in {resume} was started in {workdir}, and a config's "
        "relative paths are read from the directory retrain runs in: if a path above is "
        f"one of them, resume from there: {resume_command(RunDir(Path(resume).expanduser()))}"
    )


def main(argv: list[str]) -> int:
    switches, rest = own_switches(argv)
    path, flags = config_path(rest)
    if load_dotenv():
        print("Loaded .env")
    if path is None:
        print(f"No ./{DEFAULT_CONFIG}: running on the built-in defaults plus the flags given")
    try:
        config = load_config(path, flags)
    except ConfigError as exc:
        note = started_elsewhere(flags)
        if note is None:
            raise
        raise ConfigError([*exc.problems, note], exc.source) from exc
    if switches.overwrite:
        refuse_overwrite(config)
    if config.campaign is not None:
        from retrain.campaign.run import run_campaign

        return run_campaign(config, config_path=path)
    if is_standalone_squeeze(config):
        from retrain.cli.squeeze import run_standalone

        return run_standalone(config, path, flags)
    from retrain.logs.ownership import launch_for
    from retrain.trainer import train

    quiet_libraries()
    launch = launch_for(path, flags, overwrite=switches.overwrite)
    return train(config, config_path=path, launch=launch)
