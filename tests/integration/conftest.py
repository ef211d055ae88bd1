"""Fixtures for runs of the real training loop on a tiny random model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_model import make_tiny_model  # noqa: E402

# A reward the random tiny model earns about half the time, so groups are informative.
PARITY_REWARD = "def score(response, reference):\n    return float(sum(map(ord, response)) % 2)\n"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def tiny_raw(tmp_path, tiny_model_dir) -> dict:
    """A raw TOML mapping for a 3-step run on the tiny model (edit before building)."""
    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    return {
        "backend": {
            "backend": "local",
            "devices": "cpu",
            "adapter_path": str(tmp_path / "adapter"),
            # A fixed thread count: float sums depend on it, and the default policy picks
            # it from the box's load, which would make bit-level comparisons load-dependent.
            # float32 matmuls: "auto" picks bf16 on CPUs with AVX512-BF16, so tolerances
            # would depend on the machine (test_precision.py covers bf16).
            "options": {"threads": 1, "dtype": "fp32"},
        },
        "model": {"model": str(tiny_model_dir), "lora_rank": 4},
        "algorithm": {"advantage_mode": "grpo", "transform_mode": "gtpo_hicra"},
        "training": {
            "seed": 3,
            "max_steps": 3,
            "batch_size": 2,
            "group_size": 4,
            "max_tokens": 6,
            "temperature": 1.0,
            "lr": 5e-3,
            "save_every": 2,
        },
        "data": {
            "source": "reasoning_gym",
            "task": "basic_arithmetic",
            "size": 50,
            "args": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        },
        "reward": {"type": "custom", "custom_module": str(tmp_path / "parity_reward.py")},
        "logging": {"log_dir": str(tmp_path / "logs"), "group_lines": 1},
        "plugins": {"search_paths": [str(tmp_path)]},
    }
