"""`retrain [CONFIG] [--flags]`: train, run a campaign, or run a standalone squeeze."""

from __future__ import annotations

from pathlib import Path

from retrain.config import DEFAULT_CONFIG, load_config, load_dotenv


def split_path(argv: list[str]) -> tuple[str, list[str]]:
    """The config path is the first token that is not a flag or a flag's value."""
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return DEFAULT_CONFIG, argv


def config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """Like split_path, but None when no path was given and there is no ./retrain.toml
    while flags were: the run uses the built-in defaults plus those flags (the original's
    `retrain --lr 1e-4` form). Bare `retrain` with no config still asks for one."""
    path, flags = split_path(argv)
    explicit = bool(argv) and not argv[0].startswith("-")
    if not explicit and flags and not Path(DEFAULT_CONFIG).is_file():
        return None, flags
    return path, flags


def is_standalone_squeeze(config) -> bool:
    return (
        config.squeeze is not None and config.campaign is None and bool(config.squeeze.adapter_path)
    )


def main(argv: list[str]) -> int:
    path, flags = config_path(argv)
    if load_dotenv():
        print("Loaded .env")
    if path is None:
        print(f"No ./{DEFAULT_CONFIG}: running on the built-in defaults plus the flags given")
    config = load_config(path, flags)
    if config.campaign is not None:
        from retrain.campaign.run import run_campaign

        return run_campaign(config, config_path=path)
    if is_standalone_squeeze(config):
        from retrain.cli.squeeze import run_standalone

        return run_standalone(config)
    from retrain.trainer import train

    return train(config, config_path=path)
