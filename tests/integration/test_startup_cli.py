"""What used to fail after the model loaded (exit 1, no key) is refused before anything
loads, as a config error: `retrain explain` (exit 2), `retrain doctor` (a FAIL line, exit
1 as for every FAIL) and the run itself (`retrain CONFIG`, exit 2, before the tokenizer or
the model loads). Each test is the user's action: real files, the real CLI as a process.

The machine is made explicit: CUDA_VISIBLE_DEVICES="" hides every GPU (from nvidia-smi's
count and from torch alike), a fake nvidia-smi on PATH shows one, and HF_ENDPOINT points
at a stand-in hub on 127.0.0.1 (tests/hub_standin.py) or at a port nothing listens on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_standin import HubStandIn

from retrain.checkpoint import TrainerState, save_state
from retrain.hardware import torch_build
from retrain.types import CheckpointInfo

DEAD_HUB = "http://127.0.0.1:9"  # nothing listens on the discard port
LOADING = ("Loading tokenizer", "Loading train model", "Loading dataset")


@pytest.fixture(scope="module")
def hub():
    standin = HubStandIn()
    yield standin
    standin.close()


@pytest.fixture
def project(tmp_path, hub):
    """A working directory with a data file and empty caches, on a machine without GPUs
    whose hub is the stand-in."""
    (tmp_path / "data.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    hub.reset()
    return tmp_path


def machine(project: Path, hub: HubStandIn, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    base.update(
        HF_HUB_CACHE=str(project / "hf"),
        RETRAIN_CACHE=str(project / "retrain-cache"),
        HF_ENDPOINT=hub.url,
        CUDA_VISIBLE_DEVICES="",
    )
    base.update(env)
    return base


def retrain(project: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def write_config(project: Path, model: str, *extra: str, devices: str | None = "cpu") -> Path:
    """A small local run on data.jsonl; `extra` lines are appended (whole tables)."""
    lines = ["[backend]"] + ([f'devices = "{devices}"'] if devices else [])
    lines += [f'adapter_path = "{project / "adapter"}"', "[model]", f'model = "{model}"']
    lines += ["lora_rank = 4", "[data]", 'source = "jsonl"', 'path = "data.jsonl"']
    lines += ["[training]", "seed = 1", "max_steps = 2", "batch_size = 1", "group_size = 2"]
    lines += ["max_tokens = 4", "[logging]", f'log_dir = "{project / "logs"}"', *extra]
    path = project / "c.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def assert_refused_before_loading(run: subprocess.CompletedProcess, *needles: str) -> None:
    """The run's own start: exit 2, the problem on stderr, nothing loaded."""
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    for needle in needles:
        assert needle in run.stderr
    assert not any(step in run.stdout + run.stderr for step in LOADING)


def doctor_fail(run: subprocess.CompletedProcess, name: str) -> str:
    assert run.returncode == 1, run.stdout  # doctor exits 1 on any FAIL
    return next(line for line in run.stdout.splitlines() if line.startswith(f"FAIL  {name} "))


# ----------------------------------------------------------------------------- files


def test_a_missing_jsonl_file_is_refused_when_the_config_loads(project, hub, tiny_model_dir):
    config = write_config(project, str(tiny_model_dir))
    config.write_text(config.read_text().replace('"data.jsonl"', '"nope.jsonl"'))
    env = machine(project, hub)
    where = (
        f"[data] path (c.toml:{line_of(config, 'nope.jsonl')}): JSONL file 'nope.jsonl' not found"
    )
    cwd = f"relative paths are read from the directory retrain runs in, {project}"

    explain = retrain(project, env, "explain", "c.toml")
    assert explain.returncode == 2 and where in explain.stderr and cwd in explain.stderr
    assert "Fix: the path of your JSONL file" in explain.stderr

    line = doctor_fail(retrain(project, env, "doctor", "c.toml", "--no-network"), "config")
    assert where in line

    assert_refused_before_loading(retrain(project, env, "c.toml"), where, cwd)


@pytest.mark.parametrize(
    "table, key, what",
    [
        ('[eval]\nevery = 1\npath = "held-out.jsonl"', "[eval] path", "held-out JSONL file"),
        (
            '[reward]\ntype = "custom"\ncustom_module = "my_reward.py"',
            "[reward] custom_module",
            "reward file",
        ),
    ],
)
def test_the_eval_file_and_a_reward_file_are_refused_before_the_run_loads(
    project, hub, tiny_model_dir, table, key, what
):
    config = write_config(project, str(tiny_model_dir), *table.split("\n"))
    name = table.split('"')[-2]
    where = f"{key} (c.toml:{line_of(config, name)}): {what} {name!r} not found"
    assert_refused_before_loading(retrain(project, machine(project, hub), "c.toml"), where)
    explain = retrain(project, machine(project, hub), "explain", "c.toml")
    assert explain.returncode == 2 and where in explain.stderr


