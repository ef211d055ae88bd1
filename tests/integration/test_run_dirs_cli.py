"""A run never mixes into another run's files, and a double Ctrl-C says what was saved:
the real CLI as a subprocess on the tiny random model, in a directory of real files.

Each test reproduces what a user typed (issue 28): running the same config again, then
`--overwrite`; a log or adapter directory set by a flag; a double Ctrl-C before and after
the first checkpoint, then the command the message prints.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrain.logs.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[2]

# A custom reward that presses Ctrl-C twice, as a user would, at its ABORT_AT_CALL-th call
# (in the main thread, so each signal's handler runs before the next one is sent).
ABORTING_REWARD = """\
import os
import signal

calls = 0


def score(response, reference):
    global calls
    calls += 1
    if str(calls) == os.environ.get("ABORT_AT_CALL"):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C: stop after this step
        signal.raise_signal(signal.SIGINT)  # Ctrl-C again: abort
    return float(sum(map(ord, response)) % 2)
"""

CONFIG = """\
[backend]
backend = "local"
devices = "cpu"
adapter_path = "adapters/tiny"
options = {{ threads = 1, dtype = "fp32" }}

[model]
model = "{model}"
lora_rank = 4

[algorithm]
advantage_mode = "grpo"
transform_mode = "none"

[training]
seed = 3
max_steps = {steps}
batch_size = 2
group_size = 4
max_tokens = 6
save_every = 1

[data]
source = "reasoning_gym"
task = "basic_arithmetic"
size = 50
args = {{ min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1 }}

[reward]
type = "custom"
custom_module = "reward.py"

[eval]
every = {eval_every}
size = 3
temperature = 0.0

