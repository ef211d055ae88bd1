"""Batch shaping: what a step does to its sampled groups before the advantages
(`[training]` dynamic_sampling, mask_truncated, overlong_buffer; `retrain man --topic
advantages`, "Batch shaping").

- **Dynamic sampling** (DAPO, Yu et al. 2025, section 3.2; verl's
  `algorithm.filter_groups`): a group whose rewards are all equal has zero advantage
  under group-relative baselines, so it trains nothing. `sample_step` counts the step's
  informative groups and samples more prompts from the data stream until there are
  `batch_size` of them, or `max_rounds` extra rounds were spent. An extra round draws
  only the missing number of prompts, so every group sampled belongs to the step (verl
  draws whole generation batches and discards the surplus). The all-equal groups stay in
  the step's groups: they count in the reward statistics (correct rate, mean reward) as
  sampled, and the advantage pipeline skips them by the same rule (`informative`).
- **Masking truncated completions** (`is_truncated`; TRL's `mask_truncated_completions`,
  applied by `rollout.build_datums`).
- **DAPO's soft overlong penalty** (`overlong_penalty`, eq. 13), added to the rewards
  before the filter and the advantages.

Pure functions on records, and `sample_step`, which drives the rounds through the data
source and rollout it is handed (it imports neither).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from retrain.types import Example, GroupRollout, Sample, SamplingParams, ShapingReport


@dataclass(frozen=True)
class Shaping:
    """The run's batch shaping settings (`[training]`); the defaults change nothing."""

    dynamic_sampling: bool = False
    max_rounds: int = 3  # extra sampling rounds per step at most (dynamic_sampling_max_rounds)
    mask_truncated: bool = False
    overlong_buffer: int = 0  # L_cache, tokens; 0 = no penalty
    overlong_penalty: float = 1.0  # the penalty's factor
    max_tokens: int = 0  # L_max: [training] max_tokens


# ---------------------------------------------------------------- the pure parts


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ: the advantage pipeline's skip rule (min < max)."""
    return len(rewards) > 0 and min(rewards) != max(rewards)


def is_truncated(sample: Sample) -> bool:
    """Whether the sampler stopped the completion at max_tokens without an end-of-sequence
    token (stop_reason "length"; a multi-turn trajectory: its last model turn).

    TRL's `mask_truncated_completions` zeroes the completion mask of every completion
    whose last token is not an end-of-sequence (or pad) token: its rewards still enter
    the group's advantages, its tokens leave the loss and the token count the loss is
    divided by. retrain does the same by giving it no datum (`rollout.build_datums`):
    identical for token_mean and bnpo (TRL's dapo and bnpo). One difference: TRL's
    grpo and dr_grpo loss types still count a masked completion among the completions
    they average over, whereas retrain's seq_mean_* aggregations count the completions
    trained on."""
    return sample.stop_reason == "length"


def completion_length(sample: Sample) -> int:
    """|y| of the overlong penalty: the completion's tokens, the end-of-sequence token
    included (the last token counts). For a multi-turn trajectory, its longest model
    turn, since max_tokens caps each turn."""
    if sample.loss_mask is None:
        return len(sample)
    mask = sample.loss_mask.astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask, [0]))))
    runs = edges[1::2] - edges[::2]  # lengths of the model's contiguous turns
    return int(runs.max()) if runs.size else 0


def overlong_penalty(
    lengths: Sequence[int] | np.ndarray, max_tokens: int, buffer: int, factor: float
) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times `factor`:

        0                                   |y| <= L_max - L_cache
        (L_max - L_cache - |y|) / L_cache   L_max - L_cache < |y| <= L_max
        -1                                  L_max < |y|

    with L_max = max_tokens and L_cache = buffer (> 0). The middle piece reaches -1 at
    |y| = L_max, so a completion cut at max_tokens gets the full -factor; |y| > L_max
    cannot happen when the sampler caps at max_tokens. Added to the reward."""
    if buffer <= 0:
        raise ValueError(f"the overlong buffer must be > 0 tokens, got {buffer}")
    y = np.asarray(lengths, dtype=np.float64)
    start = max_tokens - buffer
    inside = (start - y) / buffer
    return factor * np.where(y <= start, 0.0, np.where(y <= max_tokens, inside, -1.0))


def round_seed(seed: int | None, round_: int) -> int | None:
    """The sampling seed of a step's extra round: round 0 keeps the step's seed (a run
    with dynamic sampling samples its first round exactly as one without); later rounds
    step far from every step's seed, so no round replays another step's noise."""
    if seed is None or round_ == 0:
        return seed
    return (seed + round_ * 1_000_000_007) % (2**63 - 1)


def merge_counters(rounds: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One step's reward counters from its rounds' (counters, completions): a `*_rate`
    or `*_mean` is the completion-weighted mean, a `*_max` the largest, any other key (a
    count) the sum."""
    if len(rounds) == 1:
        return dict(rounds[0][0])
    total = sum(n for _, n in rounds) or 1
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for counters, _ in rounds for k in counters):
        values = [(c[key], n) for c, n in rounds if key in c]
        if key.endswith(("_rate", "_mean")):
            out[key] = sum(v * n for v, n in values) / total
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        else:
            out[key] = sum(v for v, _ in values)
    return out


