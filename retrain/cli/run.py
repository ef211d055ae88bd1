"""`retrain [CONFIG] [--flags]`: train, run a campaign, or run a standalone squeeze."""

from __future__ import annotations

from retrain.config import DEFAULT_CONFIG, load_config, load_dotenv


def split_path(argv: list[str]) -> tuple[str, list[str]]:
    """The config path is the first token that is not a flag or a flag's value."""
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return DEFAULT_CONFIG, argv


def is_standalone_squeeze(config) -> bool:
    return (
        config.squeeze is not None and config.campaign is None and bool(config.squeeze.adapter_path)
    )


def main(argv: list[str]) -> int:
    path, flags = split_path(argv)
    if load_dotenv():
        print("Loaded .env")
    config = load_config(path, flags)
    if config.campaign is not None:
        from retrain.campaign.run import run_campaign

        return run_campaign(config, config_path=path)
    if is_standalone_squeeze(config):
        from retrain.cli.squeeze import run_standalone

        return run_standalone(config)
    from retrain.trainer import train

    return train(config, config_path=path)
