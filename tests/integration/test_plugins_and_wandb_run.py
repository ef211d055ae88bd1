"""Scaffolded plugins and wandb (offline) inside real short training runs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from retrain.cli.main import main as cli_main
from retrain.config import config_from_dict
from retrain.logs.console import Console
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train


def _train(raw: dict) -> int:
    return train(config_from_dict(raw), console=Console(live=False))


@pytest.mark.parametrize("kind", ["transform", "advantage", "algorithm", "reward"])
def test_scaffolded_plugin_runs_unmodified(tiny_raw, tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    name = f"my_{kind}"
    assert cli_main(["init-plugin", "--kind", kind, "--name", name]) == 0
    raw = copy.deepcopy(tiny_raw)
    raw["plugins"] = {"search_paths": ["plugins"]}
    raw["training"]["max_steps"] = 2
    if kind == "transform":
        raw["algorithm"] = {"advantage_mode": "maxrl", "transform_mode": f"{name}.transform"}
    elif kind == "advantage":
        raw["algorithm"] = {"advantage_mode": f"{name}.advantage", "transform_mode": "none"}
    elif kind == "algorithm":
        raw["algorithm"] = {"algorithm_mode": f"{name}.algorithm"}
    else:
        raw["reward"] = {"type": "custom", "custom_module": name, "custom_function": "score"}
    assert _train(raw) == 0
    rows, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    if kind != "reward":
        assert rows[0]["condition"].count(name) == 1


def test_wandb_offline_run_and_failure_do_not_stop_training(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    raw = copy.deepcopy(tiny_raw)
    raw["training"]["max_steps"] = 2
    raw["logging"]["wandb_project"] = "retrain-test"
    assert _train(raw) == 0
    runs = list((tmp_path / "wb").rglob("*.wandb"))
    assert runs, "an offline run directory with a .wandb file"
    assert runs[0].stat().st_size > 0

    # A broken wandb must only warn: the run and its JSONL go on.
    import wandb

    def boom(*args, **kwargs):
        raise RuntimeError("wandb is down")

    monkeypatch.setattr(wandb, "init", boom)
    raw2 = copy.deepcopy(raw)
    raw2["logging"]["log_dir"] = str(tmp_path / "logs2")
    raw2["backend"]["adapter_path"] = str(tmp_path / "adapter2")  # a second run: its own
    lines: list[str] = []

    class Capture(Console):
        def print(self, text: str = "") -> None:
            lines.append(text)

    assert train(config_from_dict(raw2), console=Capture(live=False)) == 0
    assert any("wandb" in line.lower() for line in lines)
    rows, _ = read_jsonl(tmp_path / "logs2" / "metrics.jsonl")
    assert len(rows) == 2
