"""The typed loss boundary (retrain/loss/): the composed loss against the plain per-token
reference (tests/unit/reference_loss.py) on random masked batches, gradients included;
hand-worked values; the objectives registry; and a user objective by dotted path, from
resolution to the config checks that keep it off backends that cannot run it."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference_loss import (  # tests/unit: the plain reference
    ref_completion,
    ref_kl,
    ref_objective,
    ref_selection,
    ref_token,
)

from retrain import registry
from retrain.cli.summaries import objective_summary
from retrain.config import config_from_dict
from retrain.config.validate import loss_options_used
from retrain.errors import ConfigError, PluginError
from retrain.loss import (
    KL_ESTIMATORS,
    LOSS_AGGS,
    LossFn,
    LossInputs,
    LossStats,
    StepTokens,
    covariance_selection,
    needs_selection,
    resolve_objective,
    step_weights,
)
from retrain.loss import objectives as builtin
from retrain.types import LOSS_OPTIONS, USER_OBJECTIVE, TrainHyper

# max_tokens: seq_mean_token_sum_norm's constant; bnpo_batch_size: bnpo's local batches
# of 2 completions (the micro-batches below cut one of them in two)
BASE = TrainHyper(
    lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, max_tokens=12, bnpo_batch_size=2
)
MANUAL = Path(__file__).resolve().parents[2] / "retrain" / "manual" / "loss.md"

# ---------------------------------------------------------------- helpers


def random_step(seed: int, n: int = 6, spread: float = 0.6):
    """(seqs, masks) of a step: ragged completions whose first token is sometimes an
    environment token (mask False), ratios spread around 1, references beside logp."""
    rng = np.random.default_rng(seed)
    seqs, masks = [], []
    for _ in range(n):
        k = int(rng.integers(1, 10))
        lp = rng.uniform(-4.0, -0.05, k)
        seqs.append(
            (
                lp.tolist(),
                (lp + rng.normal(0, spread, k)).tolist(),
                rng.normal(0, 1.5, k).tolist(),
                (lp + rng.normal(0, spread, k)).tolist(),
            )
        )
        mask = [True] * k
        if k > 1 and rng.random() < 0.5:
            mask[0] = False
        masks.append(mask)
    return seqs, masks


def tensors(seqs, masks, dtype=torch.float64):
    """(logp, sampler, adv, ref, mask) right-padded with zeros, as the local backend pads."""
    width = max(len(s[0]) for s in seqs)
    out = []
    for j in range(4):
        t = torch.zeros((len(seqs), width), dtype=dtype)
        for i, s in enumerate(seqs):
            t[i, : len(s[j])] = torch.tensor(s[j], dtype=dtype)
        out.append(t)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, m in enumerate(masks):
        mask[i, : len(m)] = torch.tensor(m)
    return (*out, mask)


def step_picks(seqs, masks, hyper, seed=0):
    """The covariance selection over the whole step (the local backend's pre-pass, here
    with the trainer's logprobs = the seqs' logp), per completion; None when the objective
    selects nothing."""
    if not needs_selection(hyper.policy_loss):
        return None
    step = [
        StepTokens(np.asarray(lp), np.asarray(old), np.asarray(adv), np.asarray(m))
        for (lp, old, adv, _), m in zip(seqs, masks, strict=True)
    ]
    return covariance_selection(step, hyper, np.random.default_rng(seed))


def fast(seqs, masks, hyper, loss_fn=None, dtype=torch.float64, chunks=None, seed=0):
    """The composed loss over the step, in micro-batches as the local backend splits it
    (the covariance selection made once for the step first): (loss, per-token grads,
    LossStats)."""
    loss_fn = loss_fn or resolve_objective(hyper.policy_loss)
    weights, denominator = step_weights([sum(m) for m in masks], hyper)
    picks = step_picks(seqs, masks, hyper, seed)
    total, grads, stats, start = 0.0, [], LossStats(), 0
    for size in chunks or [len(seqs)]:
        part = slice(start, start + size)
        logp, old, adv, ref, mask = tensors(seqs[part], masks[part], dtype)
        logp.requires_grad_(True)
        seq_w = None
        if hyper.loss_agg != "token_mean":
            seq_w = torch.from_numpy(weights[part]).to(dtype)
        selected = None
        if picks is not None:
            selected = torch.zeros_like(mask)
            for i, p in enumerate(picks[part]):
                selected[i, : len(p)] = torch.from_numpy(p)
        inputs = LossInputs(logp, old, adv, mask, denominator, seq_w, ref, selected)
        out = loss_fn(inputs, hyper)
        out.loss.backward()
        total += float(out.loss.detach())
        stats.add(out.stats)
        grads += [logp.grad[i, : len(s[0])].tolist() for i, s in enumerate(seqs[part])]
        start += size
    return total, grads, stats


def reference(seqs, masks, hyper, seed=0):
    """The plain reference of the same step (its own covariance selection, same draw)."""
    picks = None
    if needs_selection(hyper.policy_loss):
        picks = ref_selection(seqs, masks, hyper, seed=seed)
    return ref_objective(seqs, hyper, masks, picks)


CLIP = dict(clip_eps=0.15, clip_eps_high=0.28)
OPTIONS = [
    dict(),
    dict(adv_clip_max=0.7),
    dict(tis_cap=1.3),
    dict(policy_loss="ppo_clip"),
    dict(policy_loss="ppo_clip", **CLIP),
    dict(policy_loss="ppo_clip", clip_eps=0.1, clip_eps_high=0.3, clip_ratio_c=1.5),
    dict(policy_loss="ppo_clip", clip_ratio_c=2.0, adv_clip_max=1.0, tis_cap=1.5),
    *(dict(kl_coef=0.07, kl_estimator=k) for k in KL_ESTIMATORS),
    *(
        dict(policy_loss="ppo_clip", clip_ratio_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_estimator=k)
        for k in KL_ESTIMATORS
    ),
    dict(policy_loss="gspo", **CLIP),
    dict(policy_loss="gspo", clip_eps=0.05, clip_eps_high=0.1, clip_ratio_c=1.2),
    dict(policy_loss="cispo", **CLIP),
    dict(policy_loss="cispo", clip_eps=1.0, clip_eps_high=0.5, adv_clip_max=1.0),
    dict(policy_loss="cispo", ratio_level="sequence", clip_eps=0.1, clip_eps_high=0.2),
    dict(policy_loss="sapo"),
    dict(policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=4.0, kl_coef=0.05),
    dict(policy_loss="sapo", ratio_level="sequence"),
    dict(policy_loss="vespo"),
    dict(policy_loss="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0),
    dict(policy_loss="clip_cov", clip_cov_fraction=0.2, clip_cov_lb=0.05, clip_cov_ub=3.0, **CLIP),
    dict(policy_loss="clip_cov", clip_cov_fraction=0.5, clip_cov_lb=-1.0, clip_cov_ub=0.5),
    dict(policy_loss="kl_cov", kl_cov_fraction=0.2, kl_cov_beta=0.5),
    dict(policy_loss="kl_cov", kl_cov_fraction=0.01, kl_coef=0.05, kl_estimator="k2"),
    dict(is_correction="truncate", is_low=0.5, is_high=1.5),
    dict(is_correction="truncate", is_level="sequence", is_high=3.0),
    dict(policy_loss="ppo_clip", is_correction="truncate", is_level="geometric", is_high=1.2),
    dict(is_correction="mask", is_low=0.6, is_high=1.6),
    dict(policy_loss="ppo_clip", is_correction="mask", is_level="sequence", is_low=0.3),
    dict(is_correction="mask", is_level="geometric", is_low=0.8, is_high=1.25, kl_coef=0.05),
    dict(policy_loss="gspo", is_correction="mask", is_level="geometric", is_low=0.9),
    dict(policy_loss="cispo", is_correction="truncate", is_high=1.5, **CLIP),
    dict(policy_loss="gpg"),
    dict(policy_loss="gpg", adv_clip_max=1.0, kl_coef=0.05, is_correction="mask", is_high=1.5),
    dict(policy_loss="gmpo", **CLIP),
    dict(policy_loss="gmpo", clip_eps=0.4, clip_eps_high=0.4, adv_clip_max=1.0),
    dict(policy_loss="gmpo", clip_eps=0.1, clip_eps_high=0.3, is_correction="mask", is_low=0.7),
    dict(policy_loss="dppo"),
    dict(policy_loss="dppo", clip_eps=0.1, clip_eps_high=0.3, dppo_kl_coef=0.05),
    dict(policy_loss="dppo", dppo_kl_coef=0.001, is_correction="truncate", is_high=1.5),
]

# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize(("options", "loss_agg"), list(itertools.product(OPTIONS, LOSS_AGGS)))
def test_composed_loss_matches_the_per_token_reference(options, loss_agg):
    """Loss, d loss / d logp of every token (0 off the mask), clip, KL, mismatch,
    truncation and masking statistics, on masked ragged batches split into micro-batches."""
    hyper = replace(BASE, loss_agg=loss_agg, **options)
    for seed in range(3):
        seqs, masks = random_step(seed)
        want = reference(seqs, masks, hyper, seed)
        loss, grads, stats = fast(seqs, masks, hyper, chunks=[2, 3, 1], seed=seed)
        assert loss == pytest.approx(want.loss, rel=1e-10, abs=1e-12)
        for g, w in zip(grads, want.grads, strict=True):
            assert g == pytest.approx(w, rel=1e-9, abs=1e-12)
        metrics = stats.metrics()
        assert metrics["clip_fraction"] == pytest.approx(want.clip_fraction)
        assert metrics["mismatch_kl"] == pytest.approx(want.mismatch_kl, rel=1e-10)
        assert metrics["is_truncated_fraction"] == pytest.approx(want.truncated_fraction)
        assert metrics["is_masked_fraction"] == pytest.approx(want.masked_fraction)
        if want.kl_mean is None:  # the option is off: no metric
            assert "kl_mean" not in metrics
        else:
            assert metrics["kl_mean"] == pytest.approx(want.kl_mean, rel=1e-10)
        token_truncation = hyper.tis_cap > 0 or (
            hyper.is_correction == "truncate" and hyper.is_level == "token"
        )
        assert ("tis_truncated_fraction" in metrics) == token_truncation


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean", "bnpo"])
def test_the_split_never_changes_the_step(options, loss_agg):
    """One completion per micro-batch, or all in one: the same loss, gradients and
    metrics (the covariance selection, bnpo's local batches and the sequence-level
    corrections are step-wide or per completion, never per micro-batch)."""
    hyper = replace(BASE, loss_agg=loss_agg, **options)
    seqs, masks = random_step(11, n=7)
    whole = fast(seqs, masks, hyper, seed=3)
    for chunks in ([1] * 7, [3, 4], [2, 2, 2, 1]):
        loss, grads, stats = fast(seqs, masks, hyper, chunks=chunks, seed=3)
        assert loss == pytest.approx(whole[0], rel=1e-12, abs=1e-14)
        for a, b in zip(grads, whole[1], strict=True):
            assert a == pytest.approx(b, rel=1e-12, abs=1e-15)
        assert stats.metrics() == pytest.approx(whole[2].metrics(), rel=1e-12)


def test_the_options_reach_every_branch_of_the_new_losses():
    """The random steps above exercise what the comparison is about: clipped sequences
    (gspo), clamped weights at both ends (cispo), selected tokens (clip_cov, kl_cov),
    truncated and masked tokens at every level."""
    seen = {}
    for options in OPTIONS:
        hyper = replace(BASE, **options)
        for seed in range(3):
            seqs, masks = random_step(seed)
            want = reference(seqs, masks, hyper, seed)
            key = tuple(sorted(options.items()))
            seen[key] = [
                max(seen.get(key, [0, 0, 0])[j], v)
                for j, v in enumerate(
                    (want.clip_fraction, want.truncated_fraction, want.masked_fraction)
                )
            ]
    for options in OPTIONS:
        clip, truncated, masked = seen[tuple(sorted(options.items()))]
        if options.get("policy_loss") in ("gspo", "cispo", "clip_cov", "gmpo", "dppo"):
            assert 0 < clip < 1, options
        if options.get("is_correction") == "truncate":
            assert 0 < truncated < 1, options
        if options.get("is_correction") == "mask":
            assert 0 < masked < 1, options


def test_the_random_batches_reach_every_branch():
    """Clipped and unclipped tokens of both signs, dual clip, truncation and masked
    tokens all occur above (else the comparison would prove little)."""
    hyper = replace(BASE, policy_loss="ppo_clip", clip_eps=0.1, clip_eps_high=0.3, clip_ratio_c=1.5)
    seen = set()
    for seed in range(3):
        seqs, masks = random_step(seed)
        for (lp, old, adv, _), mask in zip(seqs, masks, strict=True):
            seen |= {"masked"} if not all(mask) else set()
            for t in range(len(lp)):
                tok = ref_token(lp[t], old[t], adv[t], replace(hyper, tis_cap=1.3))
                r = math.exp(lp[t] - old[t])
                sign = "pos" if adv[t] > 0 else "neg"
                dual = adv[t] < 0 and tok.clipped and r >= 0.9
                seen.add("dual" if dual else sign + ("-clipped" if tok.clipped else ""))
                seen |= {"truncated"} if tok.truncated else set()
    assert seen == {"pos", "pos-clipped", "neg", "neg-clipped", "dual", "truncated", "masked"}


@given(
    st.lists(
        st.tuples(st.floats(-6, -0.01), st.floats(-1.5, 1.5), st.floats(-3, 3), st.floats(-1, 1)),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from(["is", "ppo_clip", "gspo", "cispo", "sapo", "vespo", "gpg", "gmpo", "dppo"]),
    st.sampled_from(LOSS_AGGS),
    st.sampled_from(["tis", "sequence_truncate", "geometric_mask"]),
)
def test_one_completion_matches_the_reference(tokens, policy_loss, loss_agg, correction):
    """Any single completion (logp, log ratio, advantage, log ratio to the reference)
    under every option at once."""
    corrections = {
        "tis": dict(tis_cap=1.8),
        "sequence_truncate": dict(is_correction="truncate", is_level="sequence", is_high=2.5),
        "geometric_mask": dict(is_correction="mask", is_level="geometric", is_low=0.7),
    }
    hyper = replace(
        BASE,
        policy_loss=policy_loss,
        loss_agg=loss_agg,
        clip_ratio_c=2.5 if policy_loss in ("ppo_clip", "gspo") else 0.0,
        dppo_kl_coef=0.01 if policy_loss == "dppo" else 0.0,
        adv_clip_max=2.0,
        kl_coef=0.05,
        **corrections[correction],
    )
    lp = [t[0] for t in tokens]
    seqs = [
        (
            lp,
            [x - t[1] for x, t in zip(lp, tokens)],
            [t[2] for t in tokens],
            [x - t[3] for x, t in zip(lp, tokens)],
        )
    ]
    masks = [[True] * len(tokens)]
    want = ref_objective(seqs, hyper, masks)
    loss, grads, _ = fast(seqs, masks, hyper)
    assert loss == pytest.approx(want.loss, rel=1e-9, abs=1e-12)
    assert grads[0] == pytest.approx(want.grads[0], rel=1e-9, abs=1e-12)


def test_the_reference_gradients_are_the_derivatives_of_its_losses():
    """Central differences of the reference's token loss equal its hand-written
    d loss / d logp (away from the clip boundaries, where the loss has a kink)."""
    rng = np.random.default_rng(4)
    checked = 0
    smooth = [  # token-level losses without a detached weight or a selection
        o
        for o in OPTIONS
        if o.get("policy_loss", "is") in ("is", "ppo_clip", "sapo", "gpg", "dppo")
        and o.get("ratio_level", "token") == "token"
        and "is_correction" not in o
    ]
    for options in smooth:
        hyper = replace(BASE, **options)
        for _ in range(30):
            lp, shift, a, d_ref = (
                -rng.uniform(0.05, 4),
                rng.normal(0, 0.6),
                rng.normal(0, 1.5),
                rng.normal(0, 0.5),
            )
            r = math.exp(shift)
            edges = [1 - hyper.clip_eps, 1 + hyper.clip_eps_high, hyper.tis_cap]
            moved = math.exp(lp) - math.exp(lp - shift)  # dppo's region is on p - p_sampler
            if (
                any(abs(r - e) < 1e-3 for e in edges)
                or abs(a * r - hyper.clip_ratio_c * a) < 1e-3
                or min(abs(moved - hyper.clip_eps_high), abs(moved + hyper.clip_eps)) < 1e-3
            ):
                continue  # a kink of the loss: no derivative to compare
            old, ref = lp - shift, lp - d_ref  # held fixed: the derivative is in logp only
            h = 1e-6
            numeric = (
                ref_token(lp + h, old, a, hyper, ref).loss
                - ref_token(lp - h, old, a, hyper, ref).loss
            ) / (2 * h)
            tok = ref_token(lp, old, a, hyper, ref)
            if hyper.tis_cap > 0 and tok.truncated:
                # the TIS weight is detached: the analytic gradient leaves it out on purpose
                continue
            assert tok.grad == pytest.approx(numeric, rel=1e-5, abs=1e-7)
            checked += 1
    assert checked > 300


@pytest.mark.parametrize(
    "options",
    [
        dict(policy_loss="gspo", clip_eps=0.5, clip_eps_high=0.5),
        dict(policy_loss="gspo", clip_eps=0.5, clip_eps_high=0.5, clip_ratio_c=1.3),
        dict(policy_loss="sapo", ratio_level="sequence"),
        dict(policy_loss="sapo", ratio_level="sequence", sapo_tau_pos=3.0, sapo_tau_neg=0.5),
        dict(policy_loss="gmpo", clip_eps=0.5, clip_eps_high=0.5),
        dict(policy_loss="gmpo", clip_eps=0.1, clip_eps_high=0.2),
    ],
)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_the_sequence_ratio_gradient_is_gspos(options, loss_agg):
    """With the advantage constant over each completion, GSPO-token's straight-through
    gradient (the reference's, and the fast path's) is the derivative of GSPO's
    sequence objective: central differences of the aggregated loss, s_i recomputed from
    the perturbed logprobs, equal it token by token (away from the clip's kinks). GMPO's
    per-token form likewise: a token cut by its log-space clip is constant in the
    geometric mean, the others move it (no kink away from the bounds)."""
    hyper = replace(BASE, loss_agg=loss_agg, **options)
    rng = np.random.default_rng(9)
    checked = 0
    for _ in range(8):
        seqs, masks = random_step(int(rng.integers(1000)), spread=0.3)
        seqs = [(lp, old, [adv[-1]] * len(adv), ref) for lp, old, adv, ref in seqs]
        want = ref_objective(seqs, hyper, masks)
        _, grads, _ = fast(seqs, masks, hyper, chunks=[1] * len(seqs))
        for i, (lp, old, adv, ref) in enumerate(seqs):
            for t in range(len(lp)):
                if not masks[i][t]:
                    continue
                h = 1e-6
                bumped = [list(s[0]) for s in seqs]
                values = []
                for step in (h, -h):
                    bumped[i][t] = lp[t] + step
                    moved = [(b, *s[1:]) for b, s in zip(bumped, seqs)]
                    values.append(ref_objective(moved, hyper, masks).loss)
                numeric = (values[0] - values[1]) / (2 * h)
                kink = hyper.policy_loss != "gmpo" and (
                    any(
                        tok is not None and tok.clipped
                        for tok in ref_completion(
                            lp, old, adv, ref, masks[i], hyper, [False] * len(lp)
                        )
                    )
                    and abs(numeric) > 0
                )
                if kink:
                    continue
                assert want.grads[i][t] == pytest.approx(numeric, rel=1e-5, abs=1e-8)
                assert grads[i][t] == pytest.approx(numeric, rel=1e-5, abs=1e-8)
                checked += 1
    assert checked > 100


# ---------------------------------------------------------------- hand-worked values


def _hand_batch():
    """Completion 1: r = 1.5 (A = 1), r = 0.5 (A = -1); completion 2: r = 1 (A = 2),
    r = 3 (A = -1). Sampler logprobs 0, so logp = log r."""
    seqs = [
        ([math.log(1.5), math.log(0.5)], [0.0, 0.0], [1.0, -1.0], [0.0, 0.0]),
        ([0.0, math.log(3.0)], [0.0, 0.0], [2.0, -1.0], [0.0, 0.0]),
    ]
    return seqs, [[True, True], [True, True]]


def test_ppo_clip_by_hand():
    """clip_eps 0.2, GRPO's per-completion mean (w_i = 1 / (2 |o_i|) = 1/4 per token):
    tok 1: min(1.5, 1.2) = 1.2 clipped -> l = -1.2, no gradient
    tok 2: min(-0.5, -0.8) = -0.8 clipped -> l = 0.8, no gradient
    tok 3: r = 1 -> l = -2, dl/dlogp = -A r = -2
    tok 4: min(-3, -1.2) = -3 unclipped -> l = 3, dl/dlogp = -A r = 3
    loss = (-1.2 + 0.8 - 2 + 3) / 4 = 0.15"""
    seqs, masks = _hand_batch()
    hyper = replace(BASE, policy_loss="ppo_clip", loss_agg="seq_mean_token_mean")
    loss, grads, stats = fast(seqs, masks, hyper)
    assert loss == pytest.approx(0.15)
    assert grads == [pytest.approx([0.0, 0.0]), pytest.approx([-0.5, 0.75])]
    assert stats.metrics()["clip_fraction"] == 0.5
    # dual clip c = 1.5 bounds token 4's loss by -c A = 1.5 (and stops its gradient)
    dual, grads, stats = fast(seqs, masks, replace(hyper, clip_ratio_c=1.5))
    assert dual == pytest.approx((-1.2 + 0.8 - 2 + 1.5) / 4)
    assert grads == [pytest.approx([0.0, 0.0]), pytest.approx([-0.5, 0.0])]
    assert stats.metrics()["clip_fraction"] == 0.75


def test_is_tis_and_k3_by_hand():
    """is, token_mean over the 4 tokens: l = -A r = -1.5, 0.5, -2, 3; TIS cap 2 turns
    token 4's into 3 * 2/3 = 2 and its gradient 3 into 2; k3 to a reference 0 adds
    0.1 * (exp(-d) + d - 1) with gradient 0.1 * (1 - exp(-d))."""
    seqs, masks = _hand_batch()
    loss, grads, _ = fast(seqs, masks, BASE)
    assert loss == pytest.approx((-1.5 + 0.5 - 2 + 3) / 4)
    assert grads == [pytest.approx([-1.5 / 4, 0.5 / 4]), pytest.approx([-2 / 4, 3 / 4])]
    loss, grads, stats = fast(seqs, masks, replace(BASE, tis_cap=2.0))
    assert loss == pytest.approx((-1.5 + 0.5 - 2 + 2) / 4)
    assert grads[1] == pytest.approx([-2 / 4, 2 / 4])
    assert stats.metrics()["tis_truncated_fraction"] == 0.25
    hyper = replace(BASE, kl_coef=0.1, kl_estimator="k3")
    loss, grads, stats = fast(seqs, masks, hyper)
    ds = [math.log(1.5), math.log(0.5), 0.0, math.log(3.0)]
    k3 = [math.exp(-d) + d - 1 for d in ds]
    assert loss == pytest.approx((-1.5 + 0.5 - 2 + 3 + 0.1 * sum(k3)) / 4)
    assert grads[1][1] == pytest.approx((3 + 0.1 * (1 - 1 / 3)) / 4)
    assert stats.metrics()["kl_mean"] == pytest.approx(sum(k3) / 4)
    assert [ref_kl(d, "k3")[0] for d in ds] == pytest.approx(k3)


def _constant_advantage_batch():
    """Completion 1: r = 1.5, 0.5 with A = 1; completion 2: r = 1, 3 with A = -1 (GSPO's
    case: one advantage per completion). Sampler logprobs 0, so logp = log r."""
    seqs, masks = _hand_batch()
    return [
        (seqs[0][0], seqs[0][1], [1.0, 1.0], seqs[0][3]),
        (*seqs[1][:2], [-1.0, -1.0], seqs[1][3]),
    ], masks


def test_gspo_by_hand():
    """s_1 = sqrt(1.5 * 0.5) = 0.8660 (in [0.8, 1.2]: unclipped), s_2 = sqrt(3) = 1.7321
    (A = -1: min(-1.7321, -1.2) = -1.7321, unclipped). Per token l = -s A, gradient -s A
    on each token; GRPO's mean (1/4 per token):
    loss = (2 * -0.8660 + 2 * 1.7321) / 4, grads -0.8660/4 and +1.7321/4.
    Dual clip c = 1.5 bounds completion 2 at -c A = 1.5, without gradient."""
    seqs, masks = _constant_advantage_batch()
    s1, s2 = math.sqrt(0.75), math.sqrt(3.0)
    hyper = replace(BASE, policy_loss="gspo", loss_agg="seq_mean_token_mean")
    loss, grads, stats = fast(seqs, masks, hyper)
    assert loss == pytest.approx((-2 * s1 + 2 * s2) / 4)
    assert grads == [pytest.approx([-s1 / 4] * 2), pytest.approx([s2 / 4] * 2)]
    assert stats.metrics()["clip_fraction"] == 0.0
    dual, grads, stats = fast(seqs, masks, replace(hyper, clip_ratio_c=1.5))
    assert dual == pytest.approx((-2 * s1 + 2 * 1.5) / 4)
    assert grads[1] == pytest.approx([0.0, 0.0])
    assert stats.metrics()["clip_fraction"] == 0.5
    # clip_eps_high 0.1 leaves completion 1 (s < 1) alone; a positive completion with
    # s = 1.2247 above 1.1 is clipped whole: both tokens constant
    up = [([math.log(1.5), 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0])]
    loss, grads, stats = fast(up, [[True, True]], replace(hyper, clip_eps_high=0.1))
    assert loss == pytest.approx(-1.1)
    assert grads == [pytest.approx([0.0, 0.0])] and stats.metrics()["clip_fraction"] == 1.0


def test_cispo_sapo_and_vespo_by_hand():
    """On _hand_batch, token_mean (1/4 per token), logp = log r:
    cispo, clip [0.8, 1.28]: weights 1.28 (r 1.5), 0.8 (r 0.5), 1 (r 1), 1.28 (r 3);
        l = -w A logp, gradient -w A: 1.28 * -1, 0.8 * 1, 1 * -2, 1.28 * 1;
    sapo, tau 1 / 1.05: r = 1 gives f = 2 / tau and gradient exactly -A (f'(1) = 1);
    vespo: completion 2 has w = 1 * 3 = 3; A = 2 >= 0 (k 2, lambda 3): phi = 9 e^-6."""
    seqs, masks = _hand_batch()
    cispo = replace(BASE, policy_loss="cispo", clip_eps=0.2, clip_eps_high=0.28)
    loss, grads, stats = fast(seqs, masks, cispo)
    logp = [math.log(1.5), math.log(0.5), 0.0, math.log(3.0)]
    w, adv = [1.28, 0.8, 1.0, 1.28], [1.0, -1.0, 2.0, -1.0]
    assert loss == pytest.approx(sum(-wi * a * lp for wi, a, lp in zip(w, adv, logp)) / 4)
    assert grads == [pytest.approx([-1.28 / 4, 0.8 / 4]), pytest.approx([-2 / 4, 1.28 / 4])]
    assert stats.metrics()["clip_fraction"] == 0.75  # r = 1 alone is inside the band
    sapo = replace(BASE, policy_loss="sapo")
    _, grads, _ = fast(seqs, masks, sapo)
    assert grads[1][0] == pytest.approx(-2.0 / 4)  # r = 1, A = 2
    g = 1 / (1 + math.exp(-0.5))  # r = 1.5, A = 1, tau = 1: sigmoid(0.5)
    assert grads[0][0] == pytest.approx(-4 * g * (1 - g) * 1.5 / 4)
    # no lower bound (clip_eps = 1, as MiniMax-M1): r = 0.5 keeps its weight 0.5
    _, grads, _ = fast(seqs, masks, replace(cispo, clip_eps=1.0))
    assert grads[0][1] == pytest.approx(0.5 / 4)
    vespo = replace(BASE, policy_loss="vespo")
    _, grads, _ = fast(seqs, masks, vespo)

    def phi(w, k, lam):
        return w**k * math.exp(lam * (1 - w))

    # completion 1: w = 1.5 * 0.5; A = 1 (k 2, lambda 3) and A = -1 (k 3, lambda 2)
    assert grads[0] == pytest.approx([-phi(0.75, 2, 3) / 4, phi(0.75, 3, 2) / 4])
    assert grads[1] == pytest.approx([-phi(3.0, 2, 3) * 2 / 4, phi(3.0, 3, 2) / 4])
    assert phi(1.0, 2, 3) == 1.0  # an on-policy sequence keeps the plain gradient


def test_gpg_by_hand():
    """gpg on _hand_batch, token_mean: l = -A logp = -ln 1.5, ln 0.5, 0, ln 3 (sum
    ln(0.5 * 3 / 1.5) = 0), gradient -A / 4 whatever the ratio (no ratio at all); where the
    trainer and the sampler agree (r = 1) its gradient is `is`'s."""
    seqs, masks = _hand_batch()
    hyper = replace(BASE, policy_loss="gpg")
    loss, grads, stats = fast(seqs, masks, hyper)
    assert loss == pytest.approx(0.0, abs=1e-15)
    assert grads == [pytest.approx([-1 / 4, 1 / 4]), pytest.approx([-2 / 4, 1 / 4])]
    assert stats.metrics()["clip_fraction"] == 0.0
    on_policy = [([-0.5, -1.2], [-0.5, -1.2], [1.0, -2.0], [0.0, 0.0])]
    _, g_gpg, _ = fast(on_policy, [[True, True]], hyper)
    _, g_is, _ = fast(on_policy, [[True, True]], BASE)
    assert g_gpg == g_is == [pytest.approx([-1 / 2, 2 / 2])]


def test_gmpo_by_hand():
    """_constant_advantage_batch, log-space clip 0.4 (the paper's), seq_mean_token_mean:
    completion 1 (A = 1): log r = ln 1.5 = 0.405 > 0.4 is cut to 0.4, ln 0.5 stays: s_1 =
    exp((0.4 + ln 0.5) / 2) = 0.8637; completion 2 (A = -1): ln 1, ln 3 are above -0.4,
    nothing cut: s_2 = sqrt 3. loss = (-s_1 + s_2) / 2; per token (1/4 each) the gradient
    -A s: completion 1's cut token 0, its other -s_1/4; completion 2's +s_2/4."""
    seqs, masks = _constant_advantage_batch()
    hyper = replace(
        BASE, policy_loss="gmpo", clip_eps=0.4, clip_eps_high=0.4, loss_agg="seq_mean_token_mean"
    )
    s1, s2 = math.exp((0.4 + math.log(0.5)) / 2), math.sqrt(3.0)
    loss, grads, stats = fast(seqs, masks, hyper)
    assert loss == pytest.approx((-s1 + s2) / 2)
    assert grads == [pytest.approx([0.0, -s1 / 4]), pytest.approx([s2 / 4, s2 / 4])]
    assert stats.metrics()["clip_fraction"] == 0.25
    # nothing cut: GMPO's ratio is GSPO's s_i, and so are the loss and the gradient
    wide = replace(hyper, clip_eps=1.0, clip_eps_high=5.0)
    gspo = replace(wide, policy_loss="gspo", clip_eps_high=5.0)
    (a, ga, _), (b, gb, _) = fast(seqs, masks, wide), fast(seqs, masks, gspo)
    assert a == pytest.approx(b) and a == pytest.approx((-math.sqrt(0.75) + s2) / 2)
    for x, y in zip(ga, gb, strict=True):
        assert x == pytest.approx(y)
    # GMPO's advantage is the completion's mean: token advantages 3 and -1 act as 1 and 1
    varied = [(seqs[0][0], seqs[0][1], [3.0, -1.0], seqs[0][3])]
    _, g_varied, _ = fast(varied, masks[:1], hyper)
    _, g_const, _ = fast(seqs[:1], masks[:1], hyper)
    assert g_varied == [pytest.approx(g_const[0])]


def _probability_batch():
    """One completion, the sampler's p = 0.5 on every token; the trainer's p = 0.8 (A = 1),
    0.4 (A = -1), 0.5 (A = 2), 0.2 (A = -1): r = 1.6, 0.8, 1, 0.4 and p - p_sampler =
    +0.3, -0.1, 0, -0.3."""
    old = [math.log(0.5)] * 4
    logp = [math.log(p) for p in (0.8, 0.4, 0.5, 0.2)]
    return [(logp, old, [1.0, -1.0, 2.0, -1.0], [0.0] * 4)], [[True] * 4]


def test_dppo_by_hand():
    """dppo, region 0.2 either way, token_mean (1/4): token 1 rose by 0.3 > 0.2 with A > 0
    and token 4 fell by 0.3 with A < 0: dropped (loss 0, no gradient, clipped); token 2
    (fell 0.1) and 3 keep -A r: 0.8 and -2, gradients -A r = 0.8, -2. With dppo_kl_coef
    0.1 every token adds 0.1 (ln r)^2, gradient 0.2 ln r, the dropped ones included."""
    seqs, masks = _probability_batch()
    hyper = replace(BASE, policy_loss="dppo")
    loss, grads, stats = fast(seqs, masks, hyper)
    assert loss == pytest.approx((0.8 - 2.0) / 4)
    assert grads == [pytest.approx([0.0, 0.8 / 4, -2.0 / 4, 0.0])]
    assert stats.metrics()["clip_fraction"] == 0.5
    kl = replace(hyper, dppo_kl_coef=0.1)
    log_r = [math.log(x) for x in (1.6, 0.8, 1.0, 0.4)]
    loss, grads, _ = fast(seqs, masks, kl)
    assert loss == pytest.approx((0.8 - 2.0 + 0.1 * sum(d * d for d in log_r)) / 4)
    policy = [0.0, 0.8, -2.0, 0.0]
    assert grads == [pytest.approx([(g + 0.2 * d) / 4 for g, d in zip(policy, log_r)])]
    # a region wide enough keeps every token: dppo is then `is`
    wide = fast(seqs, masks, replace(hyper, clip_eps=0.5, clip_eps_high=0.5))
    plain = fast(seqs, masks, BASE)
    assert wide[0] == pytest.approx(plain[0]) and wide[1] == [pytest.approx(plain[1][0])]
    # PPO's ratio clip [0.8, 1.2] cuts the same two tokens here, but on r, not on p: a
    # rare token (p_sampler 0.01 -> 0.03, r = 3) is far outside PPO's band, inside DPPO's
    rare = [([math.log(0.03)], [math.log(0.01)], [1.0], [0.0])]
    assert fast(rare, [[True]], hyper)[2].metrics()["clip_fraction"] == 0.0
    ppo = replace(BASE, policy_loss="ppo_clip")
    assert fast(rare, [[True]], ppo)[2].metrics()["clip_fraction"] == 1.0


def _row(peer, name):
    from retrain.loss.peers import PEER_LOSSES

    row = next(r for r in PEER_LOSSES if r.peer == peer and r.name == name)
    config_from_dict({"training": dict(row.settings)})  # the row is a valid config
    return replace(BASE, **row.settings)


def test_the_verl_and_prime_rl_rows_follow_the_peers_formulas():
    """Each verl / prime-rl row's settings, on a random step (one advantage per
    completion, as verl's geo_mean requires), against the peer's formula as its code
    writes it, token by token: loss (or, for dppo_tv, the gradient) and gradients."""
    seqs, masks = random_step(21, spread=0.4)
    seqs = [(lp, old, [adv[-1]] * len(adv), ref) for lp, old, adv, ref in seqs]
    masks = [[True] * len(m) for m in masks]
    n = sum(map(len, masks))
    tokens = [(i, t) for i, m in enumerate(masks) for t in range(len(m))]

    def each(fn):
        return [[fn(i, t) for t in range(len(m))] for i, m in enumerate(masks)]

    lp = lambda i, t: seqs[i][0][t]  # noqa: E731
    old = lambda i, t: seqs[i][1][t]  # noqa: E731
    adv = lambda i, t: seqs[i][2][t]  # noqa: E731
    ratio = lambda i, t: math.exp(lp(i, t) - old(i, t))  # noqa: E731

    # prime-rl default_loss_fn: sum(-keep A r + kl_tau (log r)^2) / loss tokens
    def kept(i, t, low=0.2, high=0.2):
        moved = math.exp(lp(i, t)) - math.exp(old(i, t))
        return not (moved > high if adv(i, t) > 0 else moved < -low)

    loss, grads, _ = fast(seqs, masks, _row("prime-rl", "trainer.loss (type = default)"))
    d = lambda i, t: lp(i, t) - old(i, t)  # noqa: E731
    want = sum(-kept(i, t) * adv(i, t) * ratio(i, t) + 1e-3 * d(i, t) ** 2 for i, t in tokens)
    assert loss == pytest.approx(want / n, rel=1e-10)
    want_g = each(lambda i, t: (-kept(i, t) * adv(i, t) * ratio(i, t) + 2e-3 * d(i, t)) / n)
    for g, w in zip(grads, want_g, strict=True):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-15)
    assert not all(kept(i, t) for i, t in tokens)  # the region acts on this step

    # verl dppo_tv: -A sg(min(r, 20)) logp on the kept tokens, token-mean
    _, grads, _ = fast(seqs, masks, _row("verl", "policy_loss.loss_mode=dppo_tv"))
    want_g = each(lambda i, t: -kept(i, t) * adv(i, t) * min(ratio(i, t), 20.0) / n)
    for g, w in zip(grads, want_g, strict=True):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-15)

    # verl gpg: -A logp, token-mean
    loss, grads, _ = fast(seqs, masks, _row("verl", "policy_loss.loss_mode=gpg"))
    assert loss == pytest.approx(sum(-adv(i, t) * lp(i, t) for i, t in tokens) / n)
    for g, w in zip(grads, each(lambda i, t: -adv(i, t) / n), strict=True):
        assert g == pytest.approx(w)

    # verl geo_mean: mean over completions of -A_i exp(mean_t sgn min(sgn d, sgn clip(d)))
    def geo(i):
        a = seqs[i][2][0]
        sgn = (a > 0) - (a < 0)
        kept_d = [
            sgn * min(sgn * d(i, t), sgn * min(max(d(i, t), -0.4), 0.4))
            for t in range(len(masks[i]))
        ]
        return -a * math.exp(sum(kept_d) / len(kept_d))

    loss, _, stats = fast(seqs, masks, _row("verl", "policy_loss.loss_mode=geo_mean"))
    assert loss == pytest.approx(sum(geo(i) for i in range(len(seqs))) / len(seqs), rel=1e-10)
    assert 0 < stats.metrics()["clip_fraction"] < 1


