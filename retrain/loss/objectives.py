"""The built-in policy losses: the targets of retrain.registry.OBJECTIVES (`[training]
policy_loss`). Each is `objective(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss`,
the one convention a dotted-path objective follows too; advantage clipping, truncated
importance sampling, the KL penalty and the aggregation are composed around it by
retrain.loss.compose, never here.

r_t = exp(logp_t - logp_sampler_t) is the importance ratio of token t (1 off the mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from retrain.loss.records import LossInputs, TokenLoss

if TYPE_CHECKING:
    from retrain.types import TrainHyper


def importance_sampling(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`is`: l_t = -A_t r_t, the importance-sampling policy gradient (the default; Tinker's
    `importance_sampling` loss). Its gradient is -A_t r_t d logp_t: the score function
    weighted by the advantage, corrected for the sampler's drift from the trained
    weights. Never clips."""
    return TokenLoss(-(inputs.advantages * inputs.ratio()))


def ppo_clip(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`ppo_clip`: the clipped surrogate of PPO (Schulman et al. 2017),

        l_t = -min(A_t r_t, A_t clip(r_t, 1 - clip_eps, 1 + clip_eps_high)),

    clip_eps_high > clip_eps being DAPO's clip-higher (Yu et al. 2025); and, with dual
    clip (clip_ratio_c = c > 1, Ye et al. 2020), for A_t < 0

        l_t = -max(min(A_t r_t, A_t clip(r_t, ...)), c A_t).

    A token on a clipped branch is constant in logp (no gradient) and marked clipped."""
    import torch

    adv, ratio = inputs.advantages, inputs.ratio()
    surrogate = adv * ratio
    clipped = adv * ratio.clamp(1.0 - hyper.clip_eps, 1.0 + hyper.clip_eps_high)
    objective = torch.minimum(surrogate, clipped)
    cut = clipped < surrogate
    if hyper.clip_ratio_c > 0:
        floor = adv * hyper.clip_ratio_c
        dual = (adv < 0) & (floor > objective)
        objective = torch.where(dual, floor, objective)
        cut = cut | dual
    return TokenLoss(-objective, cut)


def ppo_clipped(
    log_ratio: np.ndarray, advantages: np.ndarray, clip_eps: float, clip_eps_high: float
) -> np.ndarray:
    """Which tokens' PPO loss takes the clipped branch (no gradient): A > 0 with
    r > 1 + clip_eps_high, or A < 0 with r < 1 - clip_eps (numpy, for a backend whose
    service computes the loss; dual clip not included)."""
    ratio = np.exp(np.asarray(log_ratio, dtype=np.float64))
    adv = np.asarray(advantages, dtype=np.float64)
    return ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
