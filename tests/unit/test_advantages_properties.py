"""Property-based tests (hypothesis) of the advantage pipeline and the SEPA scheduler."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_advantages import ref_token_advantages  # noqa: E402

from retrain.advantages import (  # noqa: E402
    Segments,
    compute_token_advantages,
    grpo,
    gtpo_weights,
    maxrl,
)
from retrain.sepa import SEPAScheduler  # noqa: E402

reward = st.floats(-10, 10, allow_nan=False, allow_infinity=False)
logprob = st.floats(-60.0, 0.0, allow_nan=False, allow_infinity=False)


@st.composite
def groups(draw, min_g=1, max_g=8, max_t=25, binary=False):
    g = draw(st.integers(min_g, max_g))
    if binary:
        rewards = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=g, max_size=g))
    else:
        rewards = draw(st.lists(reward, min_size=g, max_size=g))
    lps, plans = [], []
    for _ in range(g):
        t = draw(st.integers(0, max_t))
        lps.append(draw(st.lists(logprob, min_size=t, max_size=t)))
        plans.append(draw(st.lists(st.booleans(), min_size=t, max_size=t)))
    return rewards, lps, plans


@settings(max_examples=80)
@given(st.lists(reward, min_size=1, max_size=64))
def test_grpo_sums_to_zero(rewards):
    adv = grpo(rewards)
    assert abs(adv.sum()) <= 1e-9 * max(1.0, np.abs(rewards).max()) * len(rewards)


@settings(max_examples=80)
@given(st.integers(1, 64))
def test_maxrl_all_zero_rewards_give_zeros(g):
    assert not maxrl([0.0] * g).any()


@settings(max_examples=80)
@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=64))
def test_maxrl_is_grpo_over_success_rate(rewards):
    mean = sum(rewards) / len(rewards)
    if mean > 0:
        np.testing.assert_allclose(maxrl(rewards), grpo(rewards) / (mean + 1e-6), rtol=1e-12)


@settings(max_examples=80)
@given(
    st.lists(
        st.lists(st.floats(-5, 60, allow_nan=False), min_size=0, max_size=30),
        min_size=1,
        max_size=6,
    ),
    st.floats(-5, 20, allow_nan=False),
)
def test_gtpo_weights_are_non_negative(hs, beta):
    seg = Segments.from_lengths([len(h) for h in hs])
    flat = np.array([x for h in hs for x in h], dtype=float)
    assert (gtpo_weights(flat, seg, beta) >= 0).all()


@settings(max_examples=80)
@given(groups())
def test_gtpo_beta_zero_is_identity(group):
    rewards, lps, plans = group
    ep = grpo(rewards)
    out = compute_token_advantages(
        rewards, lps, plans, advantage_mode="grpo", transform_mode="gtpo", gtpo_beta=0.0
    )
    for a, toks in zip(ep, out):
        assert (toks == a).all()


@settings(max_examples=80)
@given(
    groups(),
    st.floats(0, 1, exclude_max=True, allow_nan=False),
    st.floats(0, 3, allow_nan=False),
)
def test_hicra_never_flips_sign_and_leaves_execution_tokens(group, alpha, beta):
    rewards, lps, plans = group
    kw = dict(advantage_mode="grpo", gtpo_beta=beta)
    gtpo = compute_token_advantages(rewards, lps, plans, transform_mode="gtpo", **kw)
    hicra = compute_token_advantages(
        rewards, lps, plans, transform_mode="gtpo_hicra", hicra_alpha=alpha, **kw
    )
    for g, h, p in zip(gtpo, hicra, plans):
        p = np.array(p, dtype=bool)
        # No flip: HICRA scales planning tokens by (1 + alpha) or keeps them, so a sign
        # can only survive (a product may underflow to 0 next to a denormal logprob).
        assert not (((g > 0) & (h < 0)) | ((g < 0) & (h > 0))).any()
        assert ((h != 0) | (np.abs(g) < 1e-300)).all()
        assert (g[~p] == h[~p]).all()
        assert (np.abs(h[p]) <= np.abs(g[p]) * (1 + alpha) + 1e-12).all()


@settings(max_examples=80)
@given(groups(), st.floats(0, 3, allow_nan=False))
def test_sepa_lambda_zero_is_gtpo(group, beta):
    rewards, lps, plans = group
    a = compute_token_advantages(
        rewards, lps, plans, transform_mode="gtpo_sepa", sepa_lambda=0.0, gtpo_beta=beta
    )
    b = compute_token_advantages(rewards, lps, plans, transform_mode="gtpo", gtpo_beta=beta)
    for x, y in zip(a, b):
        assert x.tolist() == y.tolist()


@settings(max_examples=80)
@given(groups(binary=True), st.floats(0, 3, allow_nan=False))
def test_sepa_lambda_one_gives_execution_tokens_one_weight(group, beta):
    rewards, lps, plans = group
    out = compute_token_advantages(
        rewards,
        lps,
        plans,
        advantage_mode="grpo",
        transform_mode="gtpo_sepa",
        sepa_lambda=1.0,
        gtpo_beta=beta,
    )
    for toks, p in zip(out, plans):
        execs = toks[~np.array(p, dtype=bool)]
        if execs.size:
            assert np.ptp(execs) <= 1e-12 * max(1.0, np.abs(execs).max())


@settings(max_examples=80)
@given(
    groups(max_t=40),
    st.sampled_from(["grpo", "maxrl"]),
    st.sampled_from(
        [
            "none",
            "gtpo",
            "gtpo_hicra",
            "gtpo_sepa",
            "gtpo_sepa_amp",
            "gtpo_sepa_amp_c",
            "entropy_mask",
        ]
    ),
    st.floats(0, 1),
    st.floats(0, 3),
    st.floats(-1, 1),
    st.sampled_from(["surprisal", "predictive_variance", "nll"]),
    st.floats(0, 1),
)
def test_fast_path_equals_reference(group, adv, tr, lam, beta, alpha, kind, rho):
    rewards, lps, plans = group
    kw = dict(
        advantage_mode=adv,
        transform_mode=tr,
        sepa_lambda=lam,
        gtpo_beta=beta,
        hicra_alpha=alpha,
        uncertainty_kind=kind,
        surprisal_mask_rho=rho,
    )
    fast = compute_token_advantages(rewards, lps, plans, **kw)
    ref = ref_token_advantages(rewards, lps, plans, **kw)
    for f, r in zip(fast, ref):
        np.testing.assert_allclose(f, r, rtol=1e-9, atol=1e-9)


@settings(max_examples=80)
@given(groups(max_t=30), st.floats(0.01, 1), st.floats(0, 3))
def test_entropy_mask_keeps_the_top_k_tokens_and_zeroes_the_rest(group, rho, beta):
    rewards, lps, plans = group
    base = dict(advantage_mode="grpo", gtpo_beta=beta)
    masked = compute_token_advantages(
        rewards, lps, plans, transform_mode="entropy_mask", surprisal_mask_rho=rho, **base
    )
    gtpo = compute_token_advantages(rewards, lps, plans, transform_mode="gtpo", **base)
    h = np.array([min(-x, 50.0) for lp in lps for x in lp])
    if h.size == 0:
        return
    kept = np.concatenate(masked) == np.concatenate(gtpo)
    k = max(1, int(h.size * rho))
    assert kept[np.argsort(-h, kind="stable")[:k]].all()  # the k largest always stay
    assert (np.concatenate(masked)[~kept] == 0.0).all()
    assert kept.sum() >= min(k, h.size)


@settings(max_examples=80)
@given(groups(max_t=30), st.floats(0, 1))
def test_sepa_amp_keeps_planning_tokens_and_pushes_execution_apart(group, lam):
    rewards, lps, plans = group
    kw = dict(advantage_mode="grpo", sepa_lambda=lam, gtpo_beta=0.5)
    amp = compute_token_advantages(rewards, lps, plans, transform_mode="gtpo_sepa_amp", **kw)
    gtpo = compute_token_advantages(rewards, lps, plans, transform_mode="gtpo", **kw)
    for a, g, p in zip(amp, gtpo, plans):
        p = np.array(p, dtype=bool)
        # the completion's mean uncertainty is unchanged, so planning tokens keep their weight
        np.testing.assert_allclose(a[p], g[p], rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ SEPA scheduler

observations = st.lists(
    st.tuples(st.floats(0, 1), st.one_of(st.none(), st.floats(0, 100), st.just(float("nan")))),
    min_size=1,
    max_size=60,
)
sched_args = st.fixed_dictionaries(
    {
        "steps": st.integers(0, 50),
        "schedule": st.sampled_from(["linear", "auto"]),
        "delay_steps": st.integers(0, 30),
        "correct_rate_gate": st.floats(0, 1),
        "ema_decay": st.floats(0, 0.999),
        "var_threshold": st.floats(0.01, 5),
        "warmup": st.integers(1, 10),
    }
)


@settings(max_examples=80)
@given(sched_args, observations)
def test_scheduler_lambda_in_unit_interval(args, obs):
    s = SEPAScheduler(**args)
    for step, (rate, var) in enumerate(obs):
        lam = s.update(step, rate, var)
        assert 0.0 <= lam <= 1.0 and lam == s.lam


@settings(max_examples=80)
@given(sched_args, observations)
def test_scheduler_linear_is_monotone(args, obs):
    s = SEPAScheduler(**{**args, "schedule": "linear"})
    prev = 0.0
    for step, (rate, var) in enumerate(obs):
        lam = s.update(step, rate, var)
        assert lam >= prev
        prev = lam


@settings(max_examples=80)
@given(sched_args, observations)
def test_scheduler_is_zero_while_gate_shut(args, obs):
    s = SEPAScheduler(**args)
    opened = args["correct_rate_gate"] <= 0
    for step, (rate, var) in enumerate(obs):
        opened = opened or rate >= args["correct_rate_gate"]
        lam = s.update(step + 1000, rate, var)
        assert s.gate_open == opened
        if not opened:
            assert lam == 0.0


@settings(max_examples=80)
@given(sched_args, observations, observations)
def test_scheduler_state_round_trip(args, before, after):
    a = SEPAScheduler(**args)
    for step, (rate, var) in enumerate(before):
        a.update(step, rate, var)
    b = SEPAScheduler(**args)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for step, (rate, var) in enumerate(after, start=len(before)):
        assert a.update(step, rate, var) == b.update(step, rate, var)


@settings(max_examples=80)
@given(
    st.lists(st.lists(reward, min_size=1, max_size=9), min_size=1, max_size=8),
    st.sampled_from(["grpo", "maxrl", "grpo_std", "rloo"]),
)
def test_grouped_episode_advantages_equal_per_group_ones(groups_, mode):
    from retrain.registry import ADVANTAGE_MODES, import_object

    entry = ADVANTAGE_MODES.entry(mode)
    per_group = import_object(entry.target)
    flat = np.array([r for g in groups_ for r in g])
    sizes = np.array([len(g) for g in groups_])
    grouped = import_object(entry.grouped)(flat, sizes)
    expected = np.concatenate([per_group(g) for g in groups_])
    assert grouped.tolist() == expected.tolist()


# ------------------------------------------------------------------ the peers' estimators

# Multiples of 1/4 and integer shifts add exactly in floating point, so a shifted batch
# differs from the original only by the rounding of the means.
quarter = st.integers(-20, 20).map(lambda k: k / 4)
batches = st.lists(st.lists(quarter, min_size=1, max_size=9), min_size=1, max_size=8)
SHIFT_INVARIANT = ["grpo", "grpo_std", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
SCALE_INVARIANT = ["grpo_std", "reinforce_pp", "reinforce_pp_baseline"]
TINY_EPS = {"eps": 1e-300}  # no regularisation: the invariances are then exact


def _grouped(mode, groups_, params=None):
    from retrain.registry import ADVANTAGE_MODES, import_object

    flat = np.array([r for g in groups_ for r in g], dtype=float)
    sizes = np.array([len(g) for g in groups_])
    return import_object(ADVANTAGE_MODES.entry(mode).grouped)(flat, sizes, params or {})


@settings(max_examples=80)
@given(st.lists(reward, min_size=1, max_size=64))
def test_rloo_sums_to_zero_and_is_grpo_scaled_by_g_over_g_minus_1(rewards):
    from retrain.advantages.episode import rloo

    adv = rloo(rewards)
    g = len(rewards)
    assert abs(adv.sum()) <= 1e-9 * max(1.0, np.abs(rewards).max()) * g
    if g > 1:
        np.testing.assert_allclose(adv, grpo(rewards) * g / (g - 1), rtol=1e-12, atol=1e-12)


@settings(max_examples=80)
@given(batches, st.integers(-50, 50), st.sampled_from(SHIFT_INVARIANT))
def test_a_constant_shift_of_the_rewards_changes_nothing(groups_, shift, mode):
    params = TINY_EPS if mode in SCALE_INVARIANT else {}
    base = _grouped(mode, groups_, params)
    shifted = _grouped(mode, [[r + shift for r in g] for g in groups_], params)
    np.testing.assert_allclose(shifted, base, rtol=1e-9, atol=1e-9)


@settings(max_examples=80)
@given(batches, st.floats(0.01, 100.0), st.sampled_from([*SCALE_INVARIANT, "rloo"]))
def test_a_positive_scale_of_the_rewards_changes_only_rloo(groups_, scale, mode):
    params = TINY_EPS if mode in SCALE_INVARIANT else {}
    base = _grouped(mode, groups_, params)
    scaled = _grouped(mode, [[r * scale for r in g] for g in groups_], params)
    expected = base * scale if mode == "rloo" else base
    np.testing.assert_allclose(scaled, expected, rtol=1e-9, atol=1e-9)


@settings(max_examples=80)
@given(batches, st.sampled_from(["reinforce_pp", "reinforce_pp_baseline"]), st.floats(1e-8, 1.0))
def test_reinforce_pp_whitens_the_batch(groups_, mode, eps):
    out = _grouped(mode, groups_, {"eps": eps})
    flat = np.array([r for g in groups_ for r in g])
    if mode == "reinforce_pp_baseline":
        flat = flat - np.repeat([np.mean(g) for g in groups_], [len(g) for g in groups_])
    assert abs(out.mean()) <= 1e-9
    if flat.size > 1:
        var = flat.var(ddof=1)
        np.testing.assert_allclose(out.var(ddof=1), var / (var + eps), rtol=1e-9, atol=1e-12)


@settings(max_examples=60)
@given(
    st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=6), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 10), st.integers(1, 6), quarter), max_size=4),
    st.sampled_from(["grpo_std", "rloo", "reinforce_pp", "reinforce_pp_baseline"]),
)
def test_skipped_groups_change_no_kept_advantage(informative, constant, mode):
    """All-equal groups, wherever they sit in the step, are skipped and leave the kept
    groups' advantages (and so the REINFORCE++ batch statistics) exactly as they were."""
    from retrain.advantages import AdvantagePipeline
    from retrain.types import TokenGroup

    def make(rewards):
        return TokenGroup(np.array(rewards), [np.array([-1.0])] * len(rewards), None)

    kept = [make(g) for g in informative if len(set(g)) > 1]
    groups = list(kept)
    for at, size, value in constant:
        groups.insert(min(at, len(groups)), make([value] * size))
    pipeline = AdvantagePipeline(advantage_mode=mode, transform_mode="none")
    alone = [a for a in pipeline(kept).advantages]
    mixed = [a for a in pipeline(groups).advantages if a is not None]
    assert len(alone) == len(mixed)
    for a, b in zip(alone, mixed):
        assert [x.tolist() for x in a] == [x.tolist() for x in b]
