"""An OpenEnv app of the tests (openenv's own server: uvicorn), served on a free port of
127.0.0.1 for as long as the `with` lasts, under the interpreter running the test (which
has openenv: .venv-openenv, see tests/rerun.py)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


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
