"""The classic verifiers API (0.3.x) for tests. The project's environment has verifiers
0.4, which ships only the v1 API, so a test of the classic API runs its body here when the
classic classes import, else re-runs itself under an interpreter that has them: the one
`RETRAIN_CLASSIC_VERIFIERS_PYTHON` names, or `.venv-verifiers03/bin/python`, which
`scripts/verifiers03_venv.sh` builds (and `.ci/run` builds for every CI run)."""

from __future__ import annotations

import importlib
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv-verifiers03" / "bin" / "python"


def _python() -> str:
    given = os.environ.get("RETRAIN_CLASSIC_VERIFIERS_PYTHON", "")
    if given:
        return given
    return str(VENV_PYTHON) if VENV_PYTHON.is_file() else ""


PYTHON = _python()


def available(*classes: str) -> bool:
    """Whether `verifiers` imports here and has these classic classes."""
    try:
        vf = importlib.import_module("verifiers")
    except Exception:
        return False
    return all(hasattr(vf, name) for name in classes)


def run_pytest(test_file: str, selector: str, marker: str = "") -> subprocess.CompletedProcess:
    """`pytest -k selector test_file` under the classic interpreter, with this checkout
    of retrain on its path; `marker`: its -m where not the default one (which deselects
    a slow test)."""
    python = Path(PYTHON)
    python = python if python.is_absolute() else Path.cwd() / python
    return subprocess.run(
        [
            *(str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *(("-m", marker) if marker else ()),
            *("-k", selector, test_file),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def runs_here(test_file: str, test_name: str, *classes: str, marker: str = "") -> bool:
    """True when the classic `classes` import here: the caller runs its body. Otherwise
    the test runs under the classic interpreter, which must pass it (not skip it), and
    False is returned; with no such interpreter the test is skipped, saying how to get
    one."""
    if available(*classes):
        return True
    if not PYTHON:
        pytest.skip(
            "needs verifiers 0.3 (the classic API): run scripts/verifiers03_venv.sh once "
            "(or set RETRAIN_CLASSIC_VERIFIERS_PYTHON to a Python that has it)"
        )
    proc = run_pytest(test_file, test_name, marker)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    assert proc.returncode == 0 and "1 passed" in last and "skipped" not in last, (
        f"{test_name} under {PYTHON}:\n" + proc.stdout[-3000:] + proc.stderr[-2000:]
    )
    return False
