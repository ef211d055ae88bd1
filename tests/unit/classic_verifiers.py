"""The classic verifiers API (0.3.x) for tests. The project's environment has verifiers
0.4, which ships only the v1 API, so a test of the classic API runs its body here when the
classic classes import, else re-runs itself under an interpreter that has them: the one
`RETRAIN_CLASSIC_VERIFIERS_PYTHON` names, or `.venv-verifiers03/bin/python`, which
`scripts/verifiers03_venv.sh` builds (and `.ci/run` builds for every CI run)."""

from __future__ import annotations

import functools
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


def run_pytest(test_file: str, selector: str = "", marker: str = "") -> subprocess.CompletedProcess:
    """`pytest -rA [-k selector] test_file` under the classic interpreter, with this
    checkout of retrain on its path; `marker`: its -m where not the default one (which
    deselects a slow test)."""
    python = Path(PYTHON)
    python = python if python.is_absolute() else Path.cwd() / python
    return subprocess.run(
        [
            *(str(python), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"),
            *(("-m", marker) if marker else ()),
            *(("-k", selector) if selector else ()),
            test_file,
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
    outcomes, output = _file_outcomes(str(test_file), marker)
    mine = {node: status for node, status in outcomes.items() if test_name in node.split("::")[-1]}
    assert mine and set(mine.values()) == {"PASSED"}, (
        f"{test_name} under {PYTHON} ({mine or 'not run: skipped or not collected'}):\n{output}"
    )
    return False


@functools.cache
def _file_outcomes(test_file: str, marker: str) -> tuple[dict[str, str], str]:
    """Every test of `test_file` run once under the classic interpreter (one process per
    file, not one per test: each start imports verifiers for seconds): node id -> PASSED
    / FAILED / ERROR from pytest's -rA summary (a skipped test is not listed), and the
    output's tail for a failure message. Tests of the file that need this interpreter's
    packages fail there; only the outcomes of the classic ones are read."""
    proc = run_pytest(test_file, marker=marker)
    outcomes = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            outcomes[rest.split(" - ")[0].strip()] = status
    return outcomes, proc.stdout[-3000:] + proc.stderr[-2000:]
