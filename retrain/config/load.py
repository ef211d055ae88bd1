"""Loading a Config: TOML file + `.env` + CLI flags, type-checked and validated.

Precedence: schema defaults < TOML < CLI flags. Every problem is collected and
reported together in one ConfigError, each naming the key, the file and line (or
the flag), what was wrong and a fix.

Keys and flags are read through the installed key dialect
(:mod:`retrain.config.dialect`): without one, only retrain's own keys load; importing
retrain.compat (the CLI always does) adds the original retrain's.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.config import dialect, hints
from retrain.config.conditions import conditions_problems
from retrain.config.flags import flag_table
from retrain.config.schema import OPTIONAL_TABLES, TABLES, Config, FieldSpec, table_fields
from retrain.config.validate import cross_checks
from retrain.config.values import check_range_and_choice, coerce_value, describe_value
from retrain.errors import ConfigError

DEFAULT_CONFIG = "retrain.toml"

# ---------------------------------------------------------------- .env


def load_dotenv(path: str | Path = ".env") -> list[str]:
    """Load KEY=VALUE lines into os.environ without overriding variables already set.
    Returns the names loaded (never the values)."""
    p = Path(path)
    if not p.is_file():
        return []
    loaded = []
    for raw in p.read_text(encoding="utf-8", errors="replace").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        if name not in os.environ:
            os.environ[name] = value
            loaded.append(name)
    return loaded


# ---------------------------------------------------------------- locating keys


def locate_keys(text: str) -> dict[tuple[str, str], int]:
    """Map (table, key) -> 1-based line number, by a light scan of the TOML text.
    Sub-tables `[data.args]` and `[[campaign.conditions]]` map to (data, args) etc.;
    table headers themselves map to (table, ""). Every key also maps by its whole dotted
    table path, ("actor_rollout_ref.rollout", "n"), for other trainers' nested keys."""
    where: dict[tuple[str, str], int] = {}
    text = text.removeprefix("\ufeff")  # a byte-order mark read as text
    table = full = ""  # full: the header's whole dotted path (for nested keys' lines)
    header = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\]?\s*(#.*)?$")
    keyline = re.compile(r"^\s*([A-Za-z0-9_\-\"']+(?:\s*\.\s*[A-Za-z0-9_\-\"']+)*)\s*=")
    quote, depth = "", 0  # a multi-line string or array left open by the lines so far
    for lineno, line in enumerate(text.splitlines(), start=1):
        if quote or depth:  # a line of a value, however it reads (`lr = 5` in a prompt)
            quote, depth = _value_state(line, quote, depth)
            continue
        m = header.match(line)
        if m:
            parts = [p.strip().strip("\"'") for p in m.group(1).split(".")]
            table, full = parts[0], ".".join(parts)
            where.setdefault((table, ""), lineno)
            if len(parts) > 1:
                where.setdefault((table, parts[1]), lineno)
                table = f"{parts[0]}.{parts[1]}"  # keys below belong to the sub-table
            continue
        m = keyline.match(line)
        if m:
            parts = [p.strip().strip("\"'") for p in m.group(1).split(".")]
            path = ".".join([full, *parts[:-1]] if full else parts[:-1])
            if path:  # ("a.b.c", "key"): where another trainer's nested key is
                where.setdefault((path, parts[-1]), lineno)
            if "." in table:  # inside [data.args]: report against the parent key
                top, sub = table.split(".", 1)
                where.setdefault((top, sub), lineno)
            elif table:
                where.setdefault((table, parts[0]), lineno)
            elif len(parts) > 1:
                where.setdefault((parts[0], parts[1]), lineno)
            else:  # `name = ...` at the top: a key, or a whole table written inline
                where.setdefault(("", parts[0]), lineno)
                where.setdefault((parts[0], ""), lineno)
            quote, depth = _value_state(line[m.end() :], quote, depth)
    return where


def _value_state(line: str, quote: str, depth: int) -> tuple[str, int]:
    """After `line` of a value: the multi-line string still open (its three quotes, or
    "") and how many arrays or inline tables are. Strings are skipped whole, so a bracket
    or a quote inside one does not count; so is a comment."""
    i = 0
    while i < len(line):
        if quote:
            if quote == '"""' and line[i] == "\\":  # an escape: \" does not close it
                i += 2
            elif line.startswith(quote, i):
                i, quote = i + 3, ""
            else:
                i += 1
            continue
        ch = line[i]
        if ch == "#":
            break
        if line.startswith('"""', i) or line.startswith("'''", i):
            i, quote = i + 3, line[i : i + 3]
            continue
        if ch in "\"'":  # a one-line string: to its closing quote
            i += 1
            while i < len(line) and line[i] != ch:
                i += 2 if ch == '"' and line[i] == "\\" else 1
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(0, depth - 1)
        i += 1
    return quote, depth


@dataclass
class _Origin:
    """Where values came from, for error messages."""

    source: str | None = None
    lines: dict[tuple[str, str], int] | None = None
    flags: dict[tuple[str, str], str] | None = None
    # (table, key here) -> (table, key as written) for keys the key dialect renamed
    renamed: dict[tuple[str, str], tuple[str, str]] | None = None

    def of(self, table: str, key: str = "") -> str:
        # a key of a sub-table (`[backend.options] dtype`) set whole by its parent's key (an
        # inline `options = {...}`, or --backend-opt) is where that parent key was set
        parent = (table.rpartition(".")[0], table.rpartition(".")[2]) if "." in table else None
        for where in ((table, key), parent):
            if self.flags and where in self.flags:
                return f" (from {self.flags[where]})"
        if self.renamed and (table, key) in self.renamed:
            old = self.renamed[(table, key)]
            line = self.lines.get(old) if self.lines else None
            where = f"{self.source}:{line}, " if self.source and line else ""
            return f" ({where}written as {old[1]})"
        if self.source and self.lines is not None:
            line = (
                self.lines.get((table, key))
                or self.lines.get((table, ""))
                or (self.lines.get(parent) if parent else None)
            )
            return f" ({self.source}:{line})" if line else f" ({self.source})"
        return ""

    def at(self, path: list[str]) -> str:
        """Where a nested key (`actor_rollout_ref.rollout.n`) was written."""
        if not self.source or self.lines is None:
            return ""
        line = self.lines.get((".".join(path[:-1]), path[-1])) or self.lines.get(
            (path[0], path[1] if len(path) > 1 else "")
        )
        return f" ({self.source}:{line})" if line else self.of(path[0])


def _outside_tables(name: str, value: Any, origin: _Origin) -> list[str]:
    """The problems of a top-level `name` that is not one of retrain's tables: a key that
    belongs in one, another trainer's table, or an unknown table."""
    close = hints.did_you_mean(name, TABLES)
    if not isinstance(value, dict):
        text = hints.top_level_text(name, value) or (
            f"unknown{close}; every setting belongs in a table. Fix: move it "
            f"under its table (valid tables: {', '.join(TABLES)}), or remove it"
        )
        return [f"top-level key {name!r}{origin.of('', name)}: {text}"]
    unknown = f"unknown table [{name}]{origin.of(name)}{close}; valid tables: {', '.join(TABLES)}"
    return _peer_leaves([name], value, origin, misspelt=bool(close)) or [unknown]


def _unknown_key(table: str, key: str, value: Any, origin: _Origin) -> list[str]:
    """The problems of `[table] key`, a key the table does not have."""
    unknown = f"[{table}] {key}{origin.of(table, key)}: {hints.key_text(table, key, value)}"
    if isinstance(value, dict):  # another trainer's sub-table, such as [algorithm.kl_ctrl]
        misspelt = hints.closest(key, [s.key for s in table_fields(table)]) is not None
        return _peer_leaves([table, key], value, origin, misspelt) or [unknown]
    return [unknown]


def _peer_leaves(path: list[str], value: Any, origin: _Origin, misspelt: bool = False) -> list[str]:
    """When some keys of a nested table are other trainers' names: one problem for each
    (at its own line), and one naming the keys that have no counterpart; else []."""
    known, unknown = hints.peer_leaves(path, value, misspelt)
    if not known:
        return []
    problems = [f"{'.'.join(leaf)}{origin.at(leaf)}: {text}" for leaf, text in known]
    if unknown:
        label = f"unknown table [{path[0]}]" if len(path) == 1 else f"[{path[0]}] {path[1]}"
        names = ", ".join(".".join(leaf) for leaf in unknown)
        them = "it" if len(unknown) == 1 else "them"
        problems.append(
            f"{label}{origin.at(unknown[0])}: retrain has no setting for {names}. Fix: remove {them}"
        )
    return problems


def unknown_names(raw: Mapping[str, Any], text: str, source: str) -> list[str]:
    """The loader's problems (with the did-you-mean and the file and line) for the tables
    and keys of a parsed TOML (`raw`, its `text`, from `source`) that retrain does not
    have, and nothing else: what `migrate-config` cannot rewrite."""
    origin = _Origin(source=source, lines=locate_keys(text))
    normalized = dialect.current().normalize(raw)
    origin.renamed = normalized.renamed
    problems: list[str] = []
    for name, value in normalized.raw.items():
        if name not in TABLES:
            problems += _outside_tables(name, value, origin)
        elif isinstance(value, dict):
            known = {s.key for s in table_fields(name)}
            for key, val in value.items():
                if key not in known:
                    problems += _unknown_key(name, key, val, origin)
    return problems


# ---------------------------------------------------------------- building Config


def build_config(raw: Mapping[str, Any], origin: _Origin | None = None) -> Config:
    """Validate a raw TOML-shaped mapping into a Config, reporting every problem."""
    origin = origin or _Origin()
    normalized = dialect.current().normalize(raw)
    raw, origin.renamed = normalized.raw, normalized.renamed
    problems = [
        f"{_label(p.table, p.key)}{origin.of(p.table, p.key)}: {p.message}"
        for p in normalized.problems
    ]
    tables: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in TABLES:
            problems += _outside_tables(name, value, origin)
            continue
        if not isinstance(value, dict):
            problems.append(
                f"[{name}]{origin.of(name)}: expected a table, got {describe_value(value)}"
            )
            continue
        kwargs: dict[str, Any] = {}
        specs = {s.key: s for s in table_fields(name)}
        for key, val in value.items():
            spec = specs.get(key)
            label = f"[{name}] {key}"
            if spec is None:
                problems += _unknown_key(name, key, val, origin)
                continue
            val, error = coerce_value(spec, val)
            if error is None:
                error = check_range_and_choice(spec, val)
            if error:
                fix = spec.meta["fix"]
                problems.append(
                    f"{label}{origin.of(name, key)}: {error}{f'. Fix: {fix}' if fix else ''}"
                )
                continue
            kwargs[spec.attr] = val
        tables[name] = TABLES[name](**kwargs)
    for name in TABLES:
        if name not in tables and name not in OPTIONAL_TABLES:
            tables[name] = TABLES[name]()
    config = Config(**tables)
    if config.campaign is not None and config.campaign.conditions:
        # checked here, not by the schema: the entries are read like flags (config.conditions)
        found = conditions_problems(config.campaign.conditions)
        if found:
            where = origin.of("campaign", "conditions")
            problems.append(f"[campaign] conditions{where}: {'; '.join(found)}")
    problems.extend(
        f"{label}{origin.of(*_split(label))}: {msg}" for label, msg in cross_checks(config)
    )
    if problems:
        raise ConfigError(problems, source=origin.source)
    return config


def _label(table: str, key: str) -> str:
    return f"[{table}] {key}" if key else f"[{table}]"


def _split(label: str) -> tuple[str, str]:
    table, _, key = label.partition("] ")
    return table.lstrip("["), key


# ---------------------------------------------------------------- CLI flags


class _DictPatch(dict):
    """Entries that repeatable `--flag key=value` flags add to a table-valued key: merged
    into the TOML's table rather than replacing it."""


_BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True}
_BOOL_WORDS |= {"false": False, "no": False, "0": False, "off": False}


