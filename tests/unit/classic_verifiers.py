"""The classic verifiers API (0.3.x) for tests. The project's environment has verifiers
0.4, which ships only the v1 API, so a test of the classic API runs its body here when the
classic classes import, else re-runs itself under an interpreter that has them: the one
`RETRAIN_CLASSIC_VERIFIERS_PYTHON` names, or `.venv-verifiers03/bin/python`, which
`scripts/verifiers03_venv.sh` builds (and `.ci/run` builds for every CI run)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
from rerun import assert_passed_under

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
    assert_passed_under(PYTHON, str(test_file), test_name, marker)
    return False
