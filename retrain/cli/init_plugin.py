"""`retrain init-plugin --kind transform|advantage|algorithm|reward --name NAME [--with-test]`:
write a working plugin module (and a pytest file) into `plugins/`.

The module works unmodified when named in a TOML (the default `[plugins] search_paths`
is `["plugins"]`, relative to the working directory), and its test passes with
`pytest plugins/`. Each template is a small, real example meant to be edited.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import sys
from pathlib import Path

from retrain.errors import UsageError

KINDS = ("transform", "advantage", "algorithm", "reward")
ENTRY = {
    "transform": "transform",
    "advantage": "advantage",
    "algorithm": "algorithm",
    "reward": "score",
}


def toml_usage(kind: str, name: str, directory: str = "plugins") -> str:
    """The TOML that selects the scaffolded plugin."""
    search = "" if directory == "plugins" else f'\n[plugins]\nsearch_paths = ["{directory}"]\n'
    if kind == "transform":
        body = (
            "[algorithm]\n"
            'advantage_mode = "maxrl"\n'
            f'transform_mode = "{name}.transform"\n\n'
            "[algorithm.transform_params]\n"
            "strength = 0.5\n"
        )
    elif kind == "advantage":
        body = (
            "[algorithm]\n"
            f'advantage_mode = "{name}.advantage"\n'
            'transform_mode = "none"\n\n'
            "[algorithm.advantage_params]\n"
            "normalize_std = true\n"
        )
    elif kind == "algorithm":
        body = (
            "[algorithm]\n"
            f'algorithm_mode = "{name}.algorithm"\n\n'
            "[algorithm.transform_params]\n"
            "scale = 1.0\n"
        )
    else:
        body = f'[reward]\ntype = "custom"\ncustom_module = "{name}"\ncustom_function = "score"\n'
    return body + search


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else "" for line in text.splitlines())


# ----------------------------------------------------------------------------- templates

TRANSFORM = '''"""{name}: a token-level advantage transform for retrain.

Select it in a TOML:

{usage}

retrain calls ``transform(ctx)`` once per prompt group that carries signal (groups whose
rewards are all equal are dropped before). ``ctx`` is a TransformContext:
``episode_advantages_G`` (one A_i per completion), ``logprobs_G_T`` and
``uncertainties_G_T`` (one float array per completion), ``planning_G_T`` (bool arrays),
``sepa_lambda``, ``step`` and ``params`` ([algorithm.transform_params]).
Return one float array per completion, as long as that completion.

What this one does (edit freely): uncertainty-weighted credit. Token t of completion i
gets A_i * w_t with w_t = clip(1 + strength * (h_t / mean(h) - 1), min_weight, max_weight),
so uncertain tokens (forks in the reasoning) get more credit and confident ones less.
"""

from __future__ import annotations

import numpy as np
from retrain.advantages import TransformContext, TransformOutput


def transform(ctx: TransformContext) -> TransformOutput:
    """Uncertainty-weighted token credit (strength, min_weight, max_weight)."""
    strength = float(ctx.params.get("strength", 0.5))
    min_weight = float(ctx.params.get("min_weight", 0.0))
    max_weight = float(ctx.params.get("max_weight", 3.0))
    token_advantages = []
    mean_weights = []
    for advantage, h in zip(ctx.episode_advantages_G, ctx.uncertainties_G_T):
        h = np.asarray(h, dtype=np.float64)
        mean_h = float(h.mean()) if h.size else 0.0
        if mean_h < 1e-8:
            weights = np.ones_like(h)
        else:
            weights = np.clip(1.0 + strength * (h / mean_h - 1.0), min_weight, max_weight)
        token_advantages.append(float(advantage) * weights)
        if weights.size:
            mean_weights.append(float(weights.mean()))
    metrics = {{"{name}_mean_weight": float(np.mean(mean_weights)) if mean_weights else 1.0}}
    return TransformOutput(token_advantages=token_advantages, extra_metrics=metrics)
'''

ADVANTAGE = '''"""{name}: an episode-level advantage for retrain.

