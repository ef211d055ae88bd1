"""OpenEnv in the tests: openenv cannot share the project's environment, so a test that
needs it runs its body under .venv-openenv (`runs_here`; scripts/openenv_venv.sh builds
it, CI too), and an app of the tests is served by openenv's own server (uvicorn) on a
free port of 127.0.0.1 (`serving`)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from rerun import assert_passed_under

VENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv-openenv" / "bin" / "python"


def runs_here(test_file: str, test_name: str, marker: str = "") -> bool:
    """True when openenv imports here: the caller runs its body. Else the test runs under
    .venv-openenv, which must pass it (skipped, saying how, when that is missing);
    `marker`: the re-run's -m where not the default one (which deselects a slow test)."""
    try:
        import openenv.core  # noqa: F401

        return True
    except ImportError:
        pass
    if not VENV_PYTHON.is_file():
        pytest.skip("needs openenv 0.4.1: run scripts/openenv_venv.sh once")
    assert_passed_under(str(VENV_PYTHON), test_file, test_name, marker)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app: str, cwd: Path) -> Iterator[str]:
    """`app` ("module:attribute", the module in `cwd`) served; yields its URL once its
    /health answers."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
