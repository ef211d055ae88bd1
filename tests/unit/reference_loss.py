"""A plain, per-token Python reference of the objective (retrain/loss/, `retrain man
--topic loss`): the policy losses is and ppo_clip (clip-higher, dual clip), advantage
clipping, truncated importance sampling, the k1/k2/k3 KL penalty and the three
aggregations, each token's loss and its derivative d loss / d logp written out by hand.

Deliberately the slow, obvious way (floats, loops, math; float64 throughout) so the
vectorised implementation can be checked against it, gradients included. Not used by
retrain itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RefToken:
    loss: float
    grad: float  # d loss / d logp of this token
    clipped: bool = False  # took a clipped branch (no gradient from the policy loss)
    truncated: bool = False  # its ratio exceeded tis_cap
    kl: float | None = None  # the KL estimator's value, when kl_coef > 0


def ref_policy_loss(lp, old, a, hyper):
    """(loss, d loss / d logp, clipped?) of one token under hyper.policy_loss, `a` already
    clipped."""
    r = math.exp(lp - old)
    if hyper.policy_loss == "is":
        return -a * r, -a * r, False  # d(-a e^{lp - old}) / d lp = -a r
    if hyper.policy_loss != "ppo_clip":
        raise ValueError(hyper.policy_loss)
    lo, hi = 1 - hyper.clip_eps, 1 + hyper.clip_eps_high
    unclipped = a * r
    bounded = a * min(max(r, lo), hi)
    if bounded < unclipped:  # the clipped surrogate is the smaller: constant in logp
        objective, d_objective, clipped = bounded, 0.0, True
    else:
        objective, d_objective, clipped = unclipped, a * r, False
    c = hyper.clip_ratio_c
    if c > 0 and a < 0 and c * a > objective:  # dual clip: the loss is at most -c a
        objective, d_objective, clipped = c * a, 0.0, True
    return -objective, -d_objective, clipped


def ref_kl(d, estimator):
    """(k(d), dk/dd) of Schulman's estimators, d = logp - logp_ref."""
    if estimator == "k1":
        return d, 1.0
    if estimator == "k2":
        return 0.5 * d * d, d
    if estimator == "k3":
        return math.exp(-d) + d - 1.0, 1.0 - math.exp(-d)
    raise ValueError(estimator)


def ref_token(lp, old, a, hyper, ref=None):
    """One trained token: advantage clip, policy loss, TIS, KL (in that order)."""
    if hyper.adv_clip_max > 0:
        a = min(max(a, -hyper.adv_clip_max), hyper.adv_clip_max)
    loss, grad, clipped = ref_policy_loss(lp, old, a, hyper)
    out = RefToken(loss, grad, clipped)
    if hyper.tis_cap > 0:
        r = math.exp(lp - old)
        weight = min(1.0, hyper.tis_cap / r)  # detached: scales the gradient, not differentiated
        out.loss, out.grad, out.truncated = loss * weight, grad * weight, r > hyper.tis_cap
    if hyper.kl_coef > 0:
        kl, dkl = ref_kl(lp - ref, hyper.kl_estimator)
        out.loss += hyper.kl_coef * kl
        out.grad += hyper.kl_coef * dkl
        out.kl = kl
    return out


def ref_scales(lengths, loss_agg):
    """The factor of each completion's token losses: w_i / denominator."""
    n_tokens, n_seqs = sum(lengths), len(lengths)
    if loss_agg == "token_mean":
        return [1.0 / n_tokens for _ in lengths]
    if loss_agg == "seq_mean_token_sum":
        return [1.0 / n_seqs for _ in lengths]
    if loss_agg == "seq_mean_token_mean":
        return [1.0 / (n_seqs * k) for k in lengths]
    raise ValueError(loss_agg)


@dataclass
class RefLoss:
    loss: float
    grads: list  # per completion, per token: d loss / d logp (0 for an untrained token)
    clip_fraction: float
    kl_mean: float | None
    truncated_fraction: float | None


def ref_objective(seqs, hyper, masks=None):
    """seqs: [(logp list, sampler list, adv list, ref list | None)] per completion;
    masks: per completion, per token, whether it is trained (None = all). The step's loss
    aggregated by hyper.loss_agg over the trained tokens."""
    masks = masks or [[True] * len(s[0]) for s in seqs]
    lengths = [sum(m) for m in masks]
    total, grads, tokens = 0.0, [], []
    for (lp, old, adv, ref), mask, scale in zip(
        seqs, masks, ref_scales(lengths, hyper.loss_agg), strict=True
    ):
        g = []
        for t in range(len(lp)):
            if not mask[t]:
                g.append(0.0)
                continue
            tok = ref_token(lp[t], old[t], adv[t], hyper, None if ref is None else ref[t])
            total += scale * tok.loss
            g.append(scale * tok.grad)
            tokens.append(tok)
        grads.append(g)
    n = len(tokens)
    kl_mean = sum(t.kl for t in tokens) / n if hyper.kl_coef > 0 else None
    truncated = sum(t.truncated for t in tokens) / n if hyper.tis_cap > 0 else None
    return RefLoss(total, grads, sum(t.clipped for t in tokens) / n, kl_mean, truncated)
