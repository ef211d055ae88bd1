"""`retrain backends` and `retrain plugins`."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from retrain import registry
from retrain.cli import plugins as plugins_cli
from retrain.cli.main import main


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def project(project):
    """The shared project directory (tests/unit/conftest.py), with an empty plugins/ folder."""
    (project / "plugins").mkdir()
    return project


HOOKED_BACKEND = '''
from retrain.types import BackendCapabilities, OptionSpec

class HookedBackend:
    """A backend that describes itself."""
    retrain_backend_capabilities = staticmethod(lambda: BackendCapabilities(True, True, False, False))
    RETRAIN_BACKEND_OPTION_SCHEMA = {
        "endpoint": {"type": str, "default": "http://x", "help": "where"},
        "retries": OptionSpec("int", 3, "how often"),
    }
    def __init__(self, config, tokenizer, say=print): pass
    def sample(self, prompts_B, n, params): return []
    def train_step(self, datums, hyper): return None

class PlainBackend:
    def __init__(self, config, tokenizer, say=print): pass
    def sample(self, prompts_B, n, params): return []
    def train_step(self, datums, hyper): return None
'''

MODULE_CAPS_BACKEND = """
RETRAIN_BACKEND_CAPABILITIES = {"reports_sync_loss": False, "preserves_token_advantages": True,
                                "supports_checkpoint_resume": True, "resume_runtime_dependent": False}

class Backend:
    def sample(self, prompts_B, n, params): return []
    def train_step(self, datums, hyper): return None
