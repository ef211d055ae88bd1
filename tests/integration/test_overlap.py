"""`[backend.options] overlap`: step n trains on a background thread while step n+1
samples from the weights published after step n-1's training. Run on the tiny model in
split mode (`devices = "cpu,cpu"`: the sampler is a separate copy of the weights).

The weights are recorded where they are used: the sampler's LoRA tensors when a step
samples, the trainer's after each optimizer step. No timing is asserted."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import torch
from run_helpers import QuietConsole, stop_after_step

from retrain.backends.local import LocalBackend
from retrain.config import config_from_dict
from retrain.errors import ConfigError
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train


def run(raw: dict) -> tuple[int, list[str]]:
    console = QuietConsole()
    return train(config_from_dict(raw), console=console), console.lines


def split_raw(tiny_raw: dict, tmp_path: Path, name: str, *, overlap: bool, **training) -> dict:
    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["devices"] = "cpu,cpu"
    raw["backend"]["options"]["overlap"] = overlap
    raw["backend"]["adapter_path"] = str(tmp_path / name / "adapter")
    raw["logging"]["log_dir"] = str(tmp_path / name / "logs")
    raw["training"].update({"max_steps": 4, "save_every": 0, **training})
    return raw


def lora(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rows_of(raw: dict) -> list[dict]:
    rows, bad = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    assert not bad
    return rows


class Recorder:
    """The sampler's LoRA weights at each sampling call, the trainer's before the first
    and after every optimizer step, and each step's loss as the backend computed it."""

    def __init__(self, monkeypatch):
        self.sampled: list[dict] = []
        self.completions: list[int] = []  # n of each sampling call (training: group_size)
        self.weights: list[dict] = []  # [initial, after step 0's training, ...]
        self.losses: list[float] = []
        sample, optimize, rec = LocalBackend.sample, LocalBackend._optimize, self

        def recording_sample(self, prompts, n, params):
            if not rec.weights:
                rec.weights.append(lora(self.model))
            rec.sampled.append(lora(self.sampler_model))
            rec.completions.append(n)
            return sample(self, prompts, n, params)

        def recording_optimize(self, datums, hyper):
            result = optimize(self, datums, hyper)
            rec.weights.append(lora(self.model))
            rec.losses.append(result.loss)
            return result

        monkeypatch.setattr(LocalBackend, "sample", recording_sample)
        monkeypatch.setattr(LocalBackend, "_optimize", recording_optimize)


def test_overlap_samples_one_step_behind_and_reports_each_step_on_its_own_row(
    tiny_raw, tmp_path, monkeypatch
):
    rec = Recorder(monkeypatch)
    raw = split_raw(tiny_raw, tmp_path, "overlap", overlap=True)
    code, lines = run(raw)
    assert code == 0
    rows = rows_of(raw)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["num_datums"] > 0 for r in rows), "the parity reward keeps groups informative"
    # Step 0 samples the initial weights and trains them (on-policy); every later step
    # samples while the previous one trains: one optimizer step stale.
    assert [r["off_policy_steps"] for r in rows] == [0, 1, 1, 1]
    assert len(rec.sampled) == 4 and len(rec.weights) == 5
    assert same(rec.sampled[0], rec.weights[0])
    for n in range(1, 4):
        # the weights after step n-2's update (rec.weights[n-1]), not after step n-1's
        assert same(rec.sampled[n], rec.weights[n - 1]), n
        assert not same(rec.sampled[n], rec.weights[n]), n
    # each row carries the training of its own datums
    assert [r["loss"] for r in rows] == rec.losses
    # the final adapter holds the last step's update: the final save waited for it
    from safetensors.torch import load_file

    final = load_file(str(Path(raw["backend"]["adapter_path"]) / "final/adapter_model.safetensors"))
    last = {k.replace(".default", ""): v for k, v in rec.weights[-1].items()}
    assert {k: final[k] for k in last}.keys() == last.keys()
    assert all(torch.equal(final[k], last[k]) for k in last)
    assert sum(line.startswith("Step ") for line in lines) == 4