def _covariance_step():
    """One completion, logp [-0.1, -0.2, -3, -2], A [2, 2, -1, -1]: mean logp -1.325, mean A
    0.5, so cov = 1.8375, 1.6875, 2.5125, 1.0125. Sampler logp = logp - 0.1 (r = e^0.1)
    except token 2, r = 1.5 > 1.28 with A > 0: PPO's clipped branch."""
    logp = [-0.1, -0.2, -3.0, -2.0]
    shift = [0.1, math.log(1.5), 0.1, 0.1]
    seqs = [(logp, [x - d for x, d in zip(logp, shift)], [2.0, 2.0, -1.0, -1.0], [0.0] * 4)]
    return seqs, [[True] * 4]


def test_clip_cov_and_kl_cov_by_hand():
    seqs, masks = _covariance_step()
    r = math.exp(0.1)
    clip_cov = replace(
        BASE,
        policy_loss="clip_cov",
        clip_eps=0.2,
        clip_eps_high=0.28,
        clip_cov_fraction=0.5,
        clip_cov_lb=1.5,
        clip_cov_ub=2.0,
    )
    # k = max(1, int(0.5 * 4)) = 2; the band (1.5, 2) holds tokens 1 and 2, but token 2
    # is PPO-clipped already: token 1 alone is cut out (loss 0, no gradient)
    assert step_picks(seqs, masks, clip_cov)[0].tolist() == [True, False, False, False]
    loss, grads, stats = fast(seqs, masks, clip_cov)
    assert loss == pytest.approx((0.0 - 2 * 1.28 + r + r) / 4)
    assert grads[0] == pytest.approx([0.0, 0.0, r / 4, r / 4])
    assert stats.metrics()["clip_fraction"] == 0.5  # the cut token and the PPO-clipped one
    # kl_cov: the top int(0.5 * 4) = 2 by covariance are tokens 3 and 1; each adds
    # beta |logp - logp_sampler| = 0.5 * 0.1, gradient beta * sign = 0.5
    kl_cov = replace(BASE, policy_loss="kl_cov", kl_cov_fraction=0.5, kl_cov_beta=0.5)
    assert step_picks(seqs, masks, kl_cov)[0].tolist() == [True, False, True, False]
    loss, grads, _ = fast(seqs, masks, kl_cov)
    base = [-2 * r, -2 * 1.5, r, r]
    assert loss == pytest.approx((sum(base) + 2 * 0.05) / 4)
    assert grads[0] == pytest.approx(
        [(base[0] + 0.5) / 4, base[1] / 4, (base[2] + 0.5) / 4, base[3] / 4]
    )
    # at least one token even when the share rounds to none
    tiny = replace(kl_cov, kl_cov_fraction=0.0001)
    assert step_picks(seqs, masks, tiny)[0].tolist() == [False, False, True, False]