"""


# ---------------------------------------------------------------- backends


def test_backends_text_lists_builtins_capabilities_and_hooks(project, capsys):
    code, out, _ = run(["backends"], capsys)
    assert code == 0
    for name in ("local", "tinker", "prime_rl"):
        assert f"{name}  (source=builtin" in out
    assert "prime_rl  (source=builtin, not built)" not in out  # built since issue #14
    prime = out[out.index("prime_rl  (source=builtin") :]
    assert "reports_sync_loss=no" in prime and "strict_advantages" in prime
    assert "test receiver" in prime  # says what it was tested against
    assert "preserves_token_advantages=no" in out  # the plugin default
    for hook in (
        "retrain_backend_capabilities",
        "RETRAIN_BACKEND_CAPABILITIES",
        "retrain_backend_option_schema",
        "RETRAIN_BACKEND_OPTION_SCHEMA",
    ):
        assert hook in out
    assert "pip install 'retrain[local]'" in out
    assert "micro_batch_tokens" in out and "keepalive_s" in out
    assert "source=plugin/default" in out
    engines = out[out.index("Inference engines") :]
    assert "pytorch" in engines and "vllm" in engines and "LoRA sync" in engines


def test_backends_json_matches_the_registry_entries(project, capsys):
    code, out, _ = run(["backends", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    by_name = {b["name"]: b for b in data["backends"]}
    assert set(registry.BACKENDS.names()) <= set(by_name)
    for entry in registry.BACKENDS.entries:
        row = by_name[entry.name]
        assert row["source"] == "builtin"
        assert row["available"] is entry.available
        assert row["not_built"] == entry.not_built
        assert row["ignored_sections"] == list(entry.ignores)
        assert row["dependency_hint"] == entry.install
        assert isinstance(row["installed"], bool)
        if entry.available:
            assert row["capabilities"] == entry.capabilities.as_dict()
            assert set(row["options"]) == set(entry.options)
        else:  # never shown as usable
            assert row["capabilities"] is None and row["installed"] is False
    assert by_name["prime_rl"]["available"] is True
    assert by_name["prime_rl"]["options"]["transport"]["choices"] == ["filesystem", "zmq"]
    engines = {e["name"]: e for e in data["engines"]}
    assert list(engines) == registry.ENGINES.names()
    assert engines["pytorch"]["available"] is True
    assert engines["vllm"]["available"] is True and not engines["vllm"]["not_built"]
    assert engines["vllm"]["supports"]["default_url"] == "http://127.0.0.1:8000"
    assert engines["sglang"]["supports"]["verified"].startswith("wire format only")
    assert data["hooks"] == {
        "capabilities": ["retrain_backend_capabilities", "RETRAIN_BACKEND_CAPABILITIES"],
        "option_schema": ["retrain_backend_option_schema", "RETRAIN_BACKEND_OPTION_SCHEMA"],
    }
    assert data["plugin_default"]["preserves_token_advantages"] is False
    assert set(data["capability_fields"]) >= {"reports_sync_loss", "resume_runtime_dependent"}


def test_naming_a_backend_that_is_not_built_exits_1(project, capsys, monkeypatch):
    planned = registry.Entry("planned", description="a future backend", not_built="use local")
    backends = registry.Registry(
        "backend", (*registry.BACKENDS.entries, planned), key=registry.BACKENDS.key
    )
    monkeypatch.setattr(registry, "BACKENDS", backends)
    code, _, _ = run(["backends", "planned"], capsys)
    assert code == 1
    assert run(["backends", "prime_rl"], capsys)[0] == 0


def test_dotted_backend_with_and_without_hooks(project, capsys):
    mod = unique("mybackends")
    (project / "plugins" / f"{mod}.py").write_text(HOOKED_BACKEND)
    code, out, _ = run(["backends", "--json"], capsys)  # discovered on plugins/
    assert code == 0
    by_name = {b["name"]: b for b in json.loads(out)["backends"]}
    hooked = by_name[f"{mod}.HookedBackend"]
    assert hooked["source"] == "plugin"
    assert hooked["capabilities"]["reports_sync_loss"] is True
    assert hooked["capabilities"]["supports_checkpoint_resume"] is False
    assert hooked["options"]["endpoint"]["type"] == "str"
    assert hooked["options"]["retries"]["default"] == 3
    plain = by_name[f"{mod}.PlainBackend"]
    assert plain["source"] == "plugin/default"
    assert plain["capabilities"]["preserves_token_advantages"] is False
    code, out, _ = run(["backends"], capsys)
    assert f"{mod}.PlainBackend  (source=plugin/default)" in out


def test_module_level_hook_and_explicit_name(project, capsys, tmp_path):
    mod = unique("modcaps")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{mod}.py").write_text(MODULE_CAPS_BACKEND)
    sys.path.insert(0, str(elsewhere))
    code, out, _ = run(["backends", f"{mod}.Backend", "--json"], capsys)
    assert code == 0
    entry = next(b for b in json.loads(out)["backends"] if b["name"] == f"{mod}.Backend")
    assert entry["source"] == "plugin"
    assert entry["capabilities"]["preserves_token_advantages"] is True


def test_configured_backend_is_reported_and_bad_name_is_an_error(project, capsys):
    mod = unique("cfgbackend")
    (project / "plugins" / f"{mod}.py").write_text(HOOKED_BACKEND)
    (project / "retrain.toml").write_text(f'[backend]\nbackend = "{mod}.PlainBackend"\n')
    code, out, _ = run(["backends", "--json"], capsys)
    assert code == 0
    assert f"{mod}.PlainBackend" in {b["name"] for b in json.loads(out)["backends"]}
    code, out, _ = run(["backends", "nosuchmod_xyz.Backend", "--json"], capsys)
    assert code == 1
    entry = next(b for b in json.loads(out)["backends"] if b["name"] == "nosuchmod_xyz.Backend")
    assert entry["error"] and entry["source"] == "plugin/default"


# ---------------------------------------------------------------- plugins


def test_plugins_lists_every_builtin_kind(project, capsys):
    code, out, _ = run(["plugins"], capsys)
    assert code == 0
    for kind in plugins_cli.KINDS:
        assert plugins_cli.KIND_TITLES[kind] in out
        for name in registry.ALL_REGISTRIES[kind].names():
            assert f"  {name} " in out
    vllm = next(line for line in out.splitlines() if line.startswith("  vllm "))
    assert "not built" not in vllm and registry.ENGINES.entry("vllm").description in vllm
    algo = next(line for line in out.splitlines() if line.startswith("  maxrl_gtpo "))
    assert "alias of advantage_mode maxrl, transform_mode gtpo" in algo
    code, out, _ = run(["plugins", "--json"], capsys)
    data = json.loads(out)
    for kind in (
        "advantage_mode",
        "transform_mode",
        "algorithm_mode",
        "reward",
        "data_source",
        "backend",
        "engine",
        "policy_loss",
    ):
        assert [e["name"] for e in data["builtin"][kind]] == registry.ALL_REGISTRIES[kind].names()
    engines = {e["name"]: e for e in data["builtin"]["engine"]}
    assert engines["pytorch"]["available"] and engines["pytorch"]["target"]
    assert engines["vllm"]["available"] and engines["vllm"]["target"]
    algo = data["builtin"]["algorithm_mode"][0]
    assert algo["alias_of"] == ["maxrl", "gtpo"] and algo["target"] == ""
    assert data["search_paths"] == ["plugins"] and data["discovered"] == []


PLUGIN_MODULE = '''
import numpy as np
from retrain.advantages import AlgorithmContext, TransformContext, TransformOutput
from retrain.data.base import DataSource

def my_transform(ctx: TransformContext) -> TransformOutput:
    """Doubles everything."""
    return TransformOutput([2 * a * np.ones(len(lp)) for a, lp in zip(ctx.episode_advantages_G, ctx.logprobs_G_T)])

def my_algorithm(ctx: AlgorithmContext):
    return [np.zeros(len(lp)) for lp in ctx.logprobs_G_T]

def my_advantage(rewards, params):
    return [r - sum(rewards) / len(rewards) for r in rewards]

def my_reward(response, reference):
    return float(reference in response)

def my_uncertainty(logprobs):
    return -logprobs

def my_objective(inputs, hyper):
    """-A r, negated."""
    return None

class MySource(DataSource):
    pass

def helper(x, y, z):
    return x

def declared_thing(a):
    return a

RETRAIN_PLUGINS = {"declared_thing": "transform"}
'''


def test_plugins_discovers_and_classifies(project, capsys):
    mod = unique("myplugins")
    (project / "plugins" / f"{mod}.py").write_text(PLUGIN_MODULE)
    (project / "plugins" / f"test_{mod}.py").write_text(
        "raise RuntimeError('tests are not imported')\n"
    )
    code, out, _ = run(["plugins", "--json"], capsys)
    assert code == 0, out
    data = json.loads(out)
    kinds = {p["attr"]: p["kind"] for p in data["discovered"]}
    assert kinds == {
        "my_transform": "transform_mode",
        "my_algorithm": "algorithm_mode",
        "my_advantage": "advantage_mode",
        "my_reward": "reward",
        "my_uncertainty": "uncertainty_kind",
        "my_objective": "policy_loss",
        "MySource": "data_source",
        "declared_thing": "transform_mode",
    }
    entry = next(p for p in data["discovered"] if p["attr"] == "my_transform")
    assert entry["name"] == f"{mod}.my_transform"
    assert entry["toml"] == f'[algorithm] transform_mode = "{mod}.my_transform"'
    assert entry["doc"] == "Doubles everything."
    objective = next(p for p in data["discovered"] if p["kind"] == "policy_loss")
    assert objective["toml"] == f'[training] policy_loss = "{mod}.my_objective"'
    reward = next(p for p in data["discovered"] if p["kind"] == "reward")
    assert f'custom_module = "{mod}"' in reward["toml"]
    code, out, _ = run(["plugins"], capsys)
    assert (
        f"{mod}.my_transform" in out
        and f'use: [algorithm] transform_mode = "{mod}.my_transform"' in out
    )


def test_broken_plugin_strict_and_lenient(project, capsys):
    mod = unique("broken")
    (project / "plugins" / f"{mod}.py").write_text("import does_not_exist_anywhere\n")
    code, out, _ = run(["plugins"], capsys)
    assert code == 1 and f"error: plugin module {mod}" in out and "does_not_exist_anywhere" in out
    (project / "retrain.toml").write_text("[plugins]\nstrict = false\n")
    code, out, _ = run(["plugins"], capsys)
    assert code == 0 and "warning (skipped)" in out


def test_module_shadowing_is_reported(project, capsys):
    (project / "plugins" / "json.py").write_text(
        "def score(response, reference):\n    return 1.0\n"
    )
    code, out, _ = run(["plugins", "--json"], capsys)
    data = json.loads(out)
    assert code == 1
    assert any(p["module"] == "json" and "rename" in p["error"] for p in data["problems"])


def test_configured_dotted_paths_are_resolved(project, capsys, tmp_path):
    mod = unique("installed")
    pkg_dir = tmp_path / "site"
    pkg_dir.mkdir()
    (pkg_dir / f"{mod}.py").write_text(PLUGIN_MODULE)
    (project / "retrain.toml").write_text(
        f'[algorithm]\ntransform_mode = "{mod}.my_transform"\n'
        f'[plugins]\nsearch_paths = ["{pkg_dir}"]\n'
    )
    sys.modules.pop(mod, None)
    code, out, _ = run(["plugins", "--json"], capsys)
    data = json.loads(out)
    assert code == 0
    names = {(p["kind"], p["name"]) for p in data["discovered"]}
    assert ("transform_mode", f"{mod}.my_transform") in names
    (project / "retrain.toml").write_text('[algorithm]\ntransform_mode = "nowhere_mod_q.fn"\n')
    code, out, _ = run(["plugins", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and any("nowhere_mod_q" in p["module"] for p in data["problems"])


def test_search_path_flag(project, capsys, tmp_path):
    extra = tmp_path / "more"
    extra.mkdir()
    mod = unique("extra")
    (extra / f"{mod}.py").write_text("def adv(rewards):\n    return rewards\n")
    code, out, _ = run(["plugins", "--json", "--search-path", str(extra)], capsys)
    data = json.loads(out)
    assert code == 0 and str(extra) in data["search_paths"]
    assert any(
        p["name"] == f"{mod}.adv" and p["kind"] == "advantage_mode" for p in data["discovered"]
    )


def test_the_default_plugins_directory_named_again_is_searched_once(project, capsys):
    """`--search-path` given the absolute path of ./plugins (the default search path):
    one directory, so each of its plugins is listed once."""
    mod = unique("twice")
    (project / "plugins" / f"{mod}.py").write_text("def adv(rewards):\n    return rewards\n")
    code, out, _ = run(["plugins", "--json", "--search-path", str(project / "plugins")], capsys)
    data = json.loads(out)
    assert code == 0 and data["search_paths"] == ["plugins"]
    assert [p["name"] for p in data["discovered"]] == [f"{mod}.adv"]


def test_classify_ignores_non_plugins():
    def two(a, b):
        return a

    assert plugins_cli.classify(two) is None
    assert plugins_cli.classify(len) is None
    assert plugins_cli.classify(Path) is None
