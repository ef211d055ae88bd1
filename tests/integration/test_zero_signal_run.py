"""The zero-signal guard, as a user meets it: a run whose every conversation fails, or
whose rewards are all equal, is flagged on every step line and stops after
`[training] zero_signal_steps` such steps with exit 1 and a message naming the cause;
the checkpoint saved before is kept. The real CLI as a process on the tiny model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from cli_run import run_config

pytest.importorskip("verifiers.v1")

REPO = Path(__file__).resolve().parents[2]
ENVS = REPO / "tests" / "fixtures" / "multiturn_envs"
CONSTANT_REWARD = "def score(response, reference):\n    return 1.0\n"


def guarded(tiny_raw: dict, steps: int) -> dict:
    raw = copy.deepcopy(tiny_raw)
    raw["training"].update(max_steps=6, save_every=1, zero_signal_steps=steps)
    return raw


def test_every_conversation_failing_stops_the_run_naming_environment_errors(tiny_raw, tmp_path):
    raw = guarded(tiny_raw, 2)
    raw.pop("data")
    raw.pop("reward")
    raw["environment"] = {"provider": "verifiers", "id": "flaky_env", "args": {"modes": ["raise"]}}
    raw["plugins"]["search_paths"].append(str(ENVS))
    raw["training"].update(max_tokens=4, group_size=2, batch_size=2)
    proc = run_config(tmp_path, raw)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "no trainable datums for 2 consecutive steps" in out, out[-3000:]
    assert "[training] zero_signal_steps = 2" in out
    assert "cause: environment errors" in out
    assert out.count("| NO SIGNAL: environment errors") == 2
    assert "Done:" not in out
    assert "TrainingError" not in out  # the message, not a traceback
    rows = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["zero_signal"] for r in rows] == ["environment errors"] * 2
    assert all("no_answer_rate" not in r for r in rows)  # the env scores its own format
    # the checkpoint of step 1 is intact and resumable
    state = json.loads((tmp_path / "logs" / "trainer_state.json").read_text())
    assert state["step"] == 1 and not state["finished"]
    assert Path(raw["backend"]["adapter_path"], "checkpoint_step_1").is_dir()
    # the run says which checkpoint is kept and the command that goes on from it
    (kept,) = [line for line in out.splitlines() if line.startswith("Once fixed, the last")]
    assert kept == (
        f"Once fixed, the last checkpoint, after step 1 ({raw['backend']['adapter_path']}/"
        f"checkpoint_step_1), is kept. Resume with: retrain {tmp_path / 'run.toml'} --resume "
        f"{raw['logging']['log_dir']}"
    )


def test_equal_rewards_stop_the_run_naming_rewards_all_equal(tiny_raw, tmp_path):
    raw = guarded(tiny_raw, 3)
    (tmp_path / "constant.py").write_text(CONSTANT_REWARD)
    raw["reward"] = {"type": "custom", "custom_module": str(tmp_path / "constant.py")}
    proc = run_config(tmp_path, raw)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "no trainable datums for 3 consecutive steps" in out
    assert "cause: rewards all equal" in out
    assert out.count("| NO SIGNAL: rewards all equal") == 3
    assert "Done:" not in out


@pytest.mark.slow  # a long CLI-process test; the guard firing runs by default
def test_zero_turns_the_guard_off(tiny_raw, tmp_path):
    raw = guarded(tiny_raw, 0)
    raw["training"]["max_steps"] = 2
    (tmp_path / "constant.py").write_text(CONSTANT_REWARD)
    raw["reward"] = {"type": "custom", "custom_module": str(tmp_path / "constant.py")}
    proc = run_config(tmp_path, raw)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("| NO SIGNAL: rewards all equal") == 2 and "Done:" in out


def test_a_resumed_run_stops_where_the_straight_run_would(tiny_raw, tmp_path):
    """The guard's count of steps without a datum is part of the checkpoint: 2 such steps,
    a finished run resumed for 2 more stops at the 3rd, as one run of 4 steps would."""
    from run_helpers import QuietConsole

    from retrain.config import config_from_dict
    from retrain.errors import TrainingError
    from retrain.trainer import train

    raw = guarded(tiny_raw, 3)
    raw["training"]["max_steps"] = 2
    (tmp_path / "constant.py").write_text(CONSTANT_REWARD)
    raw["reward"] = {"type": "custom", "custom_module": str(tmp_path / "constant.py")}
    assert train(config_from_dict(raw), console=QuietConsole()) == 0
    state = json.loads((Path(raw["logging"]["log_dir"]) / "trainer_state.json").read_text())
    assert state["zero_signal"] == {"run": 2, "causes": ["rewards all equal"] * 2}
    resumed = copy.deepcopy(raw)
    resumed["training"]["max_steps"] = 4
    resumed["resume"] = {"from": raw["logging"]["log_dir"]}
    with pytest.raises(TrainingError, match="no trainable datums for 3 consecutive steps"):
        train(config_from_dict(resumed), console=QuietConsole())
    rows = (Path(raw["logging"]["log_dir"]) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0, 1, 2]