[logging]
log_dir = "logs/tiny"
group_lines = 0
"""


def write_config(work: Path, model: Path, *, steps: int = 2, eval_every: int = 0) -> Path:
    (work / "reward.py").write_text(ABORTING_REWARD)
    path = work / "run.toml"
    path.write_text(CONFIG.format(model=model, steps=steps, eval_every=eval_every))
    return path


def line_of(path: Path, key: str) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.startswith(f"{key} ="))


def cli(work: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": python_path, "OMP_WAIT_POLICY": "PASSIVE"}
    full_env.pop("ABORT_AT_CALL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", *args],
        cwd=work,
        env={**full_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def run_printed(work: Path, command: str) -> tuple[int, str, str]:
    """Run a command a message printed (`retrain ...`), as the user would paste it."""
    words = shlex.split(command)
    assert words[0] == "retrain", command
    return cli(work, *words[1:])


def steps_in(path: Path) -> list[int]:
    rows, bad = read_jsonl(path)
    assert not bad
    return [r["step"] for r in rows]


def test_a_second_run_is_refused_before_loading_and_overwrite_moves_the_first_aside(
    tmp_path, tiny_model_dir
):
    config = write_config(tmp_path, tiny_model_dir, eval_every=1)
    code, out, err = cli(tmp_path, "run.toml")
    assert code == 0, out + err
    assert "held-out correct rate" in out.splitlines()[-1]
    # transformers' noise is not the user's business: retrain's own lines only
    for noise in ("FutureWarning", "is_gradient_checkpointing", "Loading weights", "Writing model"):
        assert noise not in out + err, noise
    metrics = tmp_path / "logs" / "tiny" / "metrics.jsonl"
    first = metrics.read_text()

    # the same command again: refused before any model loads, naming both keys and lines
    code, out, err = cli(tmp_path, "run.toml")
    assert code == 2
    assert "Traceback" not in err and "Loading train model" not in out
    log_line, adapter_line = line_of(config, "log_dir"), line_of(config, "adapter_path")
    assert f"[logging] log_dir (run.toml:{log_line}): logs/tiny holds another run" in err
    assert f"[backend] adapter_path (run.toml:{adapter_line}): adapters/tiny holds" in err
    assert "continue that run: retrain run.toml --resume logs/tiny" in err
    assert "continue the run that wrote them: retrain run.toml --resume logs/tiny" in err
    assert "start over: retrain run.toml --overwrite (moves logs/tiny aside" in err
    assert metrics.read_text() == first

    # explain and doctor say it too, as errors
    code, out, _ = cli(tmp_path, "explain", "run.toml")
    assert code == 2 and f"ERROR: [logging] log_dir (run.toml:{log_line}):" in out
    code, out, _ = cli(tmp_path, "doctor", "run.toml", "--no-network")
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert code == 1 and any(f"[logging] log_dir (run.toml:{log_line})" in f for f in failed)
    code, out, _ = cli(tmp_path, "explain", "run.toml", "--overwrite")
    assert code == 0 and "WARNING: [logging] log_dir: logs/tiny holds another run" in out

    # a directory set by a flag is named by its flag; a new log dir alone is not enough
    code, _, err = cli(tmp_path, "run.toml", "--log-dir", "logs/other")
    assert code == 2 and "[logging] log_dir" not in err
    assert f"[backend] adapter_path (run.toml:{adapter_line}): adapters/tiny" in err
    code, _, err = cli(tmp_path, "--adapter-path", "adapters/tiny", "--log-dir=logs/x", "run.toml")
    assert code == 2 and "[backend] adapter_path (from --adapter-path): adapters/tiny" in err

    # --overwrite: the old run is moved aside whole, the new one has only its own rows,
    # and its summary (eval off) reads no held-out rate of the old run
    code, out, err = cli(tmp_path, "run.toml", "--overwrite", "--eval-every", "0")
    assert code == 0, out + err
    aside = sorted((tmp_path / "logs").glob("tiny.old-*"))
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == first
    assert len(list((tmp_path / "adapters").glob("tiny.old-*/final"))) == 1
    assert f"aside to {aside[0].relative_to(tmp_path)}" in out
    assert steps_in(metrics) == [0, 1]
    assert not (tmp_path / "logs" / "tiny" / "eval.jsonl").exists()
    done = out.splitlines()[-1]
    assert done.startswith("Done: 2 steps") and "held-out" not in done


@pytest.mark.slow  # a long CLI-process test; the double Ctrl-C after a checkpoint runs by default
def test_double_ctrl_c_before_the_first_checkpoint_says_nothing_was_saved(tmp_path, tiny_model_dir):
    write_config(tmp_path, tiny_model_dir)
    # no periodic checkpoint; the 9th reward call is in step 1, after step 0 was logged
    code, out, err = cli(tmp_path, "run.toml", "--save-every", "0", env={"ABORT_AT_CALL": "9"})
    assert code == 130 and "retrain: interrupted" in err
    aborted = next(line for line in out.splitlines() if line.startswith("Aborted"))
    assert aborted == (
        "Aborted before the first checkpoint: nothing was saved, so there is nothing to "
        "resume. Start the run again: retrain run.toml --save-every 0 --overwrite"
    )
    assert "step None" not in out
    command = aborted.split("Start the run again: ")[1]
    code, out, err = run_printed(tmp_path, command)  # starts over, the aborted rows aside
    assert code == 0, out + err
    assert steps_in(tmp_path / "logs" / "tiny" / "metrics.jsonl") == [0, 1]
    (aside,) = (tmp_path / "logs").glob("tiny.old-*")
    assert steps_in(aside / "metrics.jsonl") == [0]


def test_double_ctrl_c_after_a_checkpoint_names_it_and_its_resume_command_works(
    tmp_path, tiny_model_dir
):
    write_config(tmp_path, tiny_model_dir, steps=3)
    # 8 completions a step: the 9th call is in step 1, after the checkpoint of step 1
    code, out, err = cli(tmp_path, "--max-steps", "3", "run.toml", env={"ABORT_AT_CALL": "9"})
    assert code == 130
    assert "Received SIGINT: stopping after this step" in err
    aborted = next(line for line in out.splitlines() if line.startswith("Aborted"))
    assert aborted.startswith(
        "Aborted; the last checkpoint, after step 1 (adapters/tiny/checkpoint_step_1), is kept."
    )
    command = aborted.split("Resume with: ")[1]
    assert command == "retrain run.toml --max-steps 3 --resume logs/tiny"
    code, out, err = run_printed(tmp_path, command)
    assert code == 0, out + err
    assert "Resumed from logs/tiny at step 1" in out and "Resuming with" not in out
    assert out.splitlines()[-1].startswith("Done: 3 steps")
    assert steps_in(tmp_path / "logs" / "tiny" / "metrics.jsonl") == [0, 1, 2]

    # resumed with other settings: a group size the checkpoint would override is refused
    # before anything loads; the rest is said before it loads, then recorded
    more = ("run.toml", "--max-steps", "4", "--resume", "logs/tiny", "--lr", "0.01")
    code, out, err = cli(tmp_path, *more, "--group-size", "2")
    assert code == 2 and "Loading" not in out
    assert "[training] group_size: = 2 here, but the run in logs/tiny trained with " in err
    assert "Fix: group_size = 4 (or drop the flag), or a new run without --resume" in err
    code, out, _ = cli(tmp_path, "explain", *more)
    assert code == 0 and "WARNING: Resuming with 1 setting changed since the run" in out
    code, out, err = cli(tmp_path, *more)
    assert code == 0, out + err
    assert out.splitlines()[0] == (
        "Resuming after step 3 with [training] max_steps 3 -> 4 (from --max-steps): the run "
        "had finished; it now trains step 3."
    )
    assert out.splitlines()[1] == (
        "Resuming with 1 setting changed since the run last started (its "
        "config.resolved.toml): [training] lr 4e-05 -> 0.01. They apply from step 3 on; "
        "the steps before it ran with the old values."
    )
    resolved = (tmp_path / "logs" / "tiny" / "config.resolved.toml").read_text()
    assert "\nlr = 0.01\n" in resolved and "\nmax_steps = 4\n" in resolved


# A plugin backend that holds the run where the model would load (after the run claimed
# its directories, before its first row) until the test writes `go`, then fails.
GATE_BACKEND = """\
import time
from pathlib import Path