def test_clip_cov_draws_at_random_among_the_band():
    """One token of the band (1.0, 2.0) = tokens 1 and 4 (token 2 is PPO-clipped): which
    one depends on the draw, never on the split."""
    seqs, masks = _covariance_step()
    hyper = replace(
        BASE, policy_loss="clip_cov", clip_cov_fraction=0.25, clip_cov_lb=1.0, clip_cov_ub=2.0
    )
    seen = set()
    for seed in range(20):
        pick = step_picks(seqs, masks, hyper, seed)[0].tolist()
        assert sum(pick) == 1 and (pick[0] or pick[3])
        seen.add(pick.index(True))
    assert seen == {0, 3}


def test_off_policy_corrections_by_hand():
    """is on _hand_batch (r = 1.5, 0.5 | 1, 3; A = 1, -1 | 2, -1), token_mean:
    plain l = -A r = -1.5, 0.5 | -2, 3."""
    seqs, masks = _hand_batch()
    rho = [1.5, 0.5, 1.0, 3.0]
    # mask at the token level, band [0.6, 2]: tokens 2 and 4 drop out (weight 0)
    hyper = replace(BASE, is_correction="mask", is_low=0.6, is_high=2.0)
    loss, grads, stats = fast(seqs, masks, hyper)
    assert loss == pytest.approx((-1.5 - 2) / 4)
    assert grads == [pytest.approx([-1.5 / 4, 0.0]), pytest.approx([-2 / 4, 0.0])]
    assert stats.metrics()["is_masked_fraction"] == 0.5
    assert stats.metrics()["is_truncated_fraction"] == 0.0
    # truncate at the sequence level, high 1.2: completion 1's product 0.75 stays and
    # replaces each token's own ratio (factors 0.75/1.5, 0.75/0.5); completion 2's 3 is
    # cut to 1.2 (factors 1.2/1, 1.2/3)
    hyper = replace(BASE, is_correction="truncate", is_level="sequence", is_high=1.2)
    loss, grads, stats = fast(seqs, masks, hyper)
    want = [-1.5 * 0.5, 0.5 * 1.5, -2 * 1.2, 3 * 0.4]
    assert loss == pytest.approx(sum(want) / 4)
    assert grads == [
        pytest.approx([w / 4 for w in want[:2]]),
        pytest.approx([w / 4 for w in want[2:]]),
    ]
    assert stats.metrics()["is_truncated_fraction"] == 0.5
    assert "tis_truncated_fraction" not in stats.metrics()  # not token-level
    # mask at the geometric level [0.8, 1.25]: completion 1 (0.866) stays, 2 (1.732) goes
    hyper = replace(BASE, is_correction="mask", is_level="geometric", is_low=0.8, is_high=1.25)
    loss, grads, stats = fast(seqs, masks, hyper)
    assert loss == pytest.approx((-1.5 + 0.5) / 4)
    assert grads[1] == pytest.approx([0.0, 0.0])
    assert stats.metrics()["is_masked_fraction"] == 0.5
    # the mismatch is reported with or without a correction: k3 = rho - 1 - log rho
    for h in (BASE, hyper):
        _, _, stats = fast(seqs, masks, h)
        assert stats.metrics()["mismatch_kl"] == pytest.approx(
            sum(x - 1 - math.log(x) for x in rho) / 4
        )


