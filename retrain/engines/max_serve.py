"""`[inference] engine = "max"` with no `url`: retrain starts and owns a `max serve`.

Modular MAX 26.7 has no public in-process API that returns sampled token ids and
logprobs (its `max._entrypoints.llm.LLM` is private, deprecated, and returns text only;
it starts a model worker process anyway). So "in-process" means: the `max` package
installed in retrain's own environment is run as a child process (`max serve`, found
through the package's `max` console-script entry point, so no PATH lookup can pick another
`max`), bound to a free port of 127.0.0.1; retrain waits until it serves `/v1/models`,
talks to it over HTTP exactly as to a `url`, and stops it when the engine closes (or when
the Python process exits).

MAX serves LoRA adapters on GPUs only, so on a machine without an accelerator training
through it is refused before anything starts (`problems`): the adapter could not follow
the optimizer and every step would sample from stale weights.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from retrain.errors import BackendError

ENGINE_KEY = "[inference] engine"
_INSTALL_FIX = (
    "Fix: pip install modular (MAX; retrain then starts `max serve` itself), or start a MAX "
    'server yourself (scripts/max_server/start.sh) and set [inference] url = "http://127.0.0.1:8000"'
)
# Runs the `max` console script's function in a child: argv[1:] are `max` CLI arguments.
_LAUNCHER = "import sys, importlib; m, f = sys.argv.pop(1).split(':'); sys.argv[0] = 'max'; sys.exit(getattr(importlib.import_module(m), f)())"


def max_entry_point() -> str | None:
    """The `max` console script (`module:function`) of the installed MAX package, or None
    when MAX is not installed in this Python environment."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="console_scripts", name="max"):
        dist = getattr(ep, "dist", None)
        if dist is None or dist.metadata["Name"].lower() in ("max", "modular"):
            return ep.value
    return None


def accelerator_count() -> int:
    """GPUs MAX can use here (0 on a CPU-only machine)."""
    from max.driver import accelerator_count as count

    return int(count())


def problems(*, needs_lora: bool) -> list[tuple[str, str]]:
    """Why retrain cannot start MAX itself here (loads no model, starts nothing)."""
    if max_entry_point() is None:
        return [
            (
                ENGINE_KEY,
                'engine = "max" with an empty [inference] url runs MAX from retrain\'s own '
                f"Python environment ({sys.executable}), but the `max` package is not installed "
                f"there. {_INSTALL_FIX}",
            )
        ]
    if needs_lora and accelerator_count() == 0:
        return [
            (
                ENGINE_KEY,
                "MAX serves LoRA adapters on GPUs only and this machine has none, so the "
                "adapter could not follow training and every step would sample from stale "
                'weights. Fix: engine = "vllm" (runs on a CPU: scripts/vllm_server/), '
                'engine = "pytorch", or a GPU machine',
            )
        ]
    return []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ManagedMax:
    """A `max serve` child process that retrain started and stops."""

    def __init__(
        self,
        model_path: str,
        *,
        lora_rank: int = 0,
        python: str = sys.executable,
        entry: str | None = None,
        ready_s: float = 900.0,
        say: Callable[[str], None] = print,
    ):
        self.entry = entry or max_entry_point()
        if self.entry is None:
            raise BackendError(f"{ENGINE_KEY}: the `max` package is not installed. {_INSTALL_FIX}")
        self.model_path = model_path
        self.lora_rank = lora_rank
        self.python = python
        self.ready_s = ready_s
        self.say = say
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        fd, log = tempfile.mkstemp(prefix=f"retrain-max-{self.port}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)

    def command(self, gpu: bool) -> list[str]:
        args = ["serve", "--model", self.model_path, "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--max-length", "2048", "--max-batch-size", "32"]
        if gpu:
            args += ["--devices", "gpu"]
            if self.lora_rank:  # the adapter being replaced and the new one
                args += ["--enable-lora", "--max-lora-rank", str(self.lora_rank)]
                args += ["--max-num-loras", "2"]
        else:  # float32: logprobs within 2e-4 of the fp32 trainer's
            args += ["--devices", "cpu", "--quantization-encoding", "float32"]
        return [self.python, "-c", _LAUNCHER, self.entry, *args]

    def start(self, *, gpu: bool = False) -> str:
        """Start `max serve`, wait until it lists its model, return its URL."""
        env = {**os.environ, "MAX_SERVE_DISABLE_TELEMETRY": "1"}
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = self.command(gpu)
        self.say(
            f"Starting max serve on {self.url} (log: {self.log}); the first start compiles ~2 min"
        )
        with open(self.log, "wb") as out:
            # Its own session: stopping it stops its model worker processes too.
            self.process = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        atexit.register(self.close)
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise BackendError(
                    f"{ENGINE_KEY}: max serve exited (code {self.process and self.process.returncode}) "
                    f"before it was ready; last lines of {self.log}:\n{self._tail()}"
                )
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).is_success:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(1.0)
        self.close()
        raise BackendError(
            f"{ENGINE_KEY}: max serve did not answer on {self.url} within {self.ready_s:.0f}s; "
            f"see {self.log}:\n{self._tail()}"
        )

    def _tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 30 s. Idempotent."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass


__all__ = ["ManagedMax", "accelerator_count", "max_entry_point", "problems"]
