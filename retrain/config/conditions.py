"""`[[campaign.conditions]]` entries: their run-key overrides, checks and labels.

An entry names the condition's `advantage_mode` and `transform_mode`; every other key
overrides a run setting for that condition only::

    [[campaign.conditions]]
    advantage_mode = "maxrl"
    transform_mode = "gtpo_sepa"
    lr = 1e-4                           # a bare key, resolved like the `--lr` flag
    uncertainty_kind = "shannon_entropy"
    sepa.steps = 100                    # table-qualified (a TOML dotted key)
    "gtpo.beta" = 0.2                   # the same, as one quoted key

A bare key resolves to its table exactly as the CLI flag `--{key}` does (so `gtpo_beta`,
like `--gtpo-beta`, is `[gtpo] beta`); the installed key dialect
(:mod:`retrain.config.dialect`) adds its names (the original retrain's field names such
as `bp_enabled`, and keys it refuses by name). A value is type- and range-checked like
the same key at the top level. The condition's label is `{advantage_mode}+{transform_mode}`,
then for overrides `~` and `key=value` pairs sorted by key and joined by `,`, each key
as written and each value as Python prints it: `maxrl+gtpo_sepa~lr=0.0001,uncertainty_kind=...`;
`name = "GRPO"` in the entry is the label instead.

Config loading checks the entries here (so a bad one fails at load, naming the entry and
the key); :mod:`retrain.campaign` turns them into runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from retrain.config import dialect, hints
from retrain.config.flags import flag_table
from retrain.config.schema import TABLES, Config, FieldSpec, table_fields
from retrain.config.values import check_range_and_choice, coerce_value
from retrain.errors import ConfigError

MODE_KEYS = ("advantage_mode", "transform_mode")
NAME_KEY = "name"  # the condition's label, in place of the generated one
ENTRY = "[[campaign.conditions]] entry"

# Tables that are not run settings, and keys the campaign sets for each run itself.
_NOT_RUN_TABLES = ("campaign", "squeeze")
_SET_PER_RUN = {
    ("training", "seed"): "each run's seed comes from [campaign] seeds",
    ("algorithm", "advantage_mode"): "write advantage_mode = ... in the entry itself",
    ("algorithm", "transform_mode"): "write transform_mode = ... in the entry itself",
    ("algorithm", "algorithm_mode"): "a condition is an advantage_mode + transform_mode",
    ("logging", "log_dir"): "the campaign gives each run runs/{name}/",
    ("logging", "condition_label"): "the campaign sets it to the condition's label",
    ("logging", "wandb_run_name"): "the campaign names each run",
    ("logging", "wandb_group"): "the campaign groups runs by condition",
    ("backend", "adapter_path"): "the campaign gives each run runs/{name}/adapter",
    ("resume", "from"): "resume a campaign with --resume CAMPAIGN_DIR",
}


@dataclass(frozen=True)
class Override:
    """One run setting a condition overrides."""

    key: str  # as written in the entry: "lr", "sepa.steps"
    spec: FieldSpec  # the field it sets
    raw: Any  # the value as written (labels, the manifest)
    value: Any  # the value as checked and coerced (the run config)


@dataclass(frozen=True)
class Condition:
    advantage_mode: str
    transform_mode: str
    overrides: tuple[Override, ...] = ()
    name: str = ""  # `name = "GRPO"` in the entry: the label, as written

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return condition_label(self.advantage_mode, self.transform_mode, self.raw_overrides)

    @property
    def raw_overrides(self) -> dict[str, Any]:
        """{key as written: value as written}, sorted by key (the manifest records this)."""
        return {o.key: o.raw for o in sorted(self.overrides, key=lambda o: o.key)}

    def apply(self, config: Config) -> None:
        """Set the overridden fields on `config` (modes and campaign fields excluded). The
        training overrides go through the key dialect's ``fix_section`` first, so they
        mean what they meant there (the original retrain's `clip_eps` alone turns PPO
        clipping on)."""
        for o in self.overrides:
            setattr(getattr(config, o.spec.table), o.spec.attr, o.value)
        training = {o.spec.attr: o.value for o in self.overrides if o.spec.table == "training"}
        dialect.current().fix_section("training", training)
        if "policy_loss" in training:
            config.training.policy_loss = training["policy_loss"]


def condition_label(
    advantage_mode: str, transform_mode: str, overrides: Mapping[str, Any] | None = None
) -> str:
    """`adv+tx`, or `adv+tx~k1=v1,k2=v2` with the overrides sorted by key."""
    base = f"{advantage_mode}+{transform_mode}"
    if not overrides:
        return base
    return base + "~" + ",".join(f"{k}={overrides[k]}" for k in sorted(overrides))


# ------------------------------------------------------------------ resolving keys


def _written_keys(
    entry: Mapping[str, Any], flags: Mapping[str, FieldSpec]
) -> list[tuple[str, Any]]:
    """The entry's override keys as written, a TOML dotted key (`sepa.steps = 100`, which
    TOML reads as a table `sepa`) flattened to "sepa.steps"."""
    refused_tables = dialect.current().refused_tables
    out: list[tuple[str, Any]] = []
    for key, value in entry.items():
        if key in (*MODE_KEYS, NAME_KEY):
            continue
        field = flags.get(f"--{key.replace('_', '-')}")
        as_field = field is not None and field.type in ("dict", "any")
        table = key in TABLES or key in refused_tables
        if isinstance(value, dict) and table and not as_field:
            out += [(f"{key}.{sub}", v) for sub, v in value.items()]
        else:
            out.append((key, value))
    return out


Lookup = tuple[FieldSpec | None, str]  # the field a key sets, or (None, why not)


def _lookup(key: str, raw: Any, flags: Mapping[str, FieldSpec]) -> Lookup:
    """The field a written key sets, or (None, why not): a bare key as its `--key` flag
    (or a name of the key dialect), a `table.key` in its table. Another trainer's name
    (`learning_rate`) is pointed to retrain's key before any spelling guess."""
    if "." in key:
        table, _, name = key.partition(".")
        return _qualified(table, name, raw, flags)
    keys = dialect.current()
    spec = flags.get(f"--{key.replace('_', '-')}")
    if spec is None and key in keys.field_names:  # names with no flag (table-valued keys)
        spec = _spec(*keys.field_names[key])
    if spec is not None:
        return spec, ""
    refused = keys.refused_field(key)
    if refused is not None:
        label, why = refused
        return None, f"{label} is {why}"
    peer = hints.condition_peer([key], raw, flags)
    if peer is not None:
        return None, f"unknown key: {peer}"
    owners = [t for t in TABLES if key in {s.key for s in table_fields(t)}]
    if owners:
        qualified = " or ".join(f"{t}.{key}" for t in owners)
        return None, f"not reachable as a bare key; write it table-qualified: {qualified}"
    bare = [name[2:].replace("-", "_") for name in flags]
    return None, f"unknown key{hints.condition_guess(key, bare, flags)}"


