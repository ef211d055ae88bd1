"""A plain, per-token Python reference of the advantage pipeline (spec section 1),
including the original retrain's SEPA amplification and top-rho surprisal masking.

Deliberately written the slow, obvious way (lists, loops, math) so that the vectorised
implementation in retrain.advantages can be checked against it, and so the benchmark
can show the speed-up. Not used by retrain itself.
"""

from __future__ import annotations

import math

CAP = 50.0
MAXRL_EPS = 1e-6
GTPO_MIN_MEAN = 1e-7


def ref_grpo(rewards):
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def ref_maxrl(rewards):
    mean = sum(rewards) / len(rewards)
    if mean <= MAXRL_EPS:
        return [0.0 for _ in rewards]
    return [(r - mean) / (mean + MAXRL_EPS) for r in rewards]


GRPO_STD_EPS = 1e-6
REINFORCE_PP_EPS = 1e-8


def _sample_std(xs):
    """Sample standard deviation (ddof = 1); 0 for a single value."""
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_grpo_std(rewards, eps=GRPO_STD_EPS):
    """(r_i - mean) / (sample std + eps): Shao et al. 2024, as verl and TRL compute it."""
    mean = sum(rewards) / len(rewards)
    std = _sample_std(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def ref_rloo(rewards):
    """r_i minus the mean of the other rewards (0 for a group of one)."""
    n = len(rewards)
    if n == 1:
        return [0.0]
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def ref_opo(rewards, lengths):
    """r_i minus the length-weighted mean reward of the group (OPO's optimal baseline);
    equal weights when no completion has a token."""
    weights = list(lengths) if sum(lengths) > 0 else [1] * len(rewards)
    baseline = sum(w * r for w, r in zip(weights, rewards)) / sum(weights)
    return [r - baseline for r in rewards]


def _ref_whiten(xs, eps):
    """(x - batch mean) / sqrt(batch sample variance + eps), one value per completion."""
    if not xs:
        return []
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    return [(x - m) / math.sqrt(var + eps) for x in xs]


def ref_reinforce_pp_batch(groups_rewards, eps=REINFORCE_PP_EPS):
    """REINFORCE++ over a batch of groups: per group, its completions' advantages."""
    flat = [r for g in groups_rewards for r in g]
    return _regroup(_ref_whiten(flat, eps), groups_rewards)


def ref_reinforce_pp_baseline_batch(groups_rewards, eps=REINFORCE_PP_EPS):
    """REINFORCE++-baseline: group mean subtracted, then whitened over the batch."""
    centred = []
    for g in groups_rewards:
        mean = sum(g) / len(g)
        centred.extend(r - mean for r in g)
    return _regroup(_ref_whiten(centred, eps), groups_rewards)


def _regroup(flat, groups_rewards):
    out, k = [], 0
    for g in groups_rewards:
        out.append(flat[k : k + len(g)])
        k += len(g)
    return out


# Per-group references; the batch modes take a list of groups (see ref_episode_batch).
PER_GROUP_MODES = {
    "grpo": ref_grpo,
    "maxrl": ref_maxrl,
    "grpo_std": ref_grpo_std,
    "rloo": ref_rloo,
}
BATCH_MODES = {
    "reinforce_pp": ref_reinforce_pp_batch,
    "reinforce_pp_baseline": ref_reinforce_pp_baseline_batch,
}


def ref_episode_batch(mode, groups_rewards, lengths=None, **params):
    """Episode advantages of a batch of groups (lists of rewards): one list per group.
    `lengths` (per group, per completion: its tokens) is what `opo` reads."""
    groups_rewards = [[float(r) for r in g] for g in groups_rewards]
    if mode == "opo":
        return [ref_opo(g, n) for g, n in zip(groups_rewards, lengths, strict=True)]
    if mode in BATCH_MODES:
        return BATCH_MODES[mode](groups_rewards, **params)
    return [PER_GROUP_MODES[mode](g, **params) for g in groups_rewards]


SURPRISAL_NAMES = ("surprisal", "token_surprisal", "neg_logprob", "negative_logprob", "nll")
VARIANCE_NAMES = ("predictive_variance", "pred_var", "bernoulli_variance")
ENTROPY_NAMES = ("shannon_entropy", "shannon", "entropy", "token_entropy")


def ref_uncertainty(kind, logprobs, entropies=None):
    out = []
    for t, lp in enumerate(logprobs):
        if kind in SURPRISAL_NAMES:
            out.append(min(-lp, CAP))
        elif kind in VARIANCE_NAMES:
            p = math.exp(lp)
            out.append(p * (1.0 - p))
        elif kind in ENTROPY_NAMES:
            out.append(float(entropies[t]))
        else:
            raise ValueError(kind)
    return out


def ref_gtpo(adv, h, beta):
    if not h:
        return []
    m = sum(h) / len(h)
    if beta == 0 or m < GTPO_MIN_MEAN:
        return [adv for _ in h]
    return [adv * max(0.0, 1.0 + beta * (x / m - 1.0)) for x in h]


def ref_hicra(token_adv, plan, alpha):
    return [a + alpha * abs(a) * (1.0 if p else 0.0) for a, p in zip(token_adv, plan)]


def ref_sepa_pool(h, plan, lam):
    execs = [x for x, p in zip(h, plan) if not p]
    if not execs or lam == 0:
        return list(h)
    mean_exec = sum(execs) / len(execs)
    return [x if p else lam * mean_exec + (1.0 - lam) * x for x, p in zip(h, plan)]


def ref_sepa_amp(h, plan, lam, clamp=False):
    """h' = h + lam (h - mean_exec) on execution tokens, floored at 0 when clamp."""
    execs = [x for x, p in zip(h, plan) if not p]
    if not execs or lam == 0:
        return list(h)
    mean_exec = sum(execs) / len(execs)
    out = []
    for x, p in zip(h, plan):
        if p:
            out.append(x)
        else:
            y = x + lam * (x - mean_exec)
            out.append(max(0.0, y) if clamp else y)
    return out


def ref_surprisal_mask(token_advs_G, h_G, rho):
    """Top-rho masking over one group: (masked advantages, threshold, masked fraction)."""
    flat = sorted((x for h in h_G for x in h), reverse=True)
    n = len(flat)
    if n == 0:
        return [list(a) for a in token_advs_G], 0.0, 0.0
    k = min(n, max(1, int(n * rho)))
    tau = flat[k - 1]
    masked = 0
    out = []
    for advs, hs in zip(token_advs_G, h_G):
        row = []
        for a, x in zip(advs, hs):
            if x < tau:
                row.append(0.0)
                masked += 1
            else:
                row.append(a)
        out.append(row)
    return out, tau, masked / n


def ref_token_advantages(
    rewards,
    logprobs_G_T,
    planning_G_T,
    *,
    advantage_mode="maxrl",
    transform_mode="gtpo_sepa",
    gtpo_beta=0.1,
    hicra_alpha=0.2,
    sepa_lambda=0.0,
    uncertainty_kind="surprisal",
    entropies_G_T=None,
    surprisal_mask_rho=0.0,
    episode=None,
):
    """One group's token advantages. `episode` (the group's episode advantages) is
    given by ref_batch_advantages for the batch modes; else the group is the batch."""
    rewards = [float(r) for r in rewards]
    if episode is None:
        lengths = [[len(x) for x in logprobs_G_T]]
        episode = ref_episode_batch(advantage_mode, [rewards], lengths)[0]
    out, hs = [], []
    for i, a in enumerate(episode):
        lps = [float(x) for x in logprobs_G_T[i]]
        plan = (
            [bool(x) for x in planning_G_T[i]] if planning_G_T is not None else [False] * len(lps)
        )
        ents = entropies_G_T[i] if entropies_G_T is not None else None
        h = ref_uncertainty(uncertainty_kind, lps, ents)
        hs.append(h)
        if transform_mode == "none":
            toks = [a for _ in lps]
        elif transform_mode == "gtpo":
            toks = ref_gtpo(a, h, gtpo_beta)
        elif transform_mode == "gtpo_hicra":
            toks = ref_hicra(ref_gtpo(a, h, gtpo_beta), plan, hicra_alpha)
        elif transform_mode == "gtpo_sepa":
            toks = ref_gtpo(a, ref_sepa_pool(h, plan, sepa_lambda), gtpo_beta)
        elif transform_mode in ("gtpo_sepa_amp", "gtpo_sepa_amp_c"):
            amplified = ref_sepa_amp(h, plan, sepa_lambda, clamp=transform_mode.endswith("_c"))
            toks = ref_gtpo(a, amplified, gtpo_beta)
        elif transform_mode == "entropy_mask":
            toks = ref_gtpo(a, h, gtpo_beta)
        else:
            raise ValueError(transform_mode)
        out.append(toks)
    if transform_mode == "entropy_mask" and surprisal_mask_rho > 0:
        out = ref_surprisal_mask(out, hs, surprisal_mask_rho)[0]
    return out


def ref_batch_advantages(groups, **kwargs):
    """Per group: None when all rewards are equal, else the token advantages. The
    episode advantages are computed over the kept groups only (the batch of the
    reinforce_pp modes)."""
    informative = [g for g in groups if not all(r == g[0][0] for r in g[0])]
    kept = [list(g[0]) for g in informative]
    lengths = [[len(x) for x in g[1]] for g in informative]
    episodes = iter(ref_episode_batch(kwargs.get("advantage_mode", "maxrl"), kept, lengths))
    result = []
    for rewards, logprobs, planning in groups:
        if all(r == rewards[0] for r in rewards):
            result.append(None)
        else:
            result.append(
                ref_token_advantages(rewards, logprobs, planning, episode=next(episodes), **kwargs)
            )
    return result


def ref_exec_plan_stats(groups, uncertainty_kind="surprisal"):
    """(exec_mean, exec_var, plan_mean, plan_var) over the tokens of kept groups."""
    ex, pl = [], []
    for rewards, logprobs, planning in groups:
        if all(r == rewards[0] for r in rewards):
            continue
        for lps, plan in zip(logprobs, planning):
            for h, p in zip(ref_uncertainty(uncertainty_kind, list(lps)), plan):
                (pl if p else ex).append(h)

    def mv(xs):
        if not xs:
            return math.nan, math.nan
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / len(xs)

    return (*mv(ex), *mv(pl))