def with_overlong_penalty(
    groups: list[GroupRollout], shaping: Shaping
) -> tuple[list[GroupRollout], list[float]]:
    """The groups with the penalty added to every reward (their `correct` flags, from the
    reward alone, unchanged), and the penalties, flat."""
    if shaping.overlong_buffer <= 0:
        return groups, []
    out, flat = [], []
    for g in groups:
        pen = overlong_penalty(
            [completion_length(s) for s in g.samples],
            shaping.max_tokens,
            shaping.overlong_buffer,
            shaping.overlong_penalty,
        ).tolist()
        out.append(replace(g, rewards=[r + p for r, p in zip(g.rewards, pen, strict=True)]))
        flat += pen
    return out, flat


# ---------------------------------------------------------------- the step's rounds

NextBatch = Callable[[int], list[Example]]
RolloutCall = Callable[..., tuple[list[GroupRollout], dict[str, float]]]


@dataclass
class ShapedBatch:
    groups: list[GroupRollout]
    reward_counters: dict[str, float]
    report: ShapingReport


def sample_step(
    shaping: Shaping,
    next_batch: NextBatch,
    rollout: RolloutCall,
    sizes: tuple[int, int],
    params: SamplingParams,
    timer: Any,
) -> ShapedBatch:
    """The groups of one step, `sizes` = (batch_size, group_size): one round of
    batch_size prompts, then with dynamic sampling further rounds of the missing number
    of prompts (seeds from `round_seed`) until batch_size groups are informative or
    max_rounds extra rounds are spent. Deterministic given the data position and the
    seed, so a resumed run samples the same rounds."""
    batch_size, group_size = sizes
    groups: list[GroupRollout] = []
    counters: list[tuple[dict[str, float], int]] = []
    penalties: list[float] = []
    missing, dropped, rounds = batch_size, 0, 0
    while True:
        seeded = replace(params, seed=round_seed(params.seed, rounds))
        new, round_counters = rollout(next_batch(missing), group_size, seeded, timer)
        new, pen = with_overlong_penalty(new, shaping)
        rounds += 1
        groups += new
        penalties += pen
        counters.append((round_counters, sum(len(g) for g in new)))
        if not shaping.dynamic_sampling:
            break
        useful = sum(informative(g.rewards) for g in new)
        dropped += len(new) - useful
        missing -= useful
        if missing <= 0 or rounds > shaping.max_rounds:
            break
    report = _report(shaping, batch_size - missing, batch_size, dropped, rounds, penalties)
    return ShapedBatch(groups, merge_counters(counters), report)


def _report(
    shaping: Shaping, found: int, wanted: int, dropped: int, rounds: int, penalties: list[float]
) -> ShapingReport:
    metrics: dict[str, float] = {}
    if shaping.overlong_buffer > 0:
        metrics["overlong_penalty_mean"] = float(np.mean(penalties)) if penalties else 0.0
    if not shaping.dynamic_sampling:
        return ShapingReport(metrics)
    metrics.update(groups_dropped=dropped, sampling_rounds=rounds)
    warning = ""
    if found == 0:
        warning = (
            f"dynamic sampling found no informative group in {rounds} sampling rounds (every "
            "group's rewards were all equal): this step trains on nothing"
        )
    elif found < wanted:
        warning = (
            f"dynamic sampling found {found} of {wanted} informative groups in {rounds} "
            f"sampling rounds; this step trains on those {found}"
        )
    if warning:
        warning += (
            f" ([training] dynamic_sampling_max_rounds = {shaping.max_rounds} extra rounds "
            "reached). Fix: raise dynamic_sampling_max_rounds, or a task whose groups "
            "disagree more often"
        )
    return ShapingReport(metrics, warning)
