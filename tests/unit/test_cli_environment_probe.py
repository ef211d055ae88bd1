"""`retrain explain` and `retrain doctor` import and instantiate the `[environment]`
(no model): they report its API generation, task count, whether it opens the
conversation and whether it needs tools, and an environment that fails to load is an
error there, before any run starts. The real CLI as a process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_run import run_retrain

pytest.importorskip("verifiers.v1")

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_retrain(list(args), tmp_path, env={"HF_HUB_OFFLINE": "1"})


def config(tmp_path: Path, environment: str) -> Path:
    path = tmp_path / "env.toml"
    path.write_text(
        '[backend]\ndevices = "cpu"\n[model]\nmodel = "HuggingFaceTB/SmolLM2-135M-Instruct"\n'
        f"[plugins]\nsearch_paths = [{str(FIXTURES / 'multiturn_envs')!r}, "
        f"{str(FIXTURES / 'api_generations')!r}]\n"
        f'[environment]\nprovider = "verifiers"\n{environment}\n'
    )
    return path


def test_explain_reports_what_the_environment_is(tmp_path):
    path = config(tmp_path, 'id = "opening_env"\nargs = { n = 3 }')
    proc = cli(tmp_path, "explain", str(path))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Environment:"))
    # the environment's own cap (its AgentConfig: 2 turns), where max_turns = -1
    want = "Environment: v1 API, 3 tasks, opens the conversation, multi-turn (at most 2 model turns), no tools"
    assert line == want, proc.stdout + proc.stderr


def test_the_reported_turn_cap_is_the_configs_where_it_sets_one(tmp_path):
    from retrain.config import load_config
    from retrain.data.env_probe import probe_environment

    path = config(tmp_path, 'id = "opening_env"\nargs = { n = 3 }\nmax_turns = 5')
    report = probe_environment(load_config(path, []))
    assert report.multi_turn and report.max_turns == 5
    assert "multi-turn (at most 5 model turns)" in report.summary()


def test_explain_and_doctor_refuse_an_environment_that_does_not_load(tmp_path):
    path = config(tmp_path, 'id = "interim-env"')
    proc = cli(tmp_path, "explain", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"ERROR: [environment] id ({path}:9): verifiers environment 'interim-env'" in (
        proc.stdout
    )
    assert "interim verifiers API" in proc.stdout and "Traceback" not in proc.stderr
    proc = cli(tmp_path, "doctor", str(path), "--no-network")
    assert proc.returncode == 1
    fail = [x for x in proc.stdout.splitlines() if "interim verifiers API" in x]
    assert fail and "FAIL" in fail[0], proc.stdout
