"""Other spellings of retrain's config keys and flags, as one installable record.

The loader (:mod:`retrain.config.load`), the flag table (:mod:`retrain.config.flags`)
and ``[[campaign.conditions]]`` entries (:mod:`retrain.config.conditions`) read every
key through the :class:`KeyDialect` installed here. The default one is empty: a key
retrain does not know is an unknown key, with its did-you-mean. A compatibility layer
installs its own (retrain.compat installs the original retrain's: renamed keys,
``--bp-enabled``-style flags, keys of later versions refused by name), so these modules
never import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

TableKey = tuple[str, str]  # (table, key)


@dataclass(frozen=True)
class KeyProblem:
    """A key the dialect refuses: where it is and why (key "" for a whole table)."""

    table: str
    key: str
    message: str


@dataclass(frozen=True)
class NormalizedToml:
    """A TOML mapping in retrain's own keys: what :attr:`KeyDialect.normalize` returns."""

    raw: dict[str, Any]
    problems: list[KeyProblem] = field(default_factory=list)
    # (table, key here) -> (table, key as written), so errors name the key as written
    renamed: dict[TableKey, TableKey] = field(default_factory=dict)


def _as_written(raw: Mapping[str, Any]) -> NormalizedToml:
    return NormalizedToml(dict(raw))


def _nothing(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class KeyDialect:
    """Everything loading needs to accept keys and flags spelled another way.

    - ``normalize``: a whole TOML mapping -> retrain's keys, plus the keys it refuses.
    - ``flag_aliases``: extra ``--flag`` names -> (table, key) (a schema flag wins).
    - ``param_flags``: repeatable ``--flag key=value`` flags -> the (table, dict key)
      they add entries to.
    - ``field_names``: bare names a ``[[campaign.conditions]]`` entry may use beyond the
      flags -> (table, key).
    - ``renamed``: (table, key as written) -> (table, key here); a flag for the new key
      wins over the old key in the TOML, and entries may write either.
    - ``refused_field(name)``: for a refused bare name (a flag without its ``--`` and
      with ``_`` for ``-``, or a condition key): ("[table] key", why); else None.
    - ``refused_key(table, key)``: why a ``table.key`` of a condition entry is refused,
      else None.
    - ``refused_tables``: tables that are not retrain's but whose keys are refused one
      by one (so a condition's ``echo.enabled`` is flattened, then refused by name).
    - ``fix_section(table, section)``: in place, what a table's values meant in that
      dialect (applied to a condition's overrides; ``normalize`` applies it itself).
    """

    name: str = "retrain"
    normalize: Callable[[Mapping[str, Any]], NormalizedToml] = _as_written
    flag_aliases: Mapping[str, TableKey] = field(default_factory=dict)
    param_flags: Mapping[str, TableKey] = field(default_factory=dict)
    field_names: Mapping[str, TableKey] = field(default_factory=dict)
    renamed: Mapping[TableKey, TableKey] = field(default_factory=dict)
    refused_field: Callable[[str], tuple[str, str] | None] = _nothing
    refused_key: Callable[[str, str], str | None] = _nothing
    refused_tables: frozenset[str] = frozenset()
    fix_section: Callable[[str, dict[str, Any]], None] = _nothing


RETRAIN = KeyDialect()
_installed: list[KeyDialect] = [RETRAIN]  # one slot: the dialect in force


def current() -> KeyDialect:
    """The dialect loading reads keys through (:data:`RETRAIN` until one is installed)."""
    return _installed[0]


def install(dialect: KeyDialect) -> None:
    """Make `dialect` the one in force (installing the same one again changes nothing)."""
    _installed[0] = dialect
