"""Episode-level advantages: one number per completion of a prompt group.

Both built-ins take the group's rewards (a list or a 1-D array) and an optional params
dict, and return a float64 array of the same length:

- ``grpo``:  A_i = r_i - mean(r)                       (no std normalisation)
- ``maxrl``: A_i = (r_i - mean(r)) / (mean(r) + eps)   (eps = 1e-6), all zeros when
  mean(r) <= eps. Dividing by the success rate up-weights rare successes.

``params`` is accepted (and ignored, except ``eps`` for maxrl) so that built-ins and
dotted-path plugins share one calling convention: ``fn(rewards)`` or
``fn(rewards, params)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MAXRL_EPS = 1e-6


def _as_rewards(rewards_G: Sequence[float] | np.ndarray) -> np.ndarray:
    r = np.asarray(rewards_G, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


def grpo(
    rewards_G: Sequence[float] | np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """GRPO episode advantages: each reward minus the group mean."""
    r = _as_rewards(rewards_G)
    if r.size == 0:
        return r
    return r - r.mean()


def maxrl(
    rewards_G: Sequence[float] | np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """MaxRL episode advantages: GRPO divided by (mean reward + eps).

    ``params["eps"]`` overrides eps (default 1e-6). A group whose mean reward is at
    most eps (for 0/1 rewards: nobody solved it) gets all zeros.
    """
    r = _as_rewards(rewards_G)
    eps = float((params or {}).get("eps", MAXRL_EPS))
    if r.size == 0:
        return r
    mean = r.mean()
    if mean <= eps:
        return np.zeros_like(r)
    return (r - mean) / (mean + eps)


# Batched forms over many groups at once (named by the registry entries' `grouped`):
# `rewards` holds every group's rewards concatenated, `sizes` the group sizes (all >= 1).
# Bit-for-bit the per-group functions called one group at a time.


def _group_means(rewards: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    # one mean() per group (not reduceat): bit-for-bit the per-group functions' means
    ends = np.cumsum(sizes).tolist()
    starts = [0, *ends[:-1]]
    return np.array([rewards[s:e].mean() for s, e in zip(starts, ends)])


def grpo_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    if rewards.size == 0:
        return np.zeros(0)
    return rewards - np.repeat(_group_means(rewards, sizes), sizes)


def maxrl_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    if rewards.size == 0:
        return np.zeros(0)
    eps = float((params or {}).get("eps", MAXRL_EPS))
    mean = _group_means(rewards, sizes)
    empty = mean <= eps
    out = (rewards - np.repeat(mean, sizes)) / np.repeat(np.where(empty, 1.0, mean + eps), sizes)
    out[np.repeat(empty, sizes)] = 0.0
    return out
