"""Starting and stopping real servers (vLLM, and MAX and llama.cpp through the same
start-script convention) for the opt-in `-m vllm` / `-m max` / `-m llamacpp` tests.

The server runs from its own venv (scripts/vllm_server/setup_venv.sh; it pins torch and
transformers < 5.20, so it cannot share the project venv) through
scripts/vllm_server/start.sh, on a free port of 127.0.0.1. RETRAIN_VLLM_URL points the tests
at a server that is already running instead (it must have been started by start.sh, or
with the same flags).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(
    os.environ.get("RETRAIN_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "retrain"
)
VENV = Path(os.environ.get("VLLM_VENV", CACHE / "servers" / "vllm-venv"))
MODEL_DIR = CACHE / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "safetensors"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_url(tmp: Path) -> Iterator[str]:
    """Yield the URL of a running vLLM server (started here unless RETRAIN_VLLM_URL is
    set); the server started here is stopped afterwards."""
    if os.environ.get("RETRAIN_VLLM_URL"):
        yield os.environ["RETRAIN_VLLM_URL"].rstrip("/")
        return
    need_server_files()
    yield from served("vllm", "VLLM", tmp, venv=VENV, model=MODEL_DIR, timeout=900)


def start_server(port: int, pidfile: Path, log: Path) -> int:
    """Start vLLM by scripts/vllm_server/start.sh on `port` and wait until it is healthy;
    its pid (also in `pidfile`)."""
    return run_start_script(
        "vllm", "VLLM", port, pidfile, log, venv=VENV, model=MODEL_DIR, timeout=900
    )


def served(
    name: str, prefix: str, tmp: Path, *, venv: Path, model: Path, timeout: int
) -> Iterator[str]:
    """Yield the URL of a server started by scripts/{name}_server/start.sh on a free port;
    it is stopped afterwards."""
    port, pidfile = free_port(), tmp / f"{name}.pid"
    start = time.time()
    try:
        run_start_script(
            name,
            prefix,
            port,
            pidfile,
            tmp / f"{name}.log",
            venv=venv,
            model=model,
            timeout=timeout,
        )
        print(f"{name} ready on port {port} in {time.time() - start:.0f}s")
        yield f"http://127.0.0.1:{port}"
    finally:
        if pidfile.exists():
            stop(int(pidfile.read_text()))


def run_start_script(
    name: str,
    prefix: str,
    port: int,
    pidfile: Path,
    log: Path,
    *,
    venv: Path,
    model: Path,
    timeout: int,
) -> int:
    """Run scripts/{name}_server/start.sh --background (settings in its PREFIX_* variables),
    which returns once the server is healthy; the server's pid (also in `pidfile`)."""
    env = {
        **os.environ,
        f"{prefix}_PORT": str(port),
        f"{prefix}_PIDFILE": str(pidfile),
        f"{prefix}_LOG": str(log),
        f"{prefix}_VENV": str(venv),
        f"{prefix}_MODEL": str(model),
    }
    result = subprocess.run(
        [str(REPO / "scripts" / f"{name}_server" / "start.sh"), "--background"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name} did not start:\n{result.stdout}\n{result.stderr}")
    return int(pidfile.read_text())


def need_server_files() -> None:
    """Skip unless the vLLM venv and the cached model exist."""
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {VENV}. Build it with: scripts/vllm_server/setup_venv.sh")
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"no SmolLM2 safetensors copy at {MODEL_DIR}: run the quickstart once")


def stop(pid: int) -> None:
    """SIGTERM the server (its engine process exits with it), SIGKILL after 30 s."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(60):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
