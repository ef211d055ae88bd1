"""The config path anywhere among the arguments (issue 28): `retrain explain --lr 1e-4
base.toml` used to say that ./retrain.toml is not found. The real CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrain.cli.args import split_config_args
from retrain.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "retrain/config/templates/quickstart.toml"
CAMPAIGN = REPO / "retrain/config/templates/campaign.toml"


def cli(cwd: Path, *args: str) -> tuple[int, str, str]:
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": python_path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize(
    ("argv", "path", "flags"),
    [
        (["base.toml", "--lr", "1e-4"], "base.toml", ["--lr", "1e-4"]),
        (["--lr", "1e-4", "base.toml"], "base.toml", ["--lr", "1e-4"]),
        (["--lr=1e-4", "base.toml", "--seed", "3"], "base.toml", ["--lr=1e-4", "--seed", "3"]),
        # a flag's value is never the path, whatever it looks like
        (["--model", "./m.toml", "base.toml"], "base.toml", ["--model", "./m.toml"]),
        (["--resume", "logs/x", "--seed", "3"], None, ["--resume", "logs/x", "--seed", "3"]),
        (["--backend-opt", "threads=2", "b.toml"], "b.toml", ["--backend-opt", "threads=2"]),
        # an unknown flag (a typo) keeps the path: the loader then names the typo
        (["--lrr", "base.toml"], "base.toml", ["--lrr"]),
        (["--lrr", "1e-4", "base.toml"], "base.toml", ["--lrr", "1e-4"]),
        ([], None, []),
    ],
)
def test_the_path_is_the_token_that_is_no_flag_and_no_flags_value(argv, path, flags):
    assert split_config_args(argv) == (path, flags)


def test_two_paths_are_refused_naming_both():
    with pytest.raises(UsageError, match=r"more than one config path: 'a.toml', 'b.toml'"):
        split_config_args(["a.toml", "--lr", "1e-4", "b.toml"])


def test_explain_with_the_path_after_the_flags(tmp_path):
    (tmp_path / "base.toml").write_text(QUICKSTART.read_text())
    code, out, err = cli(tmp_path, "explain", "--lr", "1e-4", "base.toml")
    assert code == 0, err
    assert "Config:      base.toml" in out and "Training:    lr 0.0001" in out
    code, out, _ = cli(tmp_path, "explain", "--json", "--seed", "7", "base.toml", "--lr", "2e-4")
    report = json.loads(out)
    assert code == 0 and report["config"] == "base.toml"
    assert (report["settings"]["lr"], report["settings"]["seed"]) == (2e-4, 7)
    code, _, err = cli(tmp_path, "explain", "--lrr", "1e-4", "base.toml")
    assert code == 2 and "unknown flag --lrr" in err
    assert "not found" not in err


def test_doctor_and_the_run_take_the_path_after_the_flags(tmp_path):
    (tmp_path / "base.toml").write_text(QUICKSTART.read_text())
    code, out, _ = cli(tmp_path, "doctor", "--no-network", "--lr", "1e-4", "base.toml", "--json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["config"]["status"] == "OK" and "base.toml is valid" in checks["config"]["detail"]
    code, _, err = cli(tmp_path, "--lr", "1e-4", "a.toml", "b.toml")
    assert code == 2 and "more than one config path: 'a.toml', 'b.toml'" in err
    # the run found camp.toml after a flag: a campaign refuses --overwrite, before anything
    (tmp_path / "camp.toml").write_text(CAMPAIGN.read_text())
    code, _, err = cli(tmp_path, "--seed", "3", "camp.toml", "--overwrite")
    assert code == 2 and "a campaign never reuses a directory" in err
    assert "Traceback" not in err and not (tmp_path / "logs").exists()


def test_overwrite_and_resume_together_are_refused(tmp_path):
    (tmp_path / "base.toml").write_text(QUICKSTART.read_text())
    code, _, err = cli(tmp_path, "base.toml", "--overwrite", "--resume", "logs/quickstart")
    assert code == 2 and "drop one of the two" in err and "Traceback" not in err
    code, _, err = cli(tmp_path, "explain", "base.toml", "--overwrite", "--resume", "logs/q")
    assert code == 2 and "drop one of the two" in err
