"""Running the CLI as a user does, in a subprocess: `python -m retrain.cli.main ARGS` with
this checkout on PYTHONPATH and torch's threads passive (they share the box with the test
runner), output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomlkit

REPO = Path(__file__).resolve().parents[1]


def run_retrain(
    args: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`retrain ARGS` in `cwd`; `env` adds variables to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_config(tmp_path: Path, raw: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """A run of the config `raw` (a TOML table), written to `tmp_path`/run.toml."""
    config = tmp_path / "run.toml"
    config.write_text(tomlkit.dumps(raw))
    return run_retrain([str(config)], tmp_path, timeout=timeout)
