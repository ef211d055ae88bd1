"""Hand-worked cases and reference agreement for the advantage pipeline."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_advantages import (  # noqa: E402
    ENTROPY_NAMES,
    SURPRISAL_NAMES,
    ref_batch_advantages,
    ref_exec_plan_stats,
    ref_surprisal_mask,
    ref_token_advantages,
    ref_uncertainty,
)

from retrain.advantages import (  # noqa: E402
    AdvantagePipeline,
    AdvantageStats,
    Segments,
    UncertaintyUnavailableError,
    compute_token_advantages,
    compute_uncertainty,
    grpo,
    maxrl,
    requires_entropies,
    transform_entropy_mask,
    transform_gtpo,
    transform_gtpo_hicra,
    transform_gtpo_sepa,
    transform_gtpo_sepa_amp,
    transform_gtpo_sepa_amp_c,
    transform_none,
)
from retrain.advantages.context import TransformContext, TransformOutput  # noqa: E402
from retrain.registry import (  # noqa: E402
    ADVANTAGE_MODES,
    ALGORITHM_MODES,
    PLANNING_DETECTORS,
    TRANSFORM_MODES,
    UNCERTAINTY_KINDS,
)
from retrain.types import TokenGroup  # noqa: E402

EPS = 1e-6
CONDITIONS = [
    ("grpo", "none"),
    ("maxrl", "none"),
    ("maxrl", "gtpo"),
    ("maxrl", "gtpo_hicra"),
    ("maxrl", "gtpo_sepa"),
    ("grpo", "gtpo"),
    ("grpo", "gtpo_hicra"),
    ("grpo", "gtpo_sepa"),
    ("maxrl", "gtpo_sepa_amp"),
    ("maxrl", "gtpo_sepa_amp_c"),
    ("maxrl", "entropy_mask"),
    ("grpo", "gtpo_sepa_amp_c"),
    ("grpo", "entropy_mask"),
]


def tok(rewards, logprobs, planning=None, **kw):
    return compute_token_advantages(rewards, logprobs, planning, **kw)


def batch(groups, *, sepa_lambda=0.0, step=0, **kw):
    """One pipeline call on (rewards, logprobs, planning) tuples."""
    return AdvantagePipeline(**kw)(
        [TokenGroup(*g) for g in groups], sepa_lambda=sepa_lambda, step=step
    )


# ------------------------------------------------------------------ episode level


def test_grpo_hand_worked():
    np.testing.assert_allclose(grpo([1, 0, 0, 0]), [0.75, -0.25, -0.25, -0.25])
    np.testing.assert_allclose(grpo([0.5, 1.5]), [-0.5, 0.5])


def test_grpo_has_no_std_normalisation():
    np.testing.assert_allclose(grpo([10.0, 0.0]), [5.0, -5.0])


def test_maxrl_hand_worked():
    np.testing.assert_allclose(
        maxrl([1, 0, 0, 0]),
        [0.75 / (0.25 + EPS), -0.25 / (0.25 + EPS), -0.25 / (0.25 + EPS), -0.25 / (0.25 + EPS)],
    )
    np.testing.assert_allclose(
        maxrl([1, 1, 0, 0]), [0.5 / 0.500001, 0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001]
    )


def test_maxrl_zero_mean_gives_zeros():
    assert maxrl([0, 0, 0]).tolist() == [0.0, 0.0, 0.0]
    assert maxrl([5e-7, 0.0]).tolist() == [0.0, 0.0]  # mean <= eps


def test_maxrl_upweights_rare_success():
    rare = maxrl([1, 0, 0, 0, 0, 0, 0, 0])[0]
    common = maxrl([1, 1, 1, 1, 1, 1, 1, 0])[0]
    assert rare > 6.9 and common < 0.15


def test_episode_functions_reject_nan():
    with pytest.raises(ValueError):
        grpo([1.0, float("nan")])


# ------------------------------------------------------------------ uncertainty


def test_surprisal_is_negative_logprob_capped_at_50():
    h = compute_uncertainty("surprisal", np.array([-0.5, -60.0, -np.inf, 0.0]))
    assert h.tolist() == [0.5, 50.0, 50.0, 0.0]


@pytest.mark.parametrize("kind", ["predictive_variance", "pred_var", "bernoulli_variance"])
def test_predictive_variance_and_aliases(kind):
    h = compute_uncertainty(kind, np.log(np.array([0.5, 1.0, 0.1])))
    np.testing.assert_allclose(h, [0.25, 0.0, 0.09], atol=1e-15)


def test_shannon_entropy_passes_backend_entropies_through():
    ent = np.array([0.1, 2.0, 3.5])
    np.testing.assert_array_equal(compute_uncertainty("shannon_entropy", np.zeros(3), ent), ent)


def test_shannon_entropy_without_entropies_is_a_clear_error():
    with pytest.raises(UncertaintyUnavailableError, match="pytorch") as info:
        tok([1, 0], [[-1.0], [-2.0]], uncertainty_kind="shannon_entropy")
    assert isinstance(info.value, ValueError)
    assert "local" in str(info.value)


def test_shannon_entropy_drives_gtpo():
    ent = [[1.0, 3.0], [2.0, 2.0]]
    out = tok(
        [1, 0],
        [[-0.1, -0.1], [-0.1, -0.1]],
        None,
        advantage_mode="grpo",
        transform_mode="gtpo",
        uncertainty_kind="shannon_entropy",
        entropies_G_T=ent,
    )
    np.testing.assert_allclose(out[0], [0.5 * 0.95, 0.5 * 1.05])
    np.testing.assert_allclose(out[1], [-0.5, -0.5])


def test_requires_entropies():
    assert requires_entropies("shannon_entropy")
    assert not requires_entropies("surprisal")
    assert not requires_entropies("pred_var")


# ------------------------------------------------------------------ transforms


def test_none_gives_every_token_the_episode_advantage():
    out = tok(
        [1, 0, 0, 0],
        [[-1.0, -2.0], [-0.5], [-3.0, -1.0, -2.0], []],
        advantage_mode="grpo",
        transform_mode="none",
    )
    assert [a.tolist() for a in out] == [[0.75, 0.75], [-0.25], [-0.25, -0.25, -0.25], []]


def test_gtpo_hand_worked():
    # h = [1, 3], m = 2: w = [1 + 0.1 (0.5 - 1), 1 + 0.1 (1.5 - 1)] = [0.95, 1.05]
    out = tok([1, 0], [[-1.0, -3.0], [-2.0, -2.0]], advantage_mode="grpo", transform_mode="gtpo")
    np.testing.assert_allclose(out[0], [0.5 * 0.95, 0.5 * 1.05])
    np.testing.assert_allclose(out[1], [-0.5, -0.5])


def test_gtpo_weights_clip_at_zero():
    # beta = 10: w = [max(0, 1 - 5), 1 + 5] = [0, 6]
    out = tok(
        [1, 0], [[-1.0, -3.0], [-2.0]], advantage_mode="grpo", transform_mode="gtpo", gtpo_beta=10.0
    )
    np.testing.assert_allclose(out[0], [0.0, 3.0])


def test_gtpo_uniform_when_mean_uncertainty_tiny():
    out = tok(
        [1, 0], [[0.0, -1e-9], [-1.0]], advantage_mode="grpo", transform_mode="gtpo", gtpo_beta=0.5
    )
    assert out[0].tolist() == [0.5, 0.5]


def test_gtpo_beta_zero_is_uniform():
    out = tok(
        [1, 0], [[-1.0, -7.0], [-2.0]], advantage_mode="grpo", transform_mode="gtpo", gtpo_beta=0.0
    )
    assert out[0].tolist() == [0.5, 0.5]


def test_hicra_hand_worked_positive_and_negative():
    lp = [[-1.0, -3.0], [-1.0, -3.0]]
    plan = [[True, False], [True, False]]
    out = tok([1, 0], lp, plan, advantage_mode="grpo", transform_mode="gtpo_hicra")
    np.testing.assert_allclose(out[0], [0.5 * 0.95 * 1.2, 0.5 * 1.05])
    # negative advantage: A + alpha |A| moves it towards zero, never past it
    np.testing.assert_allclose(out[1], [-0.5 * 0.95 * 0.8, -0.5 * 1.05])


def test_hicra_alpha_zero_is_gtpo():
    lp, plan = [[-1.0, -3.0], [-2.0]], [[True, False], [True]]
    a = tok([1, 0], lp, plan, transform_mode="gtpo_hicra", hicra_alpha=0.0)
    b = tok([1, 0], lp, plan, transform_mode="gtpo")
    for x, y in zip(a, b):
        assert x.tolist() == y.tolist()


@pytest.mark.parametrize("alpha", [1.5, -2.0, float("nan")])
def test_hicra_alpha_that_could_flip_signs_is_rejected(alpha):
    with pytest.raises(ValueError, match="hicra_alpha"):
        tok(
            [1, 0],
            [[-1.0], [-1.0]],
            [[True], [True]],
            transform_mode="gtpo_hicra",
            hicra_alpha=alpha,
        )


def test_hicra_alpha_one_zeroes_negative_planning_tokens():
    out = tok(
        [1, 0],
        [[-1.0], [-1.0]],
        [[True], [True]],
        advantage_mode="grpo",
        transform_mode="gtpo_hicra",
        hicra_alpha=1.0,
    )
    assert out[0].tolist() == [1.0] and out[1].tolist() == [0.0]


def test_sepa_hand_worked():
    # h = [1, 3, 5], planning = [F, F, T], lambda = 0.5: exec mean 2 -> h' = [1.5, 2.5, 5]
    # m = 3 -> w = 1 + 0.1 (h'/3 - 1)
    out = tok(
        [1, 0],
        [[-1.0, -3.0, -5.0], [-1.0]],
        [[False, False, True], [False]],
        advantage_mode="grpo",
        transform_mode="gtpo_sepa",
        sepa_lambda=0.5,
    )
    w = [1 + 0.1 * (1.5 / 3 - 1), 1 + 0.1 * (2.5 / 3 - 1), 1 + 0.1 * (5 / 3 - 1)]
    np.testing.assert_allclose(out[0], [0.5 * x for x in w])
    np.testing.assert_allclose(out[1], [-0.5])


def test_sepa_lambda_one_flattens_execution_tokens():
    out = tok(
        [1, 0],
        [[-1.0, -3.0, -5.0, -0.2], [-1.0]],
        [[False, False, True, False], [False]],
        advantage_mode="grpo",
        transform_mode="gtpo_sepa",
        sepa_lambda=1.0,
    )
    execs = out[0][[0, 1, 3]]
    assert np.ptp(execs) == 0.0
    assert out[0][2] != execs[0]


def test_sepa_lambda_zero_equals_gtpo():
    lp, plan = [[-1.0, -3.0, -5.0], [-0.3, -2.0]], [[False, True, False], [False, False]]
    a = tok([1, 0], lp, plan, transform_mode="gtpo_sepa", sepa_lambda=0.0)
    b = tok([1, 0], lp, plan, transform_mode="gtpo")
    for x, y in zip(a, b):
        assert x.tolist() == y.tolist()


def test_sepa_lambda_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="sepa_lambda"):
        tok([1, 0], [[-1.0], [-1.0]], sepa_lambda=1.5)


def test_maxrl_gtpo_sepa_defaults_hand_worked():
    out = tok([1, 0, 0, 0], [[-1.0, -2.0], [-0.5], [-3.0, -1.0, -2.0], []])
    a_pos, a_neg = 0.75 / 0.250001, -0.25 / 0.250001
    np.testing.assert_allclose(
        out[0], [a_pos * (1 + 0.1 * (1 / 1.5 - 1)), a_pos * (1 + 0.1 * (2 / 1.5 - 1))]
    )
    np.testing.assert_allclose(out[1], [a_neg])
    assert out[3].size == 0 and out[3].dtype == np.float64


def test_builtin_transforms_take_a_context_like_plugins():
    ctx = TransformContext(
        episode_advantages_G=np.array([0.5, -0.5]),
        logprobs_G_T=[np.array([-1.0, -3.0]), np.array([-2.0])],
        uncertainties_G_T=[np.array([1.0, 3.0]), np.array([2.0])],
        planning_G_T=[np.array([True, False]), np.array([False])],
        sepa_lambda=0.0,
    )
    assert transform_none(ctx).token_advantages[0].tolist() == [0.5, 0.5]
    np.testing.assert_allclose(transform_gtpo(ctx).token_advantages[0], [0.475, 0.525])
    np.testing.assert_allclose(transform_gtpo_hicra(ctx).token_advantages[0], [0.475 * 1.2, 0.525])
    out = transform_gtpo_sepa(ctx)
    assert isinstance(out, TransformOutput)
    np.testing.assert_allclose(out.token_advantages[1], [-0.5])


# ------------------------------------------------------------------ original-era modes


@pytest.mark.parametrize("alias", SURPRISAL_NAMES)
def test_surprisal_aliases(alias):
    lp = np.array([-0.5, -60.0, 0.0])
    assert UNCERTAINTY_KINDS.canonical(alias) == "surprisal"
    assert compute_uncertainty(alias, lp).tolist() == ref_uncertainty(alias, lp.tolist())
    assert not requires_entropies(alias)


@pytest.mark.parametrize("alias", ENTROPY_NAMES)
def test_shannon_entropy_aliases(alias):
    ent = np.array([0.1, 2.0, 3.5])
    assert UNCERTAINTY_KINDS.canonical(alias) == "shannon_entropy"
    np.testing.assert_array_equal(compute_uncertainty(alias, np.zeros(3), ent), ent)
    assert requires_entropies(alias) and AdvantagePipeline(uncertainty_kind=alias).needs_entropies
    with pytest.raises(UncertaintyUnavailableError):
        tok([1, 0], [[-1.0], [-2.0]], uncertainty_kind=alias)


def test_sepa_amp_hand_worked():
    # h = [1, 3, 5], planning = [F, F, T], lambda = 0.5: exec mean 2
    # h' = h + 0.5 (h - 2) on execution tokens = [0.5, 3.5, 5]; the mean stays 3
    out = tok(
        [1, 0],
        [[-1.0, -3.0, -5.0], [-1.0]],
        [[False, False, True], [False]],
        advantage_mode="grpo",
        transform_mode="gtpo_sepa_amp",
        sepa_lambda=0.5,
    )
    w = [1 + 0.1 * (x / 3 - 1) for x in (0.5, 3.5, 5.0)]
    np.testing.assert_allclose(out[0], [0.5 * x for x in w])
    np.testing.assert_allclose(out[1], [-0.5])


def test_sepa_amp_clamped_floors_at_zero_and_uses_the_new_mean():
    # all execution, lambda = 1: h' = 2 h - mu, mu = 5.2 / 3
    h = [0.2, 4.0, 1.0]
    mu = sum(h) / 3
    raw = [2 * x - mu for x in h]  # the first is negative
    assert raw[0] < 0
    lp = [[-x for x in h], [-1.0]]
    kw = dict(advantage_mode="grpo", sepa_lambda=1.0, gtpo_beta=0.5)
    amp = tok([1, 0], lp, None, transform_mode="gtpo_sepa_amp", **kw)
    amp_c = tok([1, 0], lp, None, transform_mode="gtpo_sepa_amp_c", **kw)
    m = sum(raw) / 3  # == mu: amplification keeps the mean
    np.testing.assert_allclose(amp[0], [0.5 * max(0.0, 1 + 0.5 * (x / m - 1)) for x in raw])
    floored = [max(0.0, x) for x in raw]
    m_c = sum(floored) / 3
    np.testing.assert_allclose(amp_c[0], [0.5 * (1 + 0.5 * (x / m_c - 1)) for x in floored])
    assert not np.allclose(amp[0], amp_c[0])


@pytest.mark.parametrize("mode", ["gtpo_sepa_amp", "gtpo_sepa_amp_c", "entropy_mask"])
def test_new_transforms_reduce_to_gtpo(mode):
    lp, plan = [[-1.0, -3.0, -5.0], [-0.3, -2.0]], [[False, True, False], [False, False]]
    a = tok([1, 0], lp, plan, transform_mode=mode, sepa_lambda=0.0, surprisal_mask_rho=0.0)
    b = tok([1, 0], lp, plan, transform_mode="gtpo")
    for x, y in zip(a, b):
        assert x.tolist() == y.tolist()


def test_sepa_amp_pushes_execution_tokens_apart():
    lp = [[-1.0, -3.0, -5.0, -0.2], [-1.0]]
    plan = [[False, False, True, False], [False]]
    pool = tok([1, 0], lp, plan, transform_mode="gtpo_sepa", sepa_lambda=0.8)
    gtpo = tok([1, 0], lp, plan, transform_mode="gtpo")
    amp = tok([1, 0], lp, plan, transform_mode="gtpo_sepa_amp", sepa_lambda=0.8)
    execs = [0, 1, 3]
    assert np.ptp(pool[0][execs]) < np.ptp(gtpo[0][execs]) < np.ptp(amp[0][execs])
    assert amp[0][2] == gtpo[0][2]  # the planning token keeps its h, and the mean is kept


def test_entropy_mask_hand_worked():
    # group h = [1, 3, 0.1] + [2], rho = 0.5: n = 4, k = 2, tau = 2 (second largest)
    groups = [([1.0, 0.0], [[-1.0, -3.0, -0.1], [-2.0]], None)]
    kw = dict(advantage_mode="grpo", transform_mode="entropy_mask", surprisal_mask_rho=0.5)
    res = batch(groups, **kw)
    gtpo = tok(*groups[0], advantage_mode="grpo", transform_mode="gtpo")
    out = res.advantages[0]
    assert out[0].tolist() == [0.0, gtpo[0][1], 0.0]
    assert out[1].tolist() == gtpo[1].tolist() == [-0.5]
    assert res.stats.extra_metrics == {"entropy_mask_threshold": 2.0, "entropy_mask_fraction": 0.5}
    assert res.stats.to_metrics()["entropy_mask_fraction"] == 0.5


def test_entropy_mask_keeps_ties_and_rho_one_keeps_everything():
    lp = [[-1.0, -1.0], [-1.0, -1.0]]
    kw = dict(advantage_mode="grpo", transform_mode="entropy_mask")
    tied = batch([([1.0, 0.0], lp, None)], surprisal_mask_rho=0.25, **kw)
    assert [a.tolist() for a in tied.advantages[0]] == [[0.5, 0.5], [-0.5, -0.5]]
    assert tied.stats.extra_metrics["entropy_mask_fraction"] == 0.0
    everything = batch([([1.0, 0.0], [[-1.0, -3.0], [-2.0]], None)], surprisal_mask_rho=1.0, **kw)
    gtpo = tok([1.0, 0.0], [[-1.0, -3.0], [-2.0]], advantage_mode="grpo", transform_mode="gtpo")
    for x, y in zip(everything.advantages[0], gtpo):
        assert x.tolist() == y.tolist()
    assert everything.stats.extra_metrics == {
        "entropy_mask_threshold": 1.0,
        "entropy_mask_fraction": 0.0,
    }


def test_entropy_mask_rho_zero_logs_nothing_and_other_transforms_ignore_rho():
    groups = [([1.0, 0.0], [[-1.0, -3.0, -0.1], [-2.0]], None)]
    assert batch(groups, transform_mode="entropy_mask").stats.extra_metrics == {}
    # as in the original, only entropy_mask masks: rho does not touch other transforms
    a = batch(groups, transform_mode="gtpo", surprisal_mask_rho=0.5)
    b = batch(groups, transform_mode="gtpo")
    assert a.stats.extra_metrics == {}
    for x, y in zip(a.advantages[0], b.advantages[0]):
        assert x.tolist() == y.tolist()


@pytest.mark.parametrize("key", ["surprisal_mask_rho", "entropy_mask_rho"])
def test_entropy_mask_rho_from_transform_params(key):
    lp = [[-1.0, -3.0, -0.1], [-2.0]]
    kw = dict(advantage_mode="grpo", transform_mode="entropy_mask")
    a = tok([1, 0], lp, transform_params={key: 0.5}, **kw)
    b = tok([1, 0], lp, surprisal_mask_rho=0.5, **kw)
    c = tok([1, 0], lp, transform_params={key: 0.0}, surprisal_mask_rho=0.5, **kw)
    for x, y in zip(a, b):
        assert x.tolist() == y.tolist()
    assert a[0][0] == 0.0 and c[0][0] != 0.0


@pytest.mark.parametrize("rho", [1.5, -0.1, float("nan"), "0.5", True])
def test_entropy_mask_rho_must_be_in_unit_interval(rho):
    with pytest.raises(ValueError, match="surprisal_mask_rho"):
        AdvantagePipeline(transform_mode="entropy_mask", surprisal_mask_rho=rho)
    with pytest.raises(ValueError, match="surprisal_mask_rho"):
        AdvantagePipeline(transform_params={"surprisal_mask_rho": rho})


@pytest.mark.parametrize("rho", [0.1, 0.3, 0.5, 0.9])
def test_entropy_mask_batch_matches_reference(rho):
    rng = np.random.default_rng(int(rho * 100))
    groups = [_ragged_group(rng, int(rng.integers(1, 7)), 40, p_plan=0.2) for _ in range(10)]
    groups.append(_ragged_group(rng, 3, 1, np.array([1.0, 0.0, 1.0])))  # no tokens at all
    kw = dict(advantage_mode="maxrl", transform_mode="entropy_mask", surprisal_mask_rho=rho)
    fast = batch(groups, **kw)
    taus, fractions = [], []
    for (rewards, lp, plan), got in zip(groups, fast.advantages):
        if got is None:
            continue
        ref = ref_token_advantages(rewards, lp, plan, **kw)
        gtpo = ref_token_advantages(rewards, lp, plan, **{**kw, "surprisal_mask_rho": 0.0})
        h = [ref_uncertainty("surprisal", list(x)) for x in lp]
        _, tau, fraction = ref_surprisal_mask(gtpo, h, rho)
        taus.append(tau)
        fractions.append(fraction)
        for f, r in zip(got, ref):
            np.testing.assert_allclose(f, r, rtol=1e-12, atol=1e-12)
    m = fast.stats.extra_metrics
    assert m["entropy_mask_threshold"] == pytest.approx(float(np.mean(taus)), rel=1e-12)
    assert m["entropy_mask_fraction"] == pytest.approx(float(np.mean(fractions)), rel=1e-12)


def test_new_builtin_transforms_take_a_context_like_plugins():
    ctx = TransformContext(
        episode_advantages_G=np.array([0.5, -0.5]),
        logprobs_G_T=[np.array([-1.0, -3.0, -5.0]), np.array([-2.0])],
        uncertainties_G_T=[np.array([1.0, 3.0, 5.0]), np.array([2.0])],
        planning_G_T=[np.array([False, False, True]), np.array([False])],
        sepa_lambda=0.5,
        surprisal_mask_rho=0.25,
    )
    kw = dict(advantage_mode="grpo", sepa_lambda=0.5)
    lp, plan = [[-1.0, -3.0, -5.0], [-2.0]], [[False, False, True], [False]]
    for fn, mode in (
        (transform_gtpo_sepa_amp, "gtpo_sepa_amp"),
        (transform_gtpo_sepa_amp_c, "gtpo_sepa_amp_c"),
    ):
        got = fn(ctx).token_advantages
        for x, y in zip(got, tok([1, 0], lp, plan, transform_mode=mode, **kw)):
            np.testing.assert_allclose(x, y)
    masked = transform_entropy_mask(ctx)
    assert masked.token_advantages[0][:2].tolist() == [0.0, 0.0]  # k = 1: only h = 5 stays
    assert masked.extra_metrics == {"entropy_mask_threshold": 5.0, "entropy_mask_fraction": 0.75}


@pytest.mark.parametrize(
    "name,pair", [("grpo_none", ("grpo", "none")), ("maxrl_none", ("maxrl", "none"))]
)
def test_none_algorithm_modes(name, pair):
    assert ALGORITHM_MODES.entry(name).alias_of == pair
    out = tok([1, 0, 0, 0], [[-1.0, -2.0], [-0.5], [], [-3.0]], algorithm_mode=name)
    expected = grpo([1, 0, 0, 0]) if pair[0] == "grpo" else maxrl([1, 0, 0, 0])
    assert [a.tolist() for a in out] == [[expected[0]] * 2, [expected[1]], [], [expected[3]]]


# ------------------------------------------------------------------ inputs


def test_lists_and_arrays_give_the_same_result():
    lp = [[-1.0, -2.5, -0.1], [-0.7], [-4.0, -0.01]]
    plan = [[False, True, False], [False], [True, False]]
    a = tok([1, 0, 1], lp, plan, sepa_lambda=0.3)
    b = tok(
        np.array([1.0, 0.0, 1.0]),
        [np.array(x) for x in lp],
        [np.array(p) for p in plan],
        sepa_lambda=0.3,
    )
    for x, y in zip(a, b):
        assert x.dtype == np.float64
        assert x.tolist() == y.tolist()


def test_mismatched_lengths_are_errors():
    with pytest.raises(ValueError, match="2 rewards but 1"):
        tok([1, 0], [[-1.0]])
    with pytest.raises(ValueError, match="planning"):
        tok([1, 0], [[-1.0, -2.0], [-1.0]], [[True], [False]])


def test_nan_logprobs_are_an_error():
    with pytest.raises(ValueError, match="NaN"):
        tok([1, 0], [[-1.0, float("nan")], [-1.0]])


def test_single_group_is_never_skipped():
    out = tok([1, 1], [[-1.0], [-2.0]], advantage_mode="grpo", transform_mode="none")
    assert [a.tolist() for a in out] == [[0.0], [0.0]]


# ------------------------------------------------------------------ batch form


def _ragged_group(rng, g, t_max, rewards=None, p_plan=0.1):
    lens = rng.integers(0, t_max, size=g)
    lp = [-rng.exponential(1.5, size=n) for n in lens]
    plan = [rng.random(n) < p_plan for n in lens]
    if rewards is None:
        rewards = rng.integers(0, 2, size=g).astype(float)
    return rewards, lp, plan


def test_batch_skips_and_counts_uninformative_groups():
    rng = np.random.default_rng(0)
    groups = [
        _ragged_group(rng, 3, 10, np.array([1.0, 1.0, 1.0])),
        _ragged_group(rng, 2, 10, np.array([0.0, 0.0])),
        _ragged_group(rng, 2, 10, np.array([0.5, 0.5])),
        _ragged_group(rng, 4, 10, np.array([1.0, 0.0, 0.0, 1.0])),
        _ragged_group(rng, 1, 10, np.array([1.0])),
    ]
    res = batch(groups)
    assert res.skipped == ["all_correct", "all_wrong", "all_correct", None, "all_correct"]
    assert res.kept == [False, False, False, True, False]
    assert res.stats.skipped_all_correct == 3
    assert res.stats.skipped_all_wrong == 1
    assert res.stats.kept_groups == 1 and res.stats.num_groups == 5
    assert res.advantages[0] is None and len(res.advantages[3]) == 4


def test_batch_negative_equal_rewards_count_as_all_wrong():
    res = batch([([-1.0, -1.0], [[-1.0], [-2.0]], None)])
    assert res.skipped == ["all_wrong"] and res.stats.skipped_all_wrong == 1


def test_batch_without_skipping_keeps_everything():
    res = batch([([1.0, 1.0], [[-1.0], [-2.0]], None)], skip_uninformative=False)
    assert res.kept == [True] and res.stats.kept_groups == 1


def test_batch_stats_match_reference():
    rng = np.random.default_rng(1)
    groups = [_ragged_group(rng, 4, 30, p_plan=0.3) for _ in range(6)]
    groups.append(_ragged_group(rng, 4, 30, np.ones(4), p_plan=0.3))
    res = batch(groups)
    em, ev, pm, pv = ref_exec_plan_stats(groups)
    s = res.stats
    assert s.exec_mean == pytest.approx(em, rel=1e-12)
    assert s.exec_var == pytest.approx(ev, rel=1e-10)
    assert s.plan_mean == pytest.approx(pm, rel=1e-12)
    assert s.plan_var == pytest.approx(pv, rel=1e-10)
    kept = [g for g, k in zip(groups, res.kept) if k]
    assert s.num_planning_tokens == sum(int(p.sum()) for g in kept for p in g[2])
    assert s.num_exec_tokens == sum(int((~p).sum()) for g in kept for p in g[2])


def test_batch_stats_are_nan_without_tokens():
    res = batch([([1.0, 1.0], [[-1.0], [-2.0]], None)])
    assert math.isnan(res.stats.exec_var) and math.isnan(res.stats.plan_mean)
    assert res.stats.num_exec_tokens == 0


def test_batch_lambda_callable_sees_stats_once_and_is_used():
    rng = np.random.default_rng(2)
    groups = [
        _ragged_group(rng, 4, 20, np.array([1.0, 0.0, 0.0, 1.0]), p_plan=0.3) for _ in range(3)
    ]
    seen: list[AdvantageStats] = []

    def lam_fn(stats):
        seen.append(stats)
        return 0.7

    res = batch(groups, sepa_lambda=lam_fn)
    assert len(seen) == 1 and not math.isnan(seen[0].exec_var)
    assert res.stats.sepa_lambda == 0.7
    fixed = batch(groups, sepa_lambda=0.7)
    zero = batch(groups, sepa_lambda=0.0)
    for a, b, c in zip(res.advantages, fixed.advantages, zero.advantages):
        for x, y in zip(a, b):
            assert x.tolist() == y.tolist()
        assert any(x.tolist() != z.tolist() for x, z in zip(a, c) if x.size > 1)


def test_batch_takes_token_groups_of_lists_or_arrays_and_nothing_else():
    lp = [[-1.0, -2.0], [-3.0]]
    pipeline = AdvantagePipeline()
    a = pipeline([TokenGroup([1, 0], lp)])
    b = pipeline([TokenGroup(np.array([1.0, 0.0]), [np.array(x) for x in lp])])
    for x, y in zip(a.advantages[0], b.advantages[0]):
        assert x.dtype == np.float64 and x.tolist() == y.tolist()
    with pytest.raises(TypeError, match="group 1: expected a retrain.types.TokenGroup"):
        pipeline([TokenGroup([1, 0], lp), ([1, 0], lp)])
    with pytest.raises(ValueError, match="group 0: 2 rewards but 1 logprob"):
        pipeline([TokenGroup([1, 0], lp[:1])])
    with pytest.raises(ValueError, match="group 0: completion 1 has 1 logprobs but 2 entropies"):
        pipeline([TokenGroup([1, 0], lp, entropies_G_T=[[1.0, 2.0], [1.0, 2.0]])])
    with pytest.raises(ValueError, match="rewards must be finite"):
        pipeline([TokenGroup([1, float("nan")], lp)])


def test_a_pipeline_is_reused_across_calls_with_identical_results():
    rng = np.random.default_rng(11)
    groups = [
        _ragged_group(rng, 4, 40, np.array([1.0, 0.0, 1.0, 0.0]), p_plan=0.2) for _ in range(3)
    ]
    pipeline = AdvantagePipeline(transform_mode="gtpo_hicra")
    first = pipeline([TokenGroup(*g) for g in groups], sepa_lambda=0.4)
    other = pipeline([TokenGroup(*g) for g in groups[:1]], sepa_lambda=0.9)  # different sizes
    again = pipeline([TokenGroup(*g) for g in groups], sepa_lambda=0.4)
    assert other.stats.kept_groups == 1
    assert first.stats.as_dict() == again.stats.as_dict()
    for fg, ag in zip(first.advantages, again.advantages):
        for x, y in zip(fg, ag):
            assert x.tolist() == y.tolist()


def test_stats_to_metrics_uses_logged_names():
    res = batch([([1, 0], [[-1.0, -2.0], [-3.0]], [[True, False], [False]])], sepa_lambda=0.25)
    m = res.stats.to_metrics()
    for key in (
        "exec_entropy_mean",
        "exec_entropy_var",
        "plan_entropy_mean",
        "plan_entropy_var",
        "sepa_lambda",
        "skipped_all_correct",
        "skipped_all_wrong",
    ):
        assert key in m
    assert m["plan_entropy_mean"] == 1.0 and m["sepa_lambda"] == 0.25
    json.dumps(res.stats.as_dict())


# ------------------------------------------------------------------ reference agreement


@pytest.mark.parametrize("adv_mode,tr_mode", CONDITIONS)
@pytest.mark.parametrize("kind", ["surprisal", "predictive_variance", "shannon_entropy"])
def test_fast_path_matches_reference_on_random_ragged_groups(adv_mode, tr_mode, kind):
    rng = np.random.default_rng(zlib.crc32(f"{adv_mode}/{tr_mode}/{kind}".encode()))
    for _ in range(15):
        g = int(rng.integers(1, 9))
        rewards, lp, plan = _ragged_group(rng, g, 60, p_plan=rng.random() * 0.5)
        if rng.random() < 0.2:
            lp = [np.where(rng.random(x.size) < 0.05, -80.0, x) for x in lp]  # hit the cap
        ent = [rng.exponential(2.0, size=x.size) for x in lp] if kind == "shannon_entropy" else None
        kw = dict(
            advantage_mode=adv_mode,
            transform_mode=tr_mode,
            gtpo_beta=float(rng.choice([0.0, 0.1, 0.7, 3.0])),
            hicra_alpha=float(rng.choice([0.0, 0.2, 1.0])),
            sepa_lambda=float(rng.choice([0.0, 0.35, 1.0, rng.random()])),
            uncertainty_kind=kind,
            entropies_G_T=ent,
            surprisal_mask_rho=float(rng.choice([0.0, 0.2, 0.5, 1.0, rng.random()])),
        )
        fast = compute_token_advantages(rewards, lp, plan, **kw)
        ref = ref_token_advantages(rewards, lp, plan, **kw)
        assert len(fast) == len(ref)
        for f, r in zip(fast, ref):
            np.testing.assert_allclose(f, r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("adv_mode,tr_mode", CONDITIONS[:5])
def test_batch_path_matches_reference(adv_mode, tr_mode):
    rng = np.random.default_rng(7)
    groups = []
    for _ in range(12):
        g = int(rng.integers(1, 7))
        r = rng.integers(0, 2, size=g).astype(float)
        groups.append(_ragged_group(rng, g, 80, rewards=r, p_plan=0.2))
    kw = dict(advantage_mode=adv_mode, transform_mode=tr_mode, sepa_lambda=0.6)
    fast = batch(groups, **kw)
    ref = ref_batch_advantages(groups, **kw)
    assert [a is None for a in fast.advantages] == [a is None for a in ref]
    assert any(a is None for a in ref) and any(a is not None for a in ref)
    for fg, rg in zip(fast.advantages, ref):
        if rg is None:
            continue
        for f, r in zip(fg, rg):
            np.testing.assert_allclose(f, r, rtol=1e-9, atol=1e-9)


def test_segments_handle_empty_completions():
    seg = Segments.from_lengths([0, 3, 0, 2, 0])
    x = np.arange(5, dtype=float)
    assert seg.sum(x).tolist() == [0.0, 3.0, 0.0, 7.0, 0.0]
    assert [p.tolist() for p in seg.split(x)] == [[], [0, 1, 2], [], [3, 4], []]


# ------------------------------------------------------------------ algorithm mode / registry


@pytest.mark.parametrize(
    "name,pair",
    [
        ("maxrl_gtpo", ("maxrl", "gtpo")),
        ("maxrl_gtpo_hicra", ("maxrl", "gtpo_hicra")),
        ("maxrl_gtpo_sepa", ("maxrl", "gtpo_sepa")),
    ],
)
def test_builtin_algorithm_modes_equal_their_pairs(name, pair):
    lp = [[-1.0, -3.0, -0.2], [-2.0, -0.1]]
    plan = [[True, False, False], [False, True]]
    a = tok(
        [1, 0],
        lp,
        plan,
        algorithm_mode=name,
        advantage_mode="grpo",
        transform_mode="none",
        sepa_lambda=0.5,
    )
    b = tok([1, 0], lp, plan, advantage_mode=pair[0], transform_mode=pair[1], sepa_lambda=0.5)
    for x, y in zip(a, b):
        assert x.tolist() == y.tolist()


@pytest.mark.parametrize("name", ALGORITHM_MODES.names())
def test_algorithm_alias_batch_is_exactly_its_pair(name):
    pair = ALGORITHM_MODES.entry(name).alias_of
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    groups = [TokenGroup(*_ragged_group(rng, 5, 50, p_plan=0.3)) for _ in range(8)]
    alias = AdvantagePipeline(algorithm_mode=name, advantage_mode="grpo", transform_mode="none")
    plain = AdvantagePipeline(advantage_mode=pair[0], transform_mode=pair[1])
    assert (alias.advantage_mode, alias.transform_mode) == pair
    a = alias(groups, sepa_lambda=lambda stats: 0.6, step=3)
    b = plain(groups, sepa_lambda=lambda stats: 0.6, step=3)
    assert a.skipped == b.skipped and a.stats.as_dict() == b.stats.as_dict()
    for ag, bg in zip(a.advantages, b.advantages):
        assert (ag is None) == (bg is None)
        for x, y in zip(ag or [], bg or []):
            assert x.tolist() == y.tolist()


def test_every_registry_target_of_this_package_resolves():
    for reg in (
        ADVANTAGE_MODES,
        TRANSFORM_MODES,
        ALGORITHM_MODES,
        UNCERTAINTY_KINDS,
        PLANNING_DETECTORS,
    ):
        for name in reg.names(available_only=True):
            entry = reg.entry(name)
            if entry.alias_of:  # algorithm aliases have no target of their own
                advantage, transform = entry.alias_of
                assert ADVANTAGE_MODES.is_builtin(advantage) and TRANSFORM_MODES.is_builtin(
                    transform
                )
                continue
            assert callable(reg.resolve(name)), (reg.kind, name)
            if entry.grouped:
                from retrain.registry import import_object

                assert callable(import_object(entry.grouped)), (reg.kind, name)
            if reg is TRANSFORM_MODES:
                assert entry.kernel, name
    for alias in UNCERTAINTY_KINDS.entry("predictive_variance").aliases:
        assert UNCERTAINTY_KINDS.resolve(alias) is UNCERTAINTY_KINDS.resolve("predictive_variance")


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(advantage_mode="grpo", transform_mode="none"), False),
        (dict(advantage_mode="maxrl", transform_mode="none"), False),
        (dict(transform_mode="gtpo"), True),
        (dict(transform_mode="gtpo_hicra"), True),
        (dict(transform_mode="gtpo_sepa"), True),
        (dict(transform_mode="gtpo_sepa_amp"), True),
        (dict(transform_mode="gtpo_sepa_amp_c"), True),
        (dict(transform_mode="entropy_mask"), True),
        (dict(algorithm_mode="maxrl_gtpo_sepa", transform_mode="none"), True),
        (dict(algorithm_mode="grpo_none", transform_mode="gtpo"), False),
        (dict(algorithm_mode="maxrl_none", transform_mode="gtpo"), False),
        (dict(algorithm_mode="maxrl_gtpo", transform_mode="none"), True),
    ],
)
def test_varies_per_token_of_builtins_comes_from_the_registry(kw, expected, monkeypatch):
    pipeline = AdvantagePipeline(**kw)

    def no_probe():
        raise AssertionError("built-in flows are not probed")

    monkeypatch.setattr(pipeline, "_probe", no_probe)
    assert pipeline.varies_per_token() is expected
    transform = (
        ALGORITHM_MODES.entry(kw["algorithm_mode"]).alias_of[1]
        if "algorithm_mode" in kw
        else kw["transform_mode"]
    )
    assert TRANSFORM_MODES.entry(transform).token_varying is expected


def test_needs_entropies():
    assert AdvantagePipeline(uncertainty_kind="shannon_entropy").needs_entropies
    assert not AdvantagePipeline(uncertainty_kind="pred_var").needs_entropies
    assert not AdvantagePipeline().needs_entropies


def test_builtin_pipeline_resolves_at_construction_only(monkeypatch, import_counts):
    imports, invalidations = import_counts["imports"], import_counts["invalidations"]
    pipeline = AdvantagePipeline(advantage_mode="grpo", uncertainty_kind="pred_var")
    assert imports and "retrain.advantages.episode:grpo_grouped" in imports
    built = (len(imports), len(invalidations))
    rng = np.random.default_rng(5)
    for step in range(4):
        groups = [TokenGroup(*_ragged_group(rng, 4, 20)) for _ in range(3)]
        pipeline(groups, sepa_lambda=0.5, step=step)
    assert (len(imports), len(invalidations)) == built


def test_bad_names_fail_at_construction():
    from retrain.errors import PluginError

    for kw in (
        dict(advantage_mode="maxrll"),
        dict(transform_mode="gtpo_sepaa"),
        dict(algorithm_mode="maxrl_gtpoo"),
        dict(uncertainty_kind="surprisall"),
    ):
        with pytest.raises(PluginError, match="did you mean"):
            AdvantagePipeline(**kw)


def test_unknown_mode_lists_valid_names():
    from retrain.errors import PluginError

    with pytest.raises(PluginError, match="gtpo_sepa"):
        tok([1, 0], [[-1.0], [-1.0]], transform_mode="gtpo_sepaa")


def test_top_level_exports():
    import retrain
    import retrain.advantages as adv

    # both façades serve the same classes: retrain's own, with the original API's names
    assert retrain.TransformContext is adv.TransformContext
    assert retrain.TransformOutput is adv.TransformOutput
    assert issubclass(adv.TransformContext, TransformContext)
    assert issubclass(adv.TransformOutput, TransformOutput)


def test_modules_are_pure():
    code = (
        "import sys, retrain.advantages, retrain.sepa\n"
        "bad = [m for m in ('torch', 'retrain.config', 'sentence_transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
