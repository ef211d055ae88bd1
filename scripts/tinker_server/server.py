"""Start a local Tinker-compatible server (skyrl-tx or skyrl, JAX on CPU) on 127.0.0.1.

Used by the opt-in integration test (tests/integration/test_tinker_server.py) and by hand:

    scripts/tinker_server/setup_venv.sh
    .venv-tinker-server/bin/python scripts/tinker_server/server.py [--model DIR]

prints the base URL and the model directory to use, and serves until Ctrl-C. Then point retrain at it:

    [backend] backend = "tinker"
    [model]   model = "DIR", base_url = "http://127.0.0.1:PORT"
    TINKER_API_KEY=tml-local  (any key with the tml- prefix; the local server does not check it)

The server always listens on 127.0.0.1 (the packages' own default is every address). Its
API process starts the engine with `uv run --extra ... -m <pkg>.tinker.engine`; the venv's
`uv` shim (written by setup_venv.sh) is put first on PATH, and starts the API itself, so no
real `uv` is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-tinker-server"
DEFAULT_BACKEND_CONFIG = {"max_lora_adapters": 2, "max_lora_rank": 8}


def default_model_dir() -> Path:
    """The SmolLM2-135M-Instruct safetensors copy the local backend caches."""
    root = os.environ.get("RETRAIN_CACHE") or (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "retrain"
    )
    return Path(root) / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "safetensors"


def prepare_model_dir(source: str | Path, target: str | Path) -> Path:
    """A copy of `source` (symlinks) the server's transformers 4.x can load.

    A directory saved by transformers 5 names its tokenizer class `TokenizersBackend` and
    nests `rope_theta` under `rope_parameters`; transformers 4.x (what skyrl-tx 0.3 needs)
    knows neither, so the copy's tokenizer_config.json says `PreTrainedTokenizerFast` and
    its config.json carries `rope_theta` at the top level. Point both the server
    (--base-model) and retrain ([model] model) at the copy so the names match."""
    source, target = Path(source).resolve(), Path(target)
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"{source} is not a Hugging Face model directory")
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        link = target / item.name
        if (
            item.name in ("config.json", "tokenizer_config.json")
            or link.exists()
            or link.is_symlink()
        ):
            continue
        link.symlink_to(item)
    model_config = json.loads((source / "config.json").read_text())
    rope = model_config.get("rope_parameters")
    if "rope_theta" not in model_config and isinstance(rope, dict) and "rope_theta" in rope:
        # transformers 5 nests rope_theta under rope_parameters; 4.x reads it at top level.
        model_config["rope_theta"] = rope["rope_theta"]
    link = target / "config.json"
    if link.is_symlink():
        link.unlink()
    link.write_text(json.dumps(model_config, indent=2))
    config_path = source / "tokenizer_config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        if config.get("tokenizer_class") == "TokenizersBackend":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config.pop("backend", None)
        (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return target


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# The Tinker API modules of the two packages that serve it (skyrl-tx, and its successor skyrl).
API_MODULES = ("tx.tinker.api", "skyrl.tinker.api")


def api_module(venv: Path) -> str | None:
    """The server package's API module importable in `venv`, or None."""
    python = str(Path(venv) / "bin" / "python")
    for module in API_MODULES:
        probe = subprocess.run(
            [python, "-c", f"import {module}, jax, tinker"], capture_output=True, text=True
        )
        if probe.returncode == 0:
            return module
    return None


def venv_problem(venv: Path) -> str | None:
    """Why `venv` cannot run the server, or None."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"{venv} does not exist: run scripts/tinker_server/setup_venv.sh"
    if not (venv / "uv-shim" / "uv").exists():
        return f"{venv} has no uv shim: re-run scripts/tinker_server/setup_venv.sh"
    if api_module(venv) is None:
        return (
            f"{venv} cannot import a Tinker server ({' or '.join(API_MODULES)}) with jax and "
            "tinker: re-run scripts/tinker_server/setup_venv.sh"
        )
    return None


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    workdir: Path
    log_path: Path
    started_at: float = field(default_factory=time.time)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Block until /healthz answers; returns the seconds it took."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the Tinker server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self.healthy():
                return time.time() - self.started_at
            time.sleep(1.0)
        raise TimeoutError(f"the Tinker server was not ready in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 15.0) -> None:
        """Stop the API process and the engine it started (one process group, ours)."""
        pgid = self.process.pid  # started with start_new_session=True: pgid == pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace)
        with contextlib.suppress(ProcessLookupError):  # the engine may outlive the API process
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)


def start(
    model_dir: str | Path,
    workdir: str | Path,
    *,
    venv: str | Path = DEFAULT_VENV,
    port: int = 0,
    backend_config: dict | None = None,
    extra_env: dict[str, str] | None = None,
) -> Server:
    """Start skyrl-tx's Tinker API (+ engine) on 127.0.0.1; returns at once (see wait_ready)."""
    venv = Path(venv)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = dict(os.environ)
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "PATH": f"{venv / 'uv-shim'}{os.pathsep}{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv),
            "PYTHONUNBUFFERED": "1",
            # Threads: the box is small and shared; oversubscription makes JAX crawl.
            "OMP_WAIT_POLICY": env.get("OMP_WAIT_POLICY", "PASSIVE"),
        }
    )
    env.pop("PYTHONPATH", None)
    env.update(extra_env or {})
    module = api_module(venv)
    if module is None:
        raise RuntimeError(venv_problem(venv) or f"no Tinker server in {venv}")
    cmd = [
        str(venv / "uv-shim" / "uv"),  # skyrl wants a `uv run ... -m <api>` parent process
        "run",
        "-m",
        module,
        "--base-model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database-url",
        f"sqlite:///{workdir / 'tinker.db'}",
        "--checkpoints-base",
        str(workdir / "checkpoints"),
        "--backend-config",
        json.dumps(backend_config or DEFAULT_BACKEND_CONFIG),
    ]
    log_path = workdir / "server.log"
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    try:
        process = subprocess.Popen(
            cmd,
            cwd=str(workdir),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()
    return Server(process, f"http://127.0.0.1:{port}", workdir, log_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()), help="local HF model dir")
    parser.add_argument("--workdir", default=str(REPO / "logs" / "tinker_server"))
    parser.add_argument("--venv", default=str(DEFAULT_VENV))
    parser.add_argument("--port", type=int, default=0, help="0 = a free port")
    parser.add_argument("--backend-config", default=json.dumps(DEFAULT_BACKEND_CONFIG))
    args = parser.parse_args(argv)
    problem = venv_problem(Path(args.venv))
    if problem:
        print(problem, file=sys.stderr)
        return 2

    def _terminate(signum, frame):  # background jobs ignore SIGINT: honour SIGTERM too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    model_dir = prepare_model_dir(args.model, Path(args.workdir) / "model")
    server = start(
        model_dir,
        args.workdir,
        venv=args.venv,
        port=args.port,
        backend_config=json.loads(args.backend_config),
    )
    try:
        took = server.wait_ready()
        print(f"Tinker server ready at {server.url} ({took:.0f}s); log: {server.log_path}")
        print(f'Use [model] model = "{model_dir}" and base_url = "{server.url}"')
        print("Ctrl-C stops it.", flush=True)
        while server.process.poll() is None:
            time.sleep(1.0)
        print(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
