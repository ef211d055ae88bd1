"""The training objective, as pure functions of per-token tensors (torch is imported by
the functions that take tensors, so the constants and the numpy helpers stay light).

Per token t of completion i, with r = exp(logp - logp_sampler) and A the advantage
(clipped to [-adv_clip_max, adv_clip_max] when adv_clip_max > 0):

    is        l = -A r                                  (importance-sampling PG; default)
    ppo_clip  l = -min(A r, A clip(r, 1 - eps, 1 + eps_high))          (Schulman et al. 2017;
              eps_high > eps is DAPO's clip-higher, Yu et al. 2025)
              and, when clip_ratio_c = c > 1, for A < 0:
              l = -max(min(A r, A clip(r, ...)), c A)      (dual clip, Ye et al. 2020)
    + tis     l *= min(1, tis_cap / r)  (weight detached: truncated importance sampling,
              Yao et al. 2025, bounds tokens a mismatched sampler, e.g. a server engine,
              made unlikely: their contribution is capped at tis_cap A)
    + kl      l += kl_coef * k(logp - logp_ref), the reference being the base model
              (the LoRA disabled), with Schulman's estimators of KL(pi || ref):
              k1 = d,  k2 = d^2 / 2,  k3 = exp(-d) + d - 1,  d = logp - logp_ref

Aggregation over the step (N tokens, G completions of lengths |o_i|):

    token_mean           (1/N) sum_i sum_t l_it              (DAPO's token-level loss)
    seq_mean_token_sum   (1/G) sum_i sum_t l_it              (Dr. GRPO, Liu et al. 2025:
                                                               no per-length division)
    seq_mean_token_mean  (1/G) sum_i (1/|o_i|) sum_t l_it    (GRPO, Shao et al. 2024)

Every aggregation is a per-completion weight w_i over a step-wide denominator, so a step
split into micro-batches sums to exactly the same loss and gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

POLICY_LOSSES = ("is", "ppo_clip")
LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
# What a backend may list in BackendCapabilities.loss_options (beyond policy_loss = "is"
# with loss_agg = "token_mean", which every backend implements).
LOSS_OPTIONS = (
    "ppo_clip",
    "dual_clip",
    "adv_clip",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "kl",
    "tis",
)


def sequence_weights(lengths: Sequence[int], loss_agg: str) -> tuple[np.ndarray, float]:
    """(w_i per completion, denominator) of an aggregation over a whole step: the loss is
    sum_i w_i sum_t l_it / denominator."""
    lengths_arr = np.asarray(lengths, dtype=np.float64)
    ones = np.ones_like(lengths_arr)
    if loss_agg == "token_mean":
        return ones, float(lengths_arr.sum())
    if loss_agg == "seq_mean_token_sum":
        return ones, float(len(lengths_arr))
    if loss_agg == "seq_mean_token_mean":
        return 1.0 / lengths_arr, float(len(lengths_arr))
    raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")


def token_scales(lengths: Sequence[int], loss_agg: str) -> np.ndarray:
    """w_i / denominator per completion: the factor each completion's token losses get
    (a backend whose service sums token losses multiplies the advantages by it)."""
    weights, denom = sequence_weights(lengths, loss_agg)
    return weights / denom


def ppo_clipped(
    log_ratio: np.ndarray, advantages: np.ndarray, clip_eps: float, clip_eps_high: float
) -> np.ndarray:
    """Which tokens' PPO loss takes the clipped branch (no gradient): A > 0 with
    r > 1 + clip_eps_high, or A < 0 with r < 1 - clip_eps (numpy; dual clip not included)."""
    ratio = np.exp(np.asarray(log_ratio, dtype=np.float64))
    adv = np.asarray(advantages, dtype=np.float64)
    return ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps))


@dataclass
class LossStats:
    """Sums over the trained tokens of one call (add them up across micro-batches)."""

    tokens: int = 0
    clipped: float = 0.0  # tokens whose loss took a clipped branch (no gradient)
    kl_sum: float | None = None  # sum of the KL estimator; None when kl_coef = 0
    truncated: float | None = None  # tokens whose ratio exceeded tis_cap; None when off

    def add(self, other: LossStats) -> None:
        self.tokens += other.tokens
        self.clipped += other.clipped
        if other.kl_sum is not None:
            self.kl_sum = (self.kl_sum or 0.0) + other.kl_sum
        if other.truncated is not None:
            self.truncated = (self.truncated or 0.0) + other.truncated

    def metrics(self) -> dict[str, float]:
        out = {"clip_fraction": self.clipped / self.tokens if self.tokens else 0.0}
        if self.kl_sum is not None:
            out["kl_mean"] = self.kl_sum / self.tokens if self.tokens else 0.0
        if self.truncated is not None:
            out["tis_truncated_fraction"] = self.truncated / self.tokens if self.tokens else 0.0
        return out


def kl_estimate(log_ratio_ref: Any, estimator: str) -> Any:
    """Schulman's k1/k2/k3 estimator of KL(pi || ref) per token, d = logp - logp_ref."""
    d = log_ratio_ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (-d).exp() + d - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def policy_objective(
    logp: Any,
    sampler_logp: Any,
    advantages: Any,
    mask: Any,
    hyper: Any,
    *,
    denominator: float,
    seq_weights: Any = None,
    ref_logp: Any = None,
) -> tuple[Any, LossStats]:
    """The loss of a batch of (n, T) right-padded completions and its statistics.

    `hyper` is a retrain.types.TrainHyper (its policy_loss, clip_eps, clip_eps_high,
    clip_ratio_c, adv_clip_max, kl_coef and kl_estimator are read); `mask` is bool (n, T);
    `seq_weights` (n,) and `denominator` come from :func:`sequence_weights` over the whole
    step (None = weight 1); `ref_logp` is needed when kl_coef > 0. With the defaults the
    loss is exactly -(1/N) sum A exp(logp - logp_sampler)."""
    import torch

    log_ratio = torch.where(mask, logp - sampler_logp, torch.zeros_like(logp))
    adv = advantages
    if hyper.adv_clip_max > 0:
        adv = adv.clamp(-hyper.adv_clip_max, hyper.adv_clip_max)
    ratio = torch.exp(log_ratio)
    stats = LossStats(tokens=int(mask.sum()))
    if hyper.policy_loss == "is":
        per_token = -(adv * ratio)
    elif hyper.policy_loss == "ppo_clip":
        surrogate = adv * ratio
        clipped = adv * ratio.clamp(1.0 - hyper.clip_eps, 1.0 + hyper.clip_eps_high)
        objective = torch.minimum(surrogate, clipped)
        cut = clipped < surrogate
        if hyper.clip_ratio_c > 0:
            floor = adv * hyper.clip_ratio_c
            dual = (adv < 0) & (floor > objective)
            objective = torch.where(dual, floor, objective)
            cut = cut | dual
        per_token = -objective
        stats.clipped = float((cut & mask).sum())
    else:
        raise ValueError(
            f"unknown policy_loss {hyper.policy_loss!r}; valid: {', '.join(POLICY_LOSSES)}"
        )
    tis_cap = getattr(hyper, "tis_cap", 0.0)
    if tis_cap > 0:
        over = ratio.detach()
        per_token = per_token * (tis_cap / over).clamp(max=1.0)
        stats.truncated = float(((over > tis_cap) & mask).sum())
    if hyper.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference logprobs (ref_logp)")
        kl = kl_estimate(
            torch.where(mask, logp - ref_logp, torch.zeros_like(logp)), hyper.kl_estimator
        )
        per_token = per_token + hyper.kl_coef * kl
        stats.kl_sum = float(kl.detach()[mask].sum())
    if seq_weights is not None:
        per_token = per_token * seq_weights[:, None]
    loss = (per_token * mask).sum() / denominator
    return loss, stats
