"""The built-in policy losses: the targets of retrain.registry.OBJECTIVES (`[training]
policy_loss`). Each is `objective(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss`,
the one convention a dotted-path objective follows too; advantage clipping, the
off-policy correction, the KL penalty and the aggregation are composed around it by
retrain.loss.compose, never here.

r_t = exp(logp_t - logp_sampler_t) is the importance ratio of token t (1 off the mask);
s_i = exp((1/|o_i|) sum_t log r_it) the length-normalised sequence ratio of GSPO, used
through GSPO-token's s_it (value s_i, gradient s_i d logp_t: LossInputs.sequence_ratio).
sg() is stop-gradient (a detached weight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from retrain.loss.records import LossInputs, TokenLoss

if TYPE_CHECKING:
    from torch import Tensor

    from retrain.types import TrainHyper

RATIO_LEVELS = ("token", "sequence")


def importance_sampling(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`is`: l_t = -A_t r_t, the importance-sampling policy gradient (the default; Tinker's
    `importance_sampling` loss). Its gradient is -A_t r_t d logp_t: the score function
    weighted by the advantage, corrected for the sampler's drift from the trained
    weights. Never clips."""
    return TokenLoss(-(inputs.advantages * inputs.ratio()))


def clipped_surrogate(
    adv: Tensor, ratio: Tensor, hyper: TrainHyper, *, dual: bool = True
) -> tuple[Tensor, Tensor]:
    """(objective, clipped) of PPO's clipped surrogate on `ratio` (shared by ppo_clip,
    gspo and clip_cov): min(A r, A clip(r, 1 - clip_eps, 1 + clip_eps_high)), and with
    dual clip (clip_ratio_c = c > 0, `dual`) max(that, c A) where A < 0. `clipped` marks
    the tokens on a clipped branch (constant in logp)."""
    import torch

    surrogate = adv * ratio
    bounded = adv * ratio.clamp(1.0 - hyper.clip_eps, 1.0 + hyper.clip_eps_high)
    objective = torch.minimum(surrogate, bounded)
    cut = bounded < surrogate
    if dual and hyper.clip_ratio_c > 0:
        floor = adv * hyper.clip_ratio_c
        lifted = (adv < 0) & (floor > objective)
        objective = torch.where(lifted, floor, objective)
        cut = cut | lifted
    return objective, cut


