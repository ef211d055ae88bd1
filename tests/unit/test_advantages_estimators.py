"""The peers' advantage estimators: grpo_std, rloo, reinforce_pp, reinforce_pp_baseline,
opo (remax is not built: see the manual).

Hand-worked cases, agreement with the plain references in reference_advantages.py on
seeded random inputs (per group, batched, and through the pipeline), the batch-wide
statistics of the REINFORCE++ modes and their interaction with skipped groups, the
parameter checks, the registry entries and the algorithm aliases. The hypothesis
invariants are in test_advantages_properties.py.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_advantages import (  # noqa: E402
    BATCH_MODES,
    PER_GROUP_MODES,
    ref_batch_advantages,
    ref_episode_batch,
    ref_token_advantages,
)

from retrain.advantages import AdvantagePipeline, compute_token_advantages, grpo  # noqa: E402
from retrain.advantages.episode import (  # noqa: E402
    MAXRL_EPS,
    PARAMS,
    check_params,
    grpo_grouped,
    grpo_std,
    grpo_std_grouped,
    opo,
    opo_grouped,
    reinforce_pp,
    reinforce_pp_baseline,
    reinforce_pp_baseline_grouped,
    reinforce_pp_grouped,
    rloo,
    rloo_grouped,
)
from retrain.cli.main import main  # noqa: E402
from retrain.errors import ConfigError  # noqa: E402
from retrain.registry import ADVANTAGE_MODES, ALGORITHM_MODES, import_object  # noqa: E402
from retrain.types import TokenGroup  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NEW_MODES = ("grpo_std", "rloo", "reinforce_pp", "reinforce_pp_baseline")
ALL_MODES = ("grpo", "maxrl", *NEW_MODES)
PER_GROUP = {"grpo_std": grpo_std, "rloo": rloo}
GROUPED = {
    "grpo_std": grpo_std_grouped,
    "rloo": rloo_grouped,
    "reinforce_pp": reinforce_pp_grouped,
    "reinforce_pp_baseline": reinforce_pp_baseline_grouped,
}


def _group(rng, rewards, t_max=30, p_plan=0.2):
    lens = rng.integers(0, t_max, size=len(rewards))
    lp = [-rng.exponential(1.5, size=n) for n in lens]
    plan = [rng.random(n) < p_plan for n in lens]
    return TokenGroup(np.asarray(rewards, dtype=float), lp, plan)


def _flat(groups_rewards):
    return (
        np.array([r for g in groups_rewards for r in g], dtype=float),
        np.array([len(g) for g in groups_rewards], dtype=np.int64),
    )


def _episode(result):
    """The per-completion advantage of each kept group, from a `none`-transform batch
    (every token of a completion carries its episode advantage)."""
    out = []
    for group in result.advantages:
        if group is not None:
            out.append([float(x[0]) if x.size else math.nan for x in group])
    return out


# ------------------------------------------------------------------ hand-worked


def test_grpo_is_unchanged_dr_grpo():
    np.testing.assert_allclose(grpo([10.0, 0.0]), [5.0, -5.0])  # no std scale
    assert "Dr. GRPO" in ADVANTAGE_MODES.entry("grpo").description


def test_grpo_std_hand_worked():
    # mean 0.25; sample variance (0.5625 + 3 * 0.0625) / 3 = 0.25, so std 0.5
    np.testing.assert_allclose(
        grpo_std([1, 0, 0, 0]), [0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3, rtol=1e-15
    )
    # two completions: sample std |a - b| / sqrt(2)
    s = 2.0 / math.sqrt(2.0)
    np.testing.assert_allclose(grpo_std([3.0, 1.0]), [1 / (s + 1e-6), -1 / (s + 1e-6)])
    # TRL's epsilon
    np.testing.assert_allclose(grpo_std([1, 0, 0, 0], {"eps": 1e-4})[0], 0.75 / 0.5001)


def test_grpo_std_uses_the_sample_std_not_the_population_one():
    r = np.array([1.0, 0.0, 1.0, 0.0, 0.0])
    got = grpo_std(r, {"eps": 1e-300})
    np.testing.assert_allclose(got, (r - r.mean()) / r.std(ddof=1), rtol=1e-14)
    assert not np.allclose(got, (r - r.mean()) / r.std(ddof=0))


def test_rloo_hand_worked():
    # [1, 0, 0, 0]: the others' mean is 0 for the first, 1/3 for the rest
    np.testing.assert_allclose(rloo([1, 0, 0, 0]), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-15)
    np.testing.assert_allclose(rloo([3.0, 1.0]), [2.0, -2.0])
    np.testing.assert_allclose(rloo([2.0, 4.0, 9.0]), [2 - 6.5, 4 - 5.5, 9 - 3.0])


def test_group_of_one_gets_zero_under_every_builtin():
    for mode in ALL_MODES:
        fn = ADVANTAGE_MODES.resolve(mode)
        assert fn([0.7]).tolist() == [0.0], mode
        assert fn([]).tolist() == [], mode


def test_equal_rewards_centre_to_exactly_zero():
    """0.1 + 0.1 + 0.1 = 0.30000000000000004: a plain mean would leave a residue of
    1e-17 that the std scale (with a tiny eps) would blow up to +-1."""
    tiny = {"eps": 1e-300}
    for fn in (grpo_std, reinforce_pp, reinforce_pp_baseline):
        assert fn([0.1, 0.1, 0.1], tiny).tolist() == [0.0, 0.0, 0.0]
    assert rloo([0.1, 0.1, 0.1]).tolist() == [0.0, 0.0, 0.0]
    got = grpo_std_grouped(np.array([0.1, 0.1, 0.1, 1.0, 0.0]), np.array([3, 2]), tiny)
    np.testing.assert_allclose(got, [0, 0, 0, 1 / math.sqrt(2), -1 / math.sqrt(2)], atol=1e-15)


# Two kept groups, [1, 0] and [1, 1, 1, 0]:
#   reinforce_pp: batch mean 2/3, centred 1/3 or -2/3, sample variance (4/3) / 5 = 4/15
#   reinforce_pp_baseline: centred per group [0.5, -0.5] and [0.25, 0.25, 0.25, -0.75],
#   batch mean 0, sample variance 1.25 / 5 = 0.25
KEPT = [[1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
PP = [[1 / 3, -2 / 3], [1 / 3, 1 / 3, 1 / 3, -2 / 3]]
PP_BASELINE = [[1.0, -1.0], [0.5, 0.5, 0.5, -1.5]]


@pytest.mark.parametrize(
    "mode,expected,var",
    [
        ("reinforce_pp", [x for g in PP for x in g], 4 / 15),
        ("reinforce_pp_baseline", [x * 0.5 for g in PP_BASELINE for x in g], 0.25),
    ],
)
def test_reinforce_pp_hand_worked(mode, expected, var):
    rewards, sizes = _flat(KEPT)
    got = GROUPED[mode](rewards, sizes)
    np.testing.assert_allclose(got, np.array(expected) / math.sqrt(var + 1e-8), rtol=1e-14)
    if mode == "reinforce_pp_baseline":
        np.testing.assert_allclose(got, PP_BASELINE[0] + PP_BASELINE[1], rtol=1e-7)


@pytest.mark.parametrize("mode", ["reinforce_pp", "reinforce_pp_baseline"])
def test_skipped_groups_do_not_enter_the_batch_statistics(mode):
    """All-equal groups are skipped before the advantages: the kept groups get exactly
    what the batched form gives for the kept groups alone, wherever the skipped groups
    sit in the step, and the hand-worked numbers above."""
    rng = np.random.default_rng(3)
    groups = [
        _group(rng, [1.0, 1.0, 1.0]),  # all correct: skipped
        _group(rng, KEPT[0]),
        _group(rng, [0.0, 0.0, 0.0, 0.0]),  # all wrong: skipped
        _group(rng, KEPT[1]),
        _group(rng, [1.0]),  # a group of one: skipped
    ]
    res = AdvantagePipeline(advantage_mode=mode, transform_mode="none")(groups)
    assert res.kept == [False, True, False, True, False]
    alone = GROUPED[mode](*_flat(KEPT))
    kept_only = AdvantagePipeline(advantage_mode=mode, transform_mode="none")(
        [groups[1], groups[3]]
    )
    for got in (_episode(res), _episode(kept_only)):
        for g, want in zip(got, np.split(alone, [2])):
            ok = [not math.isnan(x) for x in g]
            np.testing.assert_array_equal(np.array(g)[ok], want[ok])
    # kept in the statistics (no skipping), the same completions would get other values
    everything = AdvantagePipeline(
        advantage_mode=mode, transform_mode="none", skip_uninformative=False
    )(groups)
    assert _episode(everything)[1] != _episode(res)[0]


def test_reinforce_pp_baseline_is_dr_grpo_over_one_batch_wide_std():
    """Every group's centred rewards sum to 0, so the batch mean is 0 and the baseline
    form is grpo divided by one number for the whole step."""
    rng = np.random.default_rng(11)
    groups = [rng.integers(0, 2, size=int(rng.integers(2, 9))).astype(float) for _ in range(9)]
    rewards, sizes = _flat(groups)
    a = grpo_grouped(rewards, sizes)
    expected = a / math.sqrt(a.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(reinforce_pp_baseline_grouped(rewards, sizes), expected, atol=1e-12)


# ------------------------------------------------------------------ references, random inputs


@pytest.mark.parametrize("mode", [*PER_GROUP_MODES, *BATCH_MODES])
def test_batched_forms_match_the_reference_on_random_groups(mode):
    rng = np.random.default_rng(zlib.crc32(mode.encode()))
    for _ in range(40):
        n = int(rng.integers(1, 12))
        groups = []
        for _ in range(n):
            g = int(rng.integers(1, 10))
            if rng.random() < 0.5:
                groups.append(rng.integers(0, 2, size=g).astype(float).tolist())
            else:
                groups.append(rng.normal(0.0, rng.choice([0.01, 1.0, 50.0]), size=g).tolist())
        rewards, sizes = _flat(groups)
        grouped = import_object(ADVANTAGE_MODES.entry(mode).grouped)
        got = grouped(rewards, sizes, {})
        want = np.concatenate([np.array(g, dtype=float) for g in ref_episode_batch(mode, groups)])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", NEW_MODES)
def test_per_group_functions_match_the_reference(mode):
    rng = np.random.default_rng(zlib.crc32(b"one/" + mode.encode()))
    fn = ADVANTAGE_MODES.resolve(mode)
    for _ in range(60):
        r = rng.normal(0.0, 3.0, size=int(rng.integers(1, 17)))
        want = ref_episode_batch(mode, [r.tolist()])[0]
        np.testing.assert_allclose(fn(r), want, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(fn(r.tolist()), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["grpo_std", "rloo"])
def test_per_group_modes_grouped_equal_per_group_calls(mode):
    rng = np.random.default_rng(5)
    groups = [rng.normal(size=int(rng.integers(1, 9))) for _ in range(20)]
    rewards, sizes = _flat(groups)
    expected = np.concatenate([PER_GROUP[mode](g) for g in groups])
    assert GROUPED[mode](rewards, sizes).tolist() == expected.tolist()


@pytest.mark.parametrize("mode", NEW_MODES)
@pytest.mark.parametrize("transform", ["none", "gtpo", "gtpo_hicra", "gtpo_sepa", "entropy_mask"])
def test_pipeline_batch_matches_the_reference(mode, transform):
    rng = np.random.default_rng(zlib.crc32(f"{mode}/{transform}".encode()))
    groups = []
    for _ in range(14):
        g = int(rng.integers(1, 8))
        r = rng.integers(0, 2, size=g).astype(float)
        if rng.random() < 0.3:
            r = np.round(rng.normal(size=g), 2)
        groups.append(_group(rng, r, t_max=60, p_plan=0.25))
    kw = dict(
        advantage_mode=mode,
        transform_mode=transform,
        gtpo_beta=0.4,
        hicra_alpha=0.3,
        surprisal_mask_rho=0.3,
    )
    fast = AdvantagePipeline(**kw)(groups, sepa_lambda=0.6)
    as_tuples = [(g.rewards_G.tolist(), g.logprobs_G_T, g.planning_G_T) for g in groups]
    ref = ref_batch_advantages(as_tuples, sepa_lambda=0.6, **kw)
    assert [a is None for a in fast.advantages] == [a is None for a in ref]
    assert any(a is None for a in ref) and sum(a is not None for a in ref) >= 2
    for fg, rg in zip(fast.advantages, ref):
        for f, r in zip(fg or [], rg or []):
            np.testing.assert_allclose(f, r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", NEW_MODES)
def test_one_group_token_advantages_match_the_reference(mode):
    rng = np.random.default_rng(zlib.crc32(b"tok/" + mode.encode()))
    for _ in range(20):
        g = _group(rng, rng.normal(size=int(rng.integers(1, 9))), t_max=40)
        kw = dict(advantage_mode=mode, transform_mode="gtpo_sepa", sepa_lambda=0.3)
        fast = compute_token_advantages(g.rewards_G, g.logprobs_G_T, g.planning_G_T, **kw)
        ref = ref_token_advantages(g.rewards_G, g.logprobs_G_T, g.planning_G_T, **kw)
        for f, r in zip(fast, ref):
            np.testing.assert_allclose(f, r, rtol=1e-9, atol=1e-9)


def test_a_step_of_128_completions_of_10k_tokens_runs_batched():
    """The batched forms are vectorised: one pipeline call over a large step."""
    rng = np.random.default_rng(0)
    groups = [
        TokenGroup(
            rng.integers(0, 2, size=16).astype(float),
            [-rng.exponential(1.0, size=10_000) for _ in range(16)],
            None,
        )
        for _ in range(8)
    ]
    res = AdvantagePipeline(advantage_mode="reinforce_pp_baseline", transform_mode="gtpo")(groups)
    flat = np.concatenate([x for g in res.advantages if g is not None for x in g])
    assert flat.size == 10_000 * 16 * res.stats.kept_groups and np.isfinite(flat).all()


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize("mode", NEW_MODES)
def test_unknown_advantage_param_names_the_key_and_the_fix(mode):
    with pytest.raises(ConfigError, match=r"\[algorithm.advantage_params\] epsilon.*Fix:"):
        ADVANTAGE_MODES.resolve(mode)([1.0, 0.0], {"epsilon": 1e-3})
    with pytest.raises(ConfigError, match=r"\[algorithm.advantage_params\] epsilon"):
        AdvantagePipeline(advantage_mode=mode, advantage_params={"epsilon": 1e-3})


def test_rloo_takes_no_eps():
    with pytest.raises(ConfigError, match="does not read 'eps' \\(it reads no parameters\\)"):
        AdvantagePipeline(advantage_mode="rloo", advantage_params={"eps": 1e-6})


@pytest.mark.parametrize("value", [0, -1e-6, float("nan"), float("inf"), "1e-6", True])
@pytest.mark.parametrize("mode", ["grpo_std", "reinforce_pp", "reinforce_pp_baseline"])
def test_eps_must_be_a_positive_number(mode, value):
    with pytest.raises(ConfigError, match=r"\[algorithm.advantage_params\] eps: must be"):
        AdvantagePipeline(advantage_mode=mode, advantage_params={"eps": value})


def test_params_are_checked_at_construction_through_algorithm_aliases_too():
    with pytest.raises(ConfigError, match="epsilon"):
        AdvantagePipeline(algorithm_mode="grpo_std_none", advantage_params={"epsilon": 1.0})
    with pytest.raises(ConfigError, match="epsilon"):
        AdvantagePipeline(advantage_mode="reinforce_plus_plus", advantage_params={"epsilon": 1})


def test_grpo_and_maxrl_params_are_checked_like_the_others():
    """A typo, a key grpo does not read, or a non-positive eps is refused, not ignored."""
    AdvantagePipeline(advantage_mode="maxrl", advantage_params={"eps": 1e-3})
    for mode, params, said in (
        ("grpo", {"normalize_std": True}, "normalize_std"),
        ("maxrl", {"epsilon": 1e-3}, "epsilon"),
        ("maxrl", {"eps": -0.5}, "eps"),
        ("maxrl", {"eps": "x"}, "eps"),
    ):
        with pytest.raises(ConfigError, match=said):
            AdvantagePipeline(advantage_mode=mode, advantage_params=params)
    assert check_params("maxrl", {}) == {"eps": MAXRL_EPS}
    assert set(PARAMS) == {*NEW_MODES, "opo", "grpo", "maxrl"}


def test_eps_param_reaches_the_batched_form():
    groups = [TokenGroup(np.array(r), [np.zeros(1)] * len(r), None) for r in KEPT]
    for eps in (1e-8, 0.5):
        res = AdvantagePipeline(
            advantage_mode="reinforce_pp_baseline",
            transform_mode="none",
            advantage_params={"eps": eps},
        )(groups)
        want = np.array(PP_BASELINE[0] + PP_BASELINE[1]) * 0.5 / math.sqrt(0.25 + eps)
        np.testing.assert_allclose(np.concatenate(_episode(res)), want, rtol=1e-14)


# ------------------------------------------------------------------ registry and CLI


def test_registry_entries_and_aliases():
    for mode in NEW_MODES:
        entry = ADVANTAGE_MODES.entry(mode)
        assert entry is not None and entry.available and entry.grouped
        assert callable(ADVANTAGE_MODES.resolve(mode))
    assert ADVANTAGE_MODES.canonical("reinforce_plus_plus") == "reinforce_pp"
    assert ADVANTAGE_MODES.canonical("reinforce_plus_plus_baseline") == "reinforce_pp_baseline"
    assert ADVANTAGE_MODES.resolve("reinforce_plus_plus") is reinforce_pp
    assert ADVANTAGE_MODES.resolve("reinforce_plus_plus_baseline") is reinforce_pp_baseline
    opo_entry = ADVANTAGE_MODES.entry("opo")
    assert opo_entry.available and opo_entry.grouped and opo_entry.reads_lengths
    assert not any(ADVANTAGE_MODES.entry(m).reads_lengths for m in ALL_MODES)
    assert ADVANTAGE_MODES.entry("remax") is None  # not built, no name (see the manual)


@pytest.mark.parametrize("mode", NEW_MODES)
def test_none_algorithm_alias_of_every_new_mode(mode):
    entry = ALGORITHM_MODES.entry(f"{mode}_none")
    assert entry is not None and entry.alias_of == (mode, "none")
    pipeline = AdvantagePipeline(algorithm_mode=f"{mode}_none", transform_mode="gtpo")
    assert (pipeline.advantage_mode, pipeline.transform_mode) == (mode, "none")
    assert pipeline.varies_per_token() is False


def test_explain_and_plugins_know_the_new_modes(capsys):
    toml = str(REPO / "retrain/config/templates/quickstart.toml")
    for flags, label in (
        (["--advantage-mode", "reinforce_pp_baseline", "--transform-mode", "none"], None),
        (["--algorithm-mode", "rloo_none"], "rloo_none"),
    ):
        code = main(["explain", toml, "--json", *flags])
        report = json.loads(capsys.readouterr().out)
        assert code == 0
        assert report["condition"] == (label or "reinforce_pp_baseline+none")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in (*NEW_MODES, *(f"{m}_none" for m in NEW_MODES)):
        assert f"  {name} " in out


def test_manual_documents_the_new_modes(capsys):
    assert main(["man", "--topic", "advantages"]) == 0
    out = capsys.readouterr().out
    for name in (*NEW_MODES, *(f"{m}_none" for m in NEW_MODES), "remax", "opo", "opo_none"):
        assert f"`{name}`" in out, name


# ------------------------------------------------------------------ opo


def test_opo_hand_worked():
    """Rewards 1, 0, 0 with 1, 3 and 4 trained tokens: b = (1 x 1) / 8 = 1/8, so
    A = 7/8, -1/8, -1/8 (grpo's mean 1/3 would give 2/3, -1/3, -1/3): a long completion
    weighs more in the baseline."""
    np.testing.assert_allclose(opo([1.0, 0.0, 0.0], lengths=[1, 3, 4]), [7 / 8, -1 / 8, -1 / 8])
    # equal lengths: grpo
    np.testing.assert_allclose(opo([3.0, 1.0, 2.0], lengths=[5, 5, 5]), grpo([3.0, 1.0, 2.0]))
    # a group none of whose completions has a trained token: equal weights
    np.testing.assert_allclose(opo([1.0, 0.0], lengths=[0, 0]), [0.5, -0.5])
    # equal rewards: exactly 0, whatever the lengths
    assert opo([0.1, 0.1, 0.1], lengths=[1, 7, 2]).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="one length >= 0 per completion"):
        opo([1.0, 0.0], lengths=[3])


def test_opo_batched_matches_the_reference_on_random_groups():
    rng = np.random.default_rng(29)
    for _ in range(40):
        groups = [
            rng.normal(0.0, 2.0, size=int(rng.integers(1, 9))).tolist()
            for _ in range(int(rng.integers(1, 10)))
        ]
        lengths = [rng.integers(0, 50, size=len(g)).tolist() for g in groups]
        rewards, sizes = _flat(groups)
        got = opo_grouped(rewards, sizes, {}, lengths=np.concatenate(lengths))
        want = np.concatenate(ref_episode_batch("opo", groups, lengths))
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
        per_group = np.concatenate([opo(g, lengths=n) for g, n in zip(groups, lengths)])
        np.testing.assert_allclose(got, per_group, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transform", ["none", "gtpo", "gtpo_hicra", "gtpo_sepa"])
def test_opo_through_the_pipeline_reads_each_completions_tokens(transform):
    """The pipeline hands opo the size of each completion's logprobs (the tokens it is
    trained on): the plain reference, fed the same lengths, agrees."""
    rng = np.random.default_rng(zlib.crc32(f"opo/{transform}".encode()))
    groups = [_group(rng, rng.integers(0, 2, size=6).astype(float), t_max=60) for _ in range(10)]
    kw = dict(advantage_mode="opo", transform_mode=transform, gtpo_beta=0.4, hicra_alpha=0.3)
    fast = AdvantagePipeline(**kw)(groups, sepa_lambda=0.6)
    as_tuples = [(g.rewards_G.tolist(), g.logprobs_G_T, g.planning_G_T) for g in groups]
    ref = ref_batch_advantages(as_tuples, sepa_lambda=0.6, **kw)
    assert [a is None for a in fast.advantages] == [a is None for a in ref]
    for fg, rg in zip(fast.advantages, ref):
        for f, r in zip(fg or [], rg or []):
            np.testing.assert_allclose(f, r, rtol=1e-9, atol=1e-9)
    one = compute_token_advantages(
        groups[0].rewards_G, groups[0].logprobs_G_T, None, advantage_mode="opo",
        transform_mode="none",
    )  # fmt: skip
    want = opo(groups[0].rewards_G, lengths=[x.size for x in groups[0].logprobs_G_T])
    for tokens, a in zip(one, want):
        np.testing.assert_allclose(tokens, np.full(tokens.size, a))


def test_opo_takes_no_parameters():
    with pytest.raises(ConfigError, match="does not read 'eps' \\(it reads no parameters\\)"):
        AdvantagePipeline(advantage_mode="opo", advantage_params={"eps": 1e-6})
    entry = ALGORITHM_MODES.entry("opo_none")
    assert entry is not None and entry.alias_of == ("opo", "none")
