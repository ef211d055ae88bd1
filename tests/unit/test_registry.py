"""The registry entries: one definition record per built-in name, no phantom entries."""

from __future__ import annotations

import pytest

from retrain import registry
from retrain.backends.base import backend_info
from retrain.cli.main import main
from retrain.config import config_from_dict, load_config
from retrain.config.schema import TABLES, table_fields
from retrain.config.validate import flow_problems, static_token_varying
from retrain.errors import ConfigError, PluginError
from retrain.types import BackendCapabilities, EngineTraits

ENTRIES = [(kind, e) for kind, reg in registry.ALL_REGISTRIES.items() for e in reg.entries]
TARGETS = [(kind, e.name) for kind, e in ENTRIES if e.target]
NOT_BUILT = [(kind, e.name) for kind, e in ENTRIES if e.not_built]
ALIASES = [(kind, e.name, a) for kind, e in ENTRIES for a in e.aliases]


def _key(kind: str) -> tuple[str, str]:
    """The TOML (table, key) that names a registry's kind, from `Registry.key`."""
    table, _, key = registry.ALL_REGISTRIES[kind].key.partition("] ")
    return table.lstrip("["), key


@pytest.mark.parametrize(("kind", "name"), TARGETS, ids=[f"{k}:{n}" for k, n in TARGETS])
def test_every_builtin_target_imports(kind, name):
    obj = registry.ALL_REGISTRIES[kind].resolve(name)
    assert obj is not None


def test_every_entry_is_a_target_an_alias_or_not_built():
    for kind, e in ENTRIES:
        assert not (e.target and e.not_built), f"{kind} {e.name}: both a target and not_built"
        assert e.target or e.not_built or e.alias_of, f"{kind} {e.name}: a phantom entry"
        assert e.available == (not e.not_built)


def test_algorithm_aliases_name_builtin_pairs():
    for e in registry.ALGORITHM_MODES.entries:
        assert e.alias_of is not None and not e.target
        adv, tx = e.alias_of
        assert registry.ADVANTAGE_MODES.entry(adv).available
        assert registry.TRANSFORM_MODES.entry(tx).available


def test_registry_keys_name_schema_fields():
    fields = {(t, s.key): s for t in TABLES for s in table_fields(t)}
    for kind in registry.ALL_REGISTRIES:
        spec = fields[_key(kind)]
        assert spec.meta["registry"] == kind  # load checks the key through this registry


@pytest.fixture
def planned_engine(monkeypatch):
    """Every built-in name works today, so the not-built path is checked with a planned
    engine added to the registry (the mechanism any future name would use)."""
    planned = registry.Entry(
        "warp", description="a future server engine", not_built='use engine = "pytorch"'
    )
    engines = registry.Registry(
        "engine", (*registry.ENGINES.entries, planned), key=registry.ENGINES.key
    )
    monkeypatch.setattr(registry, "ENGINES", engines)
    monkeypatch.setitem(registry.ALL_REGISTRIES, "engine", engines)
    return engines


def test_every_builtin_name_is_built():
    assert NOT_BUILT == []  # a name that is listed must work (see planned_engine)


