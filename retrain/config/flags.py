"""The CLI flag table, derived from the schema: every flag and the field it sets.

`--{table}-{key}` for every field, plus the short `--{key}` when the key name is unique
or has a preferred owner, plus the installed key dialect's aliases
(:mod:`retrain.config.dialect`).
"""

from __future__ import annotations

from retrain.config import dialect
from retrain.config.schema import TABLES, FieldSpec, table_fields

# Keys shared by several tables get their bare `--key` flag from one preferred owner;
# the others are reachable as `--{table}-{key}`.
_PREFERRED_OWNER = {
    "seed": "training",
    "max_steps": "training",
    "model": "model",
    "adapter_path": "backend",
    "ema_decay": "backpressure",
    "warmup_steps": "training",  # the LR warmup; back pressure's is --bp-warmup-steps
}
# Bare names too vague to stand alone as flags (reachable qualified or by alias), and
# `beta`, which other trainers use for the KL coefficient (TRL's `--beta`): a bare
# `--beta` setting [gtpo] beta would take their value silently (retrain.config.peer_names).
_NO_BARE_FLAG = {
    "beta",
    "from",
    "type",
    "options",
    "enabled",
    "id",
    "path",
    "size",
    "split",
    "strict",
    "device",
    "detector",
    "source",
    "task",
    "provider",
    "schedule",
    "steps",
    "timeout",
    "threshold",
    "args",
    "warmup",
    "conditions",
    "seeds",
    "parallel",
    "executor",
}
# Short flags the spec documents that are not `--{key}` of their field.
_ALIASES = {"--resume": ("resume", "from")}


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def flag_table() -> dict[str, FieldSpec]:
    """Every CLI flag -> its field (see the module docstring)."""
    owners: dict[str, list[FieldSpec]] = {}
    flags: dict[str, FieldSpec] = {}
    for table in TABLES:
        for spec in table_fields(table):
            owners.setdefault(spec.key, []).append(spec)
            flags[f"--{_kebab(table)}-{_kebab(spec.key)}"] = spec
    for key, specs in owners.items():
        if key in _NO_BARE_FLAG:
            continue
        preferred = _PREFERRED_OWNER.get(key)
        chosen = next((s for s in specs if s.table == preferred), None) if preferred else None
        if chosen is None and len(specs) == 1:
            chosen = specs[0]
        if chosen is not None:
            flags.setdefault(f"--{_kebab(key)}", chosen)
    for alias, (table, key) in _ALIASES.items():
        flags[alias] = next(s for s in table_fields(table) if s.key == key)
    for alias, (table, key) in dialect.current().flag_aliases.items():
        flags.setdefault(alias, next(s for s in table_fields(table) if s.key == key))
    return flags
