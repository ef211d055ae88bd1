"""Batch shaping's keys are checked when the config loads: `retrain explain`, `retrain
doctor` and the run's own start (real CLI processes) report a bad one with its key, its
file:line and a fix, exit 2, before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from retrain.config import load_config
from retrain.errors import ConfigError

# A model that does not exist: a run that got past the config would fail on it instead.
HEAD = '[model]\nmodel = "/nonexistent/model"\n[backend]\ndevices = "cpu"\n[training]\n'


def cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )


def write(tmp_path, body: str):
    path = tmp_path / "retrain.toml"
    path.write_text(HEAD + body)
    return path


@pytest.mark.parametrize(
    ("body", "key", "says"),
    [
        (
            "max_tokens = 64\noverlong_buffer = 64\n",
            "[training] overlong_buffer (retrain.toml:7)",
            "must be below max_tokens (64), got 64",
        ),
        (
            "overlong_penalty = 0.5\n",
            "[training] overlong_penalty (retrain.toml:6)",
            "only used with overlong_buffer > 0",
        ),
        (
            "dynamic_sampling_max_rounds = 5\n",
            "[training] dynamic_sampling_max_rounds (retrain.toml:6)",
            "only used with dynamic_sampling = true",
        ),
        (
            "dynamic_sampling = true\ndynamic_sampling_max_rounds = 0\n",
            "[training] dynamic_sampling_max_rounds (retrain.toml:7)",
            "must be >= 1, got 0",
        ),
    ],
)
def test_a_run_and_explain_refuse_it_with_the_key_line_and_fix(tmp_path, body, key, says):
    write(tmp_path, body)
    for args in (["retrain.toml"], ["explain", "retrain.toml"]):
        proc = cli(tmp_path, *args)
        assert proc.returncode == 2, proc.stderr
        assert key in proc.stderr and says in proc.stderr and "Fix:" in proc.stderr
        assert "Traceback" not in proc.stderr and "nonexistent" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["retrain.toml"]  # no run dir


def test_doctor_reports_it(tmp_path):
    write(tmp_path, "max_tokens = 64\noverlong_buffer = 100\n")
    proc = cli(tmp_path, "doctor", "--no-network")
    assert proc.returncode == 1
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAIL") and "config" in x)
    assert "[training] overlong_buffer (retrain.toml:7)" in line and "Fix:" in line


def test_every_backend_retrain_samples_for_accepts_all_three(tmp_path):
    body = (
        "max_tokens = 64\ndynamic_sampling = true\ndynamic_sampling_max_rounds = 2\n"
        "mask_truncated = true\noverlong_buffer = 16\noverlong_penalty = 0.5\n"
    )
    for backend in ("local", "tinker", "prime_rl"):
        # prime_rl trains on one scalar advantage per completion: a flow without a transform
        flow = '[algorithm]\ntransform_mode = "none"\n'
        text = flow + HEAD.replace('devices = "cpu"', f'backend = "{backend}"') + body
        if backend == "prime_rl":  # its trainer reads run_* directories only
            text = text.replace("[backend]\n", '[backend]\nadapter_path = "out/run_a"\n')
        (tmp_path / "retrain.toml").write_text(text)
        t = load_config(tmp_path / "retrain.toml").training
        assert (t.dynamic_sampling, t.mask_truncated, t.overlong_buffer) == (True, True, 16)


def test_overlap_with_dynamic_sampling_loads(tmp_path):
    path = write(tmp_path, "dynamic_sampling = true\n")
    path.write_text(
        path.read_text().replace('devices = "cpu"', 'devices = "cpu,cpu"')
        + "[backend.options]\noverlap = true\n"
    )
    assert load_config(path).training.dynamic_sampling


def test_only_an_overlong_buffer_inside_max_tokens_loads(tmp_path):
    with pytest.raises(ConfigError, match="overlong_buffer"):
        load_config(write(tmp_path, "max_tokens = 8\noverlong_buffer = 9\n"))
    assert load_config(write(tmp_path, "max_tokens = 8\noverlong_buffer = 7\n"))


def test_explain_says_what_the_step_does_to_its_batch(tmp_path):
    write(tmp_path, "max_tokens = 64\ndynamic_sampling = true\nmask_truncated = true\n")
    path = tmp_path / "retrain.toml"
    path.write_text(path.read_text() + "overlong_buffer = 16\noverlong_penalty = 0.5\n")
    out = cli(tmp_path, "explain", "retrain.toml").stdout  # exit 2: the model is absent
    line = next(x for x in out.splitlines() if x.startswith("Shaping:"))
    assert "dynamic sampling (all-equal groups dropped, up to 3 extra rounds" in line
    assert "completions cut at 64 tokens masked" in line
    assert "overlong penalty from 48 tokens, -0.5 at 64" in line
    write(tmp_path, "")
    out = cli(tmp_path, "explain", "retrain.toml").stdout
    assert "Shaping:     off" in out.splitlines()