def ppo_clip(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`ppo_clip`: the clipped surrogate of PPO (Schulman et al. 2017),

        l_t = -min(A_t r_t, A_t clip(r_t, 1 - clip_eps, 1 + clip_eps_high)),

    clip_eps_high > clip_eps being DAPO's clip-higher (Yu et al. 2025); and, with dual
    clip (clip_ratio_c = c > 1, Ye et al. 2020), for A_t < 0

        l_t = -max(min(A_t r_t, A_t clip(r_t, ...)), c A_t).

    A token on a clipped branch is constant in logp (no gradient) and marked clipped."""
    objective, cut = clipped_surrogate(inputs.advantages, inputs.ratio(), hyper)
    return TokenLoss(-objective, cut)


def gspo(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`gspo`: Group Sequence Policy Optimization (Zheng et al. 2025, "Group Sequence
    Policy Optimization"): PPO's clipped surrogate on the length-normalised sequence ratio
    s_i = (prod_t r_it)^(1/|o_i|), in the paper's GSPO-token form

        l_t = -min(s_it A_t, clip(s_it, 1 - clip_eps, 1 + clip_eps_high) A_t),
        s_it = sg(s_i) pi(o_it) / sg(pi(o_it)),

    so every token of a completion has the value of s_i and is clipped together; with an
    advantage constant over the completion and `seq_mean_token_mean` this is GSPO's
    sequence-level objective and gradient, s_i A_i (1/|o_i|) sum_t d logp_t. The paper
    clips at 3e-4 / 4e-4 (clip_eps / clip_eps_high). Dual clip (clip_ratio_c) applies to
    s_i as to r_t in ppo_clip."""
    objective, cut = clipped_surrogate(inputs.advantages, inputs.sequence_ratio(), hyper)
    return TokenLoss(-objective, cut)


def level_ratio(inputs: LossInputs, hyper: TrainHyper) -> Tensor:
    """The ratio cispo and sapo weigh by: r_t (`ratio_level = "token"`) or GSPO-token's
    s_it (`"sequence"`, TRL's importance_sampling_level)."""
    if hyper.ratio_level == "token":
        return inputs.ratio()
    if hyper.ratio_level == "sequence":
        return inputs.sequence_ratio()
    raise ValueError(f"unknown ratio_level {hyper.ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")


def cispo(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`cispo`: Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1: Scaling Test-Time
    Compute Efficiently with Lightning Attention"):

        l_t = -sg(clip(r_t, 1 - clip_eps, 1 + clip_eps_high)) A_t logp_t

    on every token: the weight is clipped and detached, so no token loses its gradient
    (-w A_t d logp_t), unlike PPO's clipped branch. MiniMax-M1 set no lower bound
    (clip_eps = 1 here); tokens whose weight was clamped count as clipped. With
    `ratio_level = "sequence"` the weight is GSPO's s_i."""
    ratio = level_ratio(inputs, hyper)
    low, high = 1.0 - hyper.clip_eps, 1.0 + hyper.clip_eps_high
    weight = ratio.clamp(low, high).detach()
    return TokenLoss(-(weight * inputs.advantages * inputs.logp), (ratio < low) | (ratio > high))


def sapo(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`sapo`: Soft Adaptive Policy Optimization (Gao et al. 2025, "Soft Adaptive Policy
    Optimization", Qwen): a smooth gate in place of the hard clip,

        l_t = -f(r_t) A_t,   f(r) = sigmoid(tau (r - 1)) 4 / tau,
        tau = sapo_tau_pos where A_t > 0, sapo_tau_neg otherwise,

    f(1) = 2 / tau and f'(1) = 1, so on-policy tokens get the plain policy gradient and the
    gradient f'(r) r A_t d logp_t = 4 sigma (1 - sigma) r A_t d logp_t fades smoothly as r
    leaves 1 (faster for negative advantages, tau_neg > tau_pos). The paper averages per
    completion (`seq_mean_token_mean`). With `ratio_level = "sequence"` the gate reads
    GSPO's s_i. Never clips."""
    import torch

    adv = inputs.advantages
    tau = torch.where(
        adv > 0,
        torch.full_like(adv, hyper.sapo_tau_pos),
        torch.full_like(adv, hyper.sapo_tau_neg),
    )
    gate = torch.sigmoid(tau * (level_ratio(inputs, hyper) - 1.0)) * (4.0 / tau)
    return TokenLoss(-(gate * adv))


def vespo(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`vespo`: Variational Sequence-level Soft Policy Optimization (VESPO, 2026,
    arXiv:2602.10693): a detached Gamma-shaped weight of the sequence's importance ratio
    w_i = prod_t r_it (not length-normalised),

        l_t = -sg(phi(w_i)) A_t logp_t,   phi(w) = w^k exp(lambda (1 - w)),

    (k, lambda) = (vespo_k_pos, vespo_lambda_pos) where A_t >= 0, the _neg pair otherwise:
    phi(1) = 1, and phi falls towards 0 for a sequence the trainer finds much more or much
    less likely than the sampler did. Computed in log space (log phi = k log w +
    lambda (1 - w)); never clips."""
    import torch

    adv = inputs.advantages
    log_w = inputs.log_ratio().detach().sum(-1, keepdim=True)
    nonneg = adv >= 0
    k = torch.where(
        nonneg, torch.full_like(adv, hyper.vespo_k_pos), torch.full_like(adv, hyper.vespo_k_neg)
    )
    lam = torch.where(
        nonneg,
        torch.full_like(adv, hyper.vespo_lambda_pos),
        torch.full_like(adv, hyper.vespo_lambda_neg),
    )
    phi = (k * log_w + lam * (1.0 - log_w.exp())).exp()
    return TokenLoss(-(phi * adv * inputs.logp))


def gpg(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`gpg`: Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong
    Reinforcement Learning Baseline for Model Reasoning", arXiv 2504.02546): the plain
    policy gradient, no ratio, no clip, no trust region,

        l_t = -A_t logp_t,   gradient -A_t d logp_t,

    verl's `compute_policy_loss_gpg` (aggregated by its loss_agg_mode, token-mean by
    default). Its gradient is `is`'s where the trainer and the sampler agree (r = 1); off
    policy it does not weigh by r. GPG's batch scale alpha = B / B_valid is part of its
    advantage (verl's adv_estimator gpg), not of this loss. Never clips."""
    return TokenLoss(-(inputs.advantages * inputs.logp))


def gmpo(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`gmpo`: Geometric-Mean Policy Optimization (Zhao et al. 2025, "Geometric-Mean Policy
    Optimization", arXiv 2507.20673; verl's `geo_mean`): PPO on the geometric mean of a
    completion's token ratios, each clipped in log space,

        l_i = -A_i exp((1/|o_i|) sum_t g_i min(g_i log r_t, g_i clip(log r_t, -eps, eps_high))),

    g_i = sign(A_i), eps / eps_high = clip_eps / clip_eps_high, and A_i the mean of the completion's token advantages (GMPO's
    advantage is one per completion). The clip bites above clip_eps_high where A_i > 0 and
    below -clip_eps where A_i < 0; a token cut there is constant in logp and marked
    clipped. The bounds are on log r: the paper's (e^-0.4, e^0.4) is clip_eps =
    clip_eps_high = 0.4. Per token, as GSPO-token: every trained token has the value l_i,
    and token t the derivative -A_i s_i u_t in its own logp (u_t = 0 where cut), so with
    `seq_mean_token_mean` the step's loss is (1/G) sum_i l_i, GMPO's and verl's (which
    averages l_i over the completions whatever its loss_agg_mode), gradient included."""
    import torch

    mask = inputs.mask
    lengths = inputs.lengths()
    adv = (inputs.advantages * mask).sum(-1, keepdim=True) / lengths
    sign = adv.sign()
    log_r = inputs.log_ratio()
    low, high = -hyper.clip_eps, hyper.clip_eps_high
    cut = mask & (((sign > 0) & (log_r > high)) | ((sign < 0) & (log_r < low)))
    kept = torch.where(cut, log_r.clamp(low, high).detach(), log_r)
    log_s = (kept.sum(-1, keepdim=True) / lengths).detach()
    # straight-through: value s_i, derivative s_i in the token's own logp where not cut
    own = torch.where(cut, torch.zeros_like(log_r), inputs.logp - inputs.logp.detach())
    per_token = -(adv * torch.where(mask, log_s + own, torch.zeros_like(own)).exp())
    return TokenLoss(per_token, cut)


def dppo(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`dppo`: DPPO-Binary-TV (Divergence PPO, arXiv 2602.04879), prime-rl's default loss:
    the importance-sampling policy gradient inside a trust region on the probability
    itself, p_t = exp(logp_t), rather than on the ratio,

        l_t = -A_t r_t + dppo_kl_coef (logp_t - logp_sampler_t)^2,

    with the policy term dropped (the squared term kept) where the token left the region
    in the direction its advantage pushes: p_t - p_sampler_t > clip_eps_high where
    A_t > 0, p_t - p_sampler_t < -clip_eps otherwise. Those tokens have no policy
    gradient and count as clipped. The squared log ratio to the sampler is the Kimi K2.5
    regulariser prime-rl adds (its kl_tau, 1e-3); it is not the KL to the reference model
    (`kl_coef`), and an off-policy correction scales it with the token's loss. prime-rl's
    region is dppo_mask_low / dppo_mask_high (0.2), here clip_eps / clip_eps_high; its
    adv_tau scales A. verl's `dppo_tv` has the same region and gradient but weighs by
    sg(min(r, clip_ratio_c)) logp (an is_correction = "truncate" at is_high =
    clip_ratio_c here)."""
    import torch

    adv = inputs.advantages
    log_r = inputs.log_ratio()
    moved = inputs.logp.detach().exp() - inputs.sampler_logp.exp()
    out = inputs.mask & torch.where(adv > 0, moved > hyper.clip_eps_high, moved < -hyper.clip_eps)
    policy = torch.where(out, torch.zeros_like(log_r), -(adv * log_r.exp()))
    return TokenLoss(policy + hyper.dppo_kl_coef * log_r * log_r, out)


def _selected(inputs: LossInputs, name: str) -> Tensor:
    if inputs.selected is None:
        raise ValueError(
            f"policy_loss {name!r} needs the step's covariance selection "
            "(LossInputs.selected, from retrain.loss.selection before the first micro-batch)"
        )
    return inputs.selected


def clip_cov(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`clip_cov`: Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement
    Learning for Reasoning Language Models"): PPO's clipped surrogate (no dual
    clip), except that a few tokens of high covariance between logp and A are cut out,

        l_t = 0                                              t in I_clip
        l_t = -min(A_t r_t, A_t clip(r_t, 1 - clip_eps, 1 + clip_eps_high))  otherwise,

    I_clip: clip_cov_fraction x N tokens (at least 1) drawn at random among the trained
    tokens whose centred covariance (A_t - mean A)(logp_t - mean logp) lies in
    (clip_cov_lb, clip_cov_ub) and whose PPO loss is not already clipped, over the whole
    step (retrain.loss.selection, before the first micro-batch: `inputs.selected`).
    Both the cut-out and the PPO-clipped tokens count as clipped."""
    import torch

    objective, cut = clipped_surrogate(inputs.advantages, inputs.ratio(), hyper, dual=False)
    chosen = _selected(inputs, "clip_cov")
    return TokenLoss(torch.where(chosen, torch.zeros_like(objective), -objective), cut | chosen)


def kl_cov(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss:
    """`kl_cov`: KL-Cov (Cui et al. 2025, the same paper): the unclipped policy gradient, with a
    penalty on the log ratio of the kl_cov_fraction x N tokens (at least 1) of largest
    centred covariance (A_t - mean A)(logp_t - mean logp) over the whole step,

        l_t = -A_t r_t + kl_cov_beta |logp_t - logp_sampler_t|    t in I_kl
        l_t = -A_t r_t                                          otherwise

    (retrain.loss.selection picks I_kl before the first micro-batch: `inputs.selected`).
    Never clips."""
    import torch

    penalty = hyper.kl_cov_beta * inputs.log_ratio().abs()
    chosen = _selected(inputs, "kl_cov")
    base = -(inputs.advantages * inputs.ratio())
    return TokenLoss(base + torch.where(chosen, penalty, torch.zeros_like(penalty)))


def ppo_clipped(
    log_ratio: np.ndarray, advantages: np.ndarray, clip_eps: float, clip_eps_high: float
) -> np.ndarray:
    """Which tokens' PPO loss takes the clipped branch (no gradient): A > 0 with
    r > 1 + clip_eps_high, or A < 0 with r < 1 - clip_eps (numpy, for a backend whose
    service computes the loss, and for the covariance selection; dual clip not
    included)."""
    ratio = np.exp(np.asarray(log_ratio, dtype=np.float64))
    adv = np.asarray(advantages, dtype=np.float64)
    return ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps))


def cispo_clipped(log_ratio: np.ndarray, clip_eps: float, clip_eps_high: float) -> np.ndarray:
    """Which tokens' cispo weight was clamped: r < 1 - clip_eps or r > 1 + clip_eps_high
    (numpy, for a backend whose service computes the loss)."""
    ratio = np.exp(np.asarray(log_ratio, dtype=np.float64))
    return (ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps_high)
