"""A retrain.toml of `[backend] devices` and some `[backend.options]` (string values), for
the tests of an option's config check and `explain` line."""

from __future__ import annotations

from pathlib import Path


def option_config(directory: Path, devices: str, **options: str) -> Path:
    """`directory`/retrain.toml: devices on line 2, the options from line 4 in order."""
    lines = ["[backend]", f'devices = "{devices}"', "[backend.options]"]
    lines += [f'{key} = "{value}"' for key, value in options.items()]
    path = directory / "retrain.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