def test_without_overlap_split_mode_stays_on_policy(tiny_raw, tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    raw = split_raw(tiny_raw, tmp_path, "plain", overlap=False)
    assert run(raw)[0] == 0
    rows = rows_of(raw)
    assert [r["off_policy_steps"] for r in rows] == [0, 0, 0, 0]
    for n in range(4):  # every step samples the weights its datums train
        assert same(rec.sampled[n], rec.weights[n]), n
    assert [r["loss"] for r in rows] == rec.losses

    # Step 0 is the same in both modes (same weights, same samples); step 1 is not:
    # with overlap it was sampled before step 0's update was published.
    overlapped = split_raw(tiny_raw, tmp_path, "overlap", overlap=True)
    assert run(overlapped)[0] == 0
    other = rows_of(overlapped)
    for key in ("loss", "log_ratio_mean", "grad_norm"):
        assert other[0][key] == pytest.approx(rows[0][key], abs=1e-6), key
    assert same(rec.sampled[5], rec.sampled[4])  # the second run's step 1 saw step 0's weights
    assert not same(rec.sampled[1], rec.sampled[5])


def test_an_evaluation_with_overlap_sees_the_weights_of_the_steps_before_it(
    tiny_raw, tmp_path, monkeypatch
):
    """A step's row (with the evaluation due after it) is written before the next step
    starts training: the evaluation samples exactly the weights of the steps done."""
    rec = Recorder(monkeypatch)
    raw = split_raw(tiny_raw, tmp_path, "eval", overlap=True)
    raw["eval"] = {"every": 2, "size": 3, "temperature": 0.0, "samples": 1}
    assert run(raw)[0] == 0
    rows = rows_of(raw)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["off_policy_steps"] for r in rows] == [0, 1, 1, 1]
    assert [r.get("eval_step") for r in rows] == [None, 2, None, 4]
    # sampling calls: eval(0), steps 0, 1, 2, eval(2) while step 2 waits, step 3, eval(4)
    assert rec.completions == [1, 4, 4, 4, 1, 4, 1]
    assert same(rec.sampled[0], rec.weights[0])
    assert same(rec.sampled[4], rec.weights[2])  # after steps 0 and 1, not step 2
    assert same(rec.sampled[6], rec.weights[4])


@pytest.mark.parametrize(
    "infer, train, overlap, windows",
    [
        ("cuda:0", "cuda:0", False, (["cuda:0"], [])),  # from sampling to the update
        ("cuda:0", "cuda:0", True, ([], ["cuda:0"])),  # a server samples beside training
        ("cuda:0", "cuda:1", False, (["cuda:0"], ["cuda:1"])),
        ("cuda:0", "cuda:1", True, (["cuda:0"], ["cuda:1"])),
        ("cpu", "cpu", True, ([], [])),
    ],
)
def test_where_a_steps_peak_memory_starts_counting(infer, train, overlap, windows):
    from retrain.backends.peak_memory import peak_windows

    got = peak_windows(torch.device(infer), torch.device(train), overlap)
    assert got == tuple([torch.device(d) for d in ds] for ds in windows)


class Peaks:
    """torch.cuda's peak-memory counters, standing in on a CPU (a fake only for what a CPU
    lacks): per device, the most allocated since its last reset."""

    def __init__(self, monkeypatch):
        self.peak: dict = {}
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: self.peak.get(d, 0))

    def reset(self, device):
        self.peak[device] = 0

    def allocate(self, device, size):
        self.peak[device] = max(self.peak.get(device, 0), size)


def test_with_overlap_each_steps_peak_memory_is_its_own(tiny_raw, tmp_path, monkeypatch):
    """`gpu_peak_memory_gb` with overlap: step n's training runs while step n+1 samples,
    whose reset of the peak counters once cut step n's training peak in two and counted
    step n+1's sampling in it. Now each step's row holds the larger of its own sampling's
    peak (the sampler's device, read as its training starts) and its own training's (the
    trainer's device, counted from its training). Split mode on two CPU devices, the
    counters stood in for two GPUs."""
    import retrain.backends.local as local
    import retrain.backends.peak_memory as peak_memory

    sampler, trainer = torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setattr(peak_memory, "peak_windows", lambda *a: ([sampler], [trainer]))
    peaks = Peaks(monkeypatch)
    sampled = [3e9, 1e9, 5e9, 1e9]  # what each step's sampling holds at most, in bytes
    trained = [2e9, 4e9, 2e9, 6e9]
    calls = {"sample": 0, "train": 0}
    sample, train_step = local.LocalBackend.sample, local.LocalBackend._train_step

    def sampling(self, prompts, n, params):
        out = sample(self, prompts, n, params)
        peaks.allocate(sampler, sampled[calls["sample"]])
        calls["sample"] += 1
        return out

    def training(self, datums, hyper):
        peaks.allocate(trainer, trained[calls["train"]])
        calls["train"] += 1
        return train_step(self, datums, hyper)

    monkeypatch.setattr(local.LocalBackend, "sample", sampling)
    monkeypatch.setattr(local.LocalBackend, "_train_step", training)
    raw = split_raw(tiny_raw, tmp_path, "peaks", overlap=True)
    assert run(raw)[0] == 0
    rows = rows_of(raw)
    assert [r["gpu_peak_memory_gb"] for r in rows] == [3.0, 4.0, 5.0, 6.0]