Select it in a TOML:

{usage}

retrain calls ``advantage(rewards, params)`` once per prompt group that carries signal,
with the group's rewards (a list of floats) and [algorithm.advantage_params] (a dict;
declare a single parameter ``advantage(rewards)`` if you need none). Return one number
per completion. The transform_mode then spreads them over tokens.

What this one does (edit freely): the group-normalised advantage
(r_i - mean(r)) / (std(r) + eps), or only the centred reward with normalize_std = false.
"""

from __future__ import annotations

import numpy as np


def advantage(rewards: list[float], params: dict) -> list[float]:
    """(r - mean(r)) / (std(r) + eps); params: normalize_std (true), eps (1e-6)."""
    r = np.asarray(rewards, dtype=np.float64)
    centred = r - r.mean()
    if not params.get("normalize_std", True):
        return centred.tolist()
    eps = float(params.get("eps", 1e-6))
    return (centred / (r.std() + eps)).tolist()
'''

ALGORITHM = '''"""{name}: a whole advantage algorithm for retrain (replaces advantage_mode + transform_mode).

Select it in a TOML:

{usage}

retrain calls ``algorithm(ctx)`` once per prompt group that carries signal. ``ctx`` is an
AlgorithmContext: the raw ``rewards_G``, ``logprobs_G_T`` and ``uncertainties_G_T`` (one
float array per completion), ``planning_G_T``, ``sepa_lambda``, ``step``, ``params``
([algorithm.transform_params]) and ``advantage_params`` ([algorithm.advantage_params]).
Return one float array per completion, as long as that completion.

What this one does (edit freely): a leave-one-out baseline (each completion is compared
with the mean reward of the other completions of its group), the same advantage on every
token of the completion, times ``scale``.
"""

from __future__ import annotations

import numpy as np
from retrain.advantages import AlgorithmContext, TransformOutput


def algorithm(ctx: AlgorithmContext) -> TransformOutput:
    """Leave-one-out advantage, uniform over tokens (scale)."""
    rewards = np.asarray(ctx.rewards_G, dtype=np.float64)
    n = rewards.size
    baseline = (rewards.sum() - rewards) / (n - 1) if n > 1 else rewards
    episode = float(ctx.params.get("scale", 1.0)) * (rewards - baseline)
    token_advantages = [np.full(len(lp), a) for a, lp in zip(episode, ctx.logprobs_G_T)]
    metrics = {{"{name}_abs_advantage": float(np.abs(episode).mean()) if n else 0.0}}
    return TransformOutput(token_advantages=token_advantages, extra_metrics=metrics)
'''

REWARD = '''"""{name}: a custom reward for retrain.

Select it in a TOML:

{usage}

retrain calls ``score(response, reference)`` for every completion: the model's text and
the example's reference answer. Return a float (1.0 counts as correct). It may be an
``async def``. An exception scores 0.0 and is counted in reward_errors; the run goes on.

What this one does (edit freely): 1.0 when the last \\\\boxed{{}} answer equals the reference
after light normalisation (spaces, case, $ signs, a trailing period), 0.1 for a boxed but
wrong answer (credit for the format), 0.0 when there is no boxed answer.
"""

from __future__ import annotations

from retrain.rewards import extract_boxed

FORMAT_CREDIT = 0.1


def _normalise(text: str) -> str:
    return " ".join(text.replace("$", "").split()).lower().rstrip(".")


def score(response: str, reference: str) -> float:
    """1.0 right, FORMAT_CREDIT boxed but wrong, 0.0 no boxed answer."""
    answer = extract_boxed(response)
    if answer is None:
        return 0.0
    return 1.0 if _normalise(answer) == _normalise(reference) else FORMAT_CREDIT
'''

_TEST_HEAD = '''"""Tests of the {name} plugin: run them with `pytest {directory}/`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import {name}  # noqa: E402


