"""Rewards: score a model response against an example's reference.

    reward = build_reward("math", timeout=5.0)
    reward.score(response, reference)            # -> float
    reward.score_batch(responses, examples)      # -> BatchScore (rewards + counters)
    reward.close()

Built-in types (`[reward] type`): match, math, judge, custom, gym; see each module. Heavy
dependencies (math-verify, reasoning-gym) are imported only by the type that needs them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from retrain.errors import PluginError, RewardError
from retrain.rewards.base import BatchScore, Reward
from retrain.rewards.boxed import extract_boxed

__all__ = ["BatchScore", "Reward", "build_reward", "extract_boxed"]


def build_reward(
    type: str,
    *,
    judge_model: str = "",
    judge_base_url: str = "",
    judge_api_key: str = "",
    custom_module: str = "",
    custom_function: str = "score",
    timeout: float = 5.0,
    max_concurrency: int = 8,
    max_retries: int = 4,
    search_paths: Sequence[str] = (),
    **options: Any,
) -> Reward:
    """The reward named `type`, configured from `[reward]` options. Options a type does
    not use are ignored, so the caller can pass the whole table."""
    from retrain.registry import REWARDS

    try:
        cls = REWARDS.resolve(type)
    except PluginError as exc:
        raise RewardError(f"[reward] type: {exc}") from exc
    kwargs = dict(
        judge_model=judge_model,
        judge_base_url=judge_base_url,
        judge_api_key=judge_api_key,
        custom_module=custom_module,
        custom_function=custom_function,
        timeout=timeout,
        max_concurrency=max_concurrency,
        max_retries=max_retries,
        search_paths=tuple(search_paths or ()),
        **options,
    )
    params = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return cls(**kwargs)
