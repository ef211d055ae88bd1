"""Step-wide token selection: which tokens Clip-Cov cuts out and KL-Cov penalises (Cui et
al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models"). numpy only.

Both rank the trained tokens of the step by the centred covariance of the trainer's
logprob and the advantage,

    cov_t = (A_t - mean A) (logp_t - mean logp),   means over the step's N trained tokens,

which is what drives the entropy down (a likely token with a high advantage); then

    clip_cov   I_clip: max(1, floor(clip_cov_fraction N)) tokens drawn uniformly at random
               (without replacement) among those with clip_cov_lb < cov_t < clip_cov_ub
               whose PPO loss is not already clipped (all of them when fewer)
    kl_cov     I_kl: the max(1, floor(kl_cov_fraction N)) tokens of largest cov_t

The selection is over the whole step, before the first micro-batch, from the trainer's
logprobs of a no-gradient pass over the step (the local backend's pre-pass; the step's
weights are the ones the micro-batches then train, so these are the logprobs the loss
sees), so the tokens picked, and the loss, do not depend on how the step is split. (verl
and SkyRL select inside each micro-batch, with that micro-batch's means.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from retrain.loss.objectives import ppo_clipped

if TYPE_CHECKING:
    from retrain.types import TrainHyper

# The built-in objectives that need a selection (LossInputs.selected) for every step.
SELECTING_OBJECTIVES = ("clip_cov", "kl_cov")


@dataclass(frozen=True)
class StepTokens:
    """One completion of the step, as the selection reads it (numpy, its own length)."""

    logp: np.ndarray  # the trainer's logprobs (no gradient)
    sampler_logp: np.ndarray
    advantages: np.ndarray
    mask: np.ndarray  # bool: trained tokens


def needs_selection(policy_loss: str) -> bool:
    """Whether `policy_loss` reads LossInputs.selected (a pre-pass before the step)."""
    return policy_loss in SELECTING_OBJECTIVES


def covariance(logp: np.ndarray, advantages: np.ndarray) -> np.ndarray:
    """cov_t = (A_t - mean A)(logp_t - mean logp) over the given (trained) tokens."""
    lp = np.asarray(logp, dtype=np.float64)
    adv = np.asarray(advantages, dtype=np.float64)
    return (adv - adv.mean()) * (lp - lp.mean())


def covariance_selection(
    step: Sequence[StepTokens], hyper: TrainHyper, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per completion, a bool array of its selected tokens (module docstring) under
    hyper.policy_loss (clip_cov or kl_cov); `rng` draws Clip-Cov's tokens."""
    masks = [np.asarray(s.mask, dtype=bool) for s in step]
    picked = np.zeros(sum(m.size for m in masks), dtype=bool)
    trained = np.concatenate(masks) if masks else picked
    n = int(trained.sum())
    if n:
        lp, old, adv = (
            np.concatenate([np.asarray(getattr(s, field), dtype=np.float64) for s in step])[trained]
            for field in ("logp", "sampler_logp", "advantages")
        )
        cov = covariance(lp, adv)
        chosen = _chosen(cov, lp - old, adv, n, hyper, rng)
        where = np.flatnonzero(trained)
        picked[where[chosen]] = True
    return np.split(picked, np.cumsum([m.size for m in masks])[:-1]) if masks else []


def _chosen(
    cov: np.ndarray,
    log_ratio: np.ndarray,
    adv: np.ndarray,
    n: int,
    hyper: TrainHyper,
    rng: np.random.Generator,
) -> np.ndarray:
    """Indices (into the trained tokens) of the selection."""
    if hyper.policy_loss == "clip_cov":
        k = max(1, int(hyper.clip_cov_fraction * n))
        cut = ppo_clipped(log_ratio, adv, hyper.clip_eps, hyper.clip_eps_high)
        band = np.flatnonzero((cov > hyper.clip_cov_lb) & (cov < hyper.clip_cov_ub) & ~cut)
        return band[rng.permutation(band.size)[:k]]
    if hyper.policy_loss == "kl_cov":
        k = min(n, max(1, int(hyper.kl_cov_fraction * n)))
        return np.argsort(-cov, kind="stable")[:k]
    raise ValueError(
        f"policy_loss {hyper.policy_loss!r} selects no tokens; those that do: "
        f"{', '.join(SELECTING_OBJECTIVES)}"
    )
