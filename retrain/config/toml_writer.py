"""Write a Config back as TOML, and edit existing TOML text in place.

`config_to_toml` renders the resolved config a run saves next to its logs (and the run
files of a campaign): one `[table]` per schema table in schema order, keys in schema
order, option dicts as inline tables and lists as arrays, so the keys of a table never
get split across sub-tables. Secrets are written as `""` with a `# redacted` comment.
A test checks that the output loads back to an equal Config.

`set_keys` edits a TOML text that a person wrote, keeping its comments, order and
layout: what `migrate-config --write` needs.

Documents are built with tomlkit, a base dependency: `retrain` writes
`config.resolved.toml` on every run, with or without extras installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import tomlkit
from tomlkit.items import Item, Table

from retrain.config.schema import TABLES, Config, table_fields


class _Remove:
    """The type of `REMOVE`."""

    def __repr__(self) -> str:
        return "REMOVE"


REMOVE: Any = _Remove()
"""A value for `set_keys` that deletes the key instead of setting it."""


def _string(text: str) -> Item:
    # JSON's escapes (\" \\ \b \f \n \r \t \uXXXX) are all valid TOML basic-string
    # escapes; TOML additionally forbids a raw DEL (0x7f), which json.dumps leaves alone.
    # (Escaping here is linear; tomlkit's own escaper is quadratic in the string length.)
    escaped = json.dumps(text, ensure_ascii=False)[1:-1].replace("\x7f", "\\u007f")
    return tomlkit.string(escaped, escape=False)


def _item(value: Any) -> Item:
    """`value` as a tomlkit item: dicts become inline tables at any depth."""
    if isinstance(value, bool):
        return tomlkit.boolean("true" if value else "false")
    if isinstance(value, int):
        return tomlkit.integer(value)
    if isinstance(value, float):
        return tomlkit.float_(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        array = tomlkit.array()
        for element in value:
            array.append(_item(element))
        if any(isinstance(element, dict) for element in value):
            array.multiline(True)  # one table per line reads better than one long line
        return array
    if isinstance(value, dict):
        table = tomlkit.inline_table()
        for key, element in value.items():
            table.append(str(key), _item(element))
        return table
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def value_to_toml(value: Any) -> str:
    """One value as TOML text, e.g. `"local"`, `4e-05`, `[1, 2]`, `{a = 1}`."""
    return _item(value).as_string()


def _table(name: str, record: Any) -> Table:
    table = tomlkit.table()
    for spec in table_fields(name):
        value = getattr(record, spec.attr)
        if spec.meta.get("secret") and value:
            item = _string("")
            item.comment("redacted")
            item.trivia.comment_ws = "  "
        else:
            item = _item(value)
        table.add(spec.key, item)
    return table


def config_to_toml(config: Config, *, header: str = "") -> str:
    """`config` as a TOML document; `header` lines become comments at its top. Optional
    tables that are unset (None) are left out."""
    doc = tomlkit.document()
    if header:
        for line in header.splitlines():
            doc.add(tomlkit.comment(line))
        doc.add(tomlkit.nl())
    for f in fields(config):
        if f.name not in TABLES:
            raise TypeError(f"Config field {f.name!r} is not a schema table")
        record = getattr(config, f.name)
        if record is not None:
            doc.add(f.name, _table(f.name, record))
    return tomlkit.dumps(doc).rstrip("\n") + "\n"


def _container(doc: Any, table: str, *, create: bool) -> Any:
    """The table (or inline table) named by dotted `table` in `doc`; None when it is
    missing and `create` is false."""
    node = doc
    for part in table.split(".") if table else ():
        if part not in node:
            if not create:
                return None
            node.add(part, tomlkit.table())
        node = node[part]
        if not isinstance(node, Mapping):
            raise ValueError(f"[{table}] is not a table in this TOML (at {part!r})")
    return node


def set_keys(text: str, changes: Mapping[tuple[str, str], Any]) -> str:
    """`text` with each `(table, key)` of `changes` set to its value, keeping comments,
    order and layout; `table` may be dotted (`backend.options`) or "" for the top level.
    A value of `REMOVE` deletes the key. A missing table is appended, a missing key is
    added at the end of its table, and a replaced value keeps its trailing comment."""
    doc = tomlkit.parse(text)
    for (table, key), value in changes.items():
        node = _container(doc, table, create=value is not REMOVE)
        if value is REMOVE:
            if node is not None and key in node:
                del node[key]
        else:
            node[key] = _item(value)
    return tomlkit.dumps(doc)