def param_value(text: str) -> Any:
    """The value of a `--backend-opt key=value`-style flag, read like a TOML value
    (`2`, `0.5`, `true`, `"x"`, `[1, 2]`, `{a = 1}`) or JSON; otherwise the text itself."""
    text = text.strip()
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def _add_param(overlay: dict[str, dict[str, Any]], flag: str, text: str) -> str | None:
    """Add one `key=value` of a repeatable param flag to the overlay; the problem or None."""
    key, eq, value = text.partition("=")
    table, field = dialect.current().param_flags[flag]
    if not eq or not key.strip():
        return f"flag {flag} takes key=value (e.g. {flag} alpha=0.2), got {text!r}"
    patch = overlay.setdefault(table, {}).setdefault(field, _DictPatch())
    if not isinstance(patch, _DictPatch):  # the whole table was also given as a flag
        patch = overlay[table][field] = _DictPatch(patch)
    key, value = key.strip(), param_value(value)
    if key in patch and patch[key] != value:
        return f"flag {flag} sets {key} twice, to {patch[key]!r} and {value!r}. Fix: give it once"
    patch[key] = value
    return None


def _unknown_flag(name: str, value: str | None, flags: Mapping[str, FieldSpec]) -> str:
    keys = dialect.current()
    refused = keys.refused_field(name.removeprefix("--").replace("-", "_"))
    if refused is not None:
        label, why = refused
        return f"flag {name} ({label}) is {why}"
    return hints.flag_text(name, value, flags, keys.param_flags)


