"""Dotted-path plugins for advantage_mode, transform_mode, algorithm_mode and
uncertainty_kind: calling conventions, contexts, and validation of their output."""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest

from retrain.advantages import (
    AdvantagePipeline,
    AlgorithmContext,
    TransformContext,
    TransformOutput,
    compute_token_advantages,
)
from retrain.errors import PluginError
from retrain.types import TokenGroup

PLUGIN_SOURCE = """
import math
import numpy as np
from retrain import TransformOutput

CALLS = []

def adv_one(rewards):
    CALLS.append(("adv_one", type(rewards).__name__))
    return [r * 2.0 for r in rewards]

def adv_two(rewards, params):
    CALLS.append(("adv_two", dict(params)))
    return [r * params.get("scale", 1.0) for r in rewards]

def adv_short(rewards):
    return [0.0]

def adv_nan(rewards):
    return [math.nan] * len(rewards)

def adv_raises(rewards):
    raise RuntimeError("boom")

def tr_scale(ctx):
    CALLS.append(("tr_scale", ctx.step, ctx.sepa_lambda, dict(ctx.params),
                  [u.tolist() for u in ctx.uncertainties_G_T],
                  [p.tolist() for p in ctx.planning_G_T]))
    k = ctx.params.get("k", 1.0)
    return TransformOutput(
        [np.full(len(lp), a * k) for a, lp in zip(ctx.episode_advantages_G, ctx.logprobs_G_T)],
        extra_metrics={"k_used": k, "n": float(ctx.num_completions)},
    )

def tr_by_h(ctx):
    return [a * h for a, h in zip(ctx.episode_advantages_G, ctx.uncertainties_G_T)]

def tr_list(ctx):
    return [np.zeros(len(lp)) for lp in ctx.logprobs_G_T]

def tr_too_few(ctx):
    return TransformOutput([np.zeros(len(lp)) for lp in ctx.logprobs_G_T][:-1])

def tr_wrong_len(ctx):
    return TransformOutput([np.zeros(len(lp) + 1) for lp in ctx.logprobs_G_T])

def tr_nan(ctx):
    return TransformOutput([np.full(len(lp), np.nan) for lp in ctx.logprobs_G_T])

def tr_dict(ctx):
    return {"token_advantages": []}

def algo(ctx):
    CALLS.append(("algo", ctx.rewards_G.tolist(), dict(ctx.advantage_params), dict(ctx.params)))
    return [np.full(len(lp), r + 10.0) for r, lp in zip(ctx.rewards_G, ctx.logprobs_G_T)]

def algo_bad(ctx):
    return TransformOutput([np.zeros(3)])

def unc_one(logprobs):
    return np.square(logprobs)

def unc_two(logprobs, entropies):
    return np.ones(len(logprobs)) if entropies is None else np.asarray(entropies)

def unc_bad(logprobs):
    return np.zeros(len(logprobs) + 1)

NOT_CALLABLE = 3
"""


