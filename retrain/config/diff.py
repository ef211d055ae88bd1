"""What a resumed run changes: the config in effect against the one the run recorded in
its log directory when it last started (config.resolved.toml, as TOML data).

    changes = config_changes(RunDir(log_dir).config, config)
    print("; ".join(map(str, changes)))      # [training] lr 0.0002 -> 0.001
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.config.schema import Config
from retrain.config.toml_writer import config_to_toml, value_to_toml

# Raising max_steps is how a finished run is continued; [resume] from is the resume itself.
EXPECTED = frozenset({("training", "max_steps"), ("resume", "from")})
# What the checkpoint restores whatever the config says (the controller may have moved
# the batch size): a different value here would be silently unused.
KEPT_BY_CHECKPOINT = (("training", "batch_size"), ("training", "group_size"))


@dataclass(frozen=True)
class Change:
    table: str
    key: str
    before: Any
    after: Any

    @property
    def name(self) -> str:
        return f"[{self.table}] {self.key}"

    def __str__(self) -> str:
        return f"{self.name} {value_to_toml(self.before)} -> {value_to_toml(self.after)}"


def config_changes(
    recorded: Mapping[str, Any], config: Config, workdir: Path | None = None
) -> list[Change]:
    """Each key whose value in `config` differs from `recorded`, in the manual's order.
    A table or key the run did not record (an older retrain, an optional table) is not a
    change: nothing says what it was. The run's directories are compared as places, its
    recorded relative ones read from `workdir` (where it started) when known: the same
    directory written another way (absolute, from another directory) is no change."""
    now = tomllib.loads(config_to_toml(config))
    changes = []
    for table, values in now.items():
        theirs = recorded.get(table)
        if not isinstance(values, dict) or not isinstance(theirs, dict):
            continue
        for key, value in values.items():
            if (table, key) in EXPECTED or key not in theirs or theirs[key] == value:
                continue
            if (table, key) in RUN_DIRS and _same_place(theirs[key], value, workdir):
                continue
            changes.append(Change(table, key, theirs[key], value))
    return changes


RUN_DIRS = (("logging", "log_dir"), ("backend", "adapter_path"))


def _same_place(before: Any, after: Any, workdir: Path | None) -> bool:
    if not (isinstance(before, str) and isinstance(after, str) and before and after):
        return False
    then = Path(before).expanduser()
    then = then if then.is_absolute() or workdir is None else workdir / then
    return then.resolve() == Path(after).expanduser().resolve()


def resumed_with(changes: list[Change], step: int) -> str:
    """The line a resumed run (and `explain`) says of what it changes."""
    some = f"{len(changes)} setting{'s' if len(changes) != 1 else ''}"
    return (
        f"Resuming with {some} changed since the run last started (its "
        f"config.resolved.toml): {'; '.join(map(str, changes))}. They apply from step "
        f"{step} on; the steps before it ran with the old values."
    )