def _parse_cli_value(spec: FieldSpec, text: str) -> Any:
    """Turn a flag's text into the value TOML would give, so it is type-checked alike."""
    if spec.type == "bool" and text.strip().lower() in _BOOL_WORDS:  # the original's 1/yes too
        return _BOOL_WORDS[text.strip().lower()]
    if spec.type == "str" or (spec.type == "any" and not text.lstrip().startswith("{")):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if spec.type == "list":  # convenience: comma-separated items
            items = [i.strip() for i in text.split(",") if i.strip()]
            parsed = []
            for item in items:
                try:
                    parsed.append(tomllib.loads(f"v = {item}")["v"])
                except tomllib.TOMLDecodeError:
                    parsed.append(item)
            return parsed
        if spec.type == "dict":
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                pass
        return text  # left as a string: the type check reports it


def parse_overrides(
    argv: Sequence[str],
) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str], list[str]]:
    """Parse `--flag value` / `--flag=value` tokens into a raw overlay.
    Returns (overlay, origin flags, problems)."""
    flags = flag_table()
    param_flags = dialect.current().param_flags
    overlay: dict[str, dict[str, Any]] = {}
    origins: dict[tuple[str, str], str] = {}
    problems: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            problems.append(f"unexpected argument {token!r}: flags look like --lr 1e-4")
            continue
        name, eq, value = token.partition("=")
        spec = flags.get(name)
        if spec is None and name not in param_flags:
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1  # the unknown flag's value, not an argument
            problems.append(_unknown_flag(name, value if eq or value else None, flags))
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):  # `--seed --lr 1e-4`
                what = f"{spec.label}, {spec.type}" if spec else "key=value"
                problems.append(f"flag {name} needs a value ({what})")
                continue
            value = argv[i]
            i += 1
        if spec is None:  # a repeatable --backend-opt / --*-param key=value
            problem = _add_param(overlay, name, value)
            if problem:
                problems.append(problem)
            table, field = param_flags[name]
            origins[(table, field)] = name
            # a problem with one entry names it as "[backend.options] decode"
            origins[(f"{table}.{field}", value.partition("=")[0].strip())] = name
            continue
        parsed = _parse_cli_value(spec, value)
        table = overlay.setdefault(spec.table, {})
        if spec.key in table and table[spec.key] != parsed:  # as TOML refuses a key twice
            first = origins[(spec.table, spec.key)]
            who = f"flag {name} sets" if first == name else f"flags {first} and {name} set"
            problems.append(
                f"{who} {spec.label} twice, to {table[spec.key]!r} and {parsed!r}. Fix: give "
                "it once"
            )
        table[spec.key] = parsed
        origins[(spec.table, spec.key)] = name
        for entry in parsed if isinstance(parsed, dict) else ():  # --backend-options '{...}'
            origins[(f"{spec.table}.{spec.key}", entry)] = name
    return overlay, origins, problems