def test_the_new_aggregations_by_hand():
    """_hand_batch under is: token losses -1.5, 0.5 | -2, 3 (completion sums -1 | 1)."""
    seqs, masks = _hand_batch()
    # Dr. GRPO's constant: (sum of token losses) / (G = 2 x max_tokens = 10)
    loss, grads, _ = fast(
        seqs, masks, replace(BASE, loss_agg="seq_mean_token_sum_norm", max_tokens=10)
    )
    assert loss == pytest.approx((-1 + 1) / 20)
    assert grads[1] == pytest.approx([-2 / 20, 3 / 20])
    # bnpo, one completion per local batch: GRPO's per-completion mean
    one = fast(seqs, masks, replace(BASE, loss_agg="bnpo", bnpo_batch_size=1))
    grpo = fast(seqs, masks, replace(BASE, loss_agg="seq_mean_token_mean"))
    assert one[0] == pytest.approx(grpo[0]) and one[0] == pytest.approx((-1 / 2 + 1 / 2) / 2)
    for a, b in zip(one[1], grpo[1], strict=True):
        assert a == pytest.approx(b)
    # bnpo, both in one local batch: the token mean
    both = fast(seqs, masks, replace(BASE, loss_agg="bnpo", bnpo_batch_size=2), chunks=[1, 1])
    assert both[0] == pytest.approx((-1.5 + 0.5 - 2 + 3) / 4)


