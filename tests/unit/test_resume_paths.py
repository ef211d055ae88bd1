"""A run's paths are relative to the directory it was started in: resuming it from another
directory finds its checkpoint (a run of an earlier retrain, which did not record that
directory, by its config.resolved.toml), refuses a relative log or adapter directory that
would name another place from here, and `retrain status` prints a resume command that
starts with `cd` into that directory. On real files; tests/integration/test_resume_cli.py
runs it through the CLI."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from test_resume_backend_capability import small_state

from retrain.checkpoint import load_state, resume_problems, save_state
from retrain.config import config_from_dict
from retrain.logs.rundir import RunDir
from retrain.logs.status import resume_command
from retrain.startup import resume_problems as config_problems
from retrain.types import CheckpointInfo

CHECKPOINT = "adapters/r/checkpoint_step_2"


def a_run(work: Path, *, recorded: bool) -> Path:
    """A run started in `work` (logs/r, adapters/r), its paths relative as it writes them;
    `recorded`: its trainer_state.json names `work` (written before it did otherwise)."""
    ckpt = work / CHECKPOINT
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text("{}")
    (ckpt / "adapter_model.safetensors").write_bytes(b"")
    logs = work / "logs" / "r"
    save_state(logs, small_state(2, CheckpointInfo("local", CHECKPOINT, CHECKPOINT)))
    raw = json.loads((logs / "trainer_state.json").read_text())
    for key in ("workdir", "launch"):
        raw.pop(key, None)
    if recorded:
        raw["workdir"] = str(work)
    (logs / "trainer_state.json").write_text(json.dumps(raw))
    (logs / "config.resolved.toml").write_text(
        '[logging]\nlog_dir = "logs/r"\n\n[backend]\nadapter_path = "adapters/r"\n'
    )
    return logs


def check(logs: Path) -> list[tuple[str, str]]:
    return resume_problems(str(logs), backend="local", model="m", lora_rank=4)


def test_the_checkpoint_is_found_from_another_directory(tmp_path, monkeypatch):
    for recorded in (True, False):  # recorded, or worked out from its config's log_dir
        work = tmp_path / f"work-{recorded}"
        logs = a_run(work, recorded=recorded)
        monkeypatch.chdir(tmp_path)
        assert check(logs) == [], recorded
        assert load_state(logs).checkpoint.state == str(work / CHECKPOINT)
        monkeypatch.chdir(work)  # from where it started, the paths read as written
        assert check(Path("logs/r")) == [] and load_state("logs/r").checkpoint.state == CHECKPOINT


def test_status_resumes_from_the_directory_the_run_started_in(tmp_path, monkeypatch):
    work = tmp_path / "work"
    logs = a_run(work, recorded=False)
    monkeypatch.chdir(tmp_path)
    command = resume_command(RunDir(logs))
    assert command == f"cd {work} && retrain logs/r/config.resolved.toml --resume logs/r"
    assert shlex.split(command)[:3] == ["cd", str(work), "&&"]
    # a log_dir that does not name the directory from anywhere: nothing says where it started
    (logs / "config.resolved.toml").write_text('[logging]\nlog_dir = "elsewhere"\n')
    assert resume_command(RunDir(logs)) == (
        f"retrain {logs / 'config.resolved.toml'} --resume {logs}"
    )


def test_relative_directories_that_would_name_another_place_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "work"
    logs = a_run(work, recorded=True)
    raw = {
        "resume": {"from": str(logs)},
        "logging": {"log_dir": "logs/r"},
        "backend": {"adapter_path": "adapters/r", "devices": "cpu"},
        "model": {"model": "m", "lora_rank": 4},
    }
    monkeypatch.chdir(tmp_path)
    found = dict(config_problems(config_from_dict(raw)))
    assert set(found) == {"[logging] log_dir", "[backend] adapter_path"}
    fix = (
        f"Fix: resume from there: cd {work} && retrain logs/r/config.resolved.toml --resume logs/r"
    )
    assert found["[logging] log_dir"].startswith(
        f"'logs/r' is read from the directory retrain runs in, where it names "
        f"{tmp_path / 'logs' / 'r'}; the run in {logs} was started in {work}"
    )
    assert all(problem.endswith(fix) for problem in found.values())
    # the same directories given as absolute paths resume from here
    raw["logging"]["log_dir"] = str(logs)
    raw["backend"]["adapter_path"] = str(work / "adapters" / "r")
    assert config_problems(config_from_dict(raw)) == []
    # a new log directory (a fork, as before) is not the run's own: not refused for it
    raw["logging"]["log_dir"] = "fork"
    assert config_problems(config_from_dict(raw)) == []
