"""`retrain init-plugin`: the scaffolded plugins work unmodified, and their tests pass."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import numpy as np
import pytest

from retrain.build import build_pipeline
from retrain.cli.init_plugin import KINDS, toml_usage
from retrain.cli.main import main
from retrain.config import config_from_dict
from retrain.types import TokenGroup


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def unique(kind: str) -> str:
    return f"my_{kind}_{uuid.uuid4().hex[:6]}"


def _group():
    rng = np.random.default_rng(1)
    return TokenGroup(
        rewards_G=np.array([1.0, 0.0, 1.0, 0.0]),
        logprobs_G_T=[-rng.exponential(1.0, size=n) for n in (4, 7, 2, 5)],
        planning_G_T=[np.arange(n) < 1 for n in (4, 7, 2, 5)],
    )


@pytest.mark.parametrize("kind", ["transform", "advantage", "algorithm"])
def test_scaffolded_advantage_plugins_run_as_named_in_a_toml(project, capsys, kind):
    name = unique(kind)
    code, out, _ = run(["init-plugin", "--kind", kind, "--name", name], capsys)
    assert code == 0
    assert (project / "plugins" / f"{name}.py").is_file()
    assert not (project / "plugins" / f"test_{name}.py").exists()
    assert f'"{name}.' in out  # the TOML to use is printed

    # the printed TOML is a valid config, used as the trainer uses it
    import tomllib

    raw = tomllib.loads(toml_usage(kind, name))
    config = config_from_dict(raw)
    batch = build_pipeline(config)([_group()], sepa_lambda=0.3)
    adv = batch.advantages[0]
    assert adv is not None and [x.size for x in adv] == [4, 7, 2, 5]
    assert all(np.all(np.isfinite(x)) for x in adv)
    assert adv[0].mean() > 0 > adv[1].mean()
    if kind != "advantage":
        metric = f"{name}_mean_weight" if kind == "transform" else f"{name}_abs_advantage"
        assert metric in batch.stats.extra_metrics


def test_scaffolded_reward_scores_through_build_reward(project, capsys):
    from retrain.rewards import build_reward

    name = unique("reward")
    code, _, _ = run(["init-plugin", "--kind", "reward", "--name", name], capsys)
    assert code == 0
    import tomllib

    config = config_from_dict(tomllib.loads(toml_usage("reward", name)))
    reward = build_reward(config.reward, config.plugins.search_paths)
    try:
        assert reward.score("so \\boxed{12}", "12") == 1.0
        assert reward.score("so \\boxed{13}", "12") == pytest.approx(0.1)
        assert reward.score("twelve", "12") == 0.0
    finally:
        reward.close()


def test_scaffolded_tests_pass_with_pytest(project, capsys):
    names = {kind: unique(kind) for kind in KINDS}
    for kind, name in names.items():
        code, out, _ = run(["init-plugin", "--kind", kind, "--name", name, "--with-test"], capsys)
        assert code == 0 and "pytest plugins/" in out
        assert (project / "plugins" / f"test_{name}.py").is_file()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "plugins", "-q", "-p", "no:cacheprovider"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{2 * len(KINDS)} passed" in proc.stdout

    # and `retrain plugins` finds them with the right kinds
    code, out, _ = run(["plugins", "--json"], capsys)
    assert code == 0
    found = {p["name"]: p["kind"] for p in json.loads(out)["discovered"]}
    assert found[f"{names['transform']}.transform"] == "transform_mode"
    assert found[f"{names['advantage']}.advantage"] == "advantage_mode"
    assert found[f"{names['algorithm']}.algorithm"] == "algorithm_mode"
    assert found[f"{names['reward']}.score"] == "reward"
    assert not any("test_" in n for n in found)


def test_refuses_overwrite_without_force(project, capsys):
    name = unique("transform")
    assert run(["init-plugin", "--kind", "transform", "--name", name], capsys)[0] == 0
    path = project / "plugins" / f"{name}.py"
    path.write_text("# mine\n")
    code, _, err = run(["init-plugin", "--kind", "transform", "--name", name], capsys)
    assert code == 2 and "--force" in err and path.read_text() == "# mine\n"
    code, _, _ = run(["init-plugin", "--kind", "transform", "--name", name, "--force"], capsys)
    assert code == 0 and "def transform(ctx" in path.read_text()


@pytest.mark.parametrize(
    "bad, message",
    [
        ("1abc", "identifier"),
        ("class", "identifier"),
        ("my-plugin", "identifier"),
        ("json", "standard-library"),
        ("numpy", "installed module"),
        ("test_thing", "skipped"),
    ],
)
def test_rejects_bad_names(project, capsys, bad, message):
    code, _, err = run(["init-plugin", "--kind", "reward", "--name", bad], capsys)
    assert code == 2 and message in err
    assert not (project / "plugins" / f"{bad}.py").exists()


def test_custom_dir_adds_search_path_to_the_snippet(project, capsys):
    name = unique("advantage")
    code, out, _ = run(
        ["init-plugin", "--kind", "advantage", "--name", name, "--dir", "my_plugins"], capsys
    )
    assert code == 0 and (project / "my_plugins" / f"{name}.py").is_file()
    assert 'search_paths = ["my_plugins"]' in out


def test_unknown_kind_is_a_usage_error(project, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["init-plugin", "--kind", "backend", "--name", "x"])
    assert exc.value.code == 2
