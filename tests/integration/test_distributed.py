"""One run on two processes (torchrun, gloo on the CPU) against the same run on one, on
the tiny model: the same adapter and metrics, a resume on two ranks, a rank that raises,
and the config errors a world of N refuses before any model loads."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_helpers import QuietConsole

from retrain.config import config_from_dict
from retrain.config.toml_writer import config_to_toml
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

ROOT = Path(__file__).resolve().parents[2]
# Rows that measure time, or the gather that only a run on several ranks has.
TIMED = ("time_", "step_time_s", "elapsed", "wall", "tokens_per_s", "completions_per_s", "threads")


def two_rank_raw(tiny_raw: dict, tmp_path: Path, name: str) -> dict:
    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(batch_size=4, max_steps=3, save_every=2)
    raw["logging"]["log_dir"] = str(tmp_path / name / "logs")
    raw["backend"]["adapter_path"] = str(tmp_path / name / "adapter")
    raw["backend"]["options"]["collective_timeout_s"] = 60
    return raw


def torchrun(
    raw: dict, tmp_path: Path, *flags: str, nproc: int = 2, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m retrain run.toml FLAGS` as the user types it (one
    CPU thread per rank: the box has two cores)."""
    path = tmp_path / f"run-{time.monotonic_ns()}.toml"
    path.write_text(config_to_toml(config_from_dict(raw)))
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "retrain", str(path), *flags]
    return subprocess.run(
        cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=400
    )


def one_process(raw: dict) -> int:
    return train(config_from_dict(raw), console=QuietConsole())


def adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def max_diff(a: Path, b: Path) -> float:
    x, y = adapter(a), adapter(b)
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def rows(log_dir: Path) -> list[dict]:
    found, _ = read_jsonl(log_dir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in found]


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], float) and isinstance(y[key], float):
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6, nan_ok=True), key
            else:
                assert x[key] == y[key], key


def test_two_ranks_train_the_adapter_one_process_trains(tiny_raw, tmp_path):
    single = two_rank_raw(tiny_raw, tmp_path, "single")
    assert one_process(single) == 0
    double = two_rank_raw(tiny_raw, tmp_path, "double")
    done = torchrun(double, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    diff = max_diff(
        Path(single["backend"]["adapter_path"]) / "final",
        Path(double["backend"]["adapter_path"]) / "final",
    )
    print(f"max |adapter diff| 2 ranks vs 1: {diff:.3g}")
    assert diff < 1e-5
    a, b = rows(Path(single["logging"]["log_dir"])), rows(Path(double["logging"]["log_dir"]))
    assert_same_rows(a, b)
    # rank 0 alone wrote: one metrics row per step, rank 0's pid in run.json
    state = json.loads((Path(double["logging"]["log_dir"]) / "trainer_state.json").read_text())
    assert len(state["rng"]["ranks"]) == 2
    assert "Done: 3 steps" in done.stdout and done.stdout.count("Done: 3 steps") == 1
