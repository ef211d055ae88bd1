"""A Tinker run needs no local torch (`pip install 'retrain[tinker]'`): the run's own
path, from the CLI to the service, imports none. Here torch is made unimportable in the
run's process, as if it were not installed; the run gets as far as the service, whose
missing key is the clean error it stops on (no Tinker service runs here)."""

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


def test_a_tinker_run_starts_without_torch(tmp_path, tiny_model_dir):
    (tmp_path / "no_torch.py").write_text(NO_TORCH)
    (tmp_path / "retrain.toml").write_text(
        f'[backend]\nbackend = "tinker"\n[model]\nmodel = "{tiny_model_dir}"\n'
        '[training]\nmax_steps = 1\n[data]\nsource = "reasoning_gym"\ntask = "chain_sum"\n'
        "size = 8\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TINKER_API_KEY"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(
        [sys.executable, "no_torch.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "torch" not in proc.stderr, out
    assert "Connecting to Tinker..." in proc.stdout, out
    assert proc.returncode == 1 and "TINKER_API_KEY" in proc.stderr, out
