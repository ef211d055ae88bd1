"""Plugins written for the original retrain API (specs, factories, context fields,
``register_*``), as its README and docs show them, run unchanged; retrain's own API
keeps working beside it. Plugin files are written to a temporary working directory and
loaded by dotted paths, as a user's run would."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import retrain
from retrain import registry
from retrain.advantages import AdvantagePipeline, compute_token_advantages
from retrain.compat.contexts import AlgorithmContext, TransformContext
from retrain.errors import PluginError
from retrain.types import TokenGroup

R = [1.0, 0.0, 0.0, 1.0]
LP = [[-1.0, -2.5, -0.2], [-0.5], [-3.0, -1.0, -2.0, -0.7], [-0.1, -4.0]]
PLAN = [[False, True, False], [False], [True, False, False, True], [False, False]]

ORIGINAL_EXPORTS = (
    "AlgorithmContext",
    "AlgorithmOutput",
    "AlgorithmSpec",
    "AdvantageContext",
    "AdvantageOutput",
    "AdvantageSpec",
    "PostProcessFn",
    "TransformContext",
    "TransformOutput",
    "TransformSpec",
    "UncertaintyContext",
    "UncertaintySpec",
    "entropy_mask_post_process",
    "surprisal_mask_post_process",
    "register_advantage_mode",
    "register_algorithm_mode",
    "register_transform_mode",
    "register_uncertainty_kind",
)

# ------------------------------------------------------------------ plain references
# The original API's formulas, written the obvious way (per token, lists).


def orig_gtpo(adv, h, beta):
    h = [min(x, 50.0) for x in h]
    if not h:
        return []
    mean = sum(h) / len(h)
    if beta == 0.0 or mean < 1e-7:
        return [adv] * len(h)
    return [adv * max(0.0, 1.0 + beta * (x / (mean + 1e-8) - 1.0)) for x in h]


def orig_hicra(advs, mask, alpha):
    return [a + alpha * abs(a) if m else a for a, m in zip(advs, mask)]


def orig_sepa(h, mask, lam, amp=False, clamp=False):
    lam = max(0.0, min(1.0, lam))
    if lam == 0.0:
        return list(h)
    h = [min(x, 50.0) for x in h]
    execs = [x for x, m in zip(h, mask) if not m]
    if not execs:
        return h
    mu = sum(execs) / len(execs)
    out = []
    for x, m in zip(h, mask):
        if m:
            out.append(x)
        elif amp:
            y = (1.0 + lam) * x - lam * mu
            out.append(max(0.0, y) if clamp else y)
        else:
            out.append(lam * mu + (1.0 - lam) * x)
    return out


def grpo_ref(rewards):
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def surprisal(lps):
    return [[min(-x, 50.0) for x in lp] for lp in lps]


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory with a `write(relpath, source)` helper; modules written
    there get unique names so tests never see each other's imports."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # paths added by a run go away after
    tag = uuid.uuid4().hex[:8]
    written: list[str] = []

    def write(relpath: str, source: str) -> str:
        """Write the module, return its dotted module name (with the unique tag)."""
        parts = Path(relpath).with_suffix("").parts
        parts = (*parts[:-1], f"{parts[-1]}_{tag}")
        path = tmp_path.joinpath(*parts).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        name = ".".join(parts)
        written.append(name)
        return name

    importlib.invalidate_caches()
    yield write
    for name in written:
        sys.modules.pop(name, None)


@pytest.fixture
def cleanup_registrations():
    names: list[tuple[str, str]] = []
    yield names
    for kind, name in names:
        registry.ALL_REGISTRIES[kind].remove(name)


def tok(**kw):
    kw.setdefault("advantage_mode", "grpo")
    return compute_token_advantages(R, LP, PLAN, **kw)


# ------------------------------------------------------------------ exports


def test_top_level_exports_the_original_plugin_names():
    import retrain.advantages as adv

    for name in ORIGINAL_EXPORTS:
        assert name in retrain.__all__, name
        assert getattr(retrain, name) is getattr(adv, name), name


# ------------------------------------------------------------------ transforms


README_SPEC = (
    Path(__file__).parents[1] / "fixtures/original_plugins/readme_transform.py"
).read_text()


def test_readme_factory_spec_from_the_working_directory(workdir):
    module = workdir("my_transforms.py", README_SPEC)
    out = tok(transform_mode=f"{module}.make_transform_spec", sepa_lambda=0.3, gtpo_beta=0.4)
    for i, (a, h, m) in enumerate(zip(grpo_ref(R), surprisal(LP), PLAN)):
        shifted = [x if p else x + 0.3 for x, p in zip(h, m)]
        np.testing.assert_allclose(out[i], orig_gtpo(a, shifted, 0.4), rtol=1e-12)


def test_spec_object_and_flags(workdir):
    module = workdir(
        "specs.py",
        """
        from retrain import TransformSpec

        HICRA = TransformSpec(name="h", needs_planning=True, apply_hicra=True)
        NO_PLANNING = TransformSpec(name="n", apply_hicra=True)  # masks stay all zero
        NO_SEPA = TransformSpec(
            name="s",
            needs_planning=True,
            entropy_transform=lambda h, m, lam: [x + 10 * lam for x in h],
        )
        PLAIN = TransformSpec(name="p", use_gtpo=False)
        """,
    )
    kw = dict(sepa_lambda=0.5, gtpo_beta=0.3, hicra_alpha=0.25)
    hicra = tok(transform_mode=f"{module}.HICRA", **kw)
    no_plan = tok(transform_mode=f"{module}.NO_PLANNING", **kw)
    no_sepa = tok(transform_mode=f"{module}.NO_SEPA", **kw)
    plain = tok(transform_mode=f"{module}.PLAIN", **kw)
    for i, (a, h, m) in enumerate(zip(grpo_ref(R), surprisal(LP), PLAN)):
        g = orig_gtpo(a, h, 0.3)
        np.testing.assert_allclose(hicra[i], orig_hicra(g, m, 0.25), rtol=1e-12)
        np.testing.assert_allclose(no_plan[i], g, rtol=1e-12)
        np.testing.assert_allclose(no_sepa[i], g, rtol=1e-12)  # lambda is 0 without the flag
        assert plain[i].tolist() == [a] * len(h)
    # the built-in kernel agrees up to the original's 1e-8 in GTPO's denominator
    builtin = tok(transform_mode="gtpo_hicra", **kw)
    for x, y in zip(hicra, builtin):
        np.testing.assert_allclose(x, y, rtol=1e-7)


@pytest.mark.parametrize("amp,clamp", [(False, False), (True, False), (True, True)])
def test_context_helpers_follow_the_original_formulas(workdir, amp, clamp):
    module = workdir(
        "helpers.py",
        f"""
        from retrain import TransformOutput

        def tr(ctx):
            out = []
            for a, h, m in zip(ctx.episode_advantages, ctx.logprobs_G, ctx.planning_masks_G):
                h = [-x for x in h]
                if {amp!r}:
                    if {clamp!r}:
                        from retrain.compat.list_helpers import sepa_amp_list
                        h = sepa_amp_list(h, m, ctx.sepa_lambda, clamp=True)
                    else:
                        h = ctx.sepa_amp(h, m)
                else:
                    h = ctx.sepa_pool(h, m)
                out.append(ctx.hicra(ctx.gtpo(a, h), m))
            return TransformOutput(token_advs=out)
        """,
    )
    kw = dict(sepa_lambda=0.7, gtpo_beta=0.6, hicra_alpha=0.3)
    out = tok(transform_mode=f"{module}.tr", **kw)
    for i, (a, h, m) in enumerate(zip(grpo_ref(R), surprisal(LP), PLAN)):
        moved = orig_sepa(h, m, 0.7, amp=amp, clamp=clamp)
        np.testing.assert_allclose(out[i], orig_hicra(orig_gtpo(a, moved, 0.6), m, 0.3), rtol=1e-12)
    if amp and not clamp:  # the built-in amplification agrees (up to the 1e-8)
        builtin = tok(transform_mode="gtpo_sepa_amp", sepa_lambda=0.7, gtpo_beta=0.6)
        helper = tok(transform_mode=f"{module}.tr", sepa_lambda=0.7, gtpo_beta=0.6, hicra_alpha=0)
        for x, y in zip(helper, builtin):
            np.testing.assert_allclose(x, y, rtol=1e-7)


DOCS_TRANSFORM = """
from retrain import TransformOutput

