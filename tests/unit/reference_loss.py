"""A plain, per-token Python reference of the objective (retrain/loss/, `retrain man
--topic loss`): the policy losses is, ppo_clip (clip-higher, dual clip), gspo, cispo, sapo,
vespo, clip_cov and kl_cov (with their covariance selection), gpg, gmpo and dppo, advantage
clipping, the
off-policy correction (truncate / mask at the token, sequence and geometric level; tis_cap),
the k1/k2/k3 KL penalty and the five aggregations, each token's loss and its derivative
d loss / d logp written out by hand.

Deliberately the slow, obvious way (floats, loops, math; float64 throughout) so the
vectorised implementation can be checked against it, gradients included. Not used by
retrain itself.

Sequence ratios follow GSPO-token: s_it has the value s_i and the derivative s_i with
respect to logp_t (its own token only), so a token's "grad" below is d l_t / d logp_t
through that straight-through path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class RefToken:
    loss: float
    grad: float  # d loss / d logp of this token
    clipped: bool = False  # the objective clipped it (TokenLoss.clipped)
    truncated: bool = False  # its importance weight was truncated
    masked: bool = False  # its importance weight was masked out
    kl: float | None = None  # the KL estimator's value, when kl_coef > 0
    mismatch: float = 0.0  # k3 of rho: rho - 1 - log rho


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def ref_clipped_surrogate(a, x, d_x, hyper, dual=True):
    """(objective, d objective / d logp, clipped?) of min(A x, A clip(x, ...)) with dual
    clip; x the ratio (r_t or s_i) and d_x its derivative in this token's logp."""
    lo, hi = 1 - hyper.clip_eps, 1 + hyper.clip_eps_high
    unclipped = a * x
    bounded = a * min(max(x, lo), hi)
    if bounded < unclipped:  # the clipped surrogate is the smaller: constant in logp
        objective, d_objective, clipped = bounded, 0.0, True
    else:
        objective, d_objective, clipped = unclipped, a * d_x, False
    c = hyper.clip_ratio_c
    if dual and c > 0 and a < 0 and c * a > objective:  # dual clip: the loss is at most -c a
        objective, d_objective, clipped = c * a, 0.0, True
    return objective, d_objective, clipped


def ref_policy_loss(lp, old, a, hyper, s=None, log_w=None, selected=False, gm=None):
    """(loss, d loss / d logp, clipped?) of one token under hyper.policy_loss, `a` already
    clipped; `s` the completion's GSPO ratio, `log_w` its summed log ratio (vespo),
    `selected` the covariance selection's pick, `gm` the completion's (A_i, GMPO ratio)."""
    r = math.exp(lp - old)
    name = hyper.policy_loss
    if name == "is":
        return -a * r, -a * r, False  # d(-a e^{lp - old}) / d lp = -a r
    if name == "gpg":
        return -a * lp, -a, False
    if name == "gmpo":
        a_i, s_gm = gm  # every token carries l_i = -A_i s; its own logp moves s unless cut
        d = lp - old
        cut = (a_i > 0 and d > hyper.clip_eps_high) or (a_i < 0 and d < -hyper.clip_eps)
        return -a_i * s_gm, 0.0 if cut else -a_i * s_gm, cut
    if name == "dppo":
        moved = math.exp(lp) - math.exp(old)
        out = moved > hyper.clip_eps_high if a > 0 else moved < -hyper.clip_eps
        d = lp - old
        kl, dkl = hyper.dppo_kl_coef * d * d, 2 * hyper.dppo_kl_coef * d
        if out:  # left the trust region: only the squared log ratio stays
            return kl, dkl, True
        return -a * r + kl, -a * r + dkl, False
    if name in ("ppo_clip", "gspo"):
        x = r if name == "ppo_clip" else s  # d x / d lp = x (straight-through for s)
        objective, d_objective, clipped = ref_clipped_surrogate(a, x, x, hyper)
        return -objective, -d_objective, clipped
    x = s if hyper.ratio_level == "sequence" else r
    if name == "cispo":
        lo, hi = 1 - hyper.clip_eps, 1 + hyper.clip_eps_high
        w = min(max(x, lo), hi)  # detached
        return -w * a * lp, -w * a, x < lo or x > hi
    if name == "sapo":
        tau = hyper.sapo_tau_pos if a > 0 else hyper.sapo_tau_neg
        g = sigmoid(tau * (x - 1))
        # f(x) = 4 g / tau, f'(x) = 4 g (1 - g); d x / d lp = x
        return -(4 * g / tau) * a, -4 * g * (1 - g) * x * a, False
    if name == "vespo":
        k, lam = (
            (hyper.vespo_k_pos, hyper.vespo_lambda_pos)
            if a >= 0
            else (hyper.vespo_k_neg, hyper.vespo_lambda_neg)
        )
        phi = math.exp(k * log_w + lam * (1 - math.exp(log_w)))  # detached
        return -phi * a * lp, -phi * a, False
    if name == "clip_cov":
        if selected:
            return 0.0, 0.0, True
        objective, d_objective, clipped = ref_clipped_surrogate(a, r, r, hyper, dual=False)
        return -objective, -d_objective, clipped
    if name == "kl_cov":
        d = lp - old
        loss, grad = -a * r, -a * r
        if selected:
            loss += hyper.kl_cov_beta * abs(d)
            grad += hyper.kl_cov_beta * (1.0 if d > 0 else -1.0 if d < 0 else 0.0)
        return loss, grad, False
    raise ValueError(name)


