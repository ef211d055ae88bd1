"""The prime_rl backend's wire formats, transports, weight sync, resume state and probe.

Batches are encoded with the backend (msgspec) and decoded with an independent msgpack
reader written from the msgpack specification (scripts/prime_rl_receiver/receiver.py),
checked against prime-rl's TrainingSample/TrainingBatch layout field by field. The
transports run through a real directory and a real ZMQ socket, each read by the receiver
in a separate process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("msgspec")

from retrain.backends import prime_rl as prl  # noqa: E402
from retrain.build import prime_rl_settings  # noqa: E402
from retrain.config import config_from_dict  # noqa: E402
from retrain.errors import BackendError, CheckpointError, ConfigError  # noqa: E402
from retrain.http import sync_client  # noqa: E402
from retrain.settings import prime_rl_run_dir_problem  # noqa: E402
from retrain.types import CheckpointInfo, Datum, SamplingParams, TrainHyper  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECEIVER = REPO / "scripts" / "prime_rl_receiver" / "receiver.py"
HYPER = TrainHyper(lr=1e-5, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8)

# prime-rl's field names in wire order (src/prime_rl/transport/types.py), written out here
# on their own rather than read from the backend.
PRIME_RL_SAMPLE = [
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "completion_logprobs",
    "completion_temperatures",
    "teacher_logprobs",
    "advantage",
    "reward",
    "pixel_values",
    "pixel_values_shape",
    "image_grid_thw",
    "routed_experts",
]
PRIME_RL_BATCH = ["examples", "step", "run_idx"]


def _load_receiver():
    spec = importlib.util.spec_from_file_location("prime_rl_test_receiver", RECEIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rx = _load_receiver()


def datum(prompt=(5, 6, 7), completion=(10, 11, 12, 2), adv=0.5, logprob=-0.25) -> Datum:
    n = len(completion)
    return Datum(list(prompt), list(completion), [logprob - i for i in range(n)], [adv] * n)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prime_config(tmp_path: Path, **options):
    return config_from_dict(
        {
            "backend": {
                "backend": "prime_rl",
                "adapter_path": str(tmp_path / "prime_out" / "run_test"),
                "options": options,
            },
            "algorithm": {"advantage_mode": "grpo", "transform_mode": "none"},
            "inference": {"url": "http://127.0.0.1:9"},
        }
    )


# ---------------------------------------------------------------- the bytes


def test_batch_bytes_follow_prime_rl_layout_field_by_field():
    samples = [
        prl.training_sample(datum(adv=0.5), 0.7),
        prl.training_sample(datum(prompt=(1,), completion=(4, 2), adv=-1.25), 0.7),
    ]
    payload = prl.encode_batch(samples, step=3)

    raw = rx.unpack(payload)  # the spec-level view: nested arrays, no field names
    # msgspec writes every field of an array-like struct, defaults included
    assert isinstance(raw, list) and len(raw) == 3  # [examples, step, run_idx]
    assert raw[1] == 3 and raw[2] is None
    first = raw[0][0]
    assert len(first) == 13
    assert first[0] == [5, 6, 7] and first[1] == [False, False, False]
    assert first[2] == [10, 11, 12, 2] and first[3] == [True] * 4
    assert first[4] == [-0.25, -1.25, -2.25, -3.25]
    assert first[5] == [0.7] * 4
    assert first[6] is None  # teacher_logprobs: nil in the middle of the array
    assert first[7] == 0.5
    assert first[8:] == [None] * 5  # reward, then the multimodal / MoE fields

    batch = rx.batch_from_wire(payload)  # named by prime-rl's layout and type-checked
    assert list(batch) == PRIME_RL_BATCH
    assert list(batch["examples"][0]) == PRIME_RL_SAMPLE
    assert batch["step"] == 3 and batch["run_idx"] is None
    assert batch["examples"][1]["advantage"] == -1.25
    assert batch["examples"][1]["prompt_ids"] == [1]


def test_bytes_start_as_msgpack_arrays_of_known_types():
    payload = prl.encode_batch([prl.training_sample(datum(prompt=(1,), completion=(2,)), 1.0)], 0)
    # fixarray(3) [ fixarray(1) [ fixarray(13) [ fixarray(1) [1], fixarray(1) [false], ...
    assert payload[:6] == bytes([0x93, 0x91, 0x9D, 0x91, 0x01, 0x91])
    assert payload[6] == 0xC2  # false
    assert payload[-2:] == bytes([0x00, 0xC0])  # step 0 as a positive fixint, run_idx nil
    assert b"\xcb" in payload  # floats are float64, as msgspec writes Python floats


def test_backend_decoder_reads_its_own_bytes_back():
    payload = prl.encode_batch([prl.training_sample(datum(), 1.0)], step=7)
    batch = prl.decode_batch(payload)
    assert batch.step == 7 and batch.examples[0].completion_ids == [10, 11, 12, 2]


def test_plain_msgpack_library_agrees_when_installed():
    msgpack = pytest.importorskip("msgpack")
    payload = prl.encode_batch([prl.training_sample(datum(), 1.0)], step=2)
    assert msgpack.unpackb(payload) == rx.unpack(payload)


def test_token_varying_advantages_are_refused():
    d = Datum([1, 2], [3, 4, 5], [-1.0, -1.0, -1.0], [0.5, 0.5, 0.9])
    with pytest.raises(BackendError, match="one scalar advantage"):
        prl.training_sample(d, 1.0)
    uniform = Datum([1, 2], [3, 4], [-1.0, -1.0], [0.3, 0.3 + 1e-9])
    assert prl.training_sample(uniform, 1.0).advantage == pytest.approx(0.3)


def test_shorter_and_longer_layouts_decode_as_msgspec_does():
    import msgspec

    short = msgspec.msgpack.encode([[[[1], [False], [2], [True], [-1.0], [1.0]]], 4])
    batch = rx.batch_from_wire(short)  # an older sender: trailing optional fields missing
    assert batch["run_idx"] is None and batch["examples"][0]["advantage"] is None
    assert prl.decode_batch(short).examples[0].reward is None


def test_the_independent_decoder_rejects_a_wrong_layout():
    import msgspec

    wrong = msgspec.msgpack.encode([[[[1], [0], [2], [True], [-1.0], [1.0]]], 0])  # mask as ints
    with pytest.raises(rx.MsgpackError, match="prompt_mask"):
        rx.batch_from_wire(wrong)


# ---------------------------------------------------------------- transports, real processes


def start_receiver(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / f"ready_{time.monotonic_ns()}.json"
    proc = subprocess.Popen(
        [sys.executable, str(RECEIVER), "--ready-file", str(ready), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the receiver did not start: {proc.stderr.read().decode()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def wait_for_lines(path: Path, n: int, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            if len(rows) >= n:
                return rows
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {n} rows after {timeout}s")


def announce(out: Path) -> None:
    """The run's control/orch.toml, as the backend writes it: the receiver (as prime-rl's
    trainer) reads no batch of a run it has not found."""
    (out / "control").mkdir(parents=True)
    (out / "control" / "orch.toml").write_text(prl.run_config_toml(out, "m"))


def test_filesystem_round_trip_through_a_receiver_process(tmp_path):
    out = tmp_path / "run_fs"
    proc, _ = start_receiver(tmp_path, "--output-dir", str(out), "--no-http")
    announce(out)
    try:
        sender = prl.FileSystemSender(out)
        payloads = [
            prl.encode_batch([prl.training_sample(datum(adv=float(k)), 1.0)], k) for k in range(2)
        ]
        for k, payload in enumerate(payloads):
            path = sender.send(k, payload)
            assert path == out / "rollouts" / f"step_{k}" / "rollouts.bin"
            assert not (path.parent / "rollouts.bin.tmp").exists()
        rows = wait_for_lines(out / "receiver" / "batches.jsonl", 2)
        wait_for_lines(out / "broadcasts" / "step_2" / "STABLE", 0)
    finally:
        proc.terminate()
        proc.wait(10)
    assert [r["step"] for r in rows] == [0, 1] and [r["expected_step"] for r in rows] == [0, 1]
    assert [r["sha256"] for r in rows] == [hashlib.sha256(p).hexdigest() for p in payloads]
    assert rows[1]["examples"][0]["advantage"] == 1.0
    assert not (out / "receiver" / "errors.jsonl").exists()
    assert prl.stable_steps(out) == [1, 2]  # the receiver broadcast after each batch


def test_zmq_round_trip_through_a_receiver_process(tmp_path):
    out = tmp_path / "run_zmq"
    port = free_port()
    proc, ready = start_receiver(
        tmp_path, "--output-dir", str(out), "--no-http", "--transport", "zmq",
        "--zmq-port", str(port),
    )  # fmt: skip
    assert ready["zmq"] == f"tcp://127.0.0.1:{port}"
    announce(out)
    try:
        sender = prl.ZMQSender(out, "127.0.0.1", port, hwm=10, timeout_s=10)
        payloads = [
            prl.encode_batch([prl.training_sample(datum(adv=float(k)), 0.9)], k) for k in range(3)
        ]
        for k, payload in enumerate(payloads):
            sender.send(k, payload)
        rows = wait_for_lines(out / "receiver" / "batches.jsonl", 3)
        sender.close()
    finally:
        proc.terminate()
        proc.wait(10)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {r["sender_id"] for r in rows} == {"run_zmq"}  # output_dir.stem, as prime-rl
    assert [r["sha256"] for r in rows] == [hashlib.sha256(p).hexdigest() for p in payloads]
    assert rows[2]["examples"][0]["completion_temperatures"] == [0.9] * 4


def test_zmq_send_without_a_trainer_fails_with_the_fix(tmp_path):
    sender = prl.ZMQSender(tmp_path / "run", "127.0.0.1", free_port(), hwm=1, timeout_s=0.2)
    try:
        with pytest.raises(BackendError, match="zmq_host/zmq_port"):
            for k in range(5):  # past the high-water mark nothing more is queued
                sender.send(k, b"x")
    finally:
        sender.close()


# ---------------------------------------------------------------- inference responses


def test_parse_response_reads_token_ids_and_logprobs():
    data = {
        "choices": [
            {
                "index": 1,
                "finish_reason": "length",
                "token_ids": [7, 8, 9],
                "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}, {"logprob": -3.0}]},
            },
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {"token": "token_id:4", "logprob": -0.5},
                        {"token": "token_id:2", "logprob": -0.1},
                    ]
                },
            },
        ]
    }
    first, second = prl.parse_response(data, 2, eos_ids=[2], max_tokens=8)
    assert first.token_ids.tolist() == [4, 2] and first.stop_reason == "eos"
    assert second.logprobs.tolist() == [-1.0, -2.0, -3.0] and second.stop_reason == "length"
    with pytest.raises(BackendError, match="returned 2 choices, expected 3"):
        prl.parse_response(data, 3)
    with pytest.raises(BackendError, match="logprobs"):
        prl.parse_choice({"token_ids": [1]})


# ---------------------------------------------------------------- the backend, faked server


class Tok:
    eos_token_id = 2


class FakeServer:
    def __init__(self):
        self.updates: list[str] = []
        self.samples: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/update_weights":
            self.updates.append(body["weight_dir"])
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/load_lora_adapter":
            self.updates.append(f"{body['lora_name']}@{body['lora_path']}")
            return httpx.Response(200, json={"status": "ok"})
        assert request.url.path == "/v1/chat/completions/tokens"
        self.samples.append(body)
        choice = {
            "finish_reason": "stop",
            "token_ids": [5, 2],
            "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.2}]},
        }
        return httpx.Response(
            200, json={"choices": [dict(choice, index=i) for i in range(body["n"])]}
        )


def make_backend(tmp_path, server, **options):
    cfg = prime_config(tmp_path, **{"sync_wait_s": 0, "sync_poll_s": 0.01, **options})
    client = sync_client(timeout=5, transport=httpx.MockTransport(server))
    return prl.PrimeRLBackend(prime_rl_settings(cfg), Tok(), say=lambda _: None, http_client=client)


def broadcast(out: Path, step: int) -> Path:
    where = out / "broadcasts" / f"step_{step}"
    where.mkdir(parents=True)
    (where / "STABLE").touch()
    return where


def test_sample_train_sync_save_and_resume(tmp_path):
    server = FakeServer()
    b = make_backend(tmp_path, server)
    out = b.output_dir
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=11)
    groups = b.sample([[1, 3], [4]], 3, params)
    assert [len(g) for g in groups] == [3, 3] and server.updates == []
    # The two prompts' requests are in flight together: find the first prompt's by its tokens.
    first = next(s for s in server.samples if s["tokens"] == [1, 3])
    assert first["n"] == 3 and first["return_token_ids"] is True and first["logprobs"] is True
    assert {s["seed"] for s in server.samples} == {11, 14}

    # the step's TrainHyper carries the temperature it sampled at ([training] temperature)
    result = b.train_step([datum()], dataclasses.replace(HYPER, temperature=0.8))
    assert result.loss == 0.0 and result.num_tokens == 4
    assert (
        prl.decode_batch(prl.rollout_path(out, 0).read_bytes()).examples[0].completion_temperatures
        == [0.8] * 4
    )

    step1 = broadcast(out, 1)
    b.sample([[1]], 1, params)
    assert server.updates == [str(step1)]  # synced to the weights trained on batch 0
    b.sample([[1]], 1, params)
    assert server.updates == [str(step1)]  # once per step

    info = b.save_checkpoint(tmp_path / "ckpt")
    assert info.backend == "prime_rl" and info.adapter == str(step1)
    saved = json.loads((tmp_path / "ckpt" / prl.STATE_FILE).read_text())
    assert saved["batches_sent"] == 1 and saved["loaded_step"] == 1
    assert saved["prime_rl_commit"] == prl.PRIME_RL_COMMIT
    b.close()

    server2 = FakeServer()
    again = make_backend(tmp_path, server2)
    again.load_checkpoint(CheckpointInfo.from_dict(json.loads(json.dumps(info.as_dict()))))
    assert server2.updates == [str(step1)]  # the inference server is pointed again
    again.train_step([datum()], HYPER)
    assert prl.rollout_path(out, 1).exists()  # batch steps continue, contiguous
    # a multi-turn datum: the environment's token (mask False) is not a trained token
    mask = [True, False, True, True]
    turns = Datum([5, 6], [10, 90, 11, 2], [-0.1, 0.0, -0.2, -0.3], [0.5, 0, 0.5, 0.5], mask)
    assert again.train_step([turns], HYPER).num_tokens == 3
    again.close()


def test_stale_weights_are_said_and_empty_steps_send_nothing(tmp_path):
    said: list[str] = []
    server = FakeServer()
    b = make_backend(tmp_path, server)
    b.say = said.append
    assert b.train_step([], HYPER).num_tokens == 0 and b.batches_sent == 0
    b.train_step([datum()], HYPER)
    b.train_step([datum()], HYPER)
    broadcast(b.output_dir, 1)
    b.sample([[1]], 1, SamplingParams(max_tokens=4, temperature=1.0))
    assert server.updates == [str(b.output_dir / "broadcasts" / "step_1")]
    assert any("has not broadcast step 2" in s and "1 step(s) behind" in s for s in said)
    b.close()


def test_load_checkpoint_refuses_another_backend(tmp_path):
    b = make_backend(tmp_path, FakeServer())
    with pytest.raises(CheckpointError, match="local backend"):
        b.load_checkpoint(CheckpointInfo("local", adapter="x", state="x"))
    with pytest.raises(CheckpointError, match="missing"):
        b.load_checkpoint(CheckpointInfo("prime_rl", state=str(tmp_path / "nowhere")))
    b.close()


# ---------------------------------------------------------------- the run directory


def test_the_run_config_the_trainer_finds_the_run_by(tmp_path):
    import tomllib

    run = tmp_path / "out" / "run_a"
    fresh = tomllib.loads(prl.run_config_toml(run, 'Qwen/Qwen3-0.6B "x"'))
    assert fresh == {
        "output_dir": str(run),
        "model": {"name": 'Qwen/Qwen3-0.6B "x"', "lora": {"name": "run_a"}},
    }
    resumed = tomllib.loads(prl.run_config_toml(run, "m", resume_step=3))
    assert resumed["ckpt"] == {"resume_step": 3}
    assert prime_rl_run_dir_problem(str(run)) is None
    assert prime_rl_run_dir_problem(str(run) + "/") is None
    assert "run_<name>" in prime_rl_run_dir_problem(str(tmp_path / "out" / "adapter"))


def test_the_backend_writes_the_run_config_and_clears_a_stale_refusal(tmp_path):
    control = tmp_path / "prime_out" / "run_test" / "control"
    control.mkdir(parents=True)
    (control / prl.CONFIG_ERROR_FILE).write_text("about an earlier orch.toml")
    b = make_backend(tmp_path, FakeServer())
    assert not (control / prl.RUN_CONFIG_FILE).exists()  # a checkpoint may still be loaded
    b.train_step([datum()], HYPER)
    text = (control / prl.RUN_CONFIG_FILE).read_text()
    assert text == prl.run_config_toml(b.output_dir, b.model)
    assert not (control / prl.CONFIG_ERROR_FILE).exists()
    b.close()  # a trainer restarted from now on waits for the run to be driven again
    assert not (control / prl.RUN_CONFIG_FILE).exists()


def test_an_evicted_run_is_refused_at_start_and_mid_run(tmp_path):
    b = make_backend(tmp_path, FakeServer())
    b.train_step([datum()], HYPER)
    evicted = b.output_dir / "control" / prl.EVICTED_FILE
    evicted.write_text("Run wrote a sample with length 9000 which exceeds max sequence length")
    params = SamplingParams(max_tokens=4, temperature=1.0)
    for call in (lambda: b.sample([[1]], 1, params), lambda: b.train_step([datum()], HYPER)):
        with pytest.raises(BackendError, match="evicted this run .*exceeds max sequence length"):
            call()
    assert b.batches_sent == 1  # nothing more was sent
    b.close()
    with pytest.raises(BackendError, match="does not train an evicted run again"):
        make_backend(tmp_path, FakeServer())


def test_a_refused_run_config_stops_the_wait_for_weights(tmp_path):
    b = make_backend(tmp_path, FakeServer(), sync_wait_s=60)
    b.train_step([datum()], HYPER)
    (b.output_dir / "control" / prl.CONFIG_ERROR_FILE).write_text("model.lora.rank (64) exceeds")
    with pytest.raises(BackendError, match=r"refused this run's control/orch.toml .*rank \(64\)"):
        b.sample([[1]], 1, SamplingParams(max_tokens=4, temperature=1.0))
    b.close()


def test_a_fresh_run_refuses_an_earlier_runs_directory_and_a_resumed_one_continues(tmp_path):
    b = make_backend(tmp_path, FakeServer())
    b.train_step([datum()], HYPER)
    broadcast(b.output_dir, 1)
    params = SamplingParams(max_tokens=4, temperature=1.0)
    b.sample([[1]], 1, params)
    info = b.save_checkpoint(tmp_path / "ckpt")
    b.close()
    fresh = make_backend(tmp_path, FakeServer())
    with pytest.raises(BackendError, match=r"earlier run's rollouts and broadcasts .*--resume"):
        fresh.sample([[1]], 1, params)
    fresh.close()
    server = FakeServer()
    resumed = make_backend(tmp_path, server)
    resumed.load_checkpoint(info)
    assert [len(g) for g in resumed.sample([[1]], 1, params)] == [1]
    # a trainer started afresh reads on from the next batch step, not from step 0
    control = resumed.output_dir / "control" / prl.RUN_CONFIG_FILE
    assert control.read_text() == prl.run_config_toml(resumed.output_dir, resumed.model, 1)
    resumed.close()


def test_a_lora_broadcast_is_loaded_by_name_and_sampled_under_it(tmp_path):
    server = FakeServer()
    b = make_backend(tmp_path, server)
    params = SamplingParams(max_tokens=4, temperature=1.0)
    b.sample([[1]], 1, params)
    assert server.samples[-1]["model"] == b.model  # the base model before any broadcast
    b.train_step([datum()], HYPER)
    step1 = broadcast(b.output_dir, 1)
    (step1 / "adapter_config.json").write_text("{}")
    b.sample([[1]], 1, params)
    assert server.updates == [f"run_test@{step1}"]
    assert server.samples[-1]["model"] == "run_test"
    b.close()


# ---------------------------------------------------------------- config, probe, CLI


def test_config_refuses_token_varying_flows_and_non_strict_advantages(tmp_path):
    raw = {"backend": {"backend": "prime_rl"}, "inference": {"url": "http://x"}}
    with pytest.raises(ConfigError, match="does not preserve token-level advantages"):
        config_from_dict({**raw, "algorithm": {"transform_mode": "gtpo_sepa"}})
    with pytest.raises(ConfigError, match="strict_advantages"):
        config_from_dict(
            {
                "backend": {"backend": "prime_rl", "options": {"strict_advantages": False}},
                "algorithm": {"transform_mode": "none"},
            }
        )
    cfg = prime_config(tmp_path, transport="zmq", sync_wait_s=5)
    assert cfg.backend.options == {"transport": "zmq", "sync_wait_s": 5}


def test_config_refuses_what_no_prime_rl_trainer_would_read(tmp_path):
    raw = {
        "backend": {"backend": "prime_rl", "adapter_path": str(tmp_path / "adapter")},
        "algorithm": {"transform_mode": "none"},
    }
    with pytest.raises(ConfigError, match=r"\[backend\] adapter_path: .* is not a prime-rl run"):
        config_from_dict(raw)
    raw["backend"]["adapter_path"] = str(tmp_path / "run_a")
    raw["campaign"] = {"seeds": [1, 2], "conditions": [{"advantage_mode": "grpo"}]}
    with pytest.raises(ConfigError, match=r"\[campaign\]: with backend = 'prime_rl' is not"):
        config_from_dict(raw)


def test_probe_names_the_url_and_the_zmq_socket(tmp_path):
    dead = free_port()
    cfg = prime_config(tmp_path, transport="zmq", zmq_host="127.0.0.1", zmq_port=dead)
    cfg.inference.url = f"http://127.0.0.1:{dead}"
    keys = dict(prl.probe(prime_rl_settings(cfg), timeout=0.5))
    assert "nothing answers" in keys["[inference] url"]
    assert f"tcp://127.0.0.1:{dead}" in keys["[backend.options] zmq_port"]
    cfg.inference.url = ""
    assert "is empty" in dict(prl.probe(prime_rl_settings(cfg), timeout=0.5))["[inference] url"]

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        ok = prime_config(tmp_path)
        ok.inference.url = f"http://127.0.0.1:{port}"
        assert prl.probe(prime_rl_settings(ok), timeout=0.5) == []


def test_probe_reports_an_unwritable_adapter_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = prime_config(tmp_path)
    cfg.backend.adapter_path = str(blocker / "sub")
    assert (
        "not a directory"
        in dict(prl.probe(prime_rl_settings(cfg), timeout=0.1))["[backend] adapter_path"]
    )


def test_explain_and_doctor_run_the_probe_before_any_model_load(tmp_path):
    from retrain.cli import doctor
    from retrain.cli.explain import build_report

    cfg = prime_config(tmp_path)
    cfg.inference.url = f"http://127.0.0.1:{free_port()}"
    report = build_report(cfg, "retrain.toml")
    assert report["backend"]["name"] == "prime_rl" and report["backend"]["source"] == "builtin"
    assert any(w.startswith("[inference] url:") for w in report["warnings"])
    assert not report["errors"]
    checks = doctor.check_backend_probe(cfg)
    assert [c.status for c in checks] == [doctor.FAIL]
    assert "[inference] url" in checks[0].detail and "start prime-rl" in checks[0].fix


def test_explain_says_the_prime_rl_trainer_owns_the_loss(tmp_path):
    """The default policy_loss "is" would otherwise read as the objective, while the prime-rl
    trainer applies its own [trainer.loss]."""
    from retrain.cli.summaries import objective_summary

    cfg = prime_config(tmp_path)
    summary = objective_summary(cfg)
    assert summary.startswith("the prime-rl trainer's own [trainer.loss]")
    assert "importance-sampling" not in summary
    cfg.backend.backend = "local"
    assert objective_summary(cfg).startswith("is (importance-sampling")
