"""Type and range checks of one config value against its field (:class:`FieldSpec`):
shared by TOML tables, CLI flags and ``[[campaign.conditions]]`` overrides, so a value
is checked alike wherever it is written."""

from __future__ import annotations

import json
import math
from typing import Any

from retrain import registry
from retrain.config.schema import FieldSpec


def describe_value(value: Any) -> str:
    """`value` as error messages show it: its TOML kind, then the value (shortened)."""
    kind = {
        bool: "bool",
        int: "int",
        float: "float",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)
    shown = json.dumps(value) if isinstance(value, str) else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{kind} {shown}"


_INT64 = (-(2**63), 2**63 - 1)


def _int64(value: int) -> str | None:
    """TOML's integers are 64-bit, though Python's parser reads larger ones: past that
    range a seed would load here and fail at torch.manual_seed when the run starts."""
    if _INT64[0] <= value <= _INT64[1]:
        return None
    return f"outside TOML's 64-bit integer range (-2**63 to 2**63 - 1), got {value}"


def coerce_value(spec: FieldSpec, value: Any) -> tuple[Any, str | None]:
    """Type-check a raw TOML value for `spec`; returns (value, error)."""
    t = spec.type
    if t == "bool":
        if isinstance(value, bool):
            return value, None
        hint = " (write true or false without quotes)" if isinstance(value, str) else ""
        return value, f"expected a bool, got {describe_value(value)}{hint}"
    if t == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value, _int64(value)
        return value, f"expected an integer, got {describe_value(value)}"
    if t == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                return value, f"expected a finite number, got {value!r}"
            return float(value), None
        return value, f"expected a number, got {describe_value(value)}"
    if t == "str":
        if isinstance(value, str):
            return value, None
        return value, f"expected a string, got {describe_value(value)}"
    if t == "dict":
        if isinstance(value, dict):
            return value, None
        return value, f"expected a table, got {describe_value(value)}"
    if t == "list":
        if not isinstance(value, list):
            return value, f"expected an array, got {describe_value(value)}"
        item = spec.meta.get("item")
        expected = {"int": int, "str": str, "dict": dict}.get(item or "")
        if expected:
            for v in value:
                if not isinstance(v, expected) or isinstance(v, bool):
                    return (
                        value,
                        f"expected an array of {item}s, got an element {describe_value(v)}",
                    )
                if item == "int" and _int64(v):
                    return value, f"an element is {_int64(v)}"
        return value, None
    # "any": environment.args accepts a table or a JSON string holding an object.
    if spec.table == "environment" and spec.key == "args":
        if isinstance(value, dict):
            return value, None
        if isinstance(value, str):
            if not value.strip():
                return {}, None
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                return value, f"not valid JSON ({exc.msg} at char {exc.pos})"
            if isinstance(parsed, dict):
                return parsed, None
            return value, "the JSON string must hold an object"
        return value, f"expected a table or a JSON string, got {describe_value(value)}"
    return value, None


def check_range_and_choice(spec: FieldSpec, value: Any) -> str | None:
    meta = spec.meta
    if meta["gt"] is not None and not value > meta["gt"]:
        return f"must be > {meta['gt']}, got {value!r}"
    if meta["ge"] is not None and not value >= meta["ge"]:
        return f"must be >= {meta['ge']}, got {value!r}"
    if meta["le"] is not None and not value <= meta["le"]:
        return f"must be <= {meta['le']}, got {value!r}"
    if meta["choices"] is not None and value not in meta["choices"]:
        valid = ", ".join(repr(c) for c in meta["choices"])
        return f"unknown value {value!r}{registry.suggest(str(value), meta['choices'])}; valid: {valid}"
    if meta["registry"] and not (meta["registry"] == "algorithm_mode" and value == ""):
        # a built-in that is not built in this version fails here, at load, with its fix
        problem = registry.ALL_REGISTRIES[meta["registry"]].check(value)
        if problem:
            return problem
    if meta["check"] is not None:
        return meta["check"](value)
    return None