def test_not_built_names_fail_config_load(planned_engine, tmp_path, capsys):
    table, key = _key("engine")
    path = tmp_path / "retrain.toml"
    path.write_text(f'[training]\nseed = 1\n[{table}]\n{key} = "warp"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problem = next(p for p in info.value.problems if f"[{table}] {key}" in p)
    assert f"{path}:4" in problem and "not built in this version" in problem
    assert planned_engine.entry("warp").not_built in problem
    assert main(["explain", str(path)]) == 2
    assert f"[{table}] {key}" in capsys.readouterr().err


def test_not_built_names_are_never_listed_as_available(planned_engine):
    assert "warp" in planned_engine.names() and "warp" not in planned_engine.names(
        available_only=True
    )
    with pytest.raises(PluginError, match="not built"):
        planned_engine.resolve("warp")


def test_backend_info_refuses_a_backend_that_is_not_built(monkeypatch):
    planned = registry.Entry("planned", description="a future backend", not_built="use local")
    backends = registry.Registry(
        "backend", (*registry.BACKENDS.entries, planned), key=registry.BACKENDS.key
    )
    monkeypatch.setattr(registry, "BACKENDS", backends)
    with pytest.raises(PluginError, match="not built"):
        backend_info("planned")
    info = backend_info("tinker")
    assert info.source == "builtin" and "[inference]" in info.ignores
    prime = backend_info("prime_rl")  # built: scalar advantages, placeholder loss, resume
    assert prime.source == "builtin" and not prime.capabilities.reports_sync_loss
    assert not prime.capabilities.preserves_token_advantages
    assert prime.capabilities.supports_checkpoint_resume
    assert prime.options["sync_wait_s"].default == 30
    assert prime.options["sync_poll_s"].default == 0.2
    assert "[inference] engine" in prime.ignores


@pytest.mark.parametrize(("kind", "name", "alias"), ALIASES)
def test_aliases_resolve(kind, name, alias):
    reg = registry.ALL_REGISTRIES[kind]
    assert reg.canonical(alias) == name and reg.entry(alias) is reg.entry(name)
    assert reg.check(alias) is None
    assert reg.resolve(alias) is reg.resolve(name)


@pytest.mark.parametrize(
    ("reg", "typo", "close"),
    [
        (registry.BACKENDS, "tinkr", "tinker"),
        (registry.TRANSFORM_MODES, "gtpo_sepaa", "gtpo_sepa"),
        (registry.UNCERTAINTY_KINDS, "pred_varr", "pred_var"),
        (registry.REWARDS, "mathh", "math"),
    ],
)
def test_check_suggests_a_close_name(reg, typo, close):
    problem = reg.check(typo)
    assert problem and f"did you mean {close!r}" in problem
    assert "valid:" in problem


def test_dotted_paths_only_where_plugins_are_allowed():
    assert registry.BACKENDS.check("pkg.mod.Backend") is None
    assert registry.REWARDS.check("pkg.mod.reward") is not None


# ---------------------------------------------------------------- the flow checks


def _config(**algorithm):
    return config_from_dict({"algorithm": algorithm}) if algorithm else config_from_dict({})


def test_static_token_varying_reads_the_entries():
    assert static_token_varying(_config(transform_mode="gtpo")) is True
    assert static_token_varying(_config(transform_mode="none")) is False
    assert static_token_varying(_config(algorithm_mode="maxrl_gtpo_sepa")) is True
    assert static_token_varying(_config(transform_mode="my_pkg.tx.fn")) is None
    assert static_token_varying(_config(algorithm_mode="my_pkg.algo.fn")) is None


def test_token_varying_flow_on_an_aggregating_backend():
    config = _config(transform_mode="gtpo")
    aggregating = BackendCapabilities(preserves_token_advantages=False)
    (key, message), *_ = flow_problems(config, aggregating, token_varying=True)
    assert key == "[algorithm] transform_mode"
    assert "token-level advantages" in message and "Fix:" in message
    assert flow_problems(config, aggregating, token_varying=None) == []  # unknown: skipped
    assert flow_problems(config, aggregating, token_varying=False) == []
    keyed = flow_problems(_config(algorithm_mode="maxrl_gtpo"), aggregating, token_varying=True)
    assert keyed[0][0] == "[algorithm] algorithm_mode"


def test_shannon_entropy_needs_entropies():
    config = _config(transform_mode="none", uncertainty_kind="shannon_entropy")
    problems = flow_problems(config, BackendCapabilities(), token_varying=False)
    assert [k for k, _ in problems] == ["[algorithm] uncertainty_kind"]
    assert "shannon_entropy" in problems[0][1] and "Fix:" in problems[0][1]
    local = registry.BACKENDS.entry("local").capabilities
    assert flow_problems(config, local, token_varying=False) == []


def test_shannon_entropy_needs_an_engine_that_returns_them(monkeypatch):
    quiet = registry.Entry(
        "pytorch",
        "retrain.engines.pytorch:build",
        engine_traits=EngineTraits(in_process=True, token_data=()),
    )
    config = _config(transform_mode="none", uncertainty_kind="shannon_entropy")
    monkeypatch.setattr(registry, "ENGINES", registry.Registry("inference engine", (quiet,)))
    local = registry.BACKENDS.entry("local").capabilities
    problems = flow_problems(config, local, token_varying=False)
    assert problems and "engine 'pytorch'" in problems[0][1]


def test_flow_is_checked_at_load_for_builtin_backends():
    with pytest.raises(ConfigError, match="uncertainty_kind"):
        config_from_dict(
            {"backend": {"backend": "tinker"}, "algorithm": {"uncertainty_kind": "shannon_entropy"}}
        )
    # a plugin backend is only known at preflight
    config_from_dict(
        {"backend": {"backend": "pkg.mod.B"}, "algorithm": {"uncertainty_kind": "shannon_entropy"}}
    )