def test_a_judge_that_nothing_serves_is_refused_before_the_run_loads(project, hub, tiny_model_dir):
    dead = 'judge_base_url = "http://127.0.0.1:9/v1"'
    config = write_config(project, str(tiny_model_dir), "[reward]", 'type = "judge"', dead)
    where = f"[reward] judge_base_url (c.toml:{line_of(config, 'judge_base_url')}): nothing"
    problem = "nothing answers at http://127.0.0.1:9/v1 (ConnectError"
    env = machine(project, hub)
    assert_refused_before_loading(retrain(project, env, "c.toml"), problem)
    explain = retrain(project, env, "explain", "c.toml")
    assert explain.returncode == 2 and f"ERROR: {where}" in explain.stdout
    assert problem in doctor_fail(retrain(project, env, "doctor", "c.toml"), "run checks")


# ----------------------------------------------------------------------------- the model


def test_a_model_the_hub_does_not_have(project, hub):
    hub.missing.add("foo/bar")
    config = write_config(project, "foo/bar")
    env = machine(project, hub)
    where = (
        f"[model] model (c.toml:{line_of(config, 'foo/bar')}): 'foo/bar' is not a local directory"
    )

    explain = retrain(project, env, "explain", "c.toml")
    assert explain.returncode == 2, explain.stdout
    error = next(line for line in explain.stdout.splitlines() if line.startswith("ERROR: [model]"))
    assert error.startswith(f"ERROR: {where}") and "has no model repository of that name" in error
    assert "Fix: the exact hub id" in error

    line = doctor_fail(retrain(project, env, "doctor", "c.toml"), "model")
    assert "[model] model: 'foo/bar' is not a local directory" in line

    assert_refused_before_loading(
        retrain(project, env, "c.toml"), "[model] model: 'foo/bar' is not a local directory"
    )
    assert hub.asked == ["foo/bar"] * 3  # one metadata request per command, nothing else

    # the same id, once the hub has it: explain passes (nothing is downloaded to say so)
    hub.missing.clear()
    assert retrain(project, env, "explain", "c.toml").returncode == 0
    assert not (project / "hf").exists()


def test_offline_with_nothing_cached_says_how_to_fetch_it(project, hub):
    write_config(project, "foo/bar")
    env = machine(project, hub, HF_HUB_OFFLINE="1")
    explain = retrain(project, env, "explain", "c.toml")
    assert explain.returncode == 2
    assert "'foo/bar' is not in the Hugging Face cache" in explain.stdout
    assert "HF_HUB_OFFLINE is set" in explain.stdout
    assert "Fix: `hf download foo/bar` once connected" in explain.stdout
    assert_refused_before_loading(retrain(project, env, "c.toml"), "HF_HUB_OFFLINE is set")
    assert hub.asked == []  # offline means no request at all


def test_an_unreachable_hub_fails_doctor_with_the_current_cli(project, hub):
    write_config(project, "foo/bar")
    env = machine(project, hub, HF_ENDPOINT=DEAD_HUB)
    run = retrain(project, env, "doctor", "c.toml")
    line = doctor_fail(run, "model")
    assert f"the hub ({DEAD_HUB}) cannot be reached" in line
    assert "fix: `hf download foo/bar` once connected" in run.stdout
    assert "huggingface-cli" not in run.stdout
    assert_refused_before_loading(retrain(project, env, "c.toml"), "cannot be reached")


def test_a_remote_backend_still_loads_the_tokenizer(project, hub):
    """tinker trains on its service (so [backend] devices is not checked, though "gpu:0"
    is the default), but the tokenizer comes from [model] model here."""
    hub.missing.add("foo/bar")
    (project / "c.toml").write_text(
        '[backend]\nbackend = "tinker"\n[model]\nmodel = "foo/bar"\n[training]\nseed = 1\n'
    )
    explain = retrain(
        project, machine(project, hub, TINKER_API_KEY="tml-test"), "explain", "c.toml"
    )
    errors = [line for line in explain.stdout.splitlines() if line.startswith("ERROR")]
    assert explain.returncode == 2 and len(errors) == 1
    assert errors[0].startswith("ERROR: [model] model (c.toml:4): the tinker backend runs the")
    assert "but the tokenizer is loaded here: 'foo/bar' is not a local directory" in errors[0]


# ----------------------------------------------------------------------------- devices