def ref_kl(d, estimator):
    """(k(d), dk/dd) of Schulman's estimators, d = logp - logp_ref."""
    if estimator == "k1":
        return d, 1.0
    if estimator == "k2":
        return 0.5 * d * d, d
    if estimator == "k3":
        return math.exp(-d) + d - 1.0, 1.0 - math.exp(-d)
    raise ValueError(estimator)


def ref_correction(hyper):
    """(kind, level, low, high) of the off-policy correction, tis_cap folded in."""
    if hyper.tis_cap > 0:
        return "truncate", "token", 0.0, hyper.tis_cap
    return hyper.is_correction, hyper.is_level, hyper.is_low, hyper.is_high


def ref_adv_clip(a, hyper):
    if hyper.adv_clip_max > 0:
        return min(max(a, -hyper.adv_clip_max), hyper.adv_clip_max)
    return a


def ref_gmpo(lp, old, adv, trained, hyper):
    """(A_i, s_i) of GMPO: the mean clipped advantage, and exp of the mean log ratio with
    each token's clipped on the side sign(A_i) pushes (min(d, eps_high) for A_i > 0,
    max(d, -eps) for A_i < 0)."""
    n = max(len(trained), 1)
    a_i = sum(ref_adv_clip(adv[t], hyper) for t in trained) / n
    logs = []
    for t in trained:
        d = lp[t] - old[t]
        if a_i > 0:
            d = min(d, hyper.clip_eps_high)
        elif a_i < 0:
            d = max(d, -hyper.clip_eps)
        logs.append(d)
    return a_i, math.exp(sum(logs) / n)


def ref_token(
    lp, old, a, hyper, ref=None, *, s=None, log_w=None, w_level=None, selected=False, gm=None
):
    """One trained token: advantage clip, policy loss, correction, KL (in that order).
    `w_level` is the correction's weight at its level (None: this token's ratio)."""
    a = ref_adv_clip(a, hyper)
    loss, grad, clipped = ref_policy_loss(lp, old, a, hyper, s, log_w, selected, gm)
    rho = math.exp(lp - old)
    out = RefToken(loss, grad, clipped, mismatch=rho - 1 - math.log(rho))
    kind, _, low, high = ref_correction(hyper)
    w = rho if w_level is None else w_level
    outside = w < low or w > high
    if kind == "truncate":
        factor = min(max(w, low), high) / rho  # detached: scales the gradient
        out.loss, out.grad, out.truncated = loss * factor, grad * factor, outside
    elif kind == "mask" and outside:
        out.loss, out.grad, out.masked = 0.0, 0.0, True
    if hyper.kl_coef > 0:
        kl, dkl = ref_kl(lp - ref, hyper.kl_estimator)
        out.loss += hyper.kl_coef * kl
        out.grad += hyper.kl_coef * dkl
        out.kl = kl
    return out


def ref_scales(lengths, hyper):
    """The factor of each completion's token losses: w_i / denominator."""
    n_tokens, n_seqs = sum(lengths), len(lengths)
    agg = hyper.loss_agg
    if agg == "token_mean":
        return [1.0 / n_tokens for _ in lengths]
    if agg == "seq_mean_token_sum":
        return [1.0 / n_seqs for _ in lengths]
    if agg == "seq_mean_token_mean":
        return [1.0 / (n_seqs * k) for k in lengths]
    if agg == "seq_mean_token_sum_norm":
        return [1.0 / (n_seqs * hyper.max_tokens) for _ in lengths]
    if agg == "bnpo":
        size = hyper.bnpo_batch_size or n_seqs
        batches = [lengths[i : i + size] for i in range(0, n_seqs, size)]
        return [1.0 / (len(batches) * max(sum(b), 1)) for b in batches for _ in b]
    raise ValueError(agg)