def _group():
    rng = np.random.default_rng(0)
    rewards = [1.0, 0.0, 0.0, 1.0]
    logprobs = [-rng.exponential(1.0, size=n) for n in (5, 8, 3, 6)]
    planning = [np.arange(n) < 2 for n in (5, 8, 3, 6)]
    return rewards, logprobs, planning
'''

TRANSFORM_TEST = (
    _TEST_HEAD
    + """

def test_transform_direct():
    from retrain.advantages import TransformContext, TransformOutput

    rewards, logprobs, planning = _group()
    episode = np.asarray(rewards) - np.mean(rewards)
    ctx = TransformContext(
        episode_advantages_G=episode,
        logprobs_G_T=logprobs,
        uncertainties_G_T=[-lp for lp in logprobs],
        planning_G_T=planning,
        params={{"strength": 0.5}},
    )
    out = {name}.transform(ctx)
    assert isinstance(out, TransformOutput)
    assert [a.size for a in out.token_advantages] == [lp.size for lp in logprobs]
    for a, e in zip(out.token_advantages, episode):
        assert np.all(np.isfinite(a))
        assert np.all(a * e >= 0)  # the credit keeps the sign of the episode advantage


def test_transform_through_the_pipeline():
    from retrain.advantages import compute_token_advantages
    from retrain.config import config_from_dict

    config_from_dict({{"algorithm": {{"transform_mode": "{name}.transform"}}}})  # the TOML value is valid
    rewards, logprobs, planning = _group()
    adv = compute_token_advantages(
        rewards,
        logprobs,
        planning,
        advantage_mode="grpo",
        transform_mode="{name}.transform",
        transform_params={{"strength": 0.5}},
        search_paths=[str(HERE)],
    )
    assert [a.size for a in adv] == [lp.size for lp in logprobs]
    assert all(np.all(np.isfinite(a)) for a in adv)
    assert adv[0].mean() > 0 > adv[1].mean()
"""
)

ADVANTAGE_TEST = (
    _TEST_HEAD
    + """

def test_advantage_direct():
    out = {name}.advantage([1.0, 0.0, 0.0, 1.0], {{}})
    assert len(out) == 4
    assert abs(sum(out)) < 1e-9 and out[0] > 0 > out[1]
    assert {name}.advantage([1.0, 0.0], {{"normalize_std": False}}) == [0.5, -0.5]


def test_advantage_through_the_pipeline():
    from retrain.advantages import compute_token_advantages
    from retrain.config import config_from_dict

    config_from_dict({{"algorithm": {{"advantage_mode": "{name}.advantage"}}}})  # the TOML value is valid
    rewards, logprobs, planning = _group()
    adv = compute_token_advantages(
        rewards,
        logprobs,
        planning,
        advantage_mode="{name}.advantage",
        transform_mode="none",
        advantage_params={{"normalize_std": True}},
        search_paths=[str(HERE)],
    )
    assert [a.size for a in adv] == [lp.size for lp in logprobs]
    expected = {name}.advantage(rewards, {{"normalize_std": True}})
    for a, e in zip(adv, expected):
        assert np.allclose(a, e)
"""
)

ALGORITHM_TEST = (
    _TEST_HEAD
    + """

def test_algorithm_direct():
    from retrain.advantages import AlgorithmContext, TransformOutput

    rewards, logprobs, planning = _group()
    ctx = AlgorithmContext(
        rewards_G=np.asarray(rewards),
        logprobs_G_T=logprobs,
        uncertainties_G_T=[-lp for lp in logprobs],
        planning_G_T=planning,
        params={{"scale": 2.0}},
    )
    out = {name}.algorithm(ctx)
    assert isinstance(out, TransformOutput)
    assert [a.size for a in out.token_advantages] == [lp.size for lp in logprobs]
    assert out.token_advantages[0][0] > 0 > out.token_advantages[1][0]


def test_algorithm_through_the_pipeline():
    from retrain.advantages import compute_token_advantages
    from retrain.config import config_from_dict

    config_from_dict({{"algorithm": {{"algorithm_mode": "{name}.algorithm"}}}})  # the TOML value is valid
    rewards, logprobs, planning = _group()
    adv = compute_token_advantages(
        rewards,
        logprobs,
        planning,
        algorithm_mode="{name}.algorithm",
        transform_params={{"scale": 1.0}},
        search_paths=[str(HERE)],
    )
    assert [a.size for a in adv] == [lp.size for lp in logprobs]
    assert all(np.all(np.isfinite(a)) for a in adv)
"""
)

REWARD_TEST = '''"""Tests of the {name} reward: run them with `pytest {directory}/`."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import {name}  # noqa: E402


def test_score_direct():
    assert {name}.score("so the answer is \\\\boxed{{42}}", "42") == 1.0
    assert {name}.score("\\\\boxed{{ 42. }}", "42") == 1.0
    assert {name}.score("\\\\boxed{{41}}", "42") == {name}.FORMAT_CREDIT
    assert {name}.score("42", "42") == 0.0


def test_score_through_retrain():
    from retrain.config import config_from_dict
    from retrain.rewards import build_reward

    config = config_from_dict({{"reward": {{"type": "custom", "custom_module": "{name}"}}}})
    reward = build_reward(config.reward, search_paths=[str(HERE)])
    try:
        assert reward.score("\\\\boxed{{7}}", "7") == 1.0
        assert reward.score("no box", "7") == 0.0
    finally:
        reward.close()
'''

TEMPLATES = {
    "transform": (TRANSFORM, TRANSFORM_TEST),
    "advantage": (ADVANTAGE, ADVANTAGE_TEST),
    "algorithm": (ALGORITHM, ALGORITHM_TEST),
    "reward": (REWARD, REWARD_TEST),
}


def render(kind: str, name: str, directory: str = "plugins") -> tuple[str, str]:
    """(module source, test source) for a plugin."""
    module, test = TEMPLATES[kind]
    usage = _indent(toml_usage(kind, name, directory))
    return module.format(name=name, usage=usage), test.format(name=name, directory=directory)


def check_name(name: str, directory: Path) -> None:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(
            f"--name {name!r} must be a Python identifier (letters, digits, _; not starting with a digit)"
        )
    if name.startswith(("test_", "_")):
        raise UsageError(
            f"--name {name!r}: names starting with 'test_' or '_' are skipped by plugin discovery"
        )
    if name in sys.stdlib_module_names:
        raise UsageError(
            f"--name {name!r} would shadow the standard-library module {name!r}; pick another name"
        )
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    ours = (directory / f"{name}.py").resolve()
    if spec is not None and origin != ours:
        raise UsageError(
            f"--name {name!r} would shadow the installed module {name!r} ({spec.origin}); pick another name"
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="retrain init-plugin",
        description="Scaffold a plugin module (and a pytest file) that works when named in a TOML.",
    )
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--name", required=True, help="module name, e.g. my_transform")
    p.add_argument("--with-test", action="store_true", help="also write DIR/test_NAME.py")
    p.add_argument(
        "--dir",
        default="plugins",
        help="where to write (default plugins/, the default [plugins] search path)",
    )
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    args = p.parse_args(argv)

    directory = Path(args.dir)
    check_name(args.name, directory)
    module_src, test_src = render(args.kind, args.name, args.dir.rstrip("/") or ".")
    targets = [(directory / f"{args.name}.py", module_src)]
    if args.with_test:
        targets.append((directory / f"test_{args.name}.py", test_src))
    existing = [str(path) for path, _ in targets if path.exists()]
    if existing and not args.force:
        raise UsageError(f"{', '.join(existing)} already exist(s); pass --force to overwrite")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for path, text in targets:
            path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write into {directory}: {exc.strerror or exc}") from exc

    print("Wrote " + ", ".join(str(path) for path, _ in targets))
    print()
    print("Use it from your TOML:")
    print()
    print(_indent(toml_usage(args.kind, args.name, args.dir.rstrip("/") or ".")))
    print()
    if args.with_test:
        print(f"Test it:  pytest {directory}/")
    print("See it:   retrain plugins")
    return 0