def test_a_steps_peak_memory_spans_all_its_sampling_rounds(monkeypatch):
    """A step that samples several times (each turn of a multi-turn rollout, each round
    of dynamic sampling) counts its largest round: each call once reset the counters,
    keeping only the last round's peak (1 GB here, not 3)."""
    from retrain.backends.peak_memory import PeakMemory

    gpu = torch.device("cuda", 0)
    peaks, memory = Peaks(monkeypatch), PeakMemory(gpu, gpu, False)
    for rounds, want in (([3e9, 1e9], 3.0), ([2e9], 2.0), ([1e9, 4e9, 2e9], 4.0)):
        for size in rounds:
            memory.sampling_starts()
            peaks.allocate(gpu, size)
        assert memory.sampled() == {}  # one device: the step's peak is read at its end
        assert memory.step(None) == {"gpu_peak_memory_gb": want}


def test_a_held_out_evaluation_is_in_no_steps_peak_memory(tiny_raw, tmp_path, monkeypatch):
    """One device, an evaluation after every step: its sampling (9 GB here) counted in
    the next step's window, which its first sampling call once opened, until the
    evaluation's sampling said it is held out."""
    import retrain.backends.local as local
    import retrain.backends.peak_memory as peak_memory

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(peak_memory, "peak_windows", lambda *a: ([gpu], []))
    peaks = Peaks(monkeypatch)
    sample = local.LocalBackend.sample

    def sampling(self, prompts, n, params):
        out = sample(self, prompts, n, params)
        peaks.allocate(gpu, 9e9 if params.held_out else 2e9)
        return out

    monkeypatch.setattr(local.LocalBackend, "sample", sampling)
    raw = copy.deepcopy(tiny_raw)
    raw["eval"] = {"every": 1, "size": 2}
    assert run(raw)[0] == 0
    assert [r["gpu_peak_memory_gb"] for r in rows_of(raw)] == [2.0, 2.0, 2.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_devices_without_cuda_are_refused_before_anything_loads(tiny_raw, tmp_path):
    """Without CUDA `gpu:0,gpu:1` once fell back to one CPU device (where overlap's
    sampler would read the weights being trained); now the run refuses the devices at its
    start (nvidia-smi's count), or torch refuses them when the backend starts."""
    raw = split_raw(tiny_raw, tmp_path, "gpu", overlap=True)
    raw["backend"]["devices"] = "gpu:0,gpu:1"
    with pytest.raises(ConfigError, match=r"\[backend\] devices.*'gpu:0,gpu:1' asks for gpu:0"):
        run(raw)
    assert not (Path(raw["backend"]["adapter_path"]) / "final").exists()


def _raise_on_call(monkeypatch, name: str, call: int, message: str) -> None:
    original, calls = getattr(LocalBackend, name), {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError(message)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, name, failing)


@pytest.mark.parametrize(
    ("where", "call"),
    [
        ("_optimize", 3),  # step 2's training, on the background thread
        ("sample", 4),  # step 3's sampling, on the main thread, while step 2 trains
    ],
)
def test_a_failure_surfaces_and_keeps_the_last_checkpoint(
    tiny_raw, tmp_path, monkeypatch, where, call
):
    rec = Recorder(monkeypatch)
    raw = split_raw(tiny_raw, tmp_path, "fail", overlap=True, save_every=2)
    _raise_on_call(monkeypatch, where, call, f"simulated failure in {where}")
    with pytest.raises(RuntimeError, match=f"simulated failure in {where}"):
        run(raw)
    assert not any(t.name == "retrain-train" for t in threading.enumerate())
    logs = Path(raw["logging"]["log_dir"])
    state = json.loads((logs / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["finished"] is False
    assert json.loads((logs / "run.json").read_text())["status"] == "failed"
    # step 2 never finished training, so it has no row; the rows saved stay
    assert [r["step"] for r in rows_of(raw)] == [0, 1]
    from safetensors.torch import load_file

    saved = load_file(str(Path(state["checkpoint"]["adapter"]) / "adapter_model.safetensors"))
    after_step_1 = {k.replace(".default", ""): v for k, v in rec.weights[2].items()}
    assert all(torch.equal(saved[k], after_step_1[k]) for k in after_step_1)


def test_stop_and_resume_with_overlap_reproduce_the_uninterrupted_run(
    tiny_raw, tmp_path, monkeypatch
):
    straight = split_raw(tiny_raw, tmp_path, "straight", overlap=True, save_every=2)
    assert run(straight)[0] == 0

    # The same run stopped after step 1 (as SIGTERM would), then resumed.
    stop_after_step(monkeypatch, 1)
    part = split_raw(tiny_raw, tmp_path, "part", overlap=True, save_every=0)
    assert run(part)[0] == 143
    state = json.loads((Path(part["logging"]["log_dir"]) / "trainer_state.json").read_text())
    assert state["step"] == 2  # the stop waited for step 1's training and saved it
    resumed = copy.deepcopy(part)
    resumed["training"]["save_every"] = 2
    resumed["resume"] = {"from": part["logging"]["log_dir"]}
    code, lines = run(resumed)
    assert code == 0 and any("Resumed from" in line for line in lines)

    a, b = rows_of(straight), rows_of(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    # a checkpoint waits for the pending training, so the step after it is on-policy
    assert [r["off_policy_steps"] for r in a] == [r["off_policy_steps"] for r in b] == [0, 1, 0, 1]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6)
        assert x["mean_reward"] == y["mean_reward"]
        assert x["examples_seen"] == y["examples_seen"]
    from safetensors.torch import load_file

    fa, fb = (
        load_file(str(Path(r["backend"]["adapter_path"]) / "final/adapter_model.safetensors"))
        for r in (straight, part)
    )
    for k in fa:
        assert torch.allclose(fa[k], fb[k], atol=1e-6), k


@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_overlap_with_a_vllm_server_samples_the_adapter_one_step_behind(tmp_path):
    """Opt-in (`-m vllm`, see test_vllm_engine.py): the quickstart on SmolLM2 with a real
    vLLM server and overlap. Each step samples from the adapter published after the
    training two steps back: the server's adapter version lags one more step than
    without overlap, and every trained step still reloads the adapter once."""
    import tomllib

    from vllm_server import MODEL_DIR, REPO, vllm_url

    servers = vllm_url(tmp_path / "server")
    url = next(servers)
    try:
        template = REPO / "retrain" / "config" / "templates" / "quickstart.toml"
        raw = tomllib.loads(template.read_text())
        raw["model"]["model"] = str(MODEL_DIR)
        raw["training"].update(max_steps=4, save_every=0, seed=1, temperature=0.7)
        raw["eval"]["every"] = 0
        raw["backend"]["adapter_path"] = str(tmp_path / "adapters")
        raw["backend"]["options"] = {"threads": 1, "overlap": True}
        raw["logging"]["log_dir"] = str(tmp_path / "logs")
        raw["inference"] = {"engine": "vllm", "url": url}
        assert run(raw)[0] == 0
    finally:
        servers.close()
    rows = rows_of(raw)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    trained = [r["num_datums"] > 0 for r in rows]
    assert [r["off_policy_steps"] for r in rows] == [0, *map(int, trained[:-1])]
    versions = [r["engine_adapter_version"] for r in rows]
    assert versions[1] == versions[0]  # step 1 sampled while step 0 trained
    for n in range(2, 4):  # step n samples what step n-2's training published
        assert versions[n] == versions[n - 1] + trained[n - 2], versions
    for n in range(1, 4):
        assert (
            rows[n]["engine_adapter_reloads"] == rows[n - 1]["engine_adapter_reloads"] + trained[n]
        )
    assert all(r["engine_adapter_reload_failures"] == 0 for r in rows)