def _merge(base: dict[str, Any], overlay: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """`base` (the TOML) with the flags' values on top. A flag wins over the key the
    dialect spells differently (`--surprisal-mask-rho` over the original's
    `entropy_mask_rho`), and `--backend-opt`-style entries are added to the TOML's table."""
    renamed = dialect.current().renamed
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for table, values in overlay.items():
        target = merged.setdefault(table, {})
        if not isinstance(target, dict):
            continue
        for key, value in values.items():
            for (t, old), new in renamed.items():
                if t == table and new == (table, key) and old in target:
                    written = target.pop(old)
                    if isinstance(written, dict) and isinstance(target.get(key, {}), dict):
                        target[key] = {**written, **target.get(key, {})}
            current = target.get(key)
            if isinstance(value, _DictPatch) and isinstance(current, dict):
                target[key] = {**current, **value}
            else:
                target[key] = dict(value) if isinstance(value, _DictPatch) else value
    return merged


# ---------------------------------------------------------------- public entry point


_UTF16 = (b"\xff\xfe", b"\xfe\xff")  # what Windows PowerShell 5's `>` writes


def read_toml(path: str | Path) -> tuple[dict[str, Any], str]:
    """Parse a TOML file; a missing file or a syntax error is a ConfigError."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"config file not found: {p}. Create one with `retrain init --template quickstart` "
            "(then run `retrain`), or pass the path of an existing TOML file.",
            head="",
        )
    if p.is_dir():
        raise ConfigError(f"{p} is a directory, not a TOML file", head="")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the file: {exc.strerror or exc}", head="") from None
    try:
        # utf-8-sig: editors on Windows may start a UTF-8 file with a byte-order mark
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        utf16 = " (it starts with UTF-16's byte-order mark)" if data[:2] in _UTF16 else ""
        raise ConfigError(
            f"{p}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}){utf16}, and TOML files "
            "are UTF-8. Fix: save the file as UTF-8",
            head="",
        ) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: TOML syntax error: {exc}", head="") from None


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
) -> Config:
    """Load and validate a Config.

    `path`: the TOML file; None means ./retrain.toml when it exists, else the schema
    defaults alone (as the original did). `overrides`: CLI-style tokens
    (`["--lr", "1e-4", "--seed=3"]`) or a mapping of dotted keys
    (`{"training.lr": 1e-4}`). Raises ConfigError listing every problem.
    """
    if path is None and not Path(DEFAULT_CONFIG).is_file():
        return config_from_dict({}, overrides)
    source = str(path if path is not None else DEFAULT_CONFIG)
    raw, text = read_toml(source)
    overlay, flag_origins, problems = _overrides_to_overlay(overrides)
    if problems:
        raise ConfigError(problems, source=source)
    _campaign_steps_from_flag(raw, overlay, flag_origins)
    origin = _Origin(source=source, lines=locate_keys(text), flags=flag_origins)
    return build_config(_merge(raw, overlay), origin)


def config_from_dict(
    raw: Mapping[str, Any], overrides: Sequence[str] | Mapping[str, Any] = ()
) -> Config:
    """Like load_config, for an already-parsed TOML mapping (tests, campaigns)."""
    overlay, flag_origins, problems = _overrides_to_overlay(overrides)
    if problems:
        raise ConfigError(problems)
    _campaign_steps_from_flag(raw, overlay, flag_origins)
    return build_config(_merge(dict(raw), overlay), _Origin(flags=flag_origins))


def _campaign_steps_from_flag(
    raw: Mapping[str, Any], overlay: dict[str, dict[str, Any]], origins: dict
) -> None:
    """`--max-steps N` on a campaign: every run's steps, as asked on the command line (a
    campaign's runs take `[campaign] max_steps`, which would otherwise override it
    silently), unless `--campaign-max-steps` is given too."""
    steps = overlay.get("training", {}).get("max_steps")
    if steps is None or not isinstance(raw.get("campaign"), Mapping):
        return
    campaign = overlay.setdefault("campaign", {})
    if "max_steps" not in campaign:
        campaign["max_steps"] = steps
        if ("training", "max_steps") in origins:
            origins[("campaign", "max_steps")] = origins[("training", "max_steps")]


def _overrides_to_overlay(
    overrides: Sequence[str] | Mapping[str, Any],
) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str], list[str]]:
    if isinstance(overrides, Mapping):
        overlay: dict[str, dict[str, Any]] = {}
        for dotted, value in overrides.items():
            table, _, key = dotted.partition(".")
            overlay.setdefault(table, {})[key] = value
        return overlay, {}, []
    return parse_overrides(list(overrides))


def iter_flag_help(flags: Mapping[str, FieldSpec] | None = None) -> Iterable[tuple[str, FieldSpec]]:
    """Flags grouped by table, shortest name first (for --help)."""
    flags = flags or flag_table()
    by_spec: dict[tuple[str, str], list[str]] = {}
    for name, spec in flags.items():
        by_spec.setdefault((spec.table, spec.key), []).append(name)
    for table in TABLES:
        for spec in table_fields(table):
            names = sorted(by_spec.get((table, spec.key), []), key=len)
            yield ", ".join(names), spec
