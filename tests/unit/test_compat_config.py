"""Configs, keys and flags of the original retrain (teilomillet/retrain, 2026-02-25)."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.cli.main import main
from retrain.cli.run import config_path
from retrain.compat import config_from_dict, later_keys, load_config, original_keys
from retrain.config import ConfigError, flag_table
from retrain.config.schema import Config, table_fields

FIXTURES = Path(__file__).parent.parent / "fixtures" / "original_configs"
ORIGINAL_CONFIGS = sorted(FIXTURES.glob("*.toml"))
# Configs whose [[campaign.conditions]] override run keys (retrain/campaign/conditions.py).


def _param(path: Path):
    return pytest.param(path, id=path.name)


def test_there_are_original_configs():
    assert len(ORIGINAL_CONFIGS) >= 20


@pytest.mark.parametrize("path", [_param(p) for p in ORIGINAL_CONFIGS])
def test_original_config_explains_cleanly(path, capsys, one_gpu, monkeypatch):
    """On the machine they were written for: a CUDA device, the hub reachable, a Tinker key."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    code = main(["explain", str(path)])
    err = capsys.readouterr().err
    assert code == 0, err


def test_entropy_mask_rho_fixture_reads_as_surprisal_mask_rho():
    config = load_config(FIXTURES / "entropy-mask-yue.toml")
    assert config.algorithm.surprisal_mask_rho == 0.2
    assert config.campaign.conditions[0]["transform_mode"] == "entropy_mask"


# ---------------------------------------------------------------- keys


def test_every_original_field_maps_to_a_schema_key():
    for field, (table, key) in original_keys.ORIGINAL_FIELDS.items():
        assert key in {s.key for s in table_fields(table)}, field
    for field, (table, key) in original_keys.LATER_FIELDS_SUPPORTED.items():
        assert key in {s.key for s in table_fields(table)}, field


def test_new_keys_and_defaults():
    c = Config()
    assert c.training.top_p == 0.95  # the original retrain's default
    assert c.algorithm.surprisal_mask_rho == 0.0
    assert c.reward.correct_threshold == 0.5


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"training": {"top_p": 0.0}}, "[training] top_p"),
        ({"training": {"top_p": 1.5}}, "[training] top_p"),
        ({"algorithm": {"surprisal_mask_rho": -0.1}}, "[algorithm] surprisal_mask_rho"),
        ({"algorithm": {"entropy_mask_rho": 1.5}}, "written as entropy_mask_rho"),
        ({"reward": {"correct_threshold": "high"}}, "[reward] correct_threshold"),
    ],
)
def test_new_keys_are_checked(raw, expected):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert expected in str(info.value)


def test_renamed_keys_load():
    c = config_from_dict(
        {
            "algorithm": {"entropy_mask_rho": 0.3, "params": {"alpha": 0.1}},
            "optimizer": {"grad_clip_norm": 0.5},
            "plugins": {"search_paths": "plugins, more"},
        }
    )
    assert c.algorithm.surprisal_mask_rho == 0.3
    assert c.algorithm.transform_params == {"alpha": 0.1}
    assert c.optimizer.max_grad_norm == 0.5
    assert c.plugins.search_paths == ["plugins", "more"]


def test_params_tables_merge_and_clash():
    c = config_from_dict(
        {"algorithm": {"params": {"a": 1}, "transform_params": {"b": 2}, "advantage_params": {}}}
    )
    assert c.algorithm.transform_params == {"a": 1, "b": 2}
    with pytest.raises(ConfigError, match=r"\[algorithm\] params.*keep only transform_params"):
        config_from_dict({"algorithm": {"params": {"a": 1}, "transform_params": {"a": 2}}})


def test_both_spellings_with_different_values_are_an_error():
    with pytest.raises(ConfigError, match="entropy_mask_rho is the original's name"):
        config_from_dict({"algorithm": {"entropy_mask_rho": 0.1, "surprisal_mask_rho": 0.2}})
    same = config_from_dict({"algorithm": {"entropy_mask_rho": 0.2, "surprisal_mask_rho": 0.2}})
    assert same.algorithm.surprisal_mask_rho == 0.2


def test_renamed_key_error_names_the_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[algorithm]\n\nentropy_mask_rho = 7\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}:3, written as entropy_mask_rho" in str(info.value)


@pytest.mark.parametrize(("table", "key"), sorted(later_keys.LATER))
def test_every_later_key_is_an_error_naming_its_version(table, key):
    with pytest.raises(ConfigError) as info:
        config_from_dict({table: {key: 1}})
    text = str(info.value)
    assert f"[{table}] {key}" in text
    assert "not supported in this build" in text and "after 2026-02-25" in text


def test_later_key_error_names_file_and_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nlr = 1e-5\nkl_cov_coef = 0.2\n\n[echo]\nenabled = true\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"[training] kl_cov_coef ({path}:3)" in str(info.value)
    assert f"[echo] enabled ({path}:6)" in str(info.value)
    assert "ECHO" in str(info.value)


def test_later_table_without_keys_is_an_error():
    with pytest.raises(ConfigError, match=r"\[optimizer_batch\].*not supported"):
        config_from_dict({"optimizer_batch": {}})


def test_legacy_prime_rl_keys_say_where_they_go():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"backend": {"prime_rl_transport": "zmq"}})
    assert "[backend] prime_rl_transport" in str(info.value)
    assert "[backend.options] as transport" in str(info.value)