def test_gradient_descent_raises_the_logprob_of_advantaged_tokens():
    """The sign: d loss / d logp < 0 where A > 0 (a step down the gradient makes the
    token likelier) and > 0 where A < 0, under every built-in objective, unclipped (the
    covariance-selected tokens aside: clip_cov cuts them out, kl_cov adds its penalty; gmpo
    reads one advantage per completion, the mean of its tokens')."""
    seqs, masks = random_step(8, spread=0.01)
    for policy_loss in registry.OBJECTIVES.names():
        hyper = replace(BASE, policy_loss=policy_loss)
        _, grads, _ = fast(seqs, masks, hyper)
        picks = step_picks(seqs, masks, hyper) or [[False] * len(m) for m in masks]
        for (_, _, adv, _), g, mask, pick in zip(seqs, grads, masks, picks, strict=True):
            if policy_loss == "gmpo":
                adv = [float(np.mean([a for a, m in zip(adv, mask) if m]))] * len(adv)
            for a, d, m, p in zip(adv, g, mask, pick, strict=True):
                if p:
                    assert policy_loss in ("clip_cov", "kl_cov")
                    assert d == 0 or policy_loss == "kl_cov"
                    continue
                assert (d == 0) if not m else (np.sign(d) == -np.sign(a)), policy_loss


