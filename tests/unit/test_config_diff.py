"""`config_changes`: a config against the TOML data a run recorded of its own."""

from __future__ import annotations

import tomllib

from retrain.config import config_from_dict
from retrain.config.diff import Change, config_changes, resumed_with
from retrain.config.toml_writer import config_to_toml

BASE = {
    "training": {"lr": 2e-4, "max_steps": 10, "group_size": 8},
    "data": {"source": "reasoning_gym", "task": "chain_sum", "args": {"min_terms": 2}},
    "reward": {"type": "judge", "judge_api_key": "sk-old"},
}


def recorded(raw: dict) -> dict:
    """What a run writes into config.resolved.toml, read back."""
    return tomllib.loads(config_to_toml(config_from_dict(raw)))


def changed(raw: dict, **tables: dict) -> dict:
    out = {table: dict(values) for table, values in raw.items()}
    for table, values in tables.items():
        out.setdefault(table, {}).update(values)
    return out


def test_the_same_config_changes_nothing():
    assert config_changes(recorded(BASE), config_from_dict(BASE)) == []


def test_each_changed_key_in_the_manuals_order():
    now = changed(
        BASE,
        data={"args": {"min_terms": 3}},
        training={"lr": 1e-3, "max_steps": 20},  # max_steps: how a run is continued
        reward={"judge_api_key": "sk-new"},  # a secret is never recorded, nor compared
        resume={"from": "logs/x"},
    )
    changes = config_changes(recorded(BASE), config_from_dict(now))
    assert changes == [
        Change("training", "lr", 2e-4, 1e-3),
        Change("data", "args", {"min_terms": 2}, {"min_terms": 3}),
    ]
    assert list(map(str, changes)) == [
        "[training] lr 0.0002 -> 0.001",
        "[data] args {min_terms = 2} -> {min_terms = 3}",
    ]
    assert resumed_with(changes[:1], 7) == (
        "Resuming with 1 setting changed since the run last started (its config.resolved.toml): "
        "[training] lr 0.0002 -> 0.001. They apply from step 7 on; the steps before it ran "
        "with the old values."
    )


def test_what_the_run_did_not_record_is_no_change():
    old = recorded(BASE)
    del old["sepa"]  # a table an older retrain did not write
    del old["training"]["lr"]  # nor this key
    now = changed(BASE, training={"lr": 1e-3}, sepa={"steps": 7}, gtpo={"beta": 0.5})
    assert config_changes(old, config_from_dict(now)) == [Change("gtpo", "beta", 0.1, 0.5)]


def test_the_run_directories_are_compared_as_places(tmp_path):
    """A resume from elsewhere names the run's directories absolutely: no change where
    they are the places the run, started in `tmp_path`, wrote relatively."""
    raw = changed(BASE, logging={"log_dir": "logs/tiny"}, backend={"adapter_path": "adapters/t"})
    here = changed(
        BASE,
        logging={"log_dir": str(tmp_path / "logs" / "tiny")},
        backend={"adapter_path": str(tmp_path / "adapters" / "t")},
    )
    assert config_changes(recorded(raw), config_from_dict(here), tmp_path) == []
    elsewhere = changed(here, logging={"log_dir": str(tmp_path / "logs" / "other")})
    (change,) = config_changes(recorded(raw), config_from_dict(elsewhere), tmp_path)
    assert change.name == "[logging] log_dir" and change.before == "logs/tiny"
