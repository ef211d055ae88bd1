"""A TOML mapping written for the original retrain, in retrain's keys.

:func:`normalize` is the original dialect's ``KeyDialect.normalize``: the original's
renamed keys go under their names here (merged when both are written), its
comma-string `[plugins] search_paths` is split, a `[training]` clip_eps means what it
meant there, and keys of later versions and the legacy `prime_rl_*` keys are taken out
as problems naming the key. Nothing is silently ignored: a known key is either mapped or
refused by name; an unknown key is still an unknown key, with its did-you-mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retrain.compat.later_keys import LATER, LATER_TABLES
from retrain.compat.original_keys import (
    LEGACY_PRIME_RL,
    MIGRATE_HINT,
    ORIGINAL,
    RENAMED,
    Renamed,
    ppo_from_clip_eps,
    split_paths,
)
from retrain.config.dialect import KeyProblem, NormalizedToml


def _merge_renamed(
    section: dict[str, Any], old: str, new: Renamed, problems: list[KeyProblem], table: str
) -> None:
    """Move section[old] to section[new.key]; dicts merge, equal values are fine."""
    value = section.pop(old)
    if new.key not in section:
        section[new.key] = value
        return
    current = section[new.key]
    if isinstance(value, dict) and isinstance(current, dict):
        clash = sorted(k for k in value if k in current and current[k] != value[k])
        if not clash:
            section[new.key] = {**value, **current}
            return
        what = f"both set {', '.join(clash)} differently"
    elif value == current:
        return
    else:
        what = "both are set, to different values"
    problems.append(
        KeyProblem(
            table,
            old,
            f"{old} is the original's name for {new.key}, and {what}. Fix: keep only {new.key}",
        )
    )


def _later_problems(table: str, section: Mapping[str, Any]) -> list[KeyProblem]:
    out = []
    for key in list(section):
        entry = LATER.get((table, key))
        if entry is not None:
            out.append(KeyProblem(table, key, f"{entry.message()}. {MIGRATE_HINT}"))
    return out


def _prime_rl_problems(section: Mapping[str, Any]) -> list[KeyProblem]:
    out = []
    for key, new in LEGACY_PRIME_RL.items():
        if key in section:
            out.append(
                KeyProblem(
                    "backend",
                    key,
                    f"a legacy PRIME-RL key, which {ORIGINAL} already refused: it belongs in "
                    f"[backend.options] as {new}. Fix: `retrain migrate-config --write FILE` moves it",
                )
            )
    return out


def _later_table_problems(table: str, section: Any) -> list[KeyProblem]:
    keys = list(section) if isinstance(section, Mapping) else []
    out = _later_problems(table, section) if isinstance(section, Mapping) else []
    known = {k for t, k in LATER if t == table}
    origin = next(e.origin for (t, _), e in LATER.items() if t == table)
    what = f"not supported in this build: [{table}] is a table of {origin}"
    for key in keys:
        if key not in known:
            out.append(KeyProblem(table, key, f"{what}. {MIGRATE_HINT}"))
    if not keys:
        out.append(KeyProblem(table, "", f"{what}. Fix: remove the table"))
    return out


def normalize(raw: Mapping[str, Any]) -> NormalizedToml:
    """`raw` in retrain's keys, with the problems and the renamed keys (see the module
    docstring)."""
    out: dict[str, Any] = {}
    problems: list[KeyProblem] = []
    renamed: dict[tuple[str, str], tuple[str, str]] = {}
    for table, section in raw.items():
        if table in LATER_TABLES:
            problems += _later_table_problems(table, section)
            continue
        if not isinstance(section, dict):
            out[table] = section
            continue
        section = dict(section)
        problems += _later_problems(table, section)
        if table == "backend":
            problems += _prime_rl_problems(section)
        for key in [k for k in section if _refused(table, k)]:
            del section[key]
        for key in [k for k in section if (table, k) in RENAMED]:
            new = RENAMED[(table, key)]
            _merge_renamed(section, key, new, problems, table)
            renamed[(new.table, new.key)] = (table, key)
        if table == "training":
            ppo_from_clip_eps(section)
        if table == "plugins" and isinstance(section.get("search_paths"), str):
            section["search_paths"] = split_paths(section["search_paths"])
        out[table] = section
    return NormalizedToml(out, problems, renamed)


def _refused(table: str, key: str) -> bool:
    return (table, key) in LATER or (table == "backend" and key in LEGACY_PRIME_RL)