def _qualified(table: str, name: str, raw: Any, flags: Mapping[str, FieldSpec]) -> Lookup:
    keys = dialect.current()
    refused = keys.refused_key(table, name)
    if refused is not None:
        return None, refused
    table, name = keys.renamed.get((table, name), (table, name))
    spec = _spec(table, name) if table in TABLES else None
    if spec is not None:
        return spec, ""
    peer = hints.condition_peer([table, name], raw, flags)
    if table not in TABLES:
        where, written, choices = "unknown table", table, list(TABLES)
    else:
        where, written, choices = f"unknown key in [{table}]", name, _keys(table)
    if peer is not None:
        return None, f"{where}: {peer}"
    guess = hints.condition_guess(written, choices, flags, peers=table in TABLES)
    return None, f"{where}{guess}"


def _keys(table: str) -> list[str]:
    return [s.key for s in table_fields(table)]


def _spec(table: str, key: str) -> FieldSpec | None:
    return next((s for s in table_fields(table) if s.key == key), None)


def _check_override(key: str, raw: Any, flags: Mapping[str, FieldSpec]) -> Override | str:
    """The checked override, or the problem (without the entry prefix)."""
    spec, why = _lookup(key, raw, flags)
    if spec is None:
        return f"{key}: {why}"
    where = f"{key} ({spec.label})" if key != spec.key else key
    if spec.table in _NOT_RUN_TABLES:
        return f"{where}: [{spec.table}] is not a run setting and cannot vary by condition"
    reserved = _SET_PER_RUN.get((spec.table, spec.key))
    if reserved:
        return f"{where}: cannot be overridden by a condition ({reserved})"
    if spec.meta.get("secret"):
        return f"{where}: a secret cannot be a condition override (it would appear in run names)"
    value, error = coerce_value(spec, raw)
    if error is None:
        error = check_range_and_choice(spec, value)
    if error:
        fix = spec.meta["fix"]
        return f"{where}: {error}{f'. Fix: {fix}' if fix else ''}"
    return Override(key, spec, raw, value)


