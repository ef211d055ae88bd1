"""Test shorthands: build a data source or a reward from keyword arguments, through the
same config tables and builders a run uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retrain.config.schema import DataConfig, EnvironmentConfig, RewardConfig
from retrain.data import build_data_source
from retrain.rewards import build_reward


def data_source(
    source: str = "math",
    *,
    max_examples: int = 0,
    shuffle_seed: int | None = None,
    search_paths: Sequence[str] = (),
    environment: dict[str, Any] | None = None,
    **data: Any,
):
    return build_data_source(
        DataConfig(source=source, **data),
        environment=EnvironmentConfig(**environment) if environment else None,
        max_examples=max_examples,
        shuffle_seed=shuffle_seed,
        search_paths=search_paths,
    )


def reward(type: str, *, search_paths: Sequence[str] = (), **keys: Any):
    return build_reward(RewardConfig(type=type, **keys), search_paths)
