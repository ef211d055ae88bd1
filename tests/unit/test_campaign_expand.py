"""Campaign expansion: one ordinary run config per condition x seed (pure, no I/O)."""

from __future__ import annotations

import dataclasses
import tomllib
from datetime import datetime
from pathlib import Path

import pytest

from retrain import registry
from retrain.campaign.expand import (
    STANDARD_CONDITIONS,
    Condition,
    campaign_conditions,
    campaign_dir_name,
    campaign_root,
    check_runs,
    expand_campaign,
    expand_run,
    uses_throttle,
)
from retrain.config import config_from_dict


def base(**campaign):
    raw = {
        "training": {"max_steps": 7, "seed": 1, "lr": 1e-4},
        "algorithm": {"advantage_mode": "grpo", "transform_mode": "gtpo"},
        "logging": {
            "log_dir": "logs/train",
            "wandb_project": "proj",
            "wandb_tags": "extra, grpo+none",
        },
        "squeeze": {"min_variance_retention": 0.9},
        "campaign": campaign,
    }
    return config_from_dict(raw)


def test_default_matrix_is_five_standard_conditions_times_eight_seeds():
    cfg = base()
    runs = expand_campaign(cfg, "logs/campaign_x")
    assert len(runs) == 40
    assert campaign_conditions(cfg) == [Condition(a, t) for a, t in STANDARD_CONDITIONS]
    assert [r.name for r in runs[:8]] == [
        f"grpo+none_s{s}" for s in (42, 101, 202, 303, 404, 505, 606, 707)
    ]
    assert runs[-1].name == "maxrl+gtpo_sepa_s707"
    assert len({r.name for r in runs}) == 40


def test_each_run_is_an_ordinary_config_with_its_own_paths_and_wandb_labels():
    cfg = base(
        seeds=[3, 4],
        max_steps=2,
        conditions=[
            {"advantage_mode": "maxrl", "transform_mode": "gtpo_hicra"},
            {"advantage_mode": "grpo", "transform_mode": "none"},
        ],
    )
    cfg.algorithm.algorithm_mode = "maxrl_gtpo"  # would override the condition
    cfg.resume.from_ = "logs/campaign_old"
    runs = expand_campaign(cfg, Path("logs/campaign_1"))
    assert [r.name for r in runs] == [
        "maxrl+gtpo_hicra_s3",
        "maxrl+gtpo_hicra_s4",
        "grpo+none_s3",
        "grpo+none_s4",
    ]
    r = runs[1]
    c = r.config
    assert c.campaign is None and c.squeeze is None
    assert (c.algorithm.advantage_mode, c.algorithm.transform_mode) == ("maxrl", "gtpo_hicra")
    assert c.algorithm.algorithm_mode == "" and c.condition == "maxrl+gtpo_hicra"
    assert c.training.seed == 4 and c.training.max_steps == 2 and c.training.lr == 1e-4
    assert c.resume.from_ == ""
    assert c.logging.log_dir == r.log_dir == str(Path("logs/campaign_1/runs/maxrl+gtpo_hicra_s4"))
    assert c.backend.adapter_path == r.adapter_path == str(Path(r.log_dir) / "adapter")
    assert r.config_path == str(Path(r.log_dir) / "run.toml")
    assert r.console_log == str(Path(r.log_dir) / "console.log")
    assert c.logging.wandb_run_name == "maxrl+gtpo_hicra_s4"
    assert c.logging.wandb_group == "maxrl+gtpo_hicra"
    assert c.logging.wandb_tags == "maxrl+gtpo_hicra,seed4,extra,grpo+none"
    assert c.backend.throttle_dir == ""  # local backend: no throttle
    # the base is untouched
    assert (
        cfg.campaign is not None and cfg.training.seed == 1 and cfg.logging.log_dir == "logs/train"
    )
    assert cfg.algorithm.algorithm_mode == "maxrl_gtpo"


def test_run_toml_reloads_to_the_same_config_and_validates():
    cfg = base(seeds=[5], max_steps=3)
    runs = expand_campaign(cfg, "/tmp/c")
    for r in runs:
        assert config_from_dict(tomllib.loads(r.toml())) == r.config
        assert "[campaign]" not in r.toml() and "[squeeze]" not in r.toml()
    assert check_runs(runs) == []


def test_check_runs_reports_conditions_the_backend_cannot_train(monkeypatch):
    # No built-in backend of this version aggregates advantages per completion: make the
    # local one claim it does, for this test only.
    local = registry.BACKENDS.entry("local")
    aggregating = dataclasses.replace(
        local,
        capabilities=dataclasses.replace(local.capabilities, preserves_token_advantages=False),
    )
    cfg = base(seeds=[1], conditions=[{"advantage_mode": "grpo", "transform_mode": "none"}])
    cfg.backend.backend = "local"
    monkeypatch.setitem(registry.BACKENDS._by_name, "local", aggregating)
    ok = expand_run(cfg, Condition("grpo", "none"), 1, "c")
    bad = expand_run(cfg, Condition("maxrl", "gtpo"), 1, "c")
    problems = check_runs([ok, bad])
    assert problems and all(p.startswith("maxrl+gtpo_s1: ") for p in problems)


@pytest.mark.parametrize(
    ("backend", "parallel", "executor", "expected"),
    [
        ("tinker", True, "local", True),
        ("tinker", False, "ray", True),
        ("tinker", False, "local", False),
        ("local", True, "local", False),
    ],
)
def test_throttle_dir_only_for_concurrent_tinker_runs(backend, parallel, executor, expected):
    cfg = base(
        seeds=[1],
        parallel=parallel,
        executor=executor,
        conditions=[{"advantage_mode": "grpo", "transform_mode": "none"}],
    )
    cfg.backend.backend = backend
    assert uses_throttle(cfg) is expected
    (run,) = expand_campaign(cfg, "logs/campaign_t")
    want = str(Path("logs/campaign_t/tinker_throttle")) if expected else ""
    assert run.config.backend.throttle_dir == want
    if expected:  # an explicit throttle_dir wins
        cfg.backend.throttle_dir = "/shared/throttle"
        (run,) = expand_campaign(cfg, "logs/campaign_t")
        assert run.config.backend.throttle_dir == "/shared/throttle"


def test_campaign_directory_naming():
    assert campaign_dir_name(datetime(2025, 3, 4, 5, 6, 7)) == "campaign_20250304_050607"
    cfg = base()
    assert campaign_root(cfg) == Path("logs")
    cfg.logging.log_dir = "results"
    assert campaign_root(cfg) == Path("results")
    cfg.logging.log_dir = "/data/exp/run1"
    assert campaign_root(cfg) == Path("/data/exp")


def test_expand_needs_a_campaign_table():
    cfg = config_from_dict({})
    with pytest.raises(ValueError):
        expand_campaign(cfg, "x")