from retrain.errors import TrainingError


class Gate:
    def __init__(self, config, tokenizer, say=print, **extra):
        Path("loading").write_text("")
        deadline = time.time() + 120
        while not Path("go").exists() and time.time() < deadline:
            time.sleep(0.05)
        raise TrainingError("the gate backend stops here")
"""

GATE_CONFIG = """\
[backend]
backend = "gate.Gate"
devices = "cpu"

[model]
model = "{model}"

[algorithm]
advantage_mode = "grpo"
transform_mode = "none"

[data]
source = "reasoning_gym"
task = "basic_arithmetic"
size = 5

[logging]
log_dir = "logs/tiny"
"""


def test_a_run_still_loading_its_model_is_live_and_a_failed_start_leaves_nothing(
    tmp_path, tiny_model_dir
):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "gate.py").write_text(GATE_BACKEND)
    (tmp_path / "run.toml").write_text(GATE_CONFIG.format(model=tiny_model_dir))
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    first = subprocess.Popen(
        [sys.executable, "-m", "retrain.cli.main", "run.toml"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": python_path, "OMP_WAIT_POLICY": "PASSIVE"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not (tmp_path / "loading").exists():
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        # it has written no row yet, and its run.json already holds the directory
        log_dir = tmp_path / "logs" / "tiny"
        assert sorted(p.name for p in log_dir.iterdir()) == ["run.json"]
        info = json.loads((log_dir / "run.json").read_text())
        assert (info["status"], info["pid"]) == ("running", first.pid)
        code, out, err = cli(tmp_path, "run.toml", "--overwrite")
        assert code == 2 and f"is running as pid {first.pid}; stop it first" in err, out + err
        assert not list((tmp_path / "logs").glob("tiny.old-*"))  # nothing moved aside
    finally:
        (tmp_path / "go").write_text("")
        out, err = first.communicate(timeout=120)
    assert first.returncode != 0 and "the gate backend stops here" in err, out + err
    assert not (tmp_path / "logs").exists()  # as if it had never started