# ---------------------------------------------------------------- the registry


def test_every_objective_is_a_registry_entry_and_a_loss_option():
    assert registry.ALL_REGISTRIES["policy_loss"] is registry.OBJECTIVES
    assert registry.OBJECTIVES.names() == [
        "is",
        "ppo_clip",
        "gspo",
        "cispo",
        "sapo",
        "vespo",
        "clip_cov",
        "kl_cov",
        "gpg",
        "gmpo",
        "dppo",
    ]
    assert resolve_objective("is") == LossFn("is", builtin.importance_sampling)
    assert resolve_objective("ppo_clip").objective is builtin.ppo_clip
    # "is" is the default every backend runs; every other name must be a loss option
    assert set(registry.OBJECTIVES.names()) - {"is"} <= set(LOSS_OPTIONS)
    local = registry.BACKENDS.entry("local").capabilities.loss_options
    assert local == LOSS_OPTIONS and USER_OBJECTIVE in local
    for name in ("tinker", "prime_rl"):
        assert USER_OBJECTIVE not in registry.BACKENDS.entry(name).capabilities.loss_options


def _write(project: Path, name: str, body: str) -> None:
    (project / f"{name}.py").write_text(
        "from retrain.loss import TokenLoss\nfrom retrain.loss import objectives\n\n" + body
    )


