"""The original retrain's keys and flags as one :class:`~retrain.config.dialect.KeyDialect`,
the record config loading reads through; :mod:`retrain.compat.install` installs it."""

from __future__ import annotations

from typing import Any

from retrain.compat import later_keys
from retrain.compat.original_keys import (
    ORIGINAL,
    ORIGINAL_FIELDS,
    PARAM_FLAGS,
    RENAMED,
    alias_flags,
    ppo_from_clip_eps,
)
from retrain.compat.toml_normalize import normalize
from retrain.config.dialect import KeyDialect


def _fix_section(table: str, section: dict[str, Any]) -> None:
    if table == "training":
        ppo_from_clip_eps(section)


ORIGINAL_DIALECT = KeyDialect(
    name=ORIGINAL,
    normalize=normalize,
    flag_aliases=alias_flags(),
    param_flags=PARAM_FLAGS,
    field_names=ORIGINAL_FIELDS,
    renamed={old: (new.table, new.key) for old, new in RENAMED.items()},
    refused_field=later_keys.refused_field,
    refused_key=later_keys.refused_key,
    refused_tables=later_keys.LATER_TABLES,
    fix_section=_fix_section,
)
