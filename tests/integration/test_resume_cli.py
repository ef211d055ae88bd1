"""Resuming as a user does, with the real CLI as a subprocess on the tiny random model:
a finished run continued by the command its refusal prints (with the flags it was
started with, and a resume that says how far it now trains), the startup line of the
backend's capabilities, and the resume command of `retrain status` run from another
directory."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import REPO, run_retrain
from test_run_dirs_cli import ABORTING_REWARD, CONFIG, steps_in


def project(work: Path, model: Path, *, steps: int) -> Path:
    """test_run_dirs_cli's project, its reward named by absolute path (a config read
    from elsewhere still finds it) and a checkpoint every 2 steps."""
    work.mkdir(parents=True, exist_ok=True)
    reward = work / "reward.py"
    reward.write_text(ABORTING_REWARD)
    text = CONFIG.format(model=model, steps=steps, eval_every=0)
    text = text.replace('custom_module = "reward.py"', f'custom_module = "{reward}"')
    (work / "retrain.toml").write_text(text.replace("save_every = 1", "save_every = 2"))
    return work


def line_with(text: str, start: str) -> str:
    return next(line.strip() for line in text.splitlines() if line.strip().startswith(start))


def test_a_finished_run_goes_on_by_the_command_its_refusal_prints(tmp_path, tiny_model_dir):
    work = project(tmp_path / "p", tiny_model_dir, steps=4)
    run = run_retrain(["--max-steps", "2", "--save-every", "1"], work)
    assert run.returncode == 0, run.stdout + run.stderr
    # the first line says what the backend guarantees; run.json records it
    assert run.stdout.splitlines()[0] == (
        "Backend: local (builtin): reports its loss, per-token advantages, resumes from "
        "checkpoints, trains under torchrun; token data: entropy; 22 loss options"
    )
    info = json.loads((work / "logs" / "tiny" / "run.json").read_text())
    assert info["backend"]["name"] == "local" and info["workdir"] == str(work)
    assert info["backend"]["capabilities"]["supports_checkpoint_resume"] is True

    # `retrain` (max_steps = 4 in retrain.toml) is refused; the hint continues the run with
    # the flags it was started with, to this config's max_steps, and says so
    refused = run_retrain([], work)
    assert refused.returncode == 2
    hint = line_with(refused.stderr, "- [logging] log_dir").split("continue that run: ")[1]
    command, _, rest = hint.partition(" (")
    assert command == "retrain --save-every 1 --resume logs/tiny --max-steps 4"
    assert rest.startswith(
        "it finished its 2 steps; this trains steps 2 to 3: --max-steps 4 is this "
        "command's max_steps, from retrain.toml:17)"
    )
    horizon = (
        "Resuming after step 2 with [training] max_steps 2 -> 4 (from --max-steps): the run "
        "had finished; it now trains steps 2 to 3."
    )
    explain = run_retrain(["explain", *shlex.split(command)[1:]], work)
    assert f"WARNING: {horizon}" in explain.stdout, explain.stdout + explain.stderr
    resumed = run_retrain(shlex.split(command)[1:], work)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.splitlines()[0] == horizon
    assert "Resuming with" not in resumed.stdout  # save_every stayed the run's own
    assert steps_in(work / "logs" / "tiny" / "metrics.jsonl") == [0, 1, 2, 3]
    assert (work / "adapters" / "tiny" / "checkpoint_step_3").is_dir()  # save_every 1 still

    # a rank-2 squeeze of the final adapter takes none of its rank-4 optimizer state
    final = work / "adapters" / "tiny" / "final"
    assert (final / "training_state.pt").is_file()
    squeeze = ["squeeze", str(final), "--compress-to", "2", "--output", str(tmp_path / "r2")]
    squeezed = run_retrain(squeeze, work)
    assert squeezed.returncode == 0, squeezed.stdout + squeezed.stderr
    assert (tmp_path / "r2" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "r2" / "training_state.pt").exists()


@pytest.mark.slow  # a long CLI-process test; the refusal's resume command runs by default
def test_the_resume_command_of_status_works_from_any_directory(tmp_path, tiny_model_dir):
    work = project(tmp_path / "p", tiny_model_dir, steps=3)
    # a double Ctrl-C in step 1, after the checkpoint of step 1
    aborted = run_retrain(["--save-every", "1"], work, env={"ABORT_AT_CALL": "9"})
    assert aborted.returncode == 130, aborted.stdout + aborted.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    # run from another directory, the run's relative log_dir would name another place
    logs = work / "logs" / "tiny"
    direct = run_retrain([str(logs / "config.resolved.toml"), "--resume", str(logs)], elsewhere)
    assert direct.returncode == 2 and "Loading" not in direct.stdout
    assert (
        f"[logging] log_dir: 'logs/tiny' is read from the directory retrain runs in, where it names {elsewhere / 'logs' / 'tiny'}"
        in direct.stderr
    )
    fix = f"Fix: resume from there: cd {work} && retrain logs/tiny/config.resolved.toml --resume logs/tiny"
    assert fix in direct.stderr
    assert list(elsewhere.iterdir()) == []
    # a config whose relative reward file is read from here fails to load: the error
    # says where the run started and the command that resumes it from there
    relative = work / "relative.toml"
    relative.write_text(
        (work / "retrain.toml").read_text().replace(str(work / "reward.py"), "reward.py")
    )
    direct = run_retrain([str(relative), "--resume", str(logs)], elsewhere)
    assert direct.returncode == 2 and "[reward] custom_module" in direct.stderr
    assert (
        f"[resume] from: the run in {logs} was started in {work}, and a config's relative "
        "paths are read from the directory retrain runs in: if a path above is one of them, "
        f"resume from there: cd {work} && retrain logs/tiny/config.resolved.toml --resume "
        "logs/tiny"
    ) in direct.stderr, direct.stderr
    assert list(elsewhere.iterdir()) == []

    # status, from yet another directory, prints a command that works pasted anywhere
    status = run_retrain(["status", str(work / "logs")], tmp_path)
    command = line_with(status.stdout, "resume:").removeprefix("resume: ")
    assert command == f"cd {work} && retrain logs/tiny/config.resolved.toml --resume logs/tiny"
    shim = tmp_path / "bin" / "retrain"  # `retrain` on PATH, running this checkout
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m retrain.cli.main "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    env.pop("ABORT_AT_CALL", None)
    pasted = subprocess.run(
        ["bash", "-c", command], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr
    assert "Resumed from logs/tiny at step 1" in pasted.stdout
    assert steps_in(logs / "metrics.jsonl") == [0, 1, 2]
    assert (work / "adapters" / "tiny" / "final").is_dir()
    assert list(elsewhere.iterdir()) == []