FLIPPED = """
CALLS = []


def flipped(inputs, hyper):
    CALLS.append(inputs.advantages.clone())
    return TokenLoss(-objectives.importance_sampling(inputs, hyper).per_token)
"""


def test_a_dotted_path_objective_is_composed_like_a_builtin(project):
    """A user objective equal to -is gives exactly -1 times is's loss and gradient (every
    option composed around it), and sees the clipped advantages."""
    _write(project, "neg_is", FLIPPED)
    loss_fn = resolve_objective("neg_is.flipped")
    assert loss_fn.name == "neg_is.flipped"
    import neg_is

    seqs, masks = random_step(5)
    for loss_agg in LOSS_AGGS:
        hyper = replace(BASE, loss_agg=loss_agg, adv_clip_max=0.5)
        mine, g_mine, stats = fast(seqs, masks, hyper, loss_fn=loss_fn)
        theirs, g_theirs, _ = fast(seqs, masks, hyper)
        assert mine == -theirs and mine != 0
        assert g_mine == [[-x for x in g] for g in g_theirs]
        assert stats.clipped == 0.0
    assert len(neg_is.CALLS) == len(LOSS_AGGS) and float(neg_is.CALLS[-1].abs().max()) == 0.5


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def fn(inputs):\n    return None\n", r"has the signature \(inputs\)"),
        ("fn = 3\n", "is not callable"),
    ],
)
def test_a_malformed_objective_fails_when_it_is_resolved(project, body, message):
    module = f"bad_sig_{abs(hash(body))}"  # imported modules stay in sys.modules
    _write(project, module, body)
    with pytest.raises(PluginError, match=message):
        resolve_objective(f"{module}.fn")
    with pytest.raises(PluginError, match="cannot import module"):
        resolve_objective("no_such_module.fn")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def fn(inputs, hyper):\n    return -inputs.logp\n", "returned Tensor"),
        (
            "def fn(inputs, hyper):\n    return TokenLoss(-inputs.logp.sum(1))\n",
            r"per_token of shape \(6,\); expected \(6, \d+\), the shape of logp",
        ),
    ],
)
def test_an_objective_that_returns_the_wrong_thing_fails_by_name(project, body, message):
    module = f"bad_out_{abs(hash(body))}"
    _write(project, module, body)
    seqs, masks = random_step(5)
    with pytest.raises(PluginError, match=message) as info:
        fast(seqs, masks, BASE, loss_fn=resolve_objective(f"{module}.fn"))
    assert f"{module}.fn" in str(info.value)


