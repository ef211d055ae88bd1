"""The tinker backend end to end against a real Tinker-compatible server on CPU (opt-in).

skyrl-tx serves the Tinker API with a JAX backend; this test starts it on 127.0.0.1 with
SmolLM2-135M-Instruct, runs `retrain` with `[backend] backend = "tinker"` for 2 steps (batch 2 x group 4),
resumes to step 4 from the saved `tinker://` checkpoint, and squeezes the final adapter
fetched through the SDK. It takes ~2-6 minutes on 2 CPU cores, most of it JAX compiling
the first sample and forward_backward (longer on a busy machine). Run it with:

    scripts/tinker_server/setup_venv.sh
    .venv-tinker-server/bin/python -m pytest -m tinker tests/integration/test_tinker_server.py -s

(skyrl-tx 0.3.0 + tinker SDK 0.16.1; `TINKER_SERVER=skyrl` builds the skyrl 0.3.0 + SDK
0.24.1 pair in .venv-tinker-server-skyrl: run it with RETRAIN_TINKER_VENV pointing there.)

Both the server and retrain (the client, with the tinker SDK version that works against the
server) run from `.venv-tinker-server` (RETRAIN_TINKER_VENV overrides it), whichever Python
runs pytest. Needs the SmolLM2 safetensors copy in the retrain cache (a first quickstart run
makes it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("RETRAIN_TINKER_VENV", REPO / ".venv-tinker-server"))
API_KEY = "tml-local-test-key"  # the local server accepts any key with the tml- prefix


def _server_module():
    path = REPO / "scripts" / "tinker_server" / "server.py"
    spec = importlib.util.spec_from_file_location("retrain_tinker_test_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


srv = _server_module()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    problem = srv.venv_problem(VENV)
    if problem:
        pytest.skip(problem)
    source = srv.default_model_dir()
    if not (source / "config.json").exists():
        pytest.skip(
            f"{source} is missing: run the quickstart once so retrain caches SmolLM2 as safetensors"
        )
    work = tmp_path_factory.mktemp("tinker_server")
    model = srv.prepare_model_dir(source, work / "model")
    started = time.time()
    handle = srv.start(model, work, venv=VENV)
    try:
        ready = handle.wait_ready(300)
        print(f"\n[tinker] server ready at {handle.url} in {ready:.1f}s (log {handle.log_path})")
        yield handle, model, work
    finally:
        handle.stop()
        print(f"[tinker] server stopped after {time.time() - started:.0f}s")


def _config(model: Path, url: str, run_dir: Path) -> str:
    return f"""
[backend]
backend = "tinker"

[backend.options]
max_retries = 3
retry_backoff_s = 2.0
timeout_s = 1800.0
keepalive_s = 15.0

[model]
model = "{model}"
base_url = "{url}"
lora_rank = 8

[algorithm]
advantage_mode = "maxrl"
transform_mode = "gtpo_sepa"

[training]
seed = 0
max_steps = 2
batch_size = 2
group_size = 4
max_tokens = 16
temperature = 1.0
lr = 2e-4
save_every = 1

[optimizer]
beta2 = 0.99

[sepa]
steps = 20
delay_steps = 5

[data]
source = "reasoning_gym"
task = "basic_arithmetic"
size = 50
seed = 1000
system_prompt = "You are a calculator. Put the final answer in \\\\boxed{{}}."
instruction = ""

[data.args]
min_terms = 2
max_terms = 2
min_digits = 1
max_digits = 1
operators = ["+"]
allow_parentheses = false
allow_negation = false

[[data.few_shot]]
user = "Calculate 3 + 4."
assistant = "3 + 4 = \\\\boxed{{7}}"

[reward]
type = "match"

