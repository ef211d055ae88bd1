"""Off-policy correction between the trainer and the sampler (`[training] is_correction`,
`is_level`, `is_low`, `is_high`; `tis_cap`), and the mismatch it corrects.

rho_t = exp(logp_t - logp_sampler_t) (detached) is how much likelier the trained weights
find token t than the sampler did (a server engine, bf16 kernels, a truncated sampler).
Retrain's objectives already weigh each token by its own ratio r_t = rho_t (the sampler is
the behaviour policy), untruncated. The correction bounds that weight at a level:

    token       w_t = rho_t
    sequence    w_i = prod_t rho_it          (the trajectory's importance weight)
    geometric   w_i = (prod_t rho_it)^(1/|o_i|)

and multiplies each token's policy loss by a detached factor c:

    truncate    c_t = clip(w, is_low, is_high) / rho_t
                the token's own weight is replaced by its level's weight, truncated:
                token level: TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly
                Brings You Off-Policy RL Training"), min(1, cap / rho_t) when is_low = 0;
                sequence level: sequence-level TIS (Liu et al. 2025, "When Speed Kills
                Stability: Demystifying RL Collapse from the Training-Inference Mismatch")
    mask        c_t = 1 if is_low <= w <= is_high else 0
                rejection: tokens (token level) or whole completions (sequence: the
                product; geometric: the geometric mean, SkyRL's and verl's geometric
                mask) whose weight leaves the band drop out; the rest keep their own
                weight r_t (token-level MIS / IcePop at the token level)

A masked token keeps its place in the aggregation's denominator (its loss is 0), so the
loss scale never depends on how many were rejected and the step's denominators are known
before any forward pass (a micro-batch split never changes the loss). The KL penalty is
added after the correction and is not weighted.

`tis_cap = C` is the short spelling of is_correction = "truncate", is_level = "token",
is_low = 0, is_high = C (configs written before these keys load unchanged).

mismatch_kl: the k3 estimator (Schulman, "Approximating KL Divergence", 2020) of
KL(sampler || trainer) on the trained tokens, which were sampled from the sampler:
rho - 1 - log rho per token (unbiased, never negative), summed over the trained tokens
before any correction, on every step, correction on or off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retrain.loss.records import LossInputs

if TYPE_CHECKING:
    from torch import Tensor

    from retrain.types import TrainHyper

IS_CORRECTIONS = ("none", "truncate", "mask")
IS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class Correction:
    """The off-policy correction of a run, from TrainHyper (tis_cap folded in)."""

    kind: str = "none"  # IS_CORRECTIONS
    level: str = "token"  # IS_LEVELS
    low: float = 0.0
    high: float = 2.0

    @classmethod
    def from_hyper(cls, hyper: TrainHyper) -> Correction:
        if hyper.tis_cap > 0:
            if hyper.is_correction != "none":
                raise ValueError(
                    "tis_cap and is_correction are two spellings of the correction; set one"
                )
            return cls("truncate", "token", 0.0, hyper.tis_cap)
        if hyper.is_correction not in IS_CORRECTIONS:
            raise ValueError(
                f"unknown is_correction {hyper.is_correction!r}; valid: {', '.join(IS_CORRECTIONS)}"
            )
        if hyper.is_level not in IS_LEVELS:
            raise ValueError(f"unknown is_level {hyper.is_level!r}; valid: {', '.join(IS_LEVELS)}")
        return cls(hyper.is_correction, hyper.is_level, hyper.is_low, hyper.is_high)

    @property
    def token_truncation(self) -> bool:
        return self.kind == "truncate" and self.level == "token"


def level_log_weight(log_rho: Tensor, mask: Tensor, level: str) -> Tensor:
    """log w at `level` from the (n, T) log rho (0 off the mask): (n, T) for tokens,
    (n, 1) for a sequence's product or geometric mean."""
    if level == "token":
        return log_rho
    total = log_rho.sum(-1, keepdim=True)
    if level == "sequence":
        return total
    return total / mask.sum(-1, keepdim=True).clamp(min=1).to(log_rho.dtype)


def apply_correction(
    per_token: Tensor, inputs: LossInputs, correction: Correction
) -> tuple[Tensor, float | Tensor, float | Tensor]:
    """(per_token * c, tokens truncated, tokens masked) of the correction (module
    docstring); c is detached. Counts are over the trained tokens (a truncated or masked
    completion counts all of them), 0-d tensors where the correction is on."""
    import torch

    if correction.kind == "none":
        return per_token, 0.0, 0.0
    mask = inputs.mask
    log_rho = inputs.log_ratio().detach()
    log_w = level_log_weight(log_rho, mask, correction.level)
    log_low = math.log(correction.low) if correction.low > 0 else -math.inf
    log_high = math.log(correction.high)
    outside = ((log_w < log_low) | (log_w > log_high)).expand_as(mask) & mask
    if correction.kind == "truncate":
        factor = (log_w.clamp(log_low, log_high) - log_rho).exp()
        return per_token * factor, outside.sum(), 0.0
    if correction.kind == "mask":
        return (
            torch.where(outside, torch.zeros_like(per_token), per_token),
            0.0,
            outside.sum(),
        )
    raise ValueError(f"unknown is_correction {correction.kind!r}")


def mismatch_kl_sum(inputs: LossInputs) -> Tensor:
    """sum over the trained tokens of k3 = rho - 1 - log rho: the sampler-to-trainer KL
    estimate (module docstring) times the tokens, a 0-d float64 tensor (off the mask
    log rho is 0, so k3 is 0)."""
    log_rho = inputs.log_ratio().detach().double()
    return (log_rho.exp() - 1.0 - log_rho).sum()