@pytest.fixture(scope="module")
def plugin_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    name = "retrain_adv_test_plugins"
    (root / f"{name}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    import importlib

    mod = importlib.import_module(name)
    yield mod
    mp.undo()


@pytest.fixture
def P(plugin_module):
    plugin_module.CALLS.clear()
    return plugin_module


LP = [[-1.0, -2.0], [-0.5], [-3.0, -1.0, -2.0]]
PLAN = [[True, False], [False], [False, False, True]]
R = [1.0, 0.0, 0.0]


def path(mod, attr):
    return f"{mod.__name__}.{attr}"


# ------------------------------------------------------------------ advantage_mode


def test_advantage_plugin_with_one_argument(P):
    out = compute_token_advantages(
        R, LP, PLAN, advantage_mode=path(P, "adv_one"), transform_mode="none"
    )
    assert [a.tolist() for a in out] == [[2.0, 2.0], [0.0], [0.0, 0.0, 0.0]]
    assert P.CALLS == [("adv_one", "list")]


def test_advantage_plugin_with_params(P):
    out = compute_token_advantages(
        R,
        LP,
        PLAN,
        advantage_mode=f"{P.__name__}:adv_two",
        transform_mode="none",
        advantage_params={"scale": 3.0},
    )
    assert out[0].tolist() == [3.0, 3.0]
    assert P.CALLS == [("adv_two", {"scale": 3.0})]


def test_advantage_plugin_feeds_builtin_transforms(P):
    out = compute_token_advantages(
        R, LP, PLAN, advantage_mode=path(P, "adv_one"), transform_mode="gtpo", gtpo_beta=0.0
    )
    assert out[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "attr,what",
    [
        ("adv_short", "1 value"),
        ("adv_nan", "NaN"),
        ("adv_raises", "RuntimeError: boom"),
        ("NOT_CALLABLE", "not callable"),
    ],
)
def test_malformed_advantage_plugin_names_itself(P, attr, what):
    with pytest.raises(PluginError, match=re.escape(path(P, attr))) as info:
        compute_token_advantages(R, LP, PLAN, advantage_mode=path(P, attr))
    assert what in str(info.value)


def test_missing_plugin_module_is_a_plugin_error():
    with pytest.raises(PluginError, match="no_such_module_xyz"):
        compute_token_advantages(R, LP, PLAN, advantage_mode="no_such_module_xyz.fn")


# ------------------------------------------------------------------ transform_mode


def test_transform_plugin_gets_a_full_context(P):
    out = compute_token_advantages(
        R,
        LP,
        PLAN,
        advantage_mode="grpo",
        transform_mode=path(P, "tr_scale"),
        transform_params={"k": 2.0},
        sepa_lambda=0.4,
        step=7,
    )
    np.testing.assert_allclose(out[0], [4 / 3, 4 / 3])
    np.testing.assert_allclose(out[2], [-2 / 3] * 3)
    (call,) = P.CALLS
    assert call[:4] == ("tr_scale", 7, 0.4, {"k": 2.0})
    assert call[4] == [[1.0, 2.0], [0.5], [3.0, 1.0, 2.0]]  # surprisal
    assert call[5] == PLAN


def test_transform_plugin_list_output_is_accepted(P):
    out = compute_token_advantages(R, LP, PLAN, transform_mode=path(P, "tr_list"))
    assert [a.tolist() for a in out] == [[0.0, 0.0], [0.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "attr,what",
    [
        ("tr_too_few", "2 completion(s); the group has 3"),
        ("tr_wrong_len", "completion 0 has 2 tokens but 3"),
        ("tr_nan", "NaN"),
        ("tr_dict", "TransformOutput"),
    ],
)
def test_malformed_transform_plugin_names_itself(P, attr, what):
    with pytest.raises(PluginError, match=re.escape(path(P, attr))) as info:
        compute_token_advantages(R, LP, PLAN, transform_mode=path(P, attr))
    assert what in str(info.value)


def test_transform_plugin_in_batch_is_called_per_kept_group_and_metrics_averaged(P):
    groups = [
        (R, LP, PLAN),
        ([1.0, 1.0], [[-1.0], [-1.0]], None),  # skipped
        ([0.0, 1.0], [[-1.0], [-2.0, -3.0]], None),
    ]
    pipeline = AdvantagePipeline(
        transform_mode=path(P, "tr_scale"), transform_params={"k": 1.0}, advantage_mode="grpo"
    )
    res = pipeline([TokenGroup(*g) for g in groups])
    assert len(P.CALLS) == 2
    assert res.advantages[1] is None
    assert res.stats.extra_metrics == {"k_used": 1.0, "n": 2.5}
    assert res.stats.to_metrics()["n"] == 2.5
    assert res.advantages[2][1].tolist() == [0.5, 0.5]


# ------------------------------------------------------------------ algorithm_mode


def test_algorithm_plugin_replaces_the_pipeline(P):
    out = compute_token_advantages(
        R,
        LP,
        PLAN,
        algorithm_mode=path(P, "algo"),
        advantage_mode="grpo",
        transform_mode="gtpo",
        advantage_params={"a": 1},
        transform_params={"t": 2},
    )
    assert [a.tolist() for a in out] == [[11.0, 11.0], [10.0], [10.0, 10.0, 10.0]]
    assert P.CALLS == [("algo", R, {"a": 1}, {"t": 2})]


def test_malformed_algorithm_plugin_names_itself(P):
    with pytest.raises(PluginError, match=re.escape(path(P, "algo_bad"))):
        compute_token_advantages(R, LP, PLAN, algorithm_mode=path(P, "algo_bad"))


# ------------------------------------------------------------------ uncertainty_kind


def test_uncertainty_plugin_one_argument(P):
    a = compute_token_advantages(
        R,
        LP,
        PLAN,
        advantage_mode="grpo",
        transform_mode="gtpo",
        uncertainty_kind=path(P, "unc_one"),
    )
    # h = logprob^2 = [1, 4] on completion 0: m = 2.5, w = 1 + 0.1 (h / m - 1)
    np.testing.assert_allclose(a[0], [2 / 3 * 0.94, 2 / 3 * 1.06], rtol=1e-12)
    # h = [9, 1, 4] on completion 2: m = 14 / 3
    w = [1 + 0.1 * (x * 3 / 14 - 1) for x in (9, 1, 4)]
    np.testing.assert_allclose(a[2], [-1 / 3 * x for x in w], rtol=1e-12)
    # surprisal (the default) would give h = [1, 2]: different weights
    b = compute_token_advantages(R, LP, PLAN, advantage_mode="grpo", transform_mode="gtpo")
    assert not np.allclose(a[0], b[0])


def test_uncertainty_plugin_two_arguments_sees_entropies(P):
    ent = [[1.0, 3.0], [2.0], [1.0, 1.0, 1.0]]
    out = compute_token_advantages(
        [1, 0, 0],
        LP,
        None,
        advantage_mode="grpo",
        transform_mode="gtpo",
        entropies_G_T=ent,
        uncertainty_kind=path(P, "unc_two"),
    )
    np.testing.assert_allclose(out[0], [2 / 3 * 0.95, 2 / 3 * 1.05])


def test_malformed_uncertainty_plugin_names_itself(P):
    with pytest.raises(PluginError, match=re.escape(path(P, "unc_bad"))):
        compute_token_advantages(R, LP, PLAN, uncertainty_kind=path(P, "unc_bad"))


def test_context_types_are_exported():
    import retrain

    assert retrain.TransformContext is TransformContext
    assert retrain.TransformOutput is TransformOutput
    ctx = AlgorithmContext(np.zeros(1), [np.zeros(1)], [np.zeros(1)], [np.zeros(1, bool)])
    assert ctx.num_completions == 1 and ctx.sepa_lambda == 0.0


# ------------------------------------------------------------------ built once


def test_pipeline_resolves_plugins_once(P, monkeypatch, import_counts):
    imports, invalidations = import_counts["imports"], import_counts["invalidations"]
    pipeline = AdvantagePipeline(
        advantage_mode=path(P, "adv_two"),
        transform_mode=path(P, "tr_scale"),
        uncertainty_kind=path(P, "unc_one"),
        advantage_params={"scale": 1.0},
    )
    assert sorted(imports) == sorted(path(P, a) for a in ("adv_two", "tr_scale", "unc_one"))
    built = (len(imports), len(invalidations))
    for step in range(3):
        res = pipeline([TokenGroup(R, LP, PLAN), TokenGroup([0.0, 1.0], LP[:2])], step=step)
        assert res.kept == [True, True]
    assert (len(imports), len(invalidations)) == built
    assert [c[0] for c in P.CALLS].count("tr_scale") == 6  # plugins still run on every call


def test_algorithm_plugin_resolves_only_itself(P, monkeypatch):
    pipeline = AdvantagePipeline(
        algorithm_mode=path(P, "algo"),
        advantage_mode="no_such_module_xyz.fn",  # replaced by the algorithm: never resolved
        transform_mode="no_such_module_xyz.fn",
    )
    out = pipeline([TokenGroup(R, LP, PLAN)]).advantages[0]
    assert [a.tolist() for a in out] == [[11.0, 11.0], [10.0], [10.0, 10.0, 10.0]]


@pytest.mark.parametrize(
    "kw,expected,probed",
    [
        (dict(transform_mode="P.tr_scale"), False, True),  # one value per completion
        (dict(transform_mode="P.tr_by_h"), True, True),
        (dict(transform_mode="P.tr_by_h", uncertainty_kind="shannon_entropy"), True, True),
        (dict(algorithm_mode="P.algo"), False, True),
        (dict(advantage_mode="P.adv_one", transform_mode="none"), False, False),
        (dict(advantage_mode="P.adv_one", transform_mode="gtpo"), True, False),
    ],
)
def test_varies_per_token_probes_plugins(P, kw, expected, probed):
    kw = {k: path(P, v[2:]) if v.startswith("P.") else v for k, v in kw.items()}
    pipeline = AdvantagePipeline(**kw)
    probes = []
    real_probe = pipeline._probe
    pipeline._probe = lambda: probes.append(1) or real_probe()
    assert pipeline.varies_per_token() is expected
    assert pipeline.varies_per_token() is expected
    assert len(probes) == int(probed)  # plugins are probed once; built-in transforms never
    # the probe (with surprisal, no entropies) leaves the pipeline as configured
    assert pipeline.uncertainty_kind == kw.get("uncertainty_kind", "surprisal")
    assert pipeline.needs_entropies == ("uncertainty_kind" in kw)
