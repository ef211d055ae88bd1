"""Back pressure wired into the training loop (tiny model, CPU)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from retrain.config import config_from_dict
from retrain.logs.console import Console
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

BP_KEYS = {
    "bp_action",
    "bp_regime",
    "bp_p_star",
    "bp_sigma",
    "bp_kappa",
    "bp_utilization",
    "bp_throughput",
}


def _run(raw: dict) -> list[str]:
    lines: list[str] = []

    class Capture(Console):
        def print(self, text: str = "") -> None:
            lines.append(text)

    assert train(config_from_dict(raw), console=Capture(live=False)) == 0
    return lines


def test_batch_size_follows_the_controller_and_survives_resume(tiny_raw, tmp_path):
    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(max_steps=5, save_every=3, batch_size=2)
    raw["backpressure"] = {
        "enabled": True,
        "warmup_steps": 4,
        "min_batch_size": 1,
        "max_batch_size": 4,
    }
    lines = _run(raw)
    rows, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    sizes = [r["batch_size"] for r in rows]
    assert len(set(sizes)) > 1, sizes  # the warmup ladder explores batch sizes
    assert sizes[:3] == [1, 2, 4]
    assert all(set(r) >= BP_KEYS for r in rows)
    assert rows[0]["bp_regime"] == "warmup"
    step_lines = [line for line in lines if line.startswith("Step ")]
    assert [int(line.split("| bs=")[1].split(" ")[0]) for line in step_lines] == sizes
    gens, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "emergence" / "generations.jsonl")
    assert len(gens) == sum(s * raw["training"]["group_size"] for s in sizes)

    # Resume at step 3 (the checkpoint) and compare with the straight run.
    part = copy.deepcopy(raw)
    part["logging"]["log_dir"] = str(tmp_path / "part")
    part["backend"]["adapter_path"] = str(tmp_path / "part_adapter")
    part["training"]["max_steps"] = 3
    _run(part)
    state = json.loads((tmp_path / "part" / "trainer_state.json").read_text())
    assert state["backpressure"] and state["batch_size"] == sizes[3]
    resumed = copy.deepcopy(part)
    resumed["training"]["max_steps"] = 5
    resumed["resume"] = {"from": str(tmp_path / "part")}
    _run(resumed)
    rows2, _ = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    assert [r["batch_size"] for r in rows2] == sizes
    assert [r["bp_regime"] for r in rows2] == [r["bp_regime"] for r in rows]
