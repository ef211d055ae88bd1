"""`retrain explain` and `retrain doctor` run what the run checks before its model loads
and refuses: the preflight of the advantage flow (retrain/build.py `preflight`: its
plugins imported, the advantage params checked, a plugin transform probed against the
backend) and the tinker backend's API key. Each is an explain ERROR naming the key (exit
2) and a doctor FAIL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrain.cli.main import main
from retrain.config import load_config
from retrain.errors import RetrainError
from retrain.startup import preflight

BASE = (
    '[backend]\ndevices = "cpu"\n[model]\nmodel = "HuggingFaceTB/SmolLM2-135M-Instruct"\n'
    "[training]\nseed = 1\n"
)
PLUGINS = """\
import numpy as np

def varying(ctx):
    return [a * h for a, h in zip(ctx.episode_advantages_G, ctx.uncertainties_G_T)]

def flat(ctx):
    return [np.full(len(lp), a) for a, lp in zip(ctx.episode_advantages_G, ctx.logprobs_G_T)]
"""


def explain(capsys, *args: str) -> tuple[int, dict]:
    code = main(["explain", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def doctor_fails(capsys, *args: str) -> list[str]:
    code = main(["doctor", *args, "--no-network", "--json"])
    checks = json.loads(capsys.readouterr().out)["checks"]
    fails = [f"{c['name']}: {c['detail']}" for c in checks if c["status"] == "FAIL"]
    assert (code == 1) == bool(fails)
    return fails


def refused_by_the_run(path: Path) -> str:
    """What the run's own preflight says (it needs no model either)."""
    with pytest.raises(RetrainError) as exc:
        preflight(load_config(path))
    return str(exc.value)


@pytest.mark.parametrize(
    "key", ["advantage_mode", "transform_mode", "algorithm_mode", "uncertainty_kind"]
)
def test_a_plugin_that_cannot_be_imported(project, capsys, key):
    path = project / "c.toml"
    path.write_text(BASE + f'[algorithm]\n{key} = "foo.bar.baz"\n')
    # the run names the key too (startup.preflight_problems, shared with explain)
    assert refused_by_the_run(path).startswith(f"[algorithm] {key}: cannot import module 'foo.bar'")
    code, report = explain(capsys, str(path))
    assert code == 2
    (error,) = [e for e in report["errors"] if "foo.bar" in e]
    assert error.startswith(f"[algorithm] {key} ({path}:8): cannot import module 'foo.bar' ")
    assert "Fix: make" in error
    (fail,) = [f for f in doctor_fails(capsys, str(path)) if "foo.bar" in f]
    assert fail.startswith(f"run checks: [algorithm] {key} ({path}:8)")
    # given as a flag, the flag is named
    flag = "--" + key.replace("_", "-")
    path.write_text(BASE)
    code, report = explain(capsys, str(path), flag, "foo.bar.baz")
    assert code == 2
    assert any(e.startswith(f"[algorithm] {key} (from {flag}): cannot") for e in report["errors"])


def test_advantage_params_the_mode_does_not_read(project, capsys):
    path = project / "c.toml"
    path.write_text(
        BASE + '[algorithm]\nadvantage_mode = "grpo_std"\n[algorithm.advantage_params]\nfoo = 1\n'
    )
    assert "advantage_mode 'grpo_std' does not read 'foo'" in refused_by_the_run(path)
    code, report = explain(capsys, str(path))
    assert code == 2
    assert (
        f"[algorithm.advantage_params] foo ({path}:10): advantage_mode 'grpo_std' does not "
        in (report["errors"][0])
    )
    assert any("does not read 'foo'" in f for f in doctor_fails(capsys, str(path)))