def _mode(entry: Mapping[str, Any], key: str) -> tuple[str, str | None]:
    """(mode, problem) for advantage_mode / transform_mode, checked like [algorithm]'s."""
    name = entry.get(key)
    if not isinstance(name, str) or not name:
        return "", f"{key}: required, a non-empty string"
    problem = check_range_and_choice(_spec("algorithm", key), name)
    return name, f"{key}: {problem}" if problem else None


# ------------------------------------------------------------------ parsing entries


def parse_entry(entry: Any, flags: Mapping[str, FieldSpec] | None = None) -> Condition | list[str]:
    """One `[[campaign.conditions]]` table as a Condition, or its problems."""
    if not isinstance(entry, Mapping):
        return ["must be a table with advantage_mode and transform_mode"]
    flags = flag_table() if flags is None else flags
    problems: list[str] = []
    modes = []
    for key in MODE_KEYS:
        name, problem = _mode(entry, key)
        modes.append(name)
        if problem:
            problems.append(problem)
    overrides: list[Override] = []
    for key, raw in _written_keys(entry, flags):
        checked = _check_override(key, raw, flags)
        if isinstance(checked, str):
            problems.append(checked)
            continue
        twin = next((o for o in overrides if o.spec == checked.spec), None)
        if twin is not None:
            problems.append(f"{key}: sets {checked.spec.label} again (as {twin.key})")
            continue
        overrides.append(checked)
    name = entry.get(NAME_KEY, "")
    if not isinstance(name, str) or (NAME_KEY in entry and not name.strip()):
        problems.append(f"{NAME_KEY}: must be a non-empty string (the condition's label)")
    if problems:
        return problems
    return Condition(modes[0], modes[1], tuple(overrides), name.strip())


def conditions_problems(entries: Sequence[Any]) -> list[str]:
    """Every problem of a `[[campaign.conditions]]` list, each naming its entry (0-based)
    and key; two entries with the same label are a problem too (they would share runs)."""
    flags = flag_table()
    problems: list[str] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        parsed = parse_entry(entry, flags)
        if isinstance(parsed, list):
            problems += [f"{ENTRY} {i}: {p}" for p in parsed]
            continue
        first = seen.setdefault(parsed.label, i)
        if first != i:
            problems.append(f"{ENTRY} {i}: repeats entry {first} ({parsed.label})")
    return problems


def parse_conditions(entries: Sequence[Any], source: str | None = None) -> list[Condition]:
    """The conditions of a `[[campaign.conditions]]` list; ConfigError on any problem."""
    problems = conditions_problems(entries)
    if problems:
        raise ConfigError(problems, source=source)
    flags = flag_table()
    return [c for e in entries if isinstance(c := parse_entry(e, flags), Condition)]
