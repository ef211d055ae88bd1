"""Held-out evaluation in a real run on the tiny random model, and `retrain eval`."""

from __future__ import annotations

import copy
import json

import pytest
from run_helpers import QuietConsole

from retrain.cli.main import main as cli_main
from retrain.config import config_from_dict
from retrain.config.toml_writer import config_to_toml
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train


def _with_eval(raw: dict, **eval_table) -> dict:
    raw = copy.deepcopy(raw)
    raw["eval"] = {"every": 1, "size": 5, "temperature": 0.0, "samples": 1, **eval_table}
    return raw


def test_run_evaluates_before_step_zero_every_step_and_at_the_end(tiny_raw, tmp_path):
    raw = _with_eval(tiny_raw)
    raw["training"]["max_steps"] = 2
    console = QuietConsole()
    assert train(config_from_dict(raw), console=console) == 0
    log = tmp_path / "logs"

    evals, bad = read_jsonl(log / "eval.jsonl")
    assert not bad
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert r["kind"] == "eval"
        assert r["eval_num_problems"] == 5 and r["eval_k"] == 1
        assert 0.0 <= r["eval_correct_rate"] <= 1.0
        # greedy with one sample: pass@1 is the correct rate
        assert r["eval_pass_at_k"] == pytest.approx(r["eval_correct_rate"])

    rows, _ = read_jsonl(log / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]  # evaluations are not training steps
    for r in rows:
        assert r["eval_step"] == r["step"] + 1
        match = next(e for e in evals if e["step"] == r["eval_step"])
        assert r["eval_correct_rate"] == match["eval_correct_rate"]
        assert {"eval_mean_reward", "eval_pass_at_k"} <= set(r)

    lines = [line for line in console.lines if line.startswith("Eval after")]
    assert [line.split()[2] for line in lines] == ["0", "1", "2"]
    assert "held-out correct=" in lines[0] and "pass@1=" in lines[0]
    assert any(line.startswith("Held-out set: 5 problems") for line in console.lines)
    assert "held-out correct rate" in console.lines[-1]


def test_eval_off_by_default_writes_nothing(tiny_raw, tmp_path):
    raw = copy.deepcopy(tiny_raw)
    raw["training"]["max_steps"] = 1
    assert train(config_from_dict(raw), console=QuietConsole()) == 0
    assert not (tmp_path / "logs" / "eval.jsonl").exists()
    rows, _ = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert not any(k.startswith("eval_") for k in rows[0])


def test_retrain_eval_on_a_saved_adapter_and_the_base_model(tiny_raw, tmp_path, capsys):
    raw = _with_eval(tiny_raw, every=0)  # evaluation off in training: the command still works
    raw["training"].update(max_steps=2, save_every=1)
    config = config_from_dict(raw)
    assert train(config, console=QuietConsole()) == 0
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config_to_toml(config), encoding="utf-8")
    adapter = tmp_path / "adapter" / "final"
    out = tmp_path / "eval_final.json"

    # the run's adapter_path is not an adapter: refused before any model loads, naming
    # the adapters it holds (the final one first, then the newest checkpoint)
    capsys.readouterr()
    assert cli_main(["eval", str(adapter.parent), "--config", str(cfg_path)]) == 2
    got = capsys.readouterr()
    step1 = adapter.parent / "checkpoint_step_1"
    assert f"holds no adapter_model.safetensors; it holds the saved adapters {adapter}, " in got.err
    fix = f"{step1}. Fix: retrain eval {adapter} --config {cfg_path}\n"
    assert fix in got.err and got.out == ""
    assert cli_main(["eval", str(tmp_path), "--config", str(cfg_path)]) == 2
    assert "a run saves one at [backend] adapter_path/final" in capsys.readouterr().err

    assert cli_main(["eval", str(adapter), "--config", str(cfg_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out correct=" in printed
    data = json.loads(out.read_text())
    assert data["adapter"] == str(adapter)
    assert data["eval_num_problems"] == 5
    assert {"eval_correct_rate", "eval_mean_reward", "eval_pass_at_k"} <= set(data)

    base_out = tmp_path / "eval_base.json"
    code = cli_main(
        ["eval", "base", "--config", str(cfg_path), "--out", str(base_out), "--size", "3"]
    )
    assert code == 0
    base = json.loads(base_out.read_text())
    assert base["adapter"] == "base" and base["eval_num_problems"] == 3


def test_retrain_eval_rejects_a_missing_adapter(tiny_raw, tmp_path, capsys):
    config = config_from_dict(_with_eval(tiny_raw))
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config_to_toml(config), encoding="utf-8")
    code = cli_main(["eval", str(tmp_path / "nope"), "--config", str(cfg_path)])
    assert code != 0
    assert "nope" in capsys.readouterr().err


def test_greedy_sampling_is_argmax_with_logprob_zero(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from retrain.engines.pytorch import PyTorchEngine
    from retrain.types import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    engine = PyTorchEngine(model, {0}, 0, torch.device("cpu"))
    prompts = [[5, 6, 7], [8, 9]]
    a = engine.sample(prompts, 2, SamplingParams(max_tokens=5, temperature=0.0, seed=1))
    b = engine.sample(prompts, 2, SamplingParams(max_tokens=5, temperature=0.0, seed=2))
    for ga, gb, prompt in zip(a, b, prompts):
        assert [s.token_ids.tolist() for s in ga] == [s.token_ids.tolist() for s in gb]
        assert ga[0].token_ids.tolist() == ga[1].token_ids.tolist()
        assert all((s.logprobs == 0).all() for s in ga)
        with torch.no_grad():  # the first token is the argmax of the prompt's next-token logits
            logits = model(torch.tensor([prompt])).logits[0, -1]
        assert ga[0].token_ids[0] == int(logits.argmax())


def test_resume_keeps_the_evaluations_up_to_the_checkpoint(tiny_raw, tmp_path):
    raw = _with_eval(tiny_raw)
    raw["training"]["max_steps"] = 2
    assert train(config_from_dict(raw), console=QuietConsole()) == 0
    raw["training"]["max_steps"] = 3
    raw["resume"] = {"from": str(tmp_path / "logs")}
    console = QuietConsole()
    assert train(config_from_dict(raw), console=console) == 0
    evals, _ = read_jsonl(tmp_path / "logs" / "eval.jsonl")
    assert [r["step"] for r in evals] == [0, 1, 2, 3]  # no second evaluation before step 2
    assert [line.split()[2] for line in console.lines if line.startswith("Eval after")] == ["3"]
