"""The classic verifiers API (0.3.x) for tests: is it importable here, and running a test
module under another interpreter that has it (`RETRAIN_CLASSIC_VERIFIERS_PYTHON`; the
project's own environment has verifiers 0.4, which ships only the v1 API)."""

from __future__ import annotations

import importlib
import os
import subprocess
from pathlib import Path

PYTHON = os.environ.get("RETRAIN_CLASSIC_VERIFIERS_PYTHON", "")
REPO = Path(__file__).resolve().parents[2]


def available(*classes: str) -> bool:
    """Whether `verifiers` imports here and has these classic classes."""
    try:
        vf = importlib.import_module("verifiers")
    except Exception:
        return False
    return all(hasattr(vf, name) for name in classes)


def run_pytest(test_file: str, selector: str) -> subprocess.CompletedProcess:
    """`pytest -k selector test_file` under the classic interpreter, with this checkout
    of retrain on its path."""
    python = Path(PYTHON)
    python = python if python.is_absolute() else Path.cwd() / python
    return subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selector, test_file],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
