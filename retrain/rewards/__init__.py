"""Rewards: score a model response against an example's reference.

    reward = build_reward(RewardConfig(type="math", timeout=5.0))
    reward.score(response, reference)            # -> float
    reward.score_batch(responses, examples)      # -> BatchScore (rewards + counters)
    reward.close()

Built-in types (`[reward] type`): match, math, judge, custom, gym; see each module. Heavy
dependencies (math-verify, reasoning-gym) are imported only by the type that needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from retrain.errors import PluginError, RewardError
from retrain.rewards.base import BatchScore, Reward
from retrain.rewards.boxed import extract_boxed

if TYPE_CHECKING:
    from retrain.config.schema import RewardConfig

__all__ = ["BatchScore", "Reward", "build_reward", "extract_boxed"]


def build_reward(reward: RewardConfig, search_paths: Sequence[str] = ()) -> Reward:
    """The reward named by `[reward] type`, built from the `[reward]` table (each type
    reads the keys it uses, see its `from_config`)."""
    from retrain.registry import REWARDS

    try:
        cls = REWARDS.resolve(reward.type)
    except PluginError as exc:
        raise RewardError(f"[reward] type: {exc}") from exc
    return cls.from_config(reward, tuple(search_paths))
