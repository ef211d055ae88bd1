"""What the compared runs differ in besides their condition and seed, read from the
configuration each run recorded (config.resolved.toml, else a campaign's run.toml).

Seeds of one condition are replicates: a key that differs among them (another lr, a
run from before an edit of the TOML) makes the interval describe a mix, so it is a
warning. Between conditions a difference outside the algorithm's tables (another
model, group size, lr) is a second variable beside the algorithm; it is said, since a
campaign may vary it on purpose.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any

from retrain.compare.runs import RunData

# Per run by design, or without effect on what it learns: its seed, directories, names,
# where and how verbosely it ran, its resume.
PER_RUN = frozenset(
    {
        ("training", "seed"),
        ("training", "max_steps"),  # runs of another length: the horizon says so
        ("backend", "adapter_path"),
        ("backend", "devices"),
        ("backend", "throttle_dir"),
        ("backend", "max_concurrent"),
        ("logging", "log_dir"),
        ("logging", "condition_label"),
        ("logging", "group_lines"),
        ("logging", "wandb_project"),
        ("logging", "wandb_run_name"),
        ("logging", "wandb_entity"),
        ("logging", "wandb_group"),
        ("logging", "wandb_tags"),
        ("plugins", "search_paths"),
        ("resume", "from"),
    }
)
# What a condition is: the algorithm and its transforms' settings, and the [training]
# keys a named algorithm sets (its loss, clip ranges, KL, length handling).
ALGORITHM_TABLES = frozenset({"algorithm", "gtpo", "hicra", "sepa", "planning"})
SHOWN = 4  # values listed per key


@functools.cache
def _algorithm_keys() -> frozenset[tuple[str, str]]:
    from retrain.algorithms import ALGORITHMS

    return frozenset(
        (table, key)
        for row in ALGORITHMS
        for table, keys in (("algorithm", row.algorithm), ("training", row.training))
        for key in keys
    )


def _settings(run: RunData) -> dict[tuple[str, str], Any]:
    """The run's recorded keys, {} when it recorded none. A campaign's own table is the
    campaign's, not the run's."""
    return {
        (table, key): value
        for table, values in run.source.config.items()
        if isinstance(values, dict) and table != "campaign"
        for key, value in values.items()
        if (table, key) not in PER_RUN
    }


def _text(value: Any) -> str:
    from retrain.config.toml_writer import value_to_toml

    return value_to_toml(value)


def _varying(settings: Sequence[dict]) -> list[tuple[str, str]]:
    """The keys every one of `settings` holds that do not have one value among them."""
    if len(settings) < 2:
        return []
    shared = set.intersection(*(set(s) for s in settings))
    keys = [k for k in settings[0] if k in shared]  # the recorded order
    return [k for k in keys if len({_text(s[k]) for s in settings}) > 1]


def setup_differences(runs: Sequence[RunData], conditions: Sequence[str]) -> list[str]:
    """Warnings for keys that differ among one condition's runs, then a note for each key
    outside the algorithm's tables that differs between conditions (and within none)."""
    recorded = [(r, s) for r in runs if (s := _settings(r))]
    out, mixed = [], set()
    for cond in conditions:
        members = [s for r, s in recorded if r.condition == cond]
        for table, key in _varying(members):
            mixed.add((table, key))
            counts = Counter(_text(s[(table, key)]) for s in members)
            values = ", ".join(
                f"{v} in {n} run{'s' if n > 1 else ''}" for v, n in list(counts.items())[:SHOWN]
            )
            out.append(
                f"{cond}: its runs differ in [{table}] {key} ({values}); seeds of one "
                "condition should differ in the seed alone"
            )
    first: dict[str, dict] = {}  # each condition's first run that recorded its config
    for r, s in recorded:
        first.setdefault(r.condition, s)
    labelled = {part.split("=")[0] for c in first for part in c.partition("~")[2].split(",")}
    for table, key in _varying(list(first.values())):
        if table in ALGORITHM_TABLES or (table, key) in _algorithm_keys() | mixed:
            continue
        if key in labelled or f"{table}.{key}" in labelled:  # a campaign's override, named
            continue
        values = "; ".join(f"{c} {_text(s[(table, key)])}" for c, s in first.items())
        out.append(f"conditions differ in more than the algorithm: [{table}] {key} ({values})")
    return out
