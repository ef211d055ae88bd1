"""Episode-level advantages: one number per completion of a prompt group.

Every built-in takes the group's rewards (a list or a 1-D array) and an optional params
dict (``[algorithm.advantage_params]``), and returns a float64 array of the same length.
With G the group size, mean(r) the group's mean reward and std_s(r) its sample standard
deviation (ddof = 1):

- ``grpo``:  A_i = r_i - mean(r). No standard-deviation scale: this is Dr. GRPO's
  advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783),
  the form verl gets with ``norm_adv_by_std_in_grpo=False`` and TRL with
  ``scale_rewards="none"``.
- ``grpo_std``: A_i = (r_i - mean(r)) / (std_s(r) + eps), eps = 1e-6: the original
  GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300), as verl and TRL compute it.
- ``maxrl``: A_i = (r_i - mean(r)) / (mean(r) + eps)   (eps = 1e-6), all zeros when
  mean(r) <= eps. Dividing by the success rate up-weights rare successes.
- ``rloo``: A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r)): the
  leave-one-out baseline (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline
  for Free!"; Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740).
- ``opo``: A_i = r_i - sum_j l_j r_j / sum_j l_j, l_j the number of tokens completion j
  is trained on: the optimal baseline of OPO (Hao et al. 2025, "On-Policy RL with
  Optimal Reward Baseline", arXiv 2505.23585), the length-weighted mean reward of the
  group, as verl's ``compute_opo_outcome_advantage`` (its l_j: the response mask's sum).
  The only mode that reads the lengths: its functions take ``lengths=`` (one per
  completion, the size of its logprobs in the pipeline). A group with no trained token
  at all weighs its completions equally.

Two more read statistics of the whole step, not of one group: REINFORCE++'s global
advantage normalisation (Hu et al. 2025, arXiv 2501.03262). With B the batch and
mean_B, var_B its mean and sample variance (ddof = 1), eps = 1e-8:

- ``reinforce_pp``: A_i = (r_i - mean_B(r)) / sqrt(var_B(r) + eps).
- ``reinforce_pp_baseline``: a_i = r_i - mean(r) (its group's mean), then
  A_i = (a_i - mean_B(a)) / sqrt(var_B(a) + eps). Each group's a sums to 0, so
  mean_B(a) = 0 and this is ``grpo`` divided by one number for the whole step.

The order and eps follow verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``
(group mean first, then ``masked_whiten``: ddof = 1, eps = 1e-8 under the square root);
OpenRLHF, the paper's own code, uses the population variance floored at 1e-8 instead.
With outcome rewards and no KL term in the reward, verl's REINFORCE++ return is the
reward itself on every token, which is what ``reinforce_pp`` whitens.

The batch B is what the advantage pipeline hands the batched form: every completion of
the step's *kept* groups. Groups whose rewards are all equal are skipped before the
advantages are computed (:mod:`retrain.advantages.pipeline`, step 1); they are not
trained on, so they do not enter mean_B and var_B either. Called on one group (the
per-group functions below, :func:`~retrain.advantages.pipeline.compute_token_advantages`)
the batch is that group. Each completion counts once in mean_B and var_B: verl
(``masked_whiten``) and OpenRLHF whiten over tokens instead, so a completion of T
tokens counts T times there; the two agree when the kept completions are equally long.

Group-size edge cases (the trainer never meets them: ``[training] group_size`` is at
least 2 and a group of one is always skipped): a group of one gets A = 0 under every
built-in (its only baseline is itself), and a batch of one completion has var_B = 0.

``params`` is accepted so that built-ins and dotted-path plugins share one calling
convention: ``fn(rewards)`` or ``fn(rewards, params)`` (``opo`` also takes ``lengths=``).
Every built-in checks its own (:func:`check_params`): ``eps`` (> 0) where the formula has
one, nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from retrain.errors import ConfigError

MAXRL_EPS = 1e-6
GRPO_STD_EPS = 1e-6  # verl's default epsilon (TRL adds 1e-4)
REINFORCE_PP_EPS = 1e-8  # added to the variance under the square root, as verl's masked_whiten

# The [algorithm.advantage_params] keys each built-in reads, with their defaults. grpo
# and maxrl once ignored keys they do not read: a typo (`epsilon`) then changed nothing
# without a word, and a string eps failed only at the first step.
PARAMS: dict[str, dict[str, float]] = {
    "grpo": {},
    "maxrl": {"eps": MAXRL_EPS},
    "grpo_std": {"eps": GRPO_STD_EPS},
    "rloo": {},
    "reinforce_pp": {"eps": REINFORCE_PP_EPS},
    "reinforce_pp_baseline": {"eps": REINFORCE_PP_EPS},
    "opo": {},
}


def _as_rewards(rewards_G: Sequence[float] | np.ndarray) -> np.ndarray:
    r = np.asarray(rewards_G, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


def check_params(mode: str, params: Mapping[str, Any] | None) -> dict[str, float]:
    """The parameters of built-in advantage mode `mode` (its defaults, overridden by
    `params`). A key the mode does not read, or an ``eps`` that is not a number > 0, is
    a ConfigError naming ``[algorithm.advantage_params]`` and the fix. A mode outside
    :data:`PARAMS` (a plugin) is not checked: {} is returned."""
    if mode not in PARAMS:
        return {}
    known = PARAMS[mode]
    out = dict(known)
    reads = ", ".join(known) or "no parameters"
    for key, value in (params or {}).items():
        where = f"[algorithm.advantage_params] {key}"
        if key not in known:
            raise ConfigError(
                f"{where}: advantage_mode {mode!r} does not read {key!r} (it reads {reads}). "
                "Fix: remove the key, or use the advantage mode it belongs to"
            )
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise ConfigError(
                f"{where}: must be a finite number > 0 for advantage_mode {mode!r}, got "
                f"{value!r}. Fix: set it to a small positive number (default {known[key]:g})"
            )
        out[key] = float(value)
    return out


def grpo(
    rewards_G: Sequence[float] | np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Dr. GRPO episode advantages: each reward minus the group mean, no std scale.

    A_i = r_i - mean(r) (Liu et al. 2025, arXiv 2503.20783, who drop GRPO's division by
    the group's standard deviation; see ``grpo_std`` for that form). No parameters."""
    check_params("grpo", params)
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
    eps = check_params("maxrl", params)["eps"]
    if r.size == 0:
        return r
    mean = r.mean()
    if mean <= eps:
        return np.zeros_like(r)
    return (r - mean) / (mean + eps)