[logging]
log_dir = "{run_dir / "logs"}"
group_lines = 2
"""


def _retrain(args: list[str], work: Path, name: str, extra_env: dict | None = None):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(
        {
            "TINKER_API_KEY": API_KEY,
            "HF_HUB_OFFLINE": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "TOKENIZERS_PARALLELISM": "false",
            "RETRAIN_CACHE": str(work / "cache"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra_env or {})
    started = time.time()
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "retrain.cli.main", *args],
        cwd=str(work),
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    seconds = time.time() - started
    output = proc.stdout + proc.stderr
    (work / f"{name}.log").write_text(output)
    print(f"[tinker] {name}: exit {proc.returncode} in {seconds:.0f}s")
    return proc.returncode, output, seconds, proc.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _show(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"[tinker]   step {r['step']}: loss={r['loss']:+.6f} reward={r['mean_reward']:.3f} "
            f"correct={r['correct_rate']:.0%} datums={r['num_datums']} "
            f"sample={r['time_sampling_s']:.1f}s train={r['time_training_s']:.1f}s "
            f"step={r['step_time_s']:.1f}s log_ratio_mean={r.get('log_ratio_mean')}"
        )


def test_train_resume_and_squeeze_against_a_local_tinker_server(server):
    handle, model, work = server
    run_dir = work / "run"
    run_dir.mkdir()
    config = run_dir / "retrain.toml"
    config.write_text(_config(model, handle.url, run_dir))
    logs = run_dir / "logs"

    # ---- 2 steps, a checkpoint after each
    code, out, seconds, _ = _retrain([str(config)], run_dir, "train")
    assert code == 0, out[-6000:] + "\n--- server log ---\n" + handle.log_tail()
    assert API_KEY not in out
    lines = out.splitlines()
    order = [
        "Connecting to Tinker...",
        f"Creating LoRA training client (model={model}, rank=8)...",
        "Training client ready.",
    ]
    positions = [next(i for i, line in enumerate(lines) if line.strip() == want) for want in order]
    assert positions == sorted(positions), out[-4000:]
    rows = _rows(logs / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["loss_is_placeholder"] is False
        assert 0.0 <= r["mean_reward"] <= 1.0 and r["tokens_generated"] > 0
        assert r["time_sampling_s"] > 0
    trained = [r for r in rows if r["num_datums"] > 0]
    for r in trained:
        assert r["trained_tokens"] > 0 and r["log_ratio_mean"] is not None
        # The sampler and the trainer see the same weights: tiny drift only.
        assert abs(r["log_ratio_mean"]) < 0.05, r
    state = json.loads((logs / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["finished"] is True
    ckpt = state["checkpoint"]
    # a CheckpointInfo record: `state` the training state, `adapter` the sampler weights
    assert ckpt["backend"] == "tinker"
    assert ckpt["state"].startswith("tinker://") and ckpt["state"].endswith("/final")
    assert ckpt["adapter"].startswith("tinker://")
    assert "Saved checkpoint at step 1 -> tinker://" in out
    assert "Saved final adapter at step 2 -> tinker://" in out
    print(f"[tinker] first run ({seconds:.0f}s): checkpoint {ckpt['state']}")
    _show(rows)

    # ---- resume from the final checkpoint and run two more steps. The server holds one
    # training model at a time (max_lora_adapters = 2, one slot is the base model): the
    # resumed run can only create its model because the first run released its own.
    code, out2, seconds2, _ = _retrain(
        [str(config), "--resume", str(logs), "--max-steps", "4"], run_dir, "resume"
    )
    assert code == 0, out2[-6000:] + "\n--- server log ---\n" + handle.log_tail()
    assert API_KEY not in out2
    assert f"Loaded Tinker checkpoint {ckpt['state']}" in out2
    assert f"Resumed from {logs} at step 2" in out2
    rows = _rows(logs / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows[2:])
    state = json.loads((logs / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["finished"] is True
    assert state["checkpoint"]["state"].startswith("tinker://")
    assert state["checkpoint"]["state"] != ckpt["state"]  # a new training run on the service
    print(f"[tinker] resumed run ({seconds2:.0f}s): checkpoint {state['checkpoint']['state']}")
    _show(rows[2:])

    # ---- LoRA-Squeeze on the tinker:// adapter, fetched through the SDK
    code, out3, seconds3, stdout3 = _retrain(
        ["squeeze", state["checkpoint"]["state"], "--json"],
        run_dir,
        "squeeze",
        {"TINKER_BASE_URL": handle.url},
    )
    assert code == 0, out3[-4000:]
    report = json.loads(stdout3[stdout3.index("{") : stdout3.rindex("}") + 1])
    assert report["source_rank"] == 8 and report["num_layers"] > 0
    # the smallest analysed rank that keeps the target share of the variance
    variance = {r["rank"]: r["mean_variance"] for r in report["ranks"]}
    assert sorted(variance) == [1, 2, 4, 8] and variance[8] == pytest.approx(1.0)
    target = report["min_variance_retention"]
    assert report["recommended_rank"] == min(r for r in variance if variance[r] >= target - 1e-12)
    print(
        f"[tinker] squeeze ({seconds3:.0f}s): {report['num_layers']} layers, "
        f"recommended rank {report['recommended_rank']} of {report['source_rank']}"
    )
    summary = {
        "train_s": seconds,
        "resume_s": seconds2,
        "squeeze_s": seconds3,
        "rows": rows,
        "checkpoint": state["checkpoint"],
        "squeeze": {k: report[k] for k in ("recommended_rank", "source_rank", "num_layers")},
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