def test_a_token_varying_plugin_transform_on_a_backend_that_aggregates(project, capsys):
    """prime_rl sends one advantage per completion: a plugin transform whose advantages
    vary within a completion is found only by probing it, as the run's preflight does."""
    (project / "plugins").mkdir()
    (project / "plugins" / "mytx.py").write_text(PLUGINS)
    path = project / "c.toml"
    # prime_rl's trainer reads run_* directories only
    base = BASE.replace("[backend]\n", '[backend]\nadapter_path = "out/run_p"\n')
    path.write_text(base + '[algorithm]\ntransform_mode = "mytx.varying"\n')
    flags = ["--backend", "prime_rl"]
    assert "does not preserve token-level advantages" in refused_by_the_run_with(path, flags)
    code, report = explain(capsys, str(path), *flags)
    assert code == 2
    (error,) = report["errors"]
    assert error.startswith(f"[algorithm] transform_mode ({path}:9): backend 'prime_rl' does not")
    # one advantage per completion: the same backend takes it
    code, report = explain(capsys, str(path), *flags, "--transform-mode", "mytx.flat")
    assert code == 0 and report["errors"] == []
    # the local backend keeps token advantages
    assert explain(capsys, str(path))[1]["errors"] == []


def refused_by_the_run_with(path: Path, flags: list[str]) -> str:
    with pytest.raises(RetrainError) as exc:
        preflight(load_config(path, flags))
    return str(exc.value)


def test_a_campaign_condition_is_preflighted_as_its_runs_are(project, capsys):
    path = project / "c.toml"
    path.write_text(
        BASE + "[campaign]\nseeds = [1, 2]\nmax_steps = 5\n[[campaign.conditions]]\n"
        'advantage_mode = "maxrl"\ntransform_mode = "nope.mod.fn"\n'
        '[[campaign.conditions]]\nadvantage_mode = "grpo"\ntransform_mode = "none"\n'
    )
    code, report = explain(capsys, str(path))
    assert code == 2
    (error,) = [e for e in report["errors"] if "nope" in e]
    assert error.startswith("[algorithm] transform_mode: cannot import module 'nope.mod'")
    assert error.endswith("(condition maxrl+nope.mod.fn)")


@pytest.fixture
def no_tinker_key(monkeypatch, tmp_path):
    """No key in the environment, no credential command, no key stored by `tinker auth
    login` (under HOME); whatever a test's .env loads is removed after it."""
    pytest.importorskip("tinker")
    for name in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD"):
        monkeypatch.setenv(name, "")  # recorded, so a value .env sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_tinker_without_an_api_key(project, capsys, no_tinker_key):
    path = project / "t.toml"
    path.write_text('[backend]\nbackend = "tinker"\n[training]\nseed = 1\n')
    code, report = explain(capsys, str(path))
    assert code == 2
    (error,) = report["errors"]
    assert error.startswith(
        f"[backend] backend ({path}:2): tinker needs a Tinker API key: TINKER_API_KEY is not set"
    )
    assert "Fix: TINKER_API_KEY=tml-..." in error
    assert any("TINKER_API_KEY is not set" in f for f in doctor_fails(capsys, str(path)))
    # a key the SDK refuses
    (project / ".env").write_text("TINKER_API_KEY=abc\n")
    code, report = explain(capsys, str(path))
    assert (
        code == 2 and "TINKER_API_KEY is set but the tinker SDK refuses it" in report["errors"][0]
    )


def test_tinker_with_its_api_key_in_dotenv(project, capsys, no_tinker_key):
    path = project / "t.toml"
    path.write_text('[backend]\nbackend = "tinker"\n[training]\nseed = 1\n')
    (project / ".env").write_text("TINKER_API_KEY=tml-test\n")
    code, report = explain(capsys, str(path))
    assert code == 0 and report["errors"] == []
    assert doctor_fails(capsys, str(path)) == []


def test_tinker_with_a_key_stored_by_tinker_auth_login(project, capsys, no_tinker_key, tmp_path):
    """The SDK also takes the key `tinker auth login` stores (~/.tinker/credentials.json)."""
    path = project / "t.toml"
    path.write_text('[backend]\nbackend = "tinker"\n[training]\nseed = 1\n')
    stored = tmp_path / "home" / ".tinker" / "credentials.json"
    stored.parent.mkdir(parents=True)
    stored.write_text("{}")
    code, report = explain(capsys, str(path))
    assert code == 0 and report["errors"] == []