def grpo_std(
    rewards_G: Sequence[float] | np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """GRPO episode advantages with the standard-deviation scale (Shao et al. 2024).

    A_i = (r_i - mean(r)) / (std_s(r) + eps) with std_s the sample standard deviation
    (ddof = 1, torch.std's default, which verl's ``compute_grpo_outcome_advantage`` and
    TRL's GRPOTrainer use) and eps = ``params["eps"]`` (default 1e-6, verl's; TRL uses
    1e-4). A group of one gets 0."""
    return _one_group(grpo_std_grouped, rewards_G, params)


def rloo(
    rewards_G: Sequence[float] | np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """RLOO episode advantages: each reward minus the mean of the group's other rewards.

    A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(r)) (Kool et al.
    2019; Ahmadian et al. 2024, arXiv 2402.14740). The advantages of a group sum to 0.
    No parameters; a group of one gets 0."""
    return _one_group(rloo_grouped, rewards_G, params)


def opo(
    rewards_G: Sequence[float] | np.ndarray,
    params: Mapping[str, Any] | None = None,
    *,
    lengths: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """OPO episode advantages (Hao et al. 2025, arXiv 2505.23585): each reward minus the
    group's length-weighted mean reward, b = sum_j l_j r_j / sum_j l_j, `lengths` the
    trained tokens of each completion. With equal lengths this is ``grpo``. No
    parameters; a group of one gets 0."""
    r = _as_rewards(rewards_G)
    sizes = np.array([r.size] if r.size else [], dtype=np.int64)
    return opo_grouped(r, sizes, params, lengths=lengths)


def reinforce_pp(
    rewards_G: Sequence[float] | np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262) over one group taken as the batch.

    A_i = (r_i - mean_B(r)) / sqrt(var_B(r) + eps), var_B with ddof = 1, eps =
    ``params["eps"]`` (default 1e-8). The pipeline uses :func:`reinforce_pp_grouped`,
    whose batch B is every completion of the step's kept groups."""
    return _one_group(reinforce_pp_grouped, rewards_G, params)


def reinforce_pp_baseline(
    rewards_G: Sequence[float] | np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """REINFORCE++-baseline (Hu et al. 2025) over one group taken as the batch.

    a_i = r_i - mean(r), then A_i = (a_i - mean_B(a)) / sqrt(var_B(a) + eps) (ddof = 1,
    eps = ``params["eps"]``, default 1e-8). The pipeline uses
    :func:`reinforce_pp_baseline_grouped`, whose batch B is every completion of the
    step's kept groups."""
    return _one_group(reinforce_pp_baseline_grouped, rewards_G, params)


def _one_group(grouped: Any, rewards_G: Any, params: Mapping[str, Any] | None) -> np.ndarray:
    r = _as_rewards(rewards_G)
    sizes = np.array([r.size] if r.size else [], dtype=np.int64)
    return grouped(r, sizes, params)


# Batched forms over many groups at once (named by the registry entries' `grouped`):
# `rewards` holds every group's rewards concatenated, `sizes` the group sizes (all >= 1).
# grpo, grpo_std, maxrl, rloo: bit-for-bit the per-group functions called one group at a
# time. reinforce_pp and reinforce_pp_baseline: statistics over all the groups given
# (the pipeline gives the kept ones), so they differ from per-group calls by design.


def _group_means(rewards: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    # one mean() per group (not reduceat): bit-for-bit the per-group functions' means
    ends = np.cumsum(sizes).tolist()
    starts = [0, *ends[:-1]]
    return np.array([rewards[s:e].mean() for s, e in zip(starts, ends)])


def grpo_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    check_params("grpo", params)
    if rewards.size == 0:
        return np.zeros(0)
    return rewards - np.repeat(_group_means(rewards, sizes), sizes)


def maxrl_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    eps = check_params("maxrl", params)["eps"]
    if rewards.size == 0:
        return np.zeros(0)
    mean = _group_means(rewards, sizes)
    empty = mean <= eps
    out = (rewards - np.repeat(mean, sizes)) / np.repeat(np.where(empty, 1.0, mean + eps), sizes)
    out[np.repeat(empty, sizes)] = 0.0
    return out


def _checked_sizes(rewards: np.ndarray, sizes: Any) -> np.ndarray:
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if (sizes < 1).any() or int(sizes.sum()) != rewards.size:
        raise ValueError(
            f"group sizes must be >= 1 and sum to the {rewards.size} rewards, got {sizes.tolist()}"
        )
    return sizes


def _starts(sizes: np.ndarray) -> np.ndarray:
    starts = np.zeros(sizes.size, dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return starts


def _group_sums(x: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    return np.add.reduceat(x, _starts(sizes))


def _centered(rewards: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """r_i - mean of its group, for every completion. Each group's first reward is
    subtracted before the mean is taken (the same in exact arithmetic), so a group of
    equal rewards centres to exactly 0 rather than to a rounding residue that a std
    scale would blow up."""
    d = rewards - np.repeat(rewards[_starts(sizes)], sizes)
    return d - np.repeat(_group_sums(d, sizes) / sizes, sizes)


def _whiten(x: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean(x)) / sqrt(var(x) + eps) over all of x; var with ddof = 1 (0 for one
    value). Centred like :func:`_centered`: equal values give exactly 0."""
    d = x - x[0]
    centered = d - d.mean()
    var = float(np.dot(centered, centered)) / max(x.size - 1, 1)
    return centered / math.sqrt(var + eps)


def grpo_std_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    eps = check_params("grpo_std", params)["eps"]
    rewards = np.asarray(rewards, dtype=np.float64)
    sizes = _checked_sizes(rewards, sizes)
    if rewards.size == 0:
        return np.zeros(0)
    centered = _centered(rewards, sizes)
    std = np.sqrt(_group_sums(centered * centered, sizes) / np.maximum(sizes - 1, 1))
    return centered / np.repeat(std + eps, sizes)


def rloo_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    check_params("rloo", params)
    rewards = np.asarray(rewards, dtype=np.float64)
    sizes = _checked_sizes(rewards, sizes)
    if rewards.size == 0:
        return np.zeros(0)
    scale = sizes / np.maximum(sizes - 1, 1)  # a group of one: its centred reward is 0
    return _centered(rewards, sizes) * np.repeat(scale, sizes)


def reinforce_pp_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """REINFORCE++ over the batch of all the groups given: rewards whitened with the
    batch's mean and sample variance (see the module docstring)."""
    eps = check_params("reinforce_pp", params)["eps"]
    rewards = np.asarray(rewards, dtype=np.float64)
    _checked_sizes(rewards, sizes)
    if rewards.size == 0:
        return np.zeros(0)
    return _whiten(rewards, eps)


def reinforce_pp_baseline_grouped(
    rewards: np.ndarray, sizes: np.ndarray, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """REINFORCE++-baseline over the batch of all the groups given: each group's mean
    subtracted first, then the centred rewards whitened over the whole batch."""
    eps = check_params("reinforce_pp_baseline", params)["eps"]
    rewards = np.asarray(rewards, dtype=np.float64)
    sizes = _checked_sizes(rewards, sizes)
    if rewards.size == 0:
        return np.zeros(0)
    return _whiten(_centered(rewards, sizes), eps)


def opo_grouped(
    rewards: np.ndarray,
    sizes: np.ndarray,
    params: Mapping[str, Any] | None = None,
    *,
    lengths: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """OPO over many groups: r_i minus its group's length-weighted mean reward. Centred
    on the group's first reward first (as :func:`_centered`), so equal rewards give
    exactly 0."""
    check_params("opo", params)
    rewards = np.asarray(rewards, dtype=np.float64)
    sizes = _checked_sizes(rewards, sizes)
    weights = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if weights.size != rewards.size or (weights < 0).any():
        raise ValueError(
            f"opo needs one length >= 0 per completion: {rewards.size} rewards, lengths "
            f"{weights.tolist()}"
        )
    if rewards.size == 0:
        return np.zeros(0)
    totals = np.repeat(_group_sums(weights, sizes), sizes)
    weights = np.where(totals > 0, weights, 1.0)  # no trained token: equal weights
    d = rewards - np.repeat(rewards[_starts(sizes)], sizes)
    baseline = _group_sums(weights * d, sizes) / _group_sums(weights, sizes)
    return d - np.repeat(baseline, sizes)
