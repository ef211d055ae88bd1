"""Write a Config back as TOML (the resolved config a run saves next to its logs).

A small writer of our own keeps the base install free of extra dependencies; the
output uses only basic strings, numbers, booleans, arrays and inline tables, and a
test checks that it loads back to an equal Config.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from typing import Any

from retrain.config.schema import OPTIONAL_TABLES, TABLES, Config, table_fields

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _string(k)


def _string(s: str) -> str:
    # JSON's escapes are valid TOML basic-string escapes; TOML additionally forbids a
    # raw DEL (0x7f), which json.dumps leaves alone.
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def value_to_toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else f"{text}.0"
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_to_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return (
            "{ "
            + ", ".join(f"{_key(str(k))} = {value_to_toml(v)}" for k, v in value.items())
            + " }"
        )
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def config_to_toml(config: Config, *, header: str = "") -> str:
    lines: list[str] = []
    if header:
        lines += [f"# {line}" if line else "#" for line in header.splitlines()] + [""]
    for f in fields(config):
        table = f.name
        record = getattr(config, table)
        if record is None and table in OPTIONAL_TABLES:
            continue
        lines.append(f"[{table}]")
        for spec in table_fields(table):
            value = getattr(record, spec.attr)
            if spec.meta.get("secret") and value:
                lines.append(f'{_key(spec.key)} = ""  # redacted')
            else:
                lines.append(f"{_key(spec.key)} = {value_to_toml(value)}")
        lines.append("")
    assert set(TABLES) >= {f.name for f in fields(config)}
    return "\n".join(lines)