def test_the_manual_example_runs_and_is_its_formula(project):
    """The objective `retrain man --topic loss` shows: -sg(min(r, 1 + eps_high)) A logp."""
    code = re.search(r"```python\n(# my_losses.py.*?)```", MANUAL.read_text(), re.DOTALL)
    assert code is not None
    (project / "my_losses.py").write_text(code.group(1))
    hyper = replace(BASE, clip_eps_high=0.28)
    seqs, masks = random_step(6)
    loss, grads, stats = fast(
        seqs, masks, hyper, loss_fn=resolve_objective("my_losses.capped_weight")
    )
    n = sum(map(sum, masks))
    want, want_grads, cut = 0.0, [], 0
    for (lp, old, adv, _), mask in zip(seqs, masks, strict=True):
        want_grads.append([])
        for x, o, a, m in zip(lp, old, adv, mask, strict=True):
            w = min(math.exp(x - o), 1.28)
            want += m * -w * a * x / n
            want_grads[-1].append(m * -w * a / n)
            cut += m and math.exp(x - o) > 1.28
    assert loss == pytest.approx(want, rel=1e-10)
    for g, w in zip(grads, want_grads, strict=True):
        assert g == pytest.approx(w, rel=1e-10, abs=1e-15)
    assert 0 < stats.clipped == cut


# ---------------------------------------------------------------- config and explain


def test_a_dotted_policy_loss_loads_for_the_local_backend_only():
    raw = {"training": {"policy_loss": "my_losses.capped_weight", "clip_eps_high": 0.28}}
    config = config_from_dict(raw)  # the PPO keys are the objective's to read
    assert loss_options_used(config) == [("[training] policy_loss", USER_OBJECTIVE)]
    assert objective_summary(config).startswith("my_losses.capped_weight (your objective")
    for backend in ("tinker", "prime_rl"):
        with pytest.raises(ConfigError) as info:
            config_from_dict(
                {
                    "backend": {"backend": backend},
                    "algorithm": {"transform_mode": "none"},
                    "training": {"policy_loss": "my_losses.capped_weight"},
                }
            )
        problem = next(p for p in info.value.problems if "[training] policy_loss" in p)
        assert "is your own objective (a dotted path)" in problem
        assert f"backend {backend!r} does not list loss_options 'user_objective'" in problem
        assert 'backend = "local"' in problem


def test_policy_loss_is_checked_through_the_registry():
    with pytest.raises(
        ConfigError, match=r"unknown policy_loss 'ppo_clp'.*did you mean 'ppo_clip'"
    ):
        config_from_dict({"training": {"policy_loss": "ppo_clp"}})
    with pytest.raises(ConfigError, match=r"\[training\] clip_ratio_c.*only used with"):
        config_from_dict({"training": {"policy_loss": "is", "clip_ratio_c": 3.0}})


def _explain(tmp_path, training: str):
    import os
    import subprocess
    import sys

    toml = tmp_path / "retrain.toml"
    toml.write_text(f"[training]\nseed = 1\n{training}")
    return subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", "explain", str(toml)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ,
    )


def test_explain_names_the_new_objectives_and_refuses_their_misuse(tmp_path, capsys):
    """`retrain explain` as a user runs it: prime-rl's loss in retrain's keys is printed on
    the Objective line; truncating gpg's (absent) ratio, or a dppo key under another
    objective, exits 2 naming the key, the file and line, and the fix, without a traceback."""
    from retrain.cli.main import main

    quickstart = Path(__file__).resolve().parents[2] / "retrain/config/templates/quickstart.toml"
    flags = ["--policy-loss", "dppo", "--dppo-kl-coef", "0.001"]
    assert main(["explain", str(quickstart), *flags]) == 0
    assert (
        "Objective:   dppo (tokens whose probability moved beyond -0.2 / +0.2 dropped, "
        "0.001 (log r)^2); agg token_mean" in capsys.readouterr().out
    )
    bad = _explain(tmp_path, 'policy_loss = "gpg"\nis_correction = "truncate"\n')
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "[training] is_correction (" in bad.stderr and "retrain.toml:4" in bad.stderr
    assert 'Fix: is_correction = "mask"' in bad.stderr
    misused = _explain(tmp_path, 'policy_loss = "gmpo"\ndppo_kl_coef = 0.01\n')
    assert misused.returncode == 2 and "retrain.toml:4" in misused.stderr
    assert 'only used with policy_loss = "dppo"' in misused.stderr
