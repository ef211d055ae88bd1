"""A Tinker run needs no local torch (`pip install 'retrain[tinker]'`): the run's own
path, from the CLI to the service, imports none. Here torch is made unimportable in the
run's process, as if it were not installed; the run gets as far as the service, which
nothing serves here (a closed port): the call's timeout ends it with a clean error, not a
hang. Without a key, the run refuses at its start, before anything loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NO_TORCH = """\
import sys
sys.modules["torch"] = None  # `import torch` now fails, as where it is not installed
from retrain.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_torch(tmp_path: Path, tiny_model_dir: Path, **env: str):
    (tmp_path / "no_torch.py").write_text(NO_TORCH)
    (tmp_path / "retrain.toml").write_text(
        '[backend]\nbackend = "tinker"\noptions = { max_retries = 1, timeout_s = 5 }\n'
        f'[model]\nmodel = "{tiny_model_dir}"\nbase_url = "http://127.0.0.1:9"\n'
        '[training]\nmax_steps = 1\n[data]\nsource = "reasoning_gym"\ntask = "chain_sum"\n'
        "size = 8\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "TINKER_API_KEY"}
    base.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", **env)
    return subprocess.run(
        [sys.executable, "no_torch.py"],
        cwd=tmp_path,
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_tinker_run_starts_without_torch(tmp_path, tiny_model_dir):
    proc = run_without_torch(tmp_path, tiny_model_dir, TINKER_API_KEY="tml-test")
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "No module named" not in out, out
    assert "Connecting to Tinker..." in proc.stdout, out
    assert proc.returncode == 1, out
    assert (
        "Tinker training-client creation failed after 1 attempts: TimeoutError: Tinker "
        "training-client creation did not answer within 5 s. The service looks unavailable: "
        "check [model] base_url"
    ) in proc.stderr, out


def test_a_tinker_run_without_its_key_is_refused_at_its_start(tmp_path, tiny_model_dir):
    proc = run_without_torch(tmp_path, tiny_model_dir)
    assert proc.returncode == 2 and "Loading" not in proc.stdout, proc.stdout + proc.stderr
    assert "[backend] backend: tinker needs a Tinker API key: TINKER_API_KEY is not set" in (
        proc.stderr
    )
