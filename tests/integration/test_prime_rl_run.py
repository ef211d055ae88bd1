"""The prime_rl backend driven by the real training loop, against a TEST RECEIVER.

scripts/prime_rl_receiver/receiver.py stands in for prime-rl (it is not prime-rl): a real
process that reads the real transport (files under adapter_path/rollouts, or a ZMQ PULL
socket), decodes every batch with its own msgpack reader against prime-rl's layout, writes
broadcasts/step_N/STABLE the way prime-rl's broadcaster does, and serves
/v1/chat/completions/tokens (deterministic tokens) and /update_weights on 127.0.0.1. The
tokenizer is the tiny model's (tests/integration/conftest.py); no model weights load.

The test marked `prime_rl` runs only where prime-rl itself is importable (a GPU box with
prime-rl installed from source, docs/prime_rl.md); it is skipped elsewhere.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("msgspec")

from run_helpers import QuietConsole  # noqa: E402

from retrain.config import config_from_dict  # noqa: E402
from retrain.errors import BackendError  # noqa: E402
from retrain.logs.jsonl import read_jsonl  # noqa: E402
from retrain.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECEIVER = REPO / "scripts" / "prime_rl_receiver" / "receiver.py"


def run(raw: dict) -> tuple[int, list[str]]:
    console = QuietConsole()
    code = train(config_from_dict(raw), console=console)
    return code, console.lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def receiver(tmp_path, tiny_model_dir):
    """Start the test receiver for an output dir; stopped at teardown."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    procs = []

    def start(out: Path, *extra: str) -> dict:
        ready = tmp_path / f"ready_{len(procs)}.json"
        proc = subprocess.Popen(
            [
                sys.executable, str(RECEIVER), "--output-dir", str(out),
                "--ready-file", str(ready), "--vocab-size", str(len(tok)),
                "--eos-id", str(tok.eos_token_id), "--first-token", "3", *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        procs.append(proc)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        return {**json.loads(ready.read_text()), "proc": proc}

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def prime_raw(tiny_raw: dict, out: Path, url: str, **options) -> dict:
    raw = copy.deepcopy(tiny_raw)
    raw["backend"] = {
        "backend": "prime_rl",
        "adapter_path": str(out),
        "options": {"sync_wait_s": 10, "sync_poll_s": 0.05, **options},
    }
    raw["inference"] = {"url": url}
    raw["algorithm"] = {"advantage_mode": "grpo", "transform_mode": "none"}
    raw["training"].update(max_steps=2, save_every=1)
    return raw


def rows(path: Path) -> list[dict]:
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )


def wait_rows(path: Path, n: int, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(rows(path)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return rows(path)


def test_two_steps_then_resume_through_the_filesystem_transport(tiny_raw, tmp_path, receiver):
    out = tmp_path / "prime_out" / "run_default"
    ready = receiver(out)
    raw = prime_raw(tiny_raw, out, ready["url"])

    code, lines = run(raw)
    assert code == 0, lines
    steps = [line for line in lines if line.startswith("Step ")]
    assert len(steps) == 2 and all("(async placeholder)" in s for s in steps)
    log_dir = Path(raw["logging"]["log_dir"])
    metrics, bad = read_jsonl(log_dir / "metrics.jsonl")
    assert not bad and [r["step"] for r in metrics] == [0, 1]
    sent = sum(1 for r in metrics if r["num_datums"])
    assert sent >= 1  # the parity reward leaves some groups informative

    batches = wait_rows(out / "receiver" / "batches.jsonl", sent)
    assert [b["step"] for b in batches] == list(range(sent))  # contiguous batch steps
    assert [b["examples"] and len(b["examples"]) for b in batches] == [
        r["num_datums"] for r in metrics if r["num_datums"]
    ]
    for b in batches:
        for e in b["examples"]:
            assert e["prompt_mask"] == [False] * len(e["prompt_ids"])
            assert e["completion_mask"] == [True] * len(e["completion_ids"])
            assert e["completion_temperatures"] == [1.0] * len(e["completion_ids"])
            assert isinstance(e["advantage"], float) and e["reward"] is None
    assert not (out / "receiver" / "errors.jsonl").exists()
    saved = json.loads((out / "final" / "prime_rl_backend_state.json").read_text())
    assert saved["batches_sent"] == sent

    # Step 1 sampled with the weights the receiver broadcast after batch 0, and the final
    # checkpoint waited for (and loaded) the broadcast of the last batch.
    updates = rows(out / "receiver" / "updates.jsonl")
    assert [u["step"] for u in updates] == list(range(1, sent + 1))
    assert updates[0]["weight_dir"] == str(out / "broadcasts" / "step_1")
    assert saved["loaded_step"] == sent

    # The trainer restarts too: it finds the run again by its control/orch.toml, which now
    # says to read on from the next batch step (the receiver's own step starts at 0).
    assert [r["step"] for r in rows(out / "receiver" / "discovered.jsonl")] == [0]
    ready["proc"].terminate()
    ready["proc"].wait(10)
    ready = receiver(out)
    resumed = copy.deepcopy(raw)
    resumed["inference"]["url"] = ready["url"]
    resumed["training"]["max_steps"] = 4
    resumed["resume"] = {"from": str(log_dir)}
    code, lines = run(resumed)
    assert code == 0, lines
    assert any("Resumed from" in line for line in lines)
    assert any("Loaded PRIME-RL backend state" in line for line in lines)
    metrics, _ = read_jsonl(log_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3]
    total = sum(1 for r in metrics if r["num_datums"])
    batches = wait_rows(out / "receiver" / "batches.jsonl", total)
    assert [b["step"] for b in batches] == list(range(total))  # resumed without a gap
    assert [b["expected_step"] for b in batches] == list(range(total))
    final = json.loads((out / "final" / "prime_rl_backend_state.json").read_text())
    assert final["batches_sent"] == total and final["loaded_step"] == total
    # On resume the inference server is pointed at the saved weights again, then on.
    updates = [u["step"] for u in rows(out / "receiver" / "updates.jsonl")]
    assert updates == [*range(1, sent + 1), sent, *range(sent + 1, total + 1)]
    assert [r["step"] for r in rows(out / "receiver" / "discovered.jsonl")] == [0, sent]


def test_a_lora_trainer_is_loaded_by_name_and_an_eviction_stops_the_run(
    tiny_raw, tmp_path, receiver
):
    """A LoRA trainer broadcasts adapters: the server loads each as the run's named LoRA
    and sampling asks for it. Then the trainer evicts the run (a sample longer than its
    sequence length): the run stops with the trainer's reason, its checkpoint kept."""
    out = tmp_path / "prime_out" / "run_lora"
    ready = receiver(out, "--lora")
    raw = prime_raw(tiny_raw, out, ready["url"])
    raw["training"].update(max_steps=3)
    code, lines = run(raw)
    assert code == 0, lines
    sent = len(rows(out / "receiver" / "batches.jsonl"))
    assert sent >= 1
    updates = rows(out / "receiver" / "updates.jsonl")
    assert {u["lora_name"] for u in updates} == {"run_lora"}
    assert updates[0]["lora_path"] == str(out / "broadcasts" / "step_1")
    models = [r["model"] for r in rows(out / "receiver" / "requests.jsonl")]
    assert models[0] == raw["model"]["model"] and models[-1] == "run_lora"

    evicting = tmp_path / "prime_out" / "run_long"
    ready = receiver(evicting, "--seq-len", "3")
    raw = prime_raw(tiny_raw, evicting, ready["url"])
    raw["logging"]["log_dir"] = str(tmp_path / "logs_long")
    raw["training"].update(max_steps=4)
    with pytest.raises(BackendError, match=r"evicted this run .*exceeds max sequence length 3"):
        run(raw)
    metrics, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    assert 1 <= len(metrics) < 4  # it stopped at the step after the eviction


def test_one_step_through_the_zmq_transport(tiny_raw, tmp_path, receiver):
    out = tmp_path / "prime_out" / "run_zmq"
    port = free_port()
    ready = receiver(out, "--transport", "zmq", "--zmq-port", str(port))
    raw = prime_raw(
        tiny_raw, out, ready["url"], transport="zmq", zmq_host="127.0.0.1", zmq_port=port
    )
    raw["training"].update(max_steps=1)
    code, lines = run(raw)
    assert code == 0, lines
    metrics, _ = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    if metrics[0]["num_datums"]:
        (batch,) = wait_rows(out / "receiver" / "batches.jsonl", 1)
        assert batch["sender_id"] == "run_zmq" and batch["step"] == 0
        assert len(batch["examples"]) == metrics[0]["num_datums"]


# ---------------------------------------------------------------- opt-in: real prime-rl

HAS_PRIME_RL = importlib.util.find_spec("prime_rl") is not None


@pytest.mark.prime_rl
@pytest.mark.skipif(not HAS_PRIME_RL, reason="prime-rl is not importable (install it from source)")
def test_prime_rl_decodes_what_retrain_sends():
    """prime-rl's own TrainingBatch type reads retrain's bytes (whatever prime-rl is installed)."""
    import msgspec
    from prime_rl.transport.types import TrainingBatch

    from retrain.backends import prime_rl as prl
    from retrain.types import Datum

    d = Datum([1, 2, 3], [4, 5, 2], [-0.5, -0.6, -0.1], [0.25] * 3)
    payload = prl.encode_batch([prl.training_sample(d, 0.7)], step=5)
    batch = msgspec.msgpack.Decoder(type=TrainingBatch).decode(payload)
    assert batch.step == 5
    (sample,) = batch.examples
    assert sample.prompt_ids == [1, 2, 3] and sample.completion_ids == [4, 5, 2]
    assert list(sample.completion_mask) == [True] * 3 and sample.advantage == 0.25


@pytest.mark.prime_rl
@pytest.mark.skipif(not HAS_PRIME_RL, reason="prime-rl is not importable (install it from source)")
def test_prime_rl_reads_the_run_config_retrain_writes(tmp_path):
    """The run's control/orch.toml, loaded as prime-rl's trainer loads it (tomli, then
    OrchestratorConfig), fresh and on resume."""
    import tomli
    from prime_rl.configs.orchestrator import OrchestratorConfig

    from retrain.backends import prime_rl as prl

    run = tmp_path / "outputs" / "run_retrain"
    for step in (0, 3):
        config = OrchestratorConfig(
            **tomli.loads(prl.run_config_toml(run, "Qwen/Qwen3-0.6B", step))
        )
        assert config.output_dir == run and config.model.name == "Qwen/Qwen3-0.6B"
        assert config.model.lora.name == "run_retrain" and config.model.lora.rank is None
        assert (config.ckpt.resume_step if step else config.ckpt) == (step or None)


@pytest.mark.prime_rl
@pytest.mark.skipif(not HAS_PRIME_RL, reason="prime-rl is not importable (install it from source)")
@pytest.mark.skipif(
    not (os.environ.get("PRIME_RL_INFERENCE_URL") and os.environ.get("PRIME_RL_OUTPUT_DIR")),
    reason="set PRIME_RL_INFERENCE_URL and PRIME_RL_OUTPUT_DIR to a running prime-rl stack",
)
def test_two_steps_against_a_running_prime_rl(tmp_path):
    """2 steps + resume against a live prime-rl trainer and inference server
    (PRIME_RL_OUTPUT_DIR: the run directory, <the trainer's output_dir>/run_<name>, new;
    PRIME_RL_MODEL: the model both serve, default Qwen/Qwen3-0.6B)."""
    raw = {
        "backend": {
            "backend": "prime_rl",
            "adapter_path": os.environ["PRIME_RL_OUTPUT_DIR"],
            "options": {"sync_wait_s": 600},
        },
        "inference": {"url": os.environ["PRIME_RL_INFERENCE_URL"]},
        "model": {"model": os.environ.get("PRIME_RL_MODEL", "Qwen/Qwen3-0.6B")},
        "algorithm": {"advantage_mode": "grpo", "transform_mode": "none"},
        "training": {"max_steps": 2, "save_every": 1, "batch_size": 4, "group_size": 8},
        "data": {"source": "reasoning_gym", "task": "basic_arithmetic", "size": 64},
        "reward": {"type": "gym"},
        "logging": {"log_dir": str(tmp_path / "logs")},
    }
    assert run(raw)[0] == 0
    resumed = copy.deepcopy(raw)
    resumed["training"]["max_steps"] = 3
    resumed["resume"] = {"from": str(tmp_path / "logs")}
    code, lines = run(resumed)
    assert code == 0 and any("Resumed from" in line for line in lines)
