"""Back pressure wired into the training loop (tiny model, CPU)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from retrain.config import config_from_dict
from retrain.logs.console import Console
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import Trainer, train

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


def usl_throughput(batch_size: int) -> float:
    """A known USL curve (lambda 10, sigma 0.1, kappa 0.05: peak near 4.2 prompts)."""
    p = float(batch_size)
    return 10.0 * p / (1.0 + 0.1 * (p - 1.0) + 0.05 * p * (p - 1.0))


def test_batch_size_follows_the_controller_and_survives_resume(tiny_raw, tmp_path, monkeypatch):
    # Measured throughput depends on the machine: inject a fixed curve so every decision,
    # and so the resumed run's batch sizes, are deterministic.
    monkeypatch.setattr(Trainer, "throughput", staticmethod(lambda r: usl_throughput(r.batch_size)))
    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(max_steps=9, save_every=5, batch_size=2)
    raw["backpressure"] = {
        "enabled": True,
        "warmup_steps": 4,
        "min_batch_size": 1,
        "max_batch_size": 8,
    }
    lines = _run(raw)
    rows, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    sizes = [r["batch_size"] for r in rows]
    assert sizes[:4] == [1, 2, 4, 8]  # the warmup ladder explores batch sizes
    assert [r["bp_regime"] for r in rows[:3]] == ["warmup"] * 3
    assert all(r["bp_regime"] != "warmup" for r in rows[3:])  # it left warmup...
    # ...throttled back from 8 and holds one size below the curve's peak (4.2 prompts),
    # by the throttle margin
    assert len(set(sizes[4:])) == 1 and 3 <= sizes[4] <= 4
    assert all(set(r) >= BP_KEYS for r in rows)
    step_lines = [line for line in lines if line.startswith("Step ")]
    assert [int(line.split("| bs=")[1].split(" ")[0]) for line in step_lines] == sizes
    gens, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "emergence" / "generations.jsonl")
    assert len(gens) == sum(s * raw["training"]["group_size"] for s in sizes)

    # Resume at step 5 (the checkpoint) and compare with the straight run.
    part = copy.deepcopy(raw)
    part["logging"]["log_dir"] = str(tmp_path / "part")
    part["backend"]["adapter_path"] = str(tmp_path / "part_adapter")
    part["training"]["max_steps"] = 5
    _run(part)
    state = json.loads((tmp_path / "part" / "trainer_state.json").read_text())
    assert state["backpressure"] and state["batch_size"] == sizes[5]
    resumed = copy.deepcopy(part)
    resumed["training"]["max_steps"] = 9
    resumed["resume"] = {"from": str(tmp_path / "part")}
    _run(resumed)
    rows2, _ = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    assert [r["batch_size"] for r in rows2] == sizes
    assert [r["bp_regime"] for r in rows2] == [r["bp_regime"] for r in rows]
    assert [r["bp_p_star"] for r in rows2] == [r["bp_p_star"] for r in rows]


def test_peaks_give_each_step_its_side_of_the_ridge_point(tiny_raw, tmp_path):
    """With both peaks set, every step's FLOPs and bytes (retrain/roofline.py, from the
    tiny model's config.json) meet the ridge point: a tiny peak rate puts any step above
    it (compute_bound), a tiny bandwidth below it (memory_bound)."""
    for name, peaks, regime in (
        ("fast_memory", {"peak_gflops": 1e-6, "peak_bw_gb_s": 1e6}, "compute_bound"),
        ("slow_memory", {"peak_gflops": 1e6, "peak_bw_gb_s": 1e-6}, "memory_bound"),
    ):
        raw = copy.deepcopy(tiny_raw)
        raw["training"].update(max_steps=2, save_every=0)
        raw["logging"]["log_dir"] = str(tmp_path / name)
        raw["backend"]["adapter_path"] = str(tmp_path / f"{name}_adapter")
        raw["backpressure"] = {"enabled": True, "warmup_steps": 4, **peaks}
        _run(raw)
        rows, _ = read_jsonl(tmp_path / name / "metrics.jsonl")
        assert [r["bp_roofline"] for r in rows] == [regime, regime]
    raw["backpressure"] = {"enabled": True, "warmup_steps": 4}  # no peaks: no hint
    raw["logging"]["log_dir"] = str(tmp_path / "none")
    raw["backend"]["adapter_path"] = str(tmp_path / "none_adapter")
    _run(raw)
    rows, _ = read_jsonl(tmp_path / "none" / "metrics.jsonl")
    assert all("bp_roofline" not in r for r in rows)
