"""The training loop on the local backend, end to end on a tiny random Llama (CPU)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from grad_recorder import step_gradients
from run_helpers import QuietConsole

from retrain.backends.local import LocalBackend
from retrain.build import build_backend
from retrain.cli.main import main as cli_main
from retrain.config import config_from_dict
from retrain.errors import CheckpointError, ConfigError, TrainingError
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train
from retrain.types import Datum, SamplingParams, TrainHyper

METRIC_FIELDS = {
    "step",
    "condition",
    "loss",
    "mean_reward",
    "correct_rate",
    "running_correct_rate",
    "num_datums",
    "batch_size",
    "group_size",
    "sepa_lambda",
    "sepa_gate_open",
    "step_time_s",
    "time_sampling_s",
    "time_scoring_s",
    "time_advantages_s",
    "time_training_s",
    "tokens_generated",
    "max_token_hit_rate",
    "exec_entropy_mean",
    "exec_entropy_var",
    "plan_entropy_mean",
    "plan_entropy_var",
    "grad_norm",
    "log_ratio_mean",
    "skipped_all_correct",
    "skipped_all_wrong",
}
GENERATION_FIELDS = {
    "step",
    "prompt",
    "completion",
    "reward",
    "answer",
    "reference",
    "num_tokens",
    "stop_reason",
}


def run(raw: dict, **kw) -> tuple[int, list[str]]:
    console = QuietConsole()
    code = train(config_from_dict(raw), console=console, **kw)
    return code, console.lines


def lora_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def test_run_writes_logs_checkpoints_and_a_loadable_adapter(tiny_raw, tmp_path, tiny_model_dir):
    code, lines = run(tiny_raw)
    assert code == 0
    step_lines = [line for line in lines if line.startswith("Step ")]
    assert len(step_lines) == 3
    assert step_lines[0].startswith("Step 0 [grpo+gtpo_hicra] | loss=")
    for part in ("| reward=", "| correct=", "% | datums=", "| bs=2 | gs=4 | sepa_l=", "| time="):
        assert part in step_lines[0]
    assert any(line.startswith("  group: ") and "correct | answer=" in line for line in lines)

    logs = Path(tiny_raw["logging"]["log_dir"])
    rows, bad = read_jsonl(logs / "metrics.jsonl")
    assert not bad and [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) >= METRIC_FIELDS
    assert sum(r["num_datums"] for r in rows) > 0, (
        "the parity reward should give informative groups"
    )
    gens, _ = read_jsonl(logs / "emergence" / "generations.jsonl")
    assert len(gens) == 3 * 2 * 4 and set(gens[0]) >= GENERATION_FIELDS
    steps, _ = read_jsonl(logs / "emergence" / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    resolved = config_from_dict(
        __import__("tomllib").loads((logs / "config.resolved.toml").read_text())
    )
    assert resolved == config_from_dict(tiny_raw)
    state = json.loads((logs / "trainer_state.json").read_text())
    assert (
        state["step"] == 3 and state["finished"] is True and "position" in json.dumps(state["data"])
    )
    assert json.loads((logs / "run.json").read_text())["status"] == "finished"

    adapter = Path(tiny_raw["backend"]["adapter_path"])
    assert (adapter / "checkpoint_step_2" / "adapter_model.safetensors").exists()
    final = adapter / "final"
    # LoRA B starts at zero; training must have moved it.
    assert any(t.abs().max() > 0 for k, t in lora_tensors(final).items() if "lora_B" in k)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = base(ids).logits
        tuned = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir), final
        )
        after = tuned(ids).logits
    assert not torch.allclose(before, after, atol=1e-6)


def _generations(log_dir: Path) -> list[tuple]:
    rows, _ = read_jsonl(log_dir / "emergence" / "generations.jsonl")
    return [
        (r["step"], r["group"], r["index"], r["completion"], r["num_tokens"], r["reward"])
        for r in rows
    ]


def test_resume_reproduces_the_uninterrupted_run(tiny_raw, tmp_path):
    straight = copy.deepcopy(tiny_raw)
    straight["training"].update(max_steps=4, save_every=2)
    straight["logging"]["log_dir"] = str(tmp_path / "straight")
    straight["backend"]["adapter_path"] = str(tmp_path / "a1")
    assert run(straight)[0] == 0

    part = copy.deepcopy(straight)
    part["logging"]["log_dir"] = str(tmp_path / "split")
    part["backend"]["adapter_path"] = str(tmp_path / "a2")
    part["training"]["max_steps"] = 2
    assert run(part)[0] == 0
    resumed = copy.deepcopy(part)
    resumed["training"]["max_steps"] = 4
    resumed["resume"] = {"from": part["logging"]["log_dir"]}
    code, lines = run(resumed)
    assert code == 0 and any("Resumed from" in line for line in lines)
    # again, with max_steps already reached: nothing to do, said before any model loads
    code, lines = run(resumed)
    assert code == 0 and not any("Loading train model" in line for line in lines), lines
    assert lines[-1] == (
        f"Nothing to do: the run in {part['logging']['log_dir']} has trained 4 steps and "
        "max_steps is 4 (set --max-steps above 4 to continue)."
    )

    a, b = Path(straight["logging"]["log_dir"]), Path(part["logging"]["log_dir"])
    assert _generations(a) == _generations(b)
    ra, _ = read_jsonl(a / "metrics.jsonl")
    rb, _ = read_jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    for x, y in zip(ra, rb, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
        assert x["mean_reward"] == y["mean_reward"]
    ta = lora_tensors(Path(straight["backend"]["adapter_path"]) / "final")
    tb = lora_tensors(Path(part["backend"]["adapter_path"]) / "final")
    for k in ta:
        assert torch.allclose(ta[k], tb[k], atol=1e-6), k


def test_a_checkpoint_that_does_not_load_lets_the_model_go(tiny_raw, tmp_path, monkeypatch):
    """A resume whose checkpoint is damaged fails after the model loaded, naming the file
    (not safetensors' own error): the run's parts are closed (a notebook that calls train() again must not keep the first model on its
    GPU), and the damaged checkpoint and the run's rows are left as they were."""
    assert run(tiny_raw)[0] == 0
    logs = Path(tiny_raw["logging"]["log_dir"])
    state = json.loads((logs / "trainer_state.json").read_text())
    weights = Path(state["checkpoint"]["adapter"]) / "adapter_model.safetensors"
    weights.write_bytes(b"not safetensors")
    rows = (logs / "metrics.jsonl").read_bytes()
    closed = []
    real_close = LocalBackend.close
    monkeypatch.setattr(LocalBackend, "close", lambda self: closed.append(1) or real_close(self))
    resumed = copy.deepcopy(tiny_raw)
    resumed["training"]["max_steps"] = 5
    resumed["resume"] = {"from": str(logs)}
    with pytest.raises(CheckpointError, match="adapter_model.safetensors does not load") as e:
        run(resumed)
    assert "SafetensorError" in str(e.value) and "Fix: put back an undamaged copy" in str(e.value)
    assert closed == [1]
    assert weights.read_bytes() == b"not safetensors"
    assert (logs / "metrics.jsonl").read_bytes() == rows


def test_resume_refuses_a_different_rank_and_names_it(tiny_raw, tmp_path):
    assert run(tiny_raw)[0] == 0
    other = copy.deepcopy(tiny_raw)
    other["model"]["lora_rank"] = 8
    other["training"]["max_steps"] = 5
    other["resume"] = {"from": tiny_raw["logging"]["log_dir"]}
    # refused at the run's start, before the model loads: a config error
    with pytest.raises(ConfigError, match=r"\[resume\] from: .*lora_rank: checkpoint 4, config 8"):
        run(other)


def test_resume_from_dir_without_state_names_the_path(tiny_raw, tmp_path, capsys):
    empty = tmp_path / "empty_logs"
    empty.mkdir()
    path = tmp_path / "c.toml"
    from retrain.config.toml_writer import config_to_toml

    path.write_text(config_to_toml(config_from_dict(tiny_raw)))
    code = cli_main([str(path), "--resume", str(empty)])
    out, err = capsys.readouterr()
    assert code == 2 and str(empty / "trainer_state.json") in err and "Traceback" not in err
    assert "[resume] from" in err and "Loading train model" not in out + err


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tiny_raw, monkeypatch):
    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(max_steps=4, save_every=1)
    calls = {"n": 0}
    original = LocalBackend._logprobs  # the training step's forward pass

    def poisoned(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls["n"] += 1
        return out * float("nan") if calls["n"] > 2 else out

    monkeypatch.setattr(LocalBackend, "_logprobs", poisoned)
    with pytest.raises(TrainingError, match="non-finite"):
        run(raw)
    logs = Path(raw["logging"]["log_dir"])
    state = json.loads((logs / "trainer_state.json").read_text())
    assert 1 <= state["step"] < 4
    assert Path(state["checkpoint"]["adapter"]).exists()
    assert state["checkpoint"]["backend"] == "local"
    assert json.loads((logs / "run.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("failing_call", [1, 3])
def test_a_failed_run_says_which_checkpoint_is_kept_and_how_to_resume(
    tiny_raw, monkeypatch, failing_call
):
    """An error retrain does not name (a bug, injected in the third optimizer step, or
    the first) keeps its traceback; the run's last lines say what was saved."""
    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(max_steps=4, save_every=1)
    calls = {"n": 0}
    original = LocalBackend._optimize

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise RuntimeError("injected")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "_optimize", failing)
    console = QuietConsole()
    with pytest.raises(RuntimeError, match="injected"):
        train(config_from_dict(raw), console=console)
    assert console.lines[-2] == "Run failed on an unexpected error (its traceback follows)."
    if failing_call == 1:  # step 0's row is not written: no --overwrite needed
        assert console.lines[-1].startswith(
            "Nothing was saved before the failure. Once fixed, start the run again: retrain"
        )
        assert "--overwrite" not in console.lines[-1]
    else:
        adapter = Path(raw["backend"]["adapter_path"], "checkpoint_step_2")
        assert console.lines[-1].startswith(
            f"Once fixed, the last checkpoint, after step 2 ({adapter}), is kept. "
            "Resume with: retrain"
        )
        assert console.lines[-1].endswith(f"--resume {raw['logging']['log_dir']}")


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from retrain.config import load_config
    from retrain.trainer import train

    real_save = torch.save
    def dying_save(obj, f, *a, **k):
        # Die (like SIGKILL: no cleanup) while writing the second checkpoint.
        if "checkpoint_step_2" in str(f):
            os._exit(137)
        return real_save(obj, f, *a, **k)
    torch.save = dying_save
    sys.exit(train(load_config(sys.argv[1])))
    """
)


def test_kill_during_checkpoint_keeps_previous_checkpoint(tiny_raw, tmp_path):
    from retrain.config.toml_writer import config_to_toml

    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(max_steps=4, save_every=1)
    cfg_path = tmp_path / "kill.toml"
    cfg_path.write_text(config_to_toml(config_from_dict(raw)))
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(cfg_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert proc.returncode == 137, proc.stderr[-2000:]
    logs = Path(raw["logging"]["log_dir"])
    state = json.loads((logs / "trainer_state.json").read_text())
    assert state["step"] == 1
    adapter = Path(raw["backend"]["adapter_path"])
    assert not (adapter / "checkpoint_step_2").exists()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(raw["model"]["model"]), adapter / "checkpoint_step_1"
    )
    # ...and the run resumes from it.
    resumed = copy.deepcopy(raw)
    resumed["resume"] = {"from": str(logs)}
    code, lines = run(resumed)
    assert code == 0 and any("at step 1" in line for line in lines)
    rows, _ = read_jsonl(logs / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def test_sigterm_stops_after_the_step_and_saves(tiny_raw, tmp_path):
    from retrain.config.toml_writer import config_to_toml

    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(max_steps=200, save_every=0)
    cfg_path = tmp_path / "long.toml"
    cfg_path.write_text(config_to_toml(config_from_dict(raw)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrain.cli.main", str(cfg_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    out = []
    deadline = time.time() + 120
    for line in proc.stdout:
        out.append(line)
        if line.startswith("Step 1 ") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(out) + rest
    assert proc.returncode == 143, text[-2000:]
    assert "Resume with: retrain" in text and "--resume" in text
    state = json.loads((Path(raw["logging"]["log_dir"]) / "trainer_state.json").read_text())
    assert 2 <= state["step"] < 200 and state["finished"] is False
    assert (
        json.loads((Path(raw["logging"]["log_dir"]) / "run.json").read_text())["status"]
        == "interrupted"
    )


def test_preflight_refuses_shannon_entropy_without_entropies(tiny_raw, tmp_path, monkeypatch):
    (tmp_path / "plain_backend.py").write_text("class PlainBackend:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["backend"] = "plain_backend.PlainBackend"
    raw["algorithm"] = {
        "advantage_mode": "grpo",
        "transform_mode": "none",
        "uncertainty_kind": "shannon_entropy",
    }
    with pytest.raises(TrainingError, match="shannon_entropy"):
        run(raw)
    raw["algorithm"] = {"advantage_mode": "grpo", "transform_mode": "gtpo"}
    with pytest.raises(TrainingError, match="token-level advantages"):
        run(raw)
    assert not Path(raw["logging"]["log_dir"]).exists()


def test_shannon_entropy_runs_on_local(tiny_raw):
    raw = copy.deepcopy(tiny_raw)
    raw["training"]["max_steps"] = 1
    raw["algorithm"]["uncertainty_kind"] = "shannon_entropy"
    assert run(raw)[0] == 0
    rows, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    assert rows[0]["token_entropy_mean"] > 0


# ---------------------------------------------------------------- backend-level checks


@pytest.fixture
def backend(tiny_raw, tiny_model_dir):
    from transformers import AutoTokenizer

    config = config_from_dict(tiny_raw)
    b = build_backend(config, AutoTokenizer.from_pretrained(tiny_model_dir), say=lambda s: None)
    with torch.no_grad():  # a non-trivial adapter, so the check covers LoRA too
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return b


def test_sampler_and_trainer_logprobs_agree(backend):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # different lengths: left padding
    groups = backend.sample(prompts, 3, SamplingParams(max_tokens=10, temperature=0.7, seed=5))
    for prompt, group in zip(prompts, groups, strict=True):
        with torch.no_grad():
            logp = backend.completion_logprobs(prompt, [s.token_ids for s in group], 0.7)
        for i, s in enumerate(group):
            assert s.stop_reason in ("eos", "length")
            assert torch.allclose(
                logp[i, : len(s.token_ids)], torch.from_numpy(s.logprobs).float(), atol=1e-4
            )


def test_sampling_is_seeded(backend):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    a = backend.sample([[5, 6, 7]], 4, params)
    b = backend.sample([[5, 6, 7]], 4, params)
    c = backend.sample([[5, 6, 7]], 4, SamplingParams(max_tokens=8, temperature=1.0, seed=12))
    ids = lambda g: [s.token_ids.tolist() for s in g[0]]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_prefix_caching_off_samples_the_same_distribution(tiny_raw, tiny_model_dir):
    from transformers import AutoTokenizer

    raw = copy.deepcopy(tiny_raw)
    raw["inference"] = {"prefix_caching": False}
    b = build_backend(
        config_from_dict(raw), AutoTokenizer.from_pretrained(tiny_model_dir), say=lambda s: None
    )
    group = b.sample([[5, 6, 7], [8, 9]], 2, SamplingParams(max_tokens=6, temperature=1.0, seed=1))
    for prompt, g in zip([[5, 6, 7], [8, 9]], group, strict=True):
        with torch.no_grad():
            logp = b.completion_logprobs(prompt, [s.token_ids for s in g], 1.0)
        for i, s in enumerate(g):
            assert torch.allclose(
                logp[i, : len(s.token_ids)], torch.from_numpy(s.logprobs).float(), atol=1e-4
            )


def test_micro_batching_does_not_change_the_update(backend):
    groups = backend.sample(
        [[5, 6, 7, 8], [9, 10]], 4, SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    )
    datums = [
        Datum(prompt, s.token_ids, s.logprobs, [0.5 - (i % 2)] * len(s.token_ids))
        for prompt, g in zip([[5, 6, 7, 8], [9, 10]], groups, strict=True)
        for i, s in enumerate(g)
    ]
    hyper = TrainHyper(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    big, grad_big = step_gradients(backend, datums, hyper, 10_000)
    small, grad_small = step_gradients(backend, datums, hyper, 12)  # one completion per chunk
    assert big.loss == pytest.approx(small.loss, abs=1e-6)
    assert any(a.abs().max() > 1e-3 for a in grad_big)  # a real gradient
    for a, b in zip(grad_big, grad_small, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_split_mode_syncs_the_sampler(tiny_raw, tiny_model_dir):
    from transformers import AutoTokenizer

    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["devices"] = "cpu,cpu"
    b = build_backend(
        config_from_dict(raw), AutoTokenizer.from_pretrained(tiny_model_dir), say=lambda s: None
    )
    assert b.split_mode and b.sampler_model is not b.model
    assert b.sizing.sampler == "auto"  # the same device: the sampler's memory is its
    group = b.sample([[5, 6, 7]], 4, SamplingParams(max_tokens=6, temperature=1.0, seed=3))[0]
    datums = [
        Datum([5, 6, 7], s.token_ids, s.logprobs, [1.0 if i < 2 else -1.0] * len(s.token_ids))
        for i, s in enumerate(group)
    ]
    b.train_step(datums, TrainHyper(lr=1e-2, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8))
    trained = dict(b.model.named_parameters())
    for name, p in b.sampler_model.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, trained[name])
    assert any(p.abs().max() > 0 for n, p in b.sampler_model.named_parameters() if "lora_B" in n)