def test_unknown_keys_still_get_did_you_mean():
    with pytest.raises(ConfigError, match=r"\[training\] top_pp.*did you mean 'top_p'"):
        config_from_dict({"training": {"top_pp": 0.9}})
    with pytest.raises(ConfigError, match=r"unknown table \[ecco\]"):
        config_from_dict({"ecco": {"enabled": True}})


def test_later_field_message_for_condition_keys():
    assert "not supported in this build" in later_keys.later_field_message("kl_cov_coef")
    assert later_keys.later_field_message("lr") is None


# ---------------------------------------------------------------- flags


def test_every_original_flag_sets_its_key():
    flags = flag_table()
    for flag, (table, key) in original_keys.alias_flags().items():
        spec = flags[flag]
        assert (spec.table, spec.key) == (table, key), flag


def test_original_flags_parse():
    c = config_from_dict(
        {},
        [
            "--bp-enabled", "yes",
            "--bp-max-batch-size", "32",
            "--optim-beta1", "0.8",
            "--optim-eps", "1e-6",
            "--tinker-max-concurrent", "2",
            "--tinker-throttle-dir", "/tmp/t",
            "--top-p", "0.95",
            "--surprisal-mask-rho", "0.2",
            "--inference-dtype", "bf16",
            "--sepa-correct-rate-gate", "0",
            "--lora-alpha", "16",
            "--plugins-search-paths", "a,b",
            "--grad-clip-norm", "0.3",
            "--resume-from", "logs/x",
        ],
    )  # fmt: skip
    assert c.backpressure.enabled is True and c.backpressure.max_batch_size == 32
    assert c.optimizer.beta1 == 0.8 and c.optimizer.eps == 1e-6
    assert c.backend.max_concurrent == 2 and c.backend.throttle_dir == "/tmp/t"
    assert c.training.top_p == 0.95 and c.algorithm.surprisal_mask_rho == 0.2
    assert c.inference.dtype == "bf16" and c.sepa.correct_rate_gate == 0.0
    assert c.lora.alpha == 16 and c.plugins.search_paths == ["a", "b"]
    assert c.optimizer.max_grad_norm == 0.3 and c.resume.from_ == "logs/x"


@pytest.mark.parametrize(("word", "value"), [("1", True), ("No", False), ("off", False)])
def test_bool_flags_take_the_originals_words(word, value):
    assert config_from_dict({}, ["--prefix-caching", word]).inference.prefix_caching is value


def test_bool_flag_rejects_other_words():
    with pytest.raises(ConfigError, match=r"\[backpressure\] enabled.*expected a bool"):
        config_from_dict({}, ["--bp-enabled", "maybe"])


def test_param_flags_add_to_the_toml_tables():
    raw = {
        "backend": {"options": {"threads": 2}},
        "algorithm": {"params": {"alpha": 0.1}, "advantage_params": {"scale": 1.0}},
    }
    c = config_from_dict(
        raw,
        [
            "--backend-opt", "micro_batch_tokens=2048",
            "--algorithm-param", "alpha=0.5",
            "--transform-param", "cap=0.1",
            "--transform-param", 'name="x"',
            "--advantage-param=scale=2",
            "--advantage-param", "tags=[1, 2]",
            "--advantage-param", "word=hello",
        ],
    )  # fmt: skip
    assert c.backend.options == {"threads": 2, "micro_batch_tokens": 2048}
    assert c.algorithm.transform_params == {"alpha": 0.5, "cap": 0.1, "name": "x"}
    assert c.algorithm.advantage_params == {"scale": 2, "tags": [1, 2], "word": "hello"}


def test_param_flag_values_are_checked_by_the_backend_schema():
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        config_from_dict({}, ["--backend-opt", "micro_batch_tokens=zero"])


@pytest.mark.parametrize("value", ["novalue", "=3"])
def test_param_flag_needs_key_value(value):
    with pytest.raises(ConfigError, match="takes key=value"):
        config_from_dict({}, ["--backend-opt", value])


def test_flag_wins_over_the_originals_spelling_in_the_toml():
    c = config_from_dict({"algorithm": {"entropy_mask_rho": 0.1}}, ["--surprisal-mask-rho", "0.4"])
    assert c.algorithm.surprisal_mask_rho == 0.4


def test_later_flag_is_an_error_naming_its_version():
    with pytest.raises(ConfigError) as info:
        config_from_dict({}, ["--kl-cov-coef", "0.2"])
    assert "--kl-cov-coef ([training] kl_cov_coef)" in str(info.value)
    assert "after 2026-02-25" in str(info.value)


def test_unknown_flag_still_gets_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean '--bp-enabled'"):
        config_from_dict({}, ["--bp-enabld", "true"])


def test_help_flags_lists_the_param_flags(capsys):
    assert main(["--help-flags"]) == 0
    out = capsys.readouterr().out
    assert "--backend-opt KEY=VALUE" in out and "--optim-beta1" in out


# ---------------------------------------------------------------- no TOML


def test_flags_without_a_toml_run_on_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, flags = config_path(["--lr", "1e-4", "--bp-enabled", "true"])
    assert path is None
    c = load_config(path, flags)
    assert c.training.lr == 1e-4 and c.backpressure.enabled is True
    assert c.model.model == Config().model.model


def test_bare_retrain_without_a_toml_still_asks_for_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_path([]) == ("retrain.toml", [])
    with pytest.raises(ConfigError, match="retrain init"):
        load_config("retrain.toml")


def test_an_existing_retrain_toml_is_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "retrain.toml").write_text("[training]\nlr = 3e-5\n")
    path, flags = config_path(["--seed", "3"])
    assert path == "retrain.toml"
    c = load_config(path, flags)
    assert c.training.lr == 3e-5 and c.training.seed == 3
