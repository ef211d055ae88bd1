"""Short training runs on the tiny random model with plugins written exactly as the
original retrain's README and docs show them, loaded by dotted paths from the working
directory; and the original-era ``entropy_mask`` transform end to end."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

import pytest

from retrain.compat import config_from_dict  # the original keys too (entropy_mask_rho)
from retrain.logs.console import Console
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

# The original README's "Custom Transform (TOML-first)" module, verbatim.
README_MODULE = (
    Path(__file__).parents[1] / "fixtures/original_plugins/readme_transform.py"
).read_text()

# The original docs' "Custom transform (context-style)" module, verbatim.
DOCS_MODULE = """
from retrain import TransformOutput

def my_transform(ctx):
    scale = float(ctx.params.get("scale", 1.0))
    token_advs = []
    for i, logprobs in enumerate(ctx.logprobs_G):
        token_advs.append([ctx.episode_advantages[i] * scale for _ in logprobs])
    return TransformOutput(token_advs=token_advs)
"""


def _run(raw: dict) -> list[dict]:
    assert train(config_from_dict(raw), console=Console(live=False)) == 0
    rows, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    return rows


@pytest.fixture
def in_workdir(tiny_raw, tmp_path, monkeypatch):
    """tiny_raw for 2 steps, run from tmp_path with the default plugin search path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # search paths added here go away after
    raw = copy.deepcopy(tiny_raw)
    raw["plugins"] = {"search_paths": ["plugins"]}
    raw["training"]["max_steps"] = 2
    yield raw
    for name in ("my_transforms", "plugins.my_transform", "plugins"):
        sys.modules.pop(name, None)


def test_readme_transform_spec_runs_from_the_working_directory(in_workdir, tmp_path):
    (tmp_path / "my_transforms.py").write_text(textwrap.dedent(README_MODULE))
    in_workdir["algorithm"] = {
        "advantage_mode": "maxrl",
        "transform_mode": "my_transforms.make_transform_spec",
    }
    rows = _run(in_workdir)
    assert rows[0]["condition"] == "maxrl+my_transforms.make_transform_spec"
    assert "my_transforms" in sys.modules


def test_docs_context_transform_runs_from_the_plugins_directory(in_workdir, tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "my_transform.py").write_text(textwrap.dedent(DOCS_MODULE))
    in_workdir["algorithm"] = {
        "advantage_mode": "maxrl",
        "transform_mode": "plugins.my_transform.my_transform",
        "transform_params": {"scale": 2.0},
    }
    rows = _run(in_workdir)
    assert rows[0]["condition"] == "maxrl+plugins.my_transform.my_transform"
    assert "plugins.my_transform" in sys.modules


@pytest.mark.parametrize(
    "rho",
    [
        {"surprisal_mask_rho": 0.5},
        {"entropy_mask_rho": 0.5},  # the original's older key
        {"transform_params": {"surprisal_mask_rho": 0.5}},  # overrides the [algorithm] key
    ],
)
def test_entropy_mask_run_logs_its_metrics(in_workdir, rho):
    in_workdir["algorithm"] = {"advantage_mode": "grpo", "transform_mode": "entropy_mask", **rho}
    rows = _run(in_workdir)
    kept = [r for r in rows if r.get("kept_groups", 1)]
    assert kept, rows
    for row in kept:
        assert 0.0 < row["entropy_mask_fraction"] < 1.0
        assert row["entropy_mask_threshold"] >= 0.0