def my_transform(ctx):
    scale = float(ctx.params.get("scale", 1.0))
    token_advs = []
    for i, logprobs in enumerate(ctx.logprobs_G):
        token_advs.append([ctx.episode_advantages[i] * scale for _ in logprobs])
    return TransformOutput(token_advs=token_advs)
"""

SCAFFOLD_TRANSFORM = '''
from retrain import TransformOutput

def my_transform(ctx):
    """ctx contains episode_advantages/logprobs/planning masks/params."""
    token_advs = []
    for i, logprobs in enumerate(ctx.logprobs_G):
        adv = ctx.episode_advantages[i]
        token_advs.append([adv for _ in logprobs])
    return TransformOutput(
        token_advs=token_advs,
        has_stats=False,
        needs_planning=False,
        uses_sepa_controller=False,
    )
'''


@pytest.mark.parametrize("source,scale", [(DOCS_TRANSFORM, 2.0), (SCAFFOLD_TRANSFORM, 1.0)])
def test_docs_context_transform_under_plugins_dir(workdir, source, scale):
    module = workdir("plugins/my_transform.py", source)
    assert module.startswith("plugins.")
    out = tok(transform_mode=f"{module}.my_transform", transform_params={"scale": 2.0})
    for i, a in enumerate(grpo_ref(R)):
        assert out[i].tolist() == [a * scale] * len(LP[i])


def test_original_context_fields():
    ctx = TransformContext(
        episode_advantages_G=np.array([0.5, -0.5]),
        logprobs_G_T=[np.array([-1.0, -2.0]), np.array([-3.0])],
        uncertainties_G_T=[np.array([1.0, 2.0]), np.array([3.0])],
        planning_G_T=[np.array([True, False]), np.array([False])],
        params={"k": 1},
        step=4,
    )
    assert ctx.episode_advantages == [0.5, -0.5]
    assert ctx.logprobs_G == [[-1.0, -2.0], [-3.0]]
    assert ctx.planning_masks_G == [[1, 0], [0]]
    assert ctx.token_distributions_G is None
    assert ctx.params == {"k": 1} and ctx.step == 4
    algo = AlgorithmContext(
        np.array([1.0, 0.0]),
        [np.array([-1.0]), np.array([-2.0])],
        [np.array([1.0]), np.array([2.0])],
        [np.array([False]), np.array([True])],
        entropies_G_T=[np.array([0.5]), np.array([0.25])],
    )
    assert algo.logprobs_G == [[-1.0], [-2.0]] and algo.planning_masks_G == [[0], [1]]
    assert algo.precomputed_entropies_G == [[0.5], [0.25]]


def test_spec_with_the_exported_mask_hook_matches_entropy_mask(workdir):
    module = workdir(
        "masked.py",
        """
        from retrain import TransformSpec, surprisal_mask_post_process

        MASKED = TransformSpec(name="masked", post_process=surprisal_mask_post_process)
        """,
    )
    groups = [TokenGroup(R, LP, PLAN), TokenGroup([0.0, 1.0], [[-1.0, -0.3], [-2.0]])]
    spec = AdvantagePipeline(transform_mode=f"{module}.MASKED", surprisal_mask_rho=0.4)
    builtin = AdvantagePipeline(transform_mode="entropy_mask", surprisal_mask_rho=0.4)
    a, b = spec(groups), builtin(groups)
    assert a.stats.extra_metrics == pytest.approx(b.stats.extra_metrics, rel=1e-12)
    assert set(a.stats.extra_metrics) == {"entropy_mask_threshold", "entropy_mask_fraction"}
    for ga, gb in zip(a.advantages, b.advantages):
        for x, y in zip(ga, gb):
            np.testing.assert_allclose(x, y, rtol=1e-7)
            assert ((x == 0) == (y == 0)).all()
    # the hook reads rho from the transform params too (its older name included)
    none = AdvantagePipeline(
        transform_mode=f"{module}.MASKED", transform_params={"entropy_mask_rho": 0}
    )
    assert none(groups).stats.extra_metrics == {}


def test_surprisal_mask_post_process_reference():
    from retrain import entropy_mask_post_process, surprisal_mask_post_process

    assert entropy_mask_post_process is surprisal_mask_post_process
    advs = [[1.0, 2.0, 3.0], [4.0]]
    h = [[0.5, 3.0, 1.0], [2.0]]
    out, metrics = surprisal_mask_post_process(advs, h, {"surprisal_mask_rho": 0.5})
    assert out == [[0.0, 2.0, 0.0], [4.0]]  # k = 2: tau = 2.0
    assert metrics == {"entropy_mask_threshold": 2.0, "entropy_mask_fraction": 0.5}
    assert surprisal_mask_post_process(advs, h, {"surprisal_mask_rho": 0.0}) == (advs, {})
    assert surprisal_mask_post_process(advs, h, {"entropy_mask_rho": "x"}) == (advs, {})


# ------------------------------------------------------------------ advantages & algorithms


def test_advantage_plugin_forms(workdir):
    module = workdir(
        "my_advantages.py",
        """
        from retrain import AdvantageOutput
        from retrain.advantages import AdvantageSpec

        def hipa_like_advantages(rewards):
            if not rewards:
                return []
            mean_r = sum(rewards) / len(rewards)
            return [2.0 * (r - mean_r) for r in rewards]

        def my_adv(rewards, params=None):
            \"\"\"Return one advantage per reward.\"\"\"
            if not rewards:
                return []
            scale = float((params or {}).get('scale', 1.0))
            mean_r = sum(rewards) / len(rewards)
            return [scale * (r - mean_r) for r in rewards]

        def keyword_params(rewards, *, params):
            return [params["scale"] * r for r in rewards]

        def context_style(ctx):
            return AdvantageOutput(advantages=[r * ctx.params["scale"] for r in ctx.rewards])

        def make_advantage_spec():
            return AdvantageSpec(name="factory_fixed", compute=lambda rewards, params: [0.25 for _ in rewards])
        """,
    )
    kw = dict(transform_mode="none", advantage_params={"scale": 3.0})
    mean = sum(R) / len(R)
    expected = {
        "hipa_like_advantages": [2.0 * (r - mean) for r in R],
        "my_adv": [3.0 * (r - mean) for r in R],
        "keyword_params": [3.0 * r for r in R],
        "context_style": [3.0 * r for r in R],
        "make_advantage_spec": [0.25] * len(R),
    }
    for attr, values in expected.items():
        out = tok(advantage_mode=f"{module}.{attr}", **kw)
        assert [x[0] for x in out] == values, attr


def test_algorithm_scaffold_and_spec(workdir):
    module = workdir(
        "plugins/my_algo.py",
        '''
        from retrain import AlgorithmOutput, AlgorithmSpec

        def my_algo(ctx):
            """Full algorithm hook: return token-level advantages directly."""
            token_advs = []
            for rewards_idx, logprobs in enumerate(ctx.logprobs_G):
                reward = ctx.rewards_G[rewards_idx]
                token_advs.append([reward for _ in logprobs])
            return AlgorithmOutput(token_advs=token_advs, has_stats=False)

        def make_spec():
            return AlgorithmSpec(name="spec", compute=lambda ctx: [[-1.0] * len(x) for x in ctx.logprobs_G])
        ''',
    )
    out = tok(algorithm_mode=f"{module}.my_algo")
    assert [x.tolist() for x in out] == [[r] * len(lp) for r, lp in zip(R, LP)]
    out = tok(algorithm_mode=f"{module}.make_spec")
    assert [x.tolist() for x in out] == [[-1.0] * len(lp) for lp in LP]


def test_factory_that_fails_or_returns_junk_names_the_plugin(workdir):
    module = workdir(
        "bad.py",
        """
        def boom():
            raise RuntimeError("no spec today")

        def junk():
            return 3
        """,
    )
    with pytest.raises(PluginError, match="factory raised RuntimeError: no spec today"):
        AdvantagePipeline(transform_mode=f"{module}.boom")
    with pytest.raises(PluginError, match="factory returned int"):
        AdvantagePipeline(transform_mode=f"{module}.junk")


# ------------------------------------------------------------------ uncertainty


def test_uncertainty_spec_and_context_forms(workdir):
    module = workdir(
        "unc.py",
        """
        from retrain import UncertaintySpec

        def by_context(ctx):
            return [abs(x) + (1.0 if m else 0.0) for x, m in zip(ctx.logprobs, ctx.planning_mask)]

        SPEC = UncertaintySpec(name="sq", compute=lambda ctx: [x * x for x in ctx.logprobs])

        NEEDS = UncertaintySpec(name="ent", compute=lambda ctx: ctx.precomputed_entropy, needs_distributions=True)
        """,
    )
    kw = dict(transform_mode="gtpo", gtpo_beta=0.5)
    out = tok(uncertainty_kind=f"{module}.by_context", **kw)
    spec = tok(uncertainty_kind=f"{module}.SPEC", **kw)
    for i, a in enumerate(grpo_ref(R)):
        h = [abs(x) + (1.0 if m else 0.0) for x, m in zip(LP[i], PLAN[i])]
        np.testing.assert_allclose(out[i], [a * w for w in _weights(h, 0.5)], rtol=1e-12)
        sq = [x * x for x in LP[i]]
        np.testing.assert_allclose(spec[i], [a * w for w in _weights(sq, 0.5)], rtol=1e-12)
    pipeline = AdvantagePipeline(uncertainty_kind=f"{module}.NEEDS")
    assert pipeline.needs_entropies
    ent = [[float(j + 1) for j in range(len(lp))] for lp in LP]
    got = tok(uncertainty_kind=f"{module}.NEEDS", entropies_G_T=ent, **kw)
    for i, a in enumerate(grpo_ref(R)):
        np.testing.assert_allclose(got[i], [a * w for w in _weights(ent[i], 0.5)], rtol=1e-12)


def _weights(h, beta):
    m = sum(h) / len(h)
    return [max(0.0, 1 + beta * (x / m - 1)) for x in h]


# ------------------------------------------------------------------ register_*


def test_register_transform_mode_is_seen_by_the_registry(cleanup_registrations):
    from retrain import TransformOutput, TransformSpec, register_transform_mode

    def doubled(ctx):
        """Every token gets twice its episode advantage."""
        return TransformOutput(
            token_advs=[[2 * a] * len(lp) for a, lp in zip(ctx.episode_advantages, ctx.logprobs_G)]
        )

    cleanup_registrations.extend([("transform_mode", "doubled"), ("transform_mode", "spec_mode")])
    register_transform_mode("doubled", doubled)
    register_transform_mode("spec_mode", TransformSpec(name="spec_mode", use_gtpo=False))
    reg = registry.TRANSFORM_MODES
    assert reg.check("doubled") is None and "doubled" in reg.names()
    assert reg.entry("doubled").description.startswith("Every token gets twice")
    assert reg.entry("doubled").token_varying and not reg.entry("spec_mode").token_varying
    out = tok(transform_mode="doubled")
    assert [x.tolist() for x in out] == [[2 * a] * len(lp) for a, lp in zip(grpo_ref(R), LP)]
    out = tok(transform_mode="spec_mode")
    assert [x.tolist() for x in out] == [[a] * len(lp) for a, lp in zip(grpo_ref(R), LP)]
    # registering again replaces (as in the original)
    register_transform_mode("doubled", TransformSpec(name="x", use_gtpo=False))
    assert [x[0] for x in tok(transform_mode="doubled")] == grpo_ref(R)
    with pytest.raises(ValueError, match="cannot contain"):
        register_transform_mode("pkg.mod", doubled)
    with pytest.raises(TypeError, match="TransformSpec or a callable"):
        register_transform_mode("nope", 3)


def test_register_other_kinds(cleanup_registrations):
    from retrain import (
        AlgorithmSpec,
        UncertaintySpec,
        register_advantage_mode,
        register_algorithm_mode,
        register_uncertainty_kind,
    )

    cleanup_registrations.extend(
        [
            ("advantage_mode", "student_zero"),
            ("algorithm_mode", "flat_one"),
            ("uncertainty_kind", "abs_logprob"),
            ("uncertainty_kind", "spec_unc"),
        ]
    )
    register_advantage_mode("student_zero", lambda rewards: [0.0 for _ in rewards])
    register_algorithm_mode(
        "flat_one",
        AlgorithmSpec(
            name="flat_one", compute=lambda ctx: [[1.0] * len(x) for x in ctx.logprobs_G]
        ),
    )
    register_uncertainty_kind("abs_logprob", lambda ctx: [abs(x) for x in ctx.logprobs])
    register_uncertainty_kind(
        "spec_unc", UncertaintySpec(name="s", compute=lambda ctx: [1.0] * len(ctx.logprobs))
    )
    assert registry.ADVANTAGE_MODES.check("student_zero") is None
    assert [x.tolist() for x in tok(advantage_mode="student_zero", transform_mode="gtpo")] == [
        [0.0] * len(lp) for lp in LP
    ]
    assert [x.tolist() for x in tok(algorithm_mode="flat_one")] == [[1.0] * len(lp) for lp in LP]
    a = tok(uncertainty_kind="abs_logprob", transform_mode="gtpo", gtpo_beta=0.5)
    b = tok(uncertainty_kind="surprisal", transform_mode="gtpo", gtpo_beta=0.5)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12)
    flat = tok(uncertainty_kind="spec_unc", transform_mode="gtpo", gtpo_beta=0.5)
    assert [x.tolist() for x in flat] == [[a] * len(lp) for a, lp in zip(grpo_ref(R), LP)]
    assert not AdvantagePipeline(uncertainty_kind="spec_unc").needs_entropies


def test_registry_add_and_remove():
    reg = registry.Registry("thing", (registry.Entry("a", "m:a", aliases=("aa",)),))
    reg.add(registry.Entry("b", "m:b", aliases=("bb",)))
    assert reg.names() == ["a", "b"] and reg.canonical("bb") == "b"
    with pytest.raises(ValueError, match="already registered"):
        reg.add(registry.Entry("aa", "m:x"))
    with pytest.raises(ValueError, match="short name"):
        reg.add(registry.Entry("pkg.mod", "m:x"))
    reg.add(registry.Entry("aa", "m:x"), replace=True)  # an alias taken over by a new entry
    assert reg.entry("aa").target == "m:x" and reg.entry("a").target == "m:a"
    reg.add(registry.Entry("b", "m:b2"), replace=True)
    assert reg.entry("b").target == "m:b2" and reg.entry("bb") is None
    assert reg.remove("b").target == "m:b2" and reg.remove("b") is None
    assert reg.names() == ["a", "aa"]


def test_registry_adapters_turn_plugin_objects_into_the_kinds_form():
    seen = []

    def not_mine(name, obj, entry):
        seen.append(("not_mine", name, entry))
        return None

    def doubled(name, obj, entry):
        return lambda x: 2 * obj(x)

    reg = registry.Registry("thing", (registry.Entry("builtin", "math:sqrt"),))
    reg.add_adapter(not_mine)
    reg.add_adapter(doubled)
    reg.add_adapter(not_mine)  # once is enough: an installer may run again
    assert reg.adapters == [not_mine, doubled]
    assert reg.resolve_plugin("math.sqrt")(16.0) == 8.0  # the first that answers wins
    assert seen == [("not_mine", "math.sqrt", None)]
    # a run-time entry resolves like a plugin; a built-in does not
    reg.add(registry.Entry("late", "math:sqrt", plugin=True))
    assert reg.is_plugin("late") and reg.is_plugin("pkg.mod.fn") and not reg.is_plugin("builtin")
    assert reg.resolve_plugin("late")(4.0) == 4.0
    assert seen[-1] == ("not_mine", "late", reg.entry("late"))


def test_original_forms_are_adapted_through_the_registry():
    import retrain.compat  # noqa: F401  installs the adapters

    for reg in (
        registry.ADVANTAGE_MODES,
        registry.TRANSFORM_MODES,
        registry.ALGORITHM_MODES,
        registry.UNCERTAINTY_KINDS,
    ):
        assert len(reg.adapters) == 1, reg.kind
        assert reg.adapters[0].__module__ == "retrain.compat.plugin_adapters"
    for reg in (registry.REWARDS, registry.BACKENDS, registry.DATA_SOURCES):
        assert reg.adapters == []


# ------------------------------------------------------------------ working directory


def test_dotted_paths_resolve_from_the_working_directory(workdir, monkeypatch):
    module = workdir("plugins/cwd_transform.py", DOCS_TRANSFORM)
    cwd = str(Path.cwd())
    # as under the `retrain` script: neither '' nor the working directory on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", cwd, ".")])
    out = tok(transform_mode=f"{module}.my_transform")
    assert out[0].tolist() == [grpo_ref(R)[0]] * len(LP[0])
    assert sys.path[-1] == cwd  # appended: installed packages still win