def test_a_gpu_on_a_cpu_only_machine(project, hub, tiny_model_dir):
    """`--devices gpu:0` used to warn and train on the CPU with exit 0."""
    write_config(project, str(tiny_model_dir))
    env = machine(project, hub)
    problem = "'gpu:0' asks for gpu:0, but this machine has no CUDA device"
    fix = 'Fix: devices = "cpu" in [backend] (or the flag --devices cpu)'

    explain = retrain(project, env, "explain", "c.toml", "--devices", "gpu:0")
    assert explain.returncode == 2
    assert (
        f"ERROR: [backend] devices (from --devices): {problem}" in explain.stdout
        and fix in explain.stdout
    )

    assert_refused_before_loading(
        retrain(project, env, "c.toml", "--devices", "gpu:0"), f"[backend] devices: {problem}", fix
    )

    # a config that never sets devices gets "gpu:0", the default: the message says so
    write_config(project, str(tiny_model_dir), devices=None)
    explain = retrain(project, env, "explain", "c.toml")
    assert explain.returncode == 2 and problem in explain.stdout
    assert "'gpu:0' is also what a config without [backend] devices asks for" in explain.stdout
    line = doctor_fail(retrain(project, env, "doctor", "c.toml", "--no-network"), "run checks")
    assert f"[backend] devices: {problem}" in line


def test_more_gpus_than_the_machine_has(project, hub, tiny_model_dir):
    """nvidia-smi (a stand-in on PATH) lists one GPU; the config asks for gpu:1."""
    bin_dir = project / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in --query-gpu=index) echo 0 ;; *) exit 9 ;; esac\n')
    smi.chmod(0o755)
    config = write_config(project, str(tiny_model_dir), devices="gpu:1")
    env = machine(project, hub, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("CUDA_VISIBLE_DEVICES")
    explain = retrain(project, env, "explain", "c.toml")
    where = f"[backend] devices (c.toml:{line_of(config, 'gpu:1')})"
    assert explain.returncode == 2
    assert (
        f"ERROR: {where}: 'gpu:1' asks for gpu:1, but this machine has 1 CUDA device(s): gpu:0. "
        'Fix: devices = "gpu:0"' in explain.stdout
    )
    # gpu:0 is there, but this machine's torch is a CPU build (CI's is): refused before
    # it loads
    write_config(project, str(tiny_model_dir), devices="gpu:0")
    explain = retrain(project, env, "explain", "c.toml")
    cpu_torch = "is built without CUDA. Fix: install torch's CUDA build"
    if torch_build().gpu:  # the GPU image's torch (.venv-torch211): no such problem
        assert cpu_torch not in explain.stdout
    else:
        assert explain.returncode == 2 and cpu_torch in explain.stdout
        assert "'gpu:0' asks for gpu:0; nvidia-smi shows 1 GPU(s), but the installed torch (" in (
            explain.stdout
        )
    # CUDA_VISIBLE_DEVICES = "" hides the GPU nvidia-smi lists: the variable is named
    explain = retrain(project, {**env, "CUDA_VISIBLE_DEVICES": ""}, "explain", "c.toml")
    assert explain.returncode == 2
    assert (
        "'gpu:0' asks for gpu:0, but CUDA_VISIBLE_DEVICES = '' leaves CUDA 0 of the 1 GPU(s) "
        "nvidia-smi lists. Fix: list it in CUDA_VISIBLE_DEVICES" in explain.stdout
    )


# ----------------------------------------------------------------------------- resume


def test_resume_from_a_directory_that_is_not_a_run(project, hub, tiny_model_dir):
    write_config(project, str(tiny_model_dir))
    (project / "elsewhere").mkdir()
    env = machine(project, hub)
    problem = "[resume] from: elsewhere/trainer_state.json not found"

    explain = retrain(project, env, "explain", "c.toml", "--resume", "elsewhere")
    flagged = problem.replace("from:", "from (from --resume):")
    assert explain.returncode == 2 and f"ERROR: {flagged}" in explain.stdout

    config = project / "c.toml"
    config.write_text(config.read_text() + '[resume]\nfrom = "elsewhere"\n')
    line = doctor_fail(retrain(project, env, "doctor", "c.toml", "--no-network"), "run checks")
    assert f"[resume] from (c.toml:{line_of(config, 'elsewhere')}): elsewhere/trainer_state" in line

    assert_refused_before_loading(retrain(project, env, "c.toml"), problem)


def test_resume_from_a_run_whose_checkpoint_is_gone(project, hub, tiny_model_dir):
    """trainer_state.json is there (as a run writes it), its checkpoint directory not."""
    write_config(project, str(tiny_model_dir))
    gone = project / "adapter" / "checkpoint_step_2"
    state = TrainerState(
        step=2,
        model=str(tiny_model_dir),
        lora_rank=4,
        condition="maxrl+gtpo_sepa",
        batch_size=1,
        group_size=2,
        data={},
        counters={},
        sepa={},
        checkpoint=CheckpointInfo("local", adapter=str(gone), state=str(gone)),
    )
    save_state(project / "logs", state)
    env = machine(project, hub)
    problem = (
        "[resume] from: logs/trainer_state.json names a checkpoint whose "
        f"files are gone: the checkpoint directory {gone}"
    )
    explain = retrain(project, env, "explain", "c.toml", "--resume", "logs")
    flagged = problem.replace("from:", "from (from --resume):")
    assert explain.returncode == 2 and flagged in explain.stdout
    assert_refused_before_loading(retrain(project, env, "c.toml", "--resume", "logs"), problem)
