"""What `retrain migrate-config` does to a config of the original retrain.

It rewrites what can be rewritten without changing what the config means, keeping the
file's comments and layout (retrain.config.toml_writer.set_keys):

- keys the original spelled differently (:data:`~retrain.compat.original_keys.RENAMED`):
  `[algorithm] entropy_mask_rho` -> `surprisal_mask_rho`, `[algorithm.params]` ->
  `[algorithm.transform_params]`, `[optimizer] grad_clip_norm` -> `max_grad_norm`;
- the legacy `[backend] prime_rl_*` keys -> `[backend.options]`;
- a comma-separated `[plugins] search_paths` string -> a list.

and lists, with what to do, the keys of later versions of the original that this build
does not implement (:mod:`retrain.compat.later_keys`), in tables and in
`[[campaign.conditions]]` entries. Those are left in place: removing them would change
the experiment silently. The command itself (modes, files, output) is
:mod:`retrain.cli.migrate_config`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass
from typing import Any

from retrain.compat.later_keys import later_field_message
from retrain.compat.original_keys import LEGACY_PRIME_RL, MIGRATE_HINT, RENAMED, split_paths
from retrain.compat.toml_normalize import normalize
from retrain.config.load import locate_keys
from retrain.config.toml_writer import REMOVE, set_keys, value_to_toml


@dataclass(frozen=True)
class Change:
    """One rewrite: the key as written, where it goes (new_key "" = deleted) and why."""

    table: str
    key: str
    new_table: str
    new_key: str
    value: Any
    why: str
    line: int | None = None

    def describe(self) -> str:
        old = f"[{self.table}] {self.key}"
        if not self.new_key:
            return f"{old}: {self.why}"
        return (
            f"{old} -> [{self.new_table}] {self.new_key} = {value_to_toml(self.value)} ({self.why})"
        )


@dataclass(frozen=True)
class Manual:
    """A key left for you: where it is and what to do. `conflict`: it is the original's
    name of a key also written, to another value (else this build does not implement it)."""

    where: str
    message: str
    line: int | None = None
    conflict: bool = False


# ---------------------------------------------------------------- planning


def _renames(raw: dict[str, Any]) -> tuple[list[Change], list[Manual]]:
    changes: list[Change] = []
    manual: list[Manual] = []
    for (table, old), new in RENAMED.items():
        section = raw.get(table)
        if not isinstance(section, dict) or old not in section:
            continue
        value, current = section[old], section.get(new.key)
        if isinstance(value, dict) and isinstance(current, dict):
            clash = sorted(k for k in value if k in current and current[k] != value[k])
            if clash:
                manual.append(
                    Manual(
                        f"[{table}] {old}",
                        f"conflicts with {new.key}, its name here, which sets "
                        f"{', '.join(clash)} differently: merge the two by hand",
                        conflict=True,
                    )
                )
                continue
            value = {**value, **current}
        elif current is not None and current != value:
            manual.append(
                Manual(
                    f"[{table}] {old}",
                    f"{old} = {value_to_toml(value)} conflicts with {new.key} = "
                    f"{value_to_toml(current)}: both name one setting ({old} is the original's "
                    f"spelling of {new.key}); keep one",
                    conflict=True,
                )
            )
            continue
        why = f"as {new.origin} spelled it" + (f"; {new.note}" if new.note else "")
        changes.append(Change(table, old, new.table, new.key, value, why))
    return changes, manual


def _prime_rl(raw: dict[str, Any]) -> list[Change]:
    backend = raw.get("backend")
    if not isinstance(backend, dict):
        return []
    options = backend.get("options") if isinstance(backend.get("options"), dict) else {}
    changes = []
    for old, new in LEGACY_PRIME_RL.items():
        if old not in backend:
            continue
        if new in options:  # as in the original: [backend.options] wins
            changes.append(
                Change("backend", old, "", "", None, f"[backend.options] {new} already set")
            )
        else:
            changes.append(
                Change("backend", old, "backend.options", new, backend[old], "legacy PRIME-RL key")
            )
    return changes


def _search_paths(raw: dict[str, Any]) -> list[Change]:
    plugins = raw.get("plugins")
    if not isinstance(plugins, dict) or not isinstance(plugins.get("search_paths"), str):
        return []
    value = split_paths(plugins["search_paths"])
    why = "the original's comma-separated form"
    return [Change("plugins", "search_paths", "plugins", "search_paths", value, why)]


def _unsupported(raw: dict[str, Any]) -> list[Manual]:
    """Later-original keys in tables and in [[campaign.conditions]] entries."""
    hint = f". {MIGRATE_HINT}"
    manual = [
        Manual(f"[{p.table}] {p.key}" if p.key else f"[{p.table}]", p.message.removesuffix(hint))
        for p in normalize(raw).problems
        if not (p.table == "backend" and p.key in LEGACY_PRIME_RL)
        and (p.table, p.key) not in RENAMED
    ]
    campaign = raw.get("campaign")
    entries = campaign.get("conditions") if isinstance(campaign, dict) else None
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        for key in entry if isinstance(entry, dict) else ():
            message = later_field_message(key)
            if message:
                manual.append(Manual(f"[[campaign.conditions]] entry {i}", message))
    return manual


def plan(raw: dict[str, Any], text: str) -> tuple[list[Change], list[Manual]]:
    """What migrate-config would rewrite, and what it leaves for you, with line numbers."""
    changes, manual = _renames(raw)
    changes += _prime_rl(raw) + _search_paths(raw)
    manual += _unsupported(raw)
    lines = locate_keys(text)
    changes = [
        Change(**{**asdict(c), "line": lines.get((c.table, c.key)) or lines.get((c.table, ""))})
        for c in changes
    ]
    manual = [Manual(m.where, m.message, _line(m.where, lines), m.conflict) for m in manual]
    return changes, manual


def _line(where: str, lines: dict[tuple[str, str], int]) -> int | None:
    if where.startswith("[["):
        return lines.get(("campaign", "conditions"))
    table, _, key = where.strip("[").partition("] ")
    return lines.get((table.rstrip("]"), key)) or lines.get((table.rstrip("]"), ""))


def _rename_in_place(lines: list[str], c: Change) -> bool:
    """Rename a `key = value` line to the new key where it stands, so its value, layout
    and trailing comment stay as written; False when `c` is not such a plain rename."""
    if c.new_table != c.table or not c.new_key or c.line is None or c.line > len(lines):
        return False
    pattern = re.compile(rf"^(\s*){re.escape(c.key)}(\s*=)")
    if not pattern.match(lines[c.line - 1]):
        return False
    lines[c.line - 1] = pattern.sub(rf"\g<1>{c.new_key}\g<2>", lines[c.line - 1], count=1)
    return True


def rewrite(text: str, changes: list[Change]) -> str:
    """`text` with `changes` applied, comments and layout kept."""
    raw = tomllib.loads(text)
    lines = text.splitlines(keepends=True)
    rest = []
    for c in changes:
        section = raw.get(c.table)
        # a plain rename: the new key is not written yet and the value stays as written
        plain = isinstance(section, dict) and c.new_key not in section
        if not (plain and c.value == section.get(c.key) and _rename_in_place(lines, c)):
            rest.append(c)
    text = "".join(lines)
    edits: dict[tuple[str, str], Any] = {}
    for c in rest:
        if (c.new_table, c.new_key) != (c.table, c.key):
            edits[(c.table, c.key)] = REMOVE
        if c.new_key:
            edits[(c.new_table, c.new_key)] = c.value
    out = set_keys(text, edits)
    tomllib.loads(out)  # the rewrite must stay valid TOML
    return out


# ---------------------------------------------------------------- the report


def _at(line: int | None) -> str:
    return f" (line {line})" if line else ""


def report(path: str, changes: list[Change], manual: list[Manual]) -> list[str]:
    """The plan as lines for a person: the rewrites, then the keys left as they are."""
    lines = []
    if changes:
        lines.append(f"{path}: {len(changes)} key(s) to rewrite:")
        lines += [f"  {c.describe()}{_at(c.line)}" for c in changes]
    unsupported = [m for m in manual if not m.conflict]
    conflicts = [m for m in manual if m.conflict]
    if unsupported:
        lines.append(
            f"{path}: {len(unsupported)} key(s) this build does not support (left as they are):"
        )
        lines += [f"  {m.where}{_at(m.line)}: {m.message}" for m in unsupported]
    if conflicts:
        lines.append(f"{path}: {len(conflicts)} key(s) in conflict (left as they are):")
        lines += [f"  {m.where}{_at(m.line)}: {m.message}" for m in conflicts]
    if not changes and not manual:
        lines.append(f"{path}: nothing to migrate")
    return lines