def ref_selection(seqs, masks, hyper, trainer_logp=None, seed=0):
    """The covariance selection of clip_cov / kl_cov over the step, by loops: per
    completion, per token, picked or not. `trainer_logp` defaults to the seqs' logp."""
    trainer_logp = trainer_logp or [s[0] for s in seqs]
    where, lps, olds, advs = [], [], [], []
    for i, ((_, old, adv, _), mask) in enumerate(zip(seqs, masks, strict=True)):
        for t, m in enumerate(mask):
            if m:
                where.append((i, t))
                lps.append(trainer_logp[i][t])
                olds.append(old[t])
                advs.append(adv[t])
    n = len(where)
    picked = [[False] * len(m) for m in masks]
    if not n:
        return picked
    mean_lp, mean_a = sum(lps) / n, sum(advs) / n
    cov = [(a - mean_a) * (lp - mean_lp) for a, lp in zip(advs, lps)]
    if hyper.policy_loss == "clip_cov":
        lo, hi = 1 - hyper.clip_eps, 1 + hyper.clip_eps_high
        band = []
        for j in range(n):
            r = math.exp(lps[j] - olds[j])
            ppo_cut = (advs[j] > 0 and r > hi) or (advs[j] < 0 and r < lo)
            if hyper.clip_cov_lb < cov[j] < hyper.clip_cov_ub and not ppo_cut:
                band.append(j)
        k = max(1, int(hyper.clip_cov_fraction * n))
        order = np.random.default_rng(seed).permutation(len(band))
        chosen = [band[o] for o in order[:k]]
    else:
        k = min(n, max(1, int(hyper.kl_cov_fraction * n)))
        chosen = sorted(range(n), key=lambda j: (-cov[j], j))[:k]
    for j in chosen:
        i, t = where[j]
        picked[i][t] = True
    return picked


def ref_completion(lp, old, adv, ref, mask, hyper, picks):
    """The RefTokens of one completion's trained tokens (None at untrained ones)."""
    trained = [t for t in range(len(lp)) if mask[t]]
    log_sum = sum(lp[t] - old[t] for t in trained)
    s = math.exp(log_sum / max(len(trained), 1))
    _, level, _, _ = ref_correction(hyper)
    w_level = {"token": None, "sequence": math.exp(log_sum), "geometric": s}[level]
    gm = ref_gmpo(lp, old, adv, trained, hyper) if hyper.policy_loss == "gmpo" else None
    out = []
    for t in range(len(lp)):
        if not mask[t]:
            out.append(None)
            continue
        r = None if ref is None else ref[t]
        out.append(
            ref_token(
                lp[t], old[t], adv[t], hyper, r, s=s, log_w=log_sum, w_level=w_level,
                selected=picks[t], gm=gm,
            )
        )  # fmt: skip
    return out


@dataclass
class RefLoss:
    loss: float
    grads: list  # per completion, per token: d loss / d logp (0 for an untrained token)
    clip_fraction: float
    kl_mean: float | None
    truncated_fraction: float
    masked_fraction: float
    mismatch_kl: float


def ref_objective(seqs, hyper, masks=None, picks=None):
    """seqs: [(logp list, sampler list, adv list, ref list | None)] per completion;
    masks: per completion, per token, whether it is trained (None = all); picks: the
    covariance selection (None = none). The step's loss aggregated by hyper.loss_agg over
    the trained tokens."""
    masks = masks or [[True] * len(s[0]) for s in seqs]
    picks = picks or [[False] * len(m) for m in masks]
    lengths = [sum(m) for m in masks]
    total, grads, tokens = 0.0, [], []
    for (lp, old, adv, ref), mask, pick, scale in zip(
        seqs, masks, picks, ref_scales(lengths, hyper), strict=True
    ):
        g = []
        for tok in ref_completion(lp, old, adv, ref, mask, hyper, pick):
            if tok is None:
                g.append(0.0)
                continue
            total += scale * tok.loss
            g.append(scale * tok.grad)
            tokens.append(tok)
        grads.append(g)
    n = len(tokens)
    kl_mean = sum(t.kl for t in tokens) / n if hyper.kl_coef > 0 else None
    return RefLoss(
        total,
        grads,
        sum(t.clipped for t in tokens) / n,
        kl_mean,
        sum(t.truncated for t in tokens) / n,
        sum(t.masked for t in tokens) / n,
        sum(t.mismatch for t in tokens) / n,
    )
