"""The multi-turn template on the real embedded model (SmolLM2-135M-Instruct), CPU:
the model plays verifiers guess-the-number games for a few steps and learns the move
format the environment asks for. Minutes on a CPU, so opt-in: `python -m pytest -m slow`.

The reward is solved (1) + 0.1 x well-formed turns (one bracketed number per reply);
what a few steps can move is the format: the share of the model's turns that are one
bracketed number rises from the first steps to the last ones. Every conversation runs
several turns (the environment answers each wrong guess)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from retrain.cli.init import templates
from retrain.config import load_config
from retrain.logs.console import Console
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

# a step is a minute or more on a shared CPU: past the suite's default 600 s timeout
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

STEPS = 8
WINDOW = 3
ONE_GUESS = re.compile(r"\[\s*\d+\s*\]")


def well_formed_share(gens: list[dict], step: int) -> float:
    turns = [
        m["content"]
        for g in gens
        if g["step"] == step
        for m in g["transcript"]
        if m["role"] == "assistant"
    ]
    return sum(len(ONE_GUESS.findall(t)) == 1 for t in turns) / max(1, len(turns))


def test_multiturn_template_learns_the_move_format_on_smollm2(tmp_path):
    cfg = tmp_path / "retrain.toml"
    cfg.write_text(templates()["multiturn"])
    config = load_config(
        cfg,
        [
            "--max-steps",
            str(STEPS),
            "--lr",
            "1e-3",
            "--save-every",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--adapter-path",
            str(tmp_path / "adapter"),
        ],
    )
    assert train(config, str(cfg), console=Console(live=False)) == 0
    rows, bad = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert not bad and [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["turns_mean"] > 1 and r["env_errors"] == 0 for r in rows)
    assert sum(r["trained_tokens"] for r in rows) > 0
    gens, _ = read_jsonl(tmp_path / "logs" / "emergence" / "generations.jsonl")
    shares = [well_formed_share(gens, s) for s in range(STEPS)]
    first, last = statistics.fmean(shares[:WINDOW]), statistics.fmean(shares[-WINDOW:])
    print(f"\n[multiturn] well-formed share per step: {[round(x, 2) for x in shares]}")
    print(f"[multiturn] mean reward per step: {[round(r['mean_reward'], 3) for r in rows]}")
    assert last > first, f"the move format did not improve: {first:.2f} -> {last:.2f}"
    state = json.loads((tmp_path / "logs" / "trainer_state.json").read_text())
    assert state["finished"] and state["step"] == STEPS
    assert Path(tmp_path / "adapter" / "final").exists()
