"""A campaign's conditions: `[[campaign.conditions]]` (parsed and checked by
:mod:`retrain.config.conditions`, which config loading uses too), else the five standard
ones; and the condition of a manifest's run entry, when a campaign resumes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from retrain.config.conditions import Condition, parse_conditions, parse_entry
from retrain.config.schema import Config
from retrain.errors import ConfigError

STANDARD_CONDITIONS: tuple[tuple[str, str], ...] = (
    ("grpo", "none"),
    ("maxrl", "none"),
    ("maxrl", "gtpo"),
    ("maxrl", "gtpo_hicra"),
    ("maxrl", "gtpo_sepa"),
)


def campaign_conditions(config: Config) -> list[Condition]:
    """The campaign's conditions: `[[campaign.conditions]]`, else the five standard ones."""
    entries = config.campaign.conditions if config.campaign is not None else []
    if not entries:
        return [Condition(adv, tx) for adv, tx in STANDARD_CONDITIONS]
    return parse_conditions(entries)


def condition_from_manifest(entry: Mapping[str, Any]) -> Condition:
    """The condition of a manifest run entry (advantage_mode, transform_mode, overrides)."""
    overrides = entry.get("overrides") or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError("'overrides' must be a JSON object of run keys")
    table = {
        "advantage_mode": entry.get("advantage_mode"),
        "transform_mode": entry.get("transform_mode"),
    }
    parsed = parse_entry({**overrides, **table})
    if isinstance(parsed, list):
        raise ConfigError(parsed)
    label = entry.get("condition")
    if isinstance(label, str) and label and label != parsed.label:  # a named condition
        return dataclasses.replace(parsed, name=label)
    return parsed
