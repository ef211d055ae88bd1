"""Memory sized to the device, without torch: a device's memory read from recorded
nvidia-smi and /proc/meminfo outputs (retrain/hardware.py), `micro_batch_tokens`' "int/auto"
option type, `explain`'s Memory line and errors against simulated devices, and doctor's
device-memory lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_memory import QWEN3_4B_CONFIG

from retrain.cli import doctor
from retrain.cli import estimates as estimates_cli
from retrain.cli.main import main
from retrain.hardware import (
    TorchBuild,
    compute_capability,
    cuda_device_count,
    cuda_visible,
    device_memory,
    driver_cuda,
    driver_too_old,
    hidden_gpus,
    matmul_dtype,
    parse_meminfo,
    torch_without_gpu,
    visible_gpu,
)
from retrain.memory import AUTO_MOST
from retrain.registry import BACKENDS
from retrain.settings import LocalOptions
from retrain.types import check_option

MIB, GIB = 2**20, 2**30
# /proc/meminfo of a 24 GiB box (the lines retrain reads, and others around them)
MEMINFO = """MemTotal:       24684084 kB
MemFree:        14274628 kB
MemAvailable:   19881324 kB
Buffers:           47372 kB
"""


class NvidiaSmi:
    """Recorded nvidia-smi answers for GPUs of (free MiB, total MiB), by PCI bus, of the
    models `names` (H100s by default); records each call."""

    def __init__(self, *gpus: tuple[int, int], names: tuple[str, ...] = ()):
        self.gpus, self.calls = gpus, []
        self.names = names or ("NVIDIA H100 80GB HBM3",) * len(gpus)

    def __call__(self, args: list[str]) -> str | None:
        self.calls.append(args)
        if args[0] == "--query-gpu=index":
            return "".join(f"{i}\n" for i in range(len(self.gpus)))
        if args[0] == "--query-gpu=name" and "-i" not in args:
            return "".join(f"{name}\n" for name in self.names)
        i = int(args[args.index("-i") + 1])
        if i >= len(self.gpus):
            return None  # nvidia-smi exits non-zero for a GPU that is not there
        free, total = self.gpus[i]
        return f"{free}, {total}\n"


# ----------------------------------------------------------------------------- hardware


def test_cpu_memory_from_meminfo():
    assert parse_meminfo(MEMINFO) == (19881324 * 1024, 24684084 * 1024)
    assert device_memory("cpu", meminfo=lambda: MEMINFO) == (19881324 * 1024, 24684084 * 1024)
    assert parse_meminfo("MemTotal: 10 kB\n") is None  # an old kernel without MemAvailable

    def unreadable() -> str:
        raise OSError("no /proc")

    assert device_memory("cpu", meminfo=unreadable) is None


def test_gpu_memory_from_nvidia_smi():
    smi = NvidiaSmi((81037, 81559), (1000, 16384))
    assert device_memory("cuda", 0, run=smi, env={}) == (81037 * MIB, 81559 * MIB)
    assert device_memory("cuda", 1, run=smi, env={}) == (1000 * MIB, 16384 * MIB)
    assert smi.calls[1] == [  # after the models: retrain/hardware.py `gpu_order_unknown`
        "--query-gpu=memory.free,memory.total",
        "--format=csv,noheader,nounits",
        "-i",
        "0",
    ]
    assert device_memory("cuda", 2, run=smi, env={}) is None
    assert device_memory("cuda", 0, run=lambda args: None, env={}) is None  # no nvidia-smi
    assert device_memory("cuda", 0, run=lambda args: "[N/A], [N/A]\n", env={}) is None
    assert device_memory("mps", 0) is None
    assert cuda_device_count(run=smi, env={}) == 2
    assert cuda_device_count(run=lambda args: None, env={}) == 0


def test_cuda_visible_devices_maps_torch_indices_to_nvidia_smi_ids():
    assert visible_gpu(0, None) == "0"
    assert visible_gpu(1, "2,3") == "3"
    assert visible_gpu(0, "GPU-8f3a") == "GPU-8f3a"
    assert visible_gpu(0, "") is None and visible_gpu(2, "2,3") is None
    smi = NvidiaSmi((1, 2), (3, 4), (5, 6), (81037, 81559))
    assert device_memory("cuda", 0, run=smi, env={"CUDA_VISIBLE_DEVICES": "3"}) == (
        81037 * MIB,
        81559 * MIB,
    )
    assert cuda_device_count(run=smi, env={"CUDA_VISIBLE_DEVICES": "3"}) == 1


def test_cuda_visible_devices_stops_at_its_first_invalid_entry():
    """CUDA's rule: the entries before the first invalid one are seen (`0,2,-1,1` shows 0
    and 2); `1` on a one-GPU machine shows none, and an empty value hides them all."""
    assert cuda_visible("0,2,-1,1", 3) == ["0", "2"]
    assert cuda_visible("2,1", 3) == ["2", "1"]
    assert cuda_visible("1", 1) == [] and cuda_visible("", 2) == []
    assert cuda_visible("GPU-8f3a, 0", 1) == ["GPU-8f3a", "0"]
    smi = NvidiaSmi((1, 2))
    assert cuda_device_count(run=smi, env={"CUDA_VISIBLE_DEVICES": "1"}) == 0
    assert hidden_gpus(run=smi, env={"CUDA_VISIBLE_DEVICES": "1"}) == (
        "CUDA_VISIBLE_DEVICES = '1' leaves CUDA 0 of the 1 GPU(s) nvidia-smi lists"
    )
    assert hidden_gpus(run=smi, env={"CUDA_VISIBLE_DEVICES": "0"}) is None
    assert hidden_gpus(run=smi, env={}) is None
    assert hidden_gpus(run=lambda args: None, env={"CUDA_VISIBLE_DEVICES": ""}) is None


HEADER = "| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4     |\n"


def test_a_driver_older_than_torchs_cuda_major_is_named():
    """CUDA runs a build of an older minor version of the driver's major (minor-version
    compatibility), not of a newer major: torch for CUDA 13 on a 12.4 driver sees no GPU."""
    assert driver_cuda(run=lambda args: HEADER) == (12, 4)
    assert driver_cuda(run=lambda args: None) is None
    cu130, cu128 = TorchBuild("2.13.0+cu130", "13.0"), TorchBuild("2.13.0+cu128", "12.8")
    assert driver_too_old(cu128, (12, 4)) is None and driver_too_old(cu130, None) is None
    assert driver_too_old(TorchBuild("2.13.0+cpu", None), (12, 4)) is None
    why, fix = torch_without_gpu(cu130, 1, (12, 4))
    assert why == (
        "the installed torch (2.13.0+cu130) is built for CUDA 13.0, and this machine's NVIDIA "
        "driver runs CUDA up to 12.4 (nvidia-smi), so torch will see no GPU"
    )
    assert fix.startswith("an NVIDIA driver for CUDA 13 (") and "a torch built for CUDA 12" in fix
    assert "sees none of the 1 GPU(s)" in torch_without_gpu(cu128, 1, (12, 4))[0]


def test_explain_warns_of_a_driver_too_old_for_torchs_cuda(
    tmp_path, capsys, monkeypatch, no_caches
):
    simulate(monkeypatch, cuda0=(79.1, 79.6))
    monkeypatch.setattr("retrain.hardware.torch_build", lambda: TorchBuild("2.13.0+cu130", "13.0"))
    monkeypatch.setattr("retrain.hardware.driver_cuda", lambda run=None: (12, 4))
    out = explain(qwen_config(tmp_path), capsys)[1]
    assert (
        "WARNING: [backend] devices: the installed torch (2.13.0+cu130) is built for CUDA 13.0, "
        "and this machine's NVIDIA driver runs CUDA up to 12.4 (nvidia-smi), so torch will see "
        "no GPU, unless CUDA's forward-compatibility package is installed. Fix: an NVIDIA "
        "driver for CUDA 13" in out
    )
    monkeypatch.setattr("retrain.hardware.driver_cuda", lambda run=None: (13, 0))
    assert "forward-compatibility" not in explain(qwen_config(tmp_path), capsys)[1]


def test_gpus_of_different_models_are_numbered_alike_only_in_pci_order():
    """nvidia-smi numbers the GPUs by PCI bus, CUDA fastest first: on a box with an RTX
    3060 on the first bus and a 4090 on the second, torch's cuda:0 is the 4090. Without
    CUDA_DEVICE_ORDER = PCI_BUS_ID, gpu:0's memory is unknown (not the 3060's), and so is
    an index in CUDA_VISIBLE_DEVICES (CUDA's numbering too); with it the numbers agree. A
    UUID names its GPU either way, and GPUs of one model are numbered alike (ties go by
    bus)."""
    from retrain.hardware import gpu_order_unknown

    models = ("NVIDIA GeForce RTX 3060", "NVIDIA GeForce RTX 4090")
    smi = NvidiaSmi((11000, 12288), (23000, 24564), names=models)
    why = gpu_order_unknown(run=smi, env={})
    assert why.startswith("GPUs of different models (NVIDIA GeForce RTX 3060, NVIDIA GeForce")
    assert device_memory("cuda", 0, run=smi, env={}) is None
    assert device_memory("cuda", 0, run=smi, env={"CUDA_VISIBLE_DEVICES": "1"}) is None
    assert compute_capability(0, run=smi, env={}) is None
    assert not [call for call in smi.calls if "-i" in call]  # never asked of a guessed GPU
    pci = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert gpu_order_unknown(run=smi, env=pci) is None
    assert device_memory("cuda", 0, run=smi, env=pci) == (11000 * MIB, 12288 * MIB)
    assert device_memory("cuda", 0, run=smi, env={**pci, "CUDA_VISIBLE_DEVICES": "1"}) == (
        23000 * MIB,
        24564 * MIB,
    )
    assert visible_gpu(0, "GPU-8f3a", numbered_alike=False) == "GPU-8f3a"
    alike = NvidiaSmi((11000, 12288), (11000, 12288))
    assert gpu_order_unknown(run=alike, env={}) is None
    assert device_memory("cuda", 1, run=alike, env={}) == (11000 * MIB, 12288 * MIB)


def test_a_pre_ampere_gpu_runs_fp32_by_default(monkeypatch):
    """compute_cap from nvidia-smi, for torch's index of the GPU; "auto" is bf16 from 8.0
    (Ampere) on and where nvidia-smi cannot say, fp32 below (a V100, a T4)."""
    calls = []

    def smi(answer):
        return lambda args: calls.append(args) or answer

    assert compute_capability(0, run=smi("8.0\n"), env={}) == (8, 0)
    assert calls[-1] == ["--query-gpu=compute_cap", "--format=csv,noheader", "-i", "0"]
    assert compute_capability(0, run=smi("7.5\n"), env={"CUDA_VISIBLE_DEVICES": "3"}) == (7, 5)
    assert calls[-1][-1] == "3"
    for unknown in (None, "[N/A]\n", "Field compute_cap is not a valid field\n", "8\n"):
        assert compute_capability(0, run=smi(unknown), env={}) is None
    assert compute_capability(0, run=smi("8.0"), env={"CUDA_VISIBLE_DEVICES": ""}) is None
    for cap, want in (((7, 0), "fp32"), ((7, 5), "fp32"), ((8, 0), "bf16"), ((9, 0), "bf16"),
                      (None, "bf16")):  # fmt: skip
        monkeypatch.setattr("retrain.hardware.compute_capability", lambda index=0, c=cap: c)
        assert matmul_dtype("auto", "cuda") == want, cap
        assert matmul_dtype("bf16", "cuda") == "bf16"  # as set


def test_a_gpus_name_and_peak_figures():
    """nvidia-smi's name for torch's cuda:index (hidden by CUDA_VISIBLE_DEVICES: none), and
    the datasheet figures explain scales the H100's measured rates by: the most specific
    pattern first (an H100 PCIe is not the SXM one, an L40S not an L40, an L40 not an L4),
    none for a GPU retrain has no figures for (then explain says so)."""
    from retrain.hardware import MEASURED_GPU, gpu_name, gpu_peaks

    calls = []
    smi = lambda answer: lambda args: calls.append(args) or answer  # noqa: E731
    assert gpu_name(1, run=smi("NVIDIA L40S\n"), env={}) == "NVIDIA L40S"
    assert calls[-1] == ["--query-gpu=name", "--format=csv,noheader", "-i", "1"]
    assert gpu_name(0, run=smi("NVIDIA L4\n"), env={"CUDA_VISIBLE_DEVICES": "GPU-a1"}) == (
        "NVIDIA L4"
    )
    assert calls[-1][-1] == "GPU-a1"
    assert gpu_name(0, run=smi("x"), env={"CUDA_VISIBLE_DEVICES": ""}) is None
    assert gpu_name(0, run=smi(None), env={}) is None
    assert gpu_peaks(MEASURED_GPU) == (989, 3.35)
    for name, want in (
        ("NVIDIA H100 PCIe", (756, 2.0)),
        ("NVIDIA H200", (989, 4.8)),
        ("NVIDIA A100-SXM4-80GB", (312, 2.039)),
        ("NVIDIA A100 80GB PCIe", (312, 1.935)),
        ("NVIDIA A100-PCIE-40GB", (312, 1.555)),
        ("NVIDIA L40S", (362, 0.864)),
        ("NVIDIA L40", (181, 0.864)),
        ("NVIDIA L4", (121, 0.3)),
        ("NVIDIA GeForce RTX 4090", (165, 1.008)),
        ("NVIDIA GeForce RTX 3090", (71, 0.936)),
        ("NVIDIA GeForce RTX 3090 Ti", None),
        ("NVIDIA A10G", None),
        (None, None),
    ):
        assert gpu_peaks(name) == want, name


def test_the_real_nvidia_smi_runner_says_none_when_it_is_absent(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_memory("cuda", 0) is None and cuda_device_count() == 0


def test_a_graphs_private_pool_is_not_free_memory(monkeypatch):
    """cuda_free_bytes counts the caching allocator's unused memory as free, but not the
    unused part of the private pools it is given (the decoder's captured graphs'): only
    the default pool's goes to a new tensor. torch.cuda's readings stand in, as a
    snapshot of each pool would give them."""
    import torch

    from retrain.hardware import cuda_free_bytes, private_idle_bytes

    segments = [  # torch.cuda.memory_snapshot()'s segments, the keys read
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 20 * MIB, "allocated_size": 4 * MIB},
        {"device": 0, "segment_pool_id": (0, 1), "total_size": 8 * MIB, "allocated_size": 2 * MIB},
        {"device": 0, "segment_pool_id": (0, 1), "total_size": 2 * MIB, "allocated_size": 0},
        {"device": 1, "segment_pool_id": (0, 2), "total_size": 64 * MIB, "allocated_size": 0},
    ]
    assert private_idle_bytes(segments, 0) == 8 * MIB  # the graph's two segments
    assert private_idle_bytes(segments, 1) == 64 * MIB
    asked = []

    def snapshot(pool, include_traces):  # one pool's segments
        asked.append((pool, include_traces))
        return [s for s in segments if s["segment_pool_id"] == pool]

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * MIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 6 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    # the driver's 100 MiB, the default pool's 16 unused; not the graph's pool's 8
    assert cuda_free_bytes(torch.device("cuda", 0), [(0, 1)]) == (100 + 16) * MIB
    assert asked == [((0, 1), False)]  # that pool alone, no traces
    assert cuda_free_bytes(torch.device("cuda", 0)) == (100 + 24) * MIB  # no graphs
    assert len(asked) == 1  # nor a snapshot


# ----------------------------------------------------------------------------- the option


def test_micro_batch_tokens_takes_a_positive_int_or_auto():
    spec = BACKENDS.entry("local").options["micro_batch_tokens"]
    assert (spec.type, spec.default) == ("int/auto", "auto")
    assert check_option(spec, "auto") is None
    assert check_option(spec, 4096) is None
    assert check_option(spec, 0) == "must be > 0, got 0"
    for bad in ("big", True, 1.5):
        assert check_option(spec, bad) == (f'expects int or "auto", got {bad!r}')
    assert LocalOptions.from_mapping({}).micro_batch_tokens == "auto"


# ----------------------------------------------------------------------------- explain


@pytest.fixture
def no_caches(tmp_path, monkeypatch):
    """No Hugging Face or retrain cache of this machine is read."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "rc"))


def simulate(
    monkeypatch,
    cap: tuple[int, int] | None = (9, 0),
    triton: bool = True,
    **devices: tuple[float, float] | None,
) -> None:
    """explain and doctor see these devices ({"cuda0": (free GiB, total GiB), "cpu": ...};
    None: a device nvidia-smi lists but whose memory it cannot read), GPUs of compute
    capability `cap` (an H100's by default), and triton installed (`triton`), as torch's
    CUDA wheels bring it."""
    import retrain.hardware as hardware

    real = hardware.compiler_missing

    def missing(kind: str) -> str | None:
        if kind == "cuda":
            return None if triton else "triton is not installed"
        return real(kind)

    monkeypatch.setattr(hardware, "compiler_missing", missing)
    monkeypatch.setattr("retrain.config.validate.compiler_missing", missing)

    def memory(kind: str, index: int = 0, **kw):
        found = devices.get("cpu" if kind == "cpu" else f"{kind}{index}")
        return None if found is None else (int(found[0] * GIB), int(found[1] * GIB))

    monkeypatch.setattr(estimates_cli, "device_memory", memory)
    monkeypatch.setattr("retrain.hardware.device_memory", memory)
    gpus = len([k for k in devices if k.startswith("cuda")])
    monkeypatch.setattr("retrain.hardware.cuda_device_count", lambda **kw: gpus)
    if gpus:  # torch's CUDA build, as a GPU machine has
        build = hardware.TorchBuild("2.13.0", "12.8")
        monkeypatch.setattr(hardware, "torch_build", lambda: build)
    monkeypatch.setattr("retrain.hardware.compute_capability", lambda index=0, **kw: cap)
    monkeypatch.setattr("retrain.hardware.gpu_order_unknown", lambda *args, **kw: None)


def qwen_config(tmp_path: Path, *options: str) -> Path:
    model = tmp_path / "qwen3-shaped"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    path = tmp_path / "r.toml"
    opts = "".join(f"{o}\n" for o in options)
    path.write_text(
        f'[model]\nmodel = "{model}"\nlora_rank = 32\n[backend]\ndevices = "gpu:0"\n'
        f"[backend.options]\n{opts}[eval]\nevery = 0\n"
        "[training]\nseed = 1\nbatch_size = 8\ngroup_size = 16\nmax_tokens = 256\n"
    )
    return path


def explain(path: Path, capsys, *flags: str) -> tuple[int, str, dict]:
    code = main(["explain", str(path), *flags])
    text = capsys.readouterr().out
    main(["explain", str(path), "--json", *flags])
    return code, text, json.loads(capsys.readouterr().out)


def memory_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("Memory:"))


def test_explain_says_the_blocks_are_compiled(tmp_path, capsys, monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=(79.1, 79.6))  # with triton
    code, text, report = explain(qwen_config(tmp_path, "compile = true"), capsys)
    assert code == 0 and not report["errors"]
    compute = next(line for line in text.splitlines() if line.startswith("Compute:"))
    assert compute.endswith(", transformer blocks compiled (torch.compile)")
    code, text, _ = explain(qwen_config(tmp_path), capsys)
    assert "compiled" not in next(line for line in text.splitlines() if line.startswith("Compute:"))


def test_explain_sizes_auto_to_an_80_gib_gpu(tmp_path, capsys, monkeypatch, no_caches):
    import retrain.memory as memory

    simulate(monkeypatch, cuda0=(79.1, 79.6))
    monkeypatch.setattr(memory, "f32_out_matmul", lambda kind: kind == "cuda")  # torch >= 2.8
    code, text, report = explain(qwen_config(tmp_path), capsys)
    est = report["estimates"]
    assert code == 0 and not report["errors"]
    n = est["micro_batch_tokens"]
    assert n % 256 == 0 and 2048 <= n < 16384
    assert est["device"] == "gpu:0" and est["device_free_gib"] == 79.1
    assert est["peak_memory_gib"] <= 0.9 * 79.1 and est["memory_problem"] is None
    assert f"micro-batches of {n} tokens (auto)" in text
    assert (
        "Compute:     bf16 model (float32 adapter weights, computed in bf16; float32 logits; "
        "norms and gated MLPs keep only their inputs for the backward)" in text
    )
    line = memory_line(text)
    assert line.startswith("Memory:      gpu:0: 79.1 of 79.6 GiB free; 4,022M params; peak ~")
    assert "not calibrated" not in line  # the cuda bf16 memory model is measured
    # the GPU holds the whole model in bf16 (4.02B x 2 bytes: 7.49 GiB, the sampler shares
    # it, its float32 logits read the bf16 output layer), not 15 GiB of float32; beside it
    # the sampler's own A and B (bf16) of the r32 adapter, 0.19 GiB
    assert float(line.split("weights ")[1].split(" ")[0]) == 7.68
    assert "(of which the sampler's copy 0.19)" in line
    assert "completions at once" not in line  # all 128 fit: the step bounds them, not memory


def test_explain_counts_a_bf16_sampling_copy_of_its_own(tmp_path, capsys, monkeypatch, no_caches):
    """`[inference] dtype = "bf16"` on a float32 trainer: the in-process engine samples
    from a bf16 model of its own, which the estimate holds beside the float32 weights
    (4.02B x 2 bytes, 7.49 GiB, and its float32 A and B: 0.38 GiB), instead of the merged
    float32 linears; a server engine holds neither on the training device."""
    import retrain.memory as memory

    simulate(monkeypatch, cuda0=(79.1, 79.6))
    monkeypatch.setattr(memory, "f32_out_matmul", lambda kind: kind == "cuda")
    base = qwen_config(tmp_path, 'dtype = "fp32"', "micro_batch_tokens = 1024")
    text = base.read_text()
    plain = memory_line(explain(base, capsys)[1])
    base.write_text(text + '[inference]\ndtype = "bf16"\n')
    line = memory_line(explain(base, capsys)[1])
    assert "(of which the sampler's copy 7.87)" in line
    merged = float(plain.split("(of which the sampler's copy ")[1].split(")")[0])
    weights = [float(x.split("weights ")[1].split(" ")[0]) for x in (plain, line)]
    # float32 weights (~15 GiB), then the merged copies give way to the bf16 model
    assert weights[1] == pytest.approx(weights[0] - merged + 7.87, abs=0.011)
    # a server engine samples on the server: no copy, no KV cache on the training device
    base.write_text(text + '[inference]\nengine = "vllm"\nurl = "http://127.0.0.1:9"\n')
    served = memory_line(explain(base, capsys)[1])
    assert "(of which the sampler's copy" not in served and "(sampling is the server's)" in served
    assert float(served.split("weights ")[1].split(" ")[0]) == pytest.approx(
        weights[0] - merged, abs=0.011
    )
    # split mode: the sampler is on the first GPU, the estimate is of the last (training)
    simulate(monkeypatch, cuda0=(79.1, 79.6), cuda1=(79.1, 79.6))
    base.write_text(text.replace('devices = "gpu:0"', 'devices = "gpu:0,gpu:1"'))
    split = memory_line(explain(base, capsys)[1])
    assert "(sampling is the other device's)" in split
    assert "(of which the sampler's copy" not in split


def largest_fitting(tmp_path, capsys) -> int:
    """The largest micro_batch_tokens that fits, as explain's error over the GPU names it
    (auto stops below it, at AUTO_MOST)."""
    error = explain(qwen_config(tmp_path, "micro_batch_tokens = 65536"), capsys)[2]["errors"][0]
    return int(error.split("the largest that fits is ")[1].split(" ")[0])


def test_explain_refuses_a_micro_batch_over_the_gpu(tmp_path, capsys, monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=(79.1, 79.6))
    auto = explain(qwen_config(tmp_path), capsys)[2]["estimates"]["micro_batch_tokens"]
    code, text, report = explain(qwen_config(tmp_path, "micro_batch_tokens = 20480"), capsys)
    assert code == 2
    (error,) = report["errors"]
    assert error.startswith("[backend.options] micro_batch_tokens = 20480: the step needs ~")
    assert "over the 79.1 GiB free on gpu:0 (of 79.6 GiB)" in error
    assert error.endswith(
        f'the largest that fits is {largest_fitting(tmp_path, capsys)} (or "auto")'
    )
    assert auto == AUTO_MOST < largest_fitting(tmp_path, capsys) < 20480  # auto fits, lower
    assert f"ERROR: {error}" in text and ", OVER the free memory" in memory_line(text)
    # the same value on an idle 141 GiB GPU is no error
    simulate(monkeypatch, cuda0=(300, 300))
    assert explain(qwen_config(tmp_path, "micro_batch_tokens = 20480"), capsys)[0] == 0


def test_explain_warns_close_to_the_free_memory(tmp_path, capsys, monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=(79.1, 79.6))
    largest = largest_fitting(tmp_path, capsys)
    code, text, report = explain(
        qwen_config(tmp_path, f"micro_batch_tokens = {largest + 256}"), capsys
    )
    assert code == 0 and not report["errors"]
    (warning,) = [w for w in report["warnings"] if "micro_batch_tokens" in w]
    assert "close to running out" in warning and f"leaving a margin: {largest}" in warning
    assert ", close to the free memory" in memory_line(text)


def test_long_completions_on_a_24_gib_gpu_decode_as_many_as_fit(
    tmp_path, capsys, monkeypatch, no_caches
):
    """The experiment template's 10,240-token completions of Qwen3-4B on a 24 GiB GPU (the
    spec's RTX 4090): the decoder holds as many completions at once as the free memory
    takes (1.44 GiB of bf16 KV cache each), so sampling is no reason to refuse the run.
    An earlier estimate sized those rows from the memory beside the bare weights and then
    added the allocator's slack and the runtime on top: ERROR, ~23.4 GiB over the 23.2
    free, for a run that fits. Only when not even one completion fits is max_tokens an
    error, and then lowering it is the fix (prompt_batch is already 0). (Checkpointing on,
    so that training such a completion fits too: the next test.)"""
    simulate(monkeypatch, cuda0=(23.2, 24.0))
    path = qwen_config(tmp_path, "checkpointing = true")
    path.write_text(path.read_text().replace("max_tokens = 256", "max_tokens = 10240"))
    code, text, report = explain(path, capsys)
    est = report["estimates"]
    assert code == 0 and not report["errors"], report["errors"]
    assert est["memory_problem"] is None and est["peak_memory_gib"] < 23.2
    line = memory_line(text)
    found = re.search(r"\((\d+) of 128 completions at once, as many as fit\)", line)
    assert found and 1 < int(found[1]) < 16  # whole groups of 16 do not fit: parts of one
    # on a 16 GiB GPU a single completion of 60,000 tokens (8.3 GiB of cache) does not fit
    simulate(monkeypatch, cuda0=(15.4, 16.0))
    path.write_text(path.read_text().replace("max_tokens = 10240", "max_tokens = 60000"))
    code, text, report = explain(path, capsys)
    (error,) = report["errors"]
    assert code == 2 and error.startswith("[training] max_tokens: sampling needs ~")
    assert "with a single completion decoded at a time" in error
    assert error.endswith("Fix: lower max_tokens, or a device with more memory")
    assert "(1 of 128 completions at once, as many as fit)" in memory_line(text)
    # whole prompts at once (prompt_batch = 2): the rows are the config's, and so the fix
    path.write_text(path.read_text().replace("max_tokens = 60000", "max_tokens = 10240"))
    code, text, report = explain(path, capsys, "--backend-opt", "prompt_batch=2")
    (error,) = report["errors"]
    assert code == 2 and "as many as fit" not in memory_line(text)
    assert error.endswith(
        "Fix: lower max_tokens, or [backend.options] prompt_batch = 0 (not 2: a bounded "
        "number of completions at once)"
    )


def test_a_completion_longer_than_the_largest_micro_batch(tmp_path, capsys, monkeypatch, no_caches):
    """A completion is trained whole: with 10,240-token completions of Qwen3-4B the
    largest micro-batch that fits a 24 GiB GPU without activation checkpointing (~1.8k
    positions) cannot hold one, so a long completion would stop the run out of memory.
    checkpointing = "auto" (the default) turns it on there, and explain says so; set to
    false, explain and doctor warn, naming it; on an 80 GiB GPU auto leaves it off."""
    simulate(monkeypatch, cuda0=(23.2, 24.0))
    path = qwen_config(tmp_path)
    path.write_text(path.read_text().replace("max_tokens = 256", "max_tokens = 10240"))
    code, text, report = explain(path, capsys)
    assert code == 0 and not report["errors"] and not report["warnings"]
    assert report["estimates"]["checkpointing"] is True
    assert "activation checkpointing: on (auto: a completion of max_tokens needs it)" in text
    assert report["estimates"]["micro_batch_tokens"] == 10240 + 256  # fits with it, whole
    # the rough time counts the blocks' second forward: training 8 x params a token, not 6
    on_s = report["estimates"]["step_time_s"]
    assert "training ~" in report["estimates"]["step_time_source"]
    assert "(a third more: activation checkpointing)" in report["estimates"]["step_time_source"]
    # set off: the largest micro-batch without it is shorter than a completion
    off = tmp_path / "off.toml"
    off.write_text(path.read_text().replace("[eval]", "checkpointing = false\n[eval]"))
    code, text, report = explain(off, capsys)
    assert report["estimates"]["step_time_s"] < on_s
    assert "a third more" not in report["estimates"]["step_time_source"]
    largest = report["estimates"]["micro_batch_tokens"]  # auto: the largest that fits
    assert code == 0 and not report["errors"] and 256 < largest < 10240 + 256
    assert "activation checkpointing: off, attention:" in text
    (warning,) = [w for w in report["warnings"] if "trained whole" in w]
    assert warning.startswith("[training] max_tokens = 10240: a completion is trained whole")
    assert "~10496 positions (a prompt of ~256 tokens and max_tokens)" in warning
    assert f"the largest that fits the 23.2 GiB free on gpu:0 is {largest}" in warning
    assert warning.endswith(
        "Fix: [backend.options] checkpointing = true (a completion of max_tokens then fits), "
        f"or max_tokens <= {largest - 256}, or a device with more memory"
    )
    assert f"WARNING: {warning}" in text
    assert "close to the free memory" not in memory_line(text)  # the peak itself fits
    check = doctor.check_memory(doctor.check_config(str(off))[1])[0]
    assert check.status == "WARN" and check.fix == warning
    assert check.detail.endswith("; a completion of max_tokens would not fit a micro-batch")
    # an 80 GiB GPU holds one without it: auto leaves it off, and nothing is said
    simulate(monkeypatch, cuda0=(79.1, 79.6))
    code, text, report = explain(path, capsys)
    assert code == 0 and not report["warnings"] and report["estimates"]["memory_problem"] is None
    assert report["estimates"]["checkpointing"] is False
    assert "checkpointing: off (auto: a completion of max_tokens fits without it)" in text
    # the GPU's memory unknown: auto is decided at start
    simulate(monkeypatch, cuda0=None)
    text = explain(path, capsys)[1]
    want = "checkpointing: auto (decided at start from the model's config and the free memory)"
    assert want in text


def test_float32_weights_that_fill_a_gpu_name_bf16(tmp_path, capsys, monkeypatch, no_caches):
    """A T4 (compute capability 7.5, no native bf16): dtype = "auto" is float32, and
    Qwen3-4B's float32 weights with the sampler's merged float32 copy (~29 GiB) fill its
    15 GiB; the error names bf16, which fits (7.8 GiB of weights)."""
    simulate(monkeypatch, cap=(7, 5), cuda0=(14.6, 15.0))
    code, text, report = explain(qwen_config(tmp_path), capsys)
    (error,) = report["errors"]
    assert code == 2 and "not even 256 positions fit the device's 14.6 GiB free" in error
    assert 'Fix: free the device, [backend.options] dtype = "bf16" (half the weights' in error
    code, text, report = explain(qwen_config(tmp_path, 'dtype = "bf16"'), capsys)
    assert code == 0 and not report["errors"]
    # on a GPU with native bf16 the weights are bf16 already: nothing to halve
    simulate(monkeypatch, cuda0=(6.0, 8.0))
    error = explain(qwen_config(tmp_path), capsys)[2]["errors"][0]
    assert "not even 256 positions fit" in error and 'dtype = "bf16"' not in error


def test_explain_without_the_gpus_memory_keeps_auto_open(tmp_path, capsys, monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=None)  # nvidia-smi lists gpu:0 but cannot read its memory
    code, text, report = explain(qwen_config(tmp_path), capsys)
    est = report["estimates"]
    assert code == 0 and est["micro_batch_tokens"] is None and est["device_free_gib"] is None
    assert "auto size (set at start from free memory)" in text
    assert "gpu:0: memory unknown" in memory_line(text)
    assert "auto is sized at start to gpu:0's free memory (unknown here)" in est["memory_note"]


def test_explain_without_any_gpu_refuses_gpu_0(tmp_path, capsys, monkeypatch, no_caches):
    """No nvidia-smi answer at all: no CUDA device, so devices = "gpu:0" is an error (the
    run would refuse it before loading the model)."""
    simulate(monkeypatch)
    path = qwen_config(tmp_path)
    code, text, report = explain(path, capsys)
    (error,) = report["errors"]
    assert code == 2 and error.startswith(f"[backend] devices ({path}:5): 'gpu:0' asks for gpu:0")
    assert "this machine has no CUDA device" in error and 'Fix: devices = "cpu"' in error


def test_explain_on_a_cpu_keeps_512(tmp_path, capsys, monkeypatch, no_caches):
    simulate(monkeypatch, cpu=(19.0, 23.5))
    path = qwen_config(tmp_path)
    path.write_text(path.read_text().replace('"gpu:0"', '"cpu"'))
    code, text, report = explain(path, capsys, "--backend-opt", "dtype=fp32")
    assert report["estimates"]["micro_batch_tokens"] == 512
    assert memory_line(text).startswith("Memory:      cpu: 19.0 of 23.5 GiB free; 4,022M params")
    assert "micro-batches of 512 tokens (auto)" in text
    # a 4B model at float32 does not fit 19 GiB of RAM
    assert code == 2 and "19.0 GiB free on cpu" in report["errors"][0]


def test_the_name_only_fallback_counts_the_device_dtype(tmp_path, capsys, monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=(79.1, 79.6), cpu=(19.0, 23.5))
    path = tmp_path / "n.toml"
    base = '[model]\nmodel = "acme/Widget-4B"\n[eval]\nevery = 0\n[training]\nseed = 1\n'
    path.write_text(base + '[backend]\ndevices = "gpu:0"\n')
    est = explain(path, capsys)[2]["estimates"]
    assert est["model_params"] == 4e9
    assert est["peak_memory_gib"] == round(4e9 * 2 / GIB, 2)  # bf16 on a GPU: 2 bytes each
    assert "at least the weights at 2 bytes each (bf16" in est["memory_note"]
    path.write_text(base + '[backend]\ndevices = "cpu"\noptions = { dtype = "fp32" }\n')
    assert explain(path, capsys)[2]["estimates"]["peak_memory_gib"] == round(4e9 * 4 / GIB, 2)
    path.write_text(base.replace("Widget-4B", "Widget-70B") + '[backend]\ndevices = "gpu:0"\n')
    code, _, report = explain(path, capsys)
    assert code == 2 and "the weights alone need ~130.4 GiB" in report["errors"][0]


# ----------------------------------------------------------------------------- doctor


def test_doctor_reports_each_devices_memory(tmp_path, monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=(79.1, 79.6), cuda1=(10.0, 16.0), cpu=(19.0, 23.5))
    checks = doctor.check_memory(None)
    assert [(c.name, c.status, c.detail) for c in checks] == [
        ("memory gpu:0", "OK", "79.1 of 79.6 GiB free"),
        ("memory gpu:1", "OK", "10.0 of 16.0 GiB free"),
        ("memory cpu", "OK", "19.0 of 23.5 GiB free"),
    ]
    config = doctor.check_config(str(qwen_config(tmp_path)))[1]
    first = doctor.check_memory(config)[0]
    assert first.status == "OK" and "the run's estimated peak ~" in first.detail
    # with the name nvidia-smi gives each GPU
    monkeypatch.setattr("retrain.hardware.gpu_name", lambda i: ["NVIDIA H100 PCIe", None][i])
    details = [c.detail for c in doctor.check_memory(None)]
    assert details == ["79.1 of 79.6 GiB free (NVIDIA H100 PCIe)", *details[1:]]
    assert details[1] == "10.0 of 16.0 GiB free"


def test_doctor_says_why_mixed_gpus_memory_is_unknown_and_the_fix(monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=None, cuda1=None, cpu=(19.0, 23.5))
    why = "GPUs of different models (A, B) without CUDA_DEVICE_ORDER = PCI_BUS_ID: ..."
    monkeypatch.setattr("retrain.hardware.gpu_order_unknown", lambda *args, **kw: why)
    first = doctor.check_memory(None)[0]
    assert (first.name, first.status) == ("memory gpu:0", "WARN")
    assert first.detail == f"cannot read its memory: {why}"
    assert first.fix.startswith("export CUDA_DEVICE_ORDER=PCI_BUS_ID")


def test_doctor_warns_about_a_run_near_or_over_the_device(tmp_path, monkeypatch, no_caches):
    simulate(monkeypatch, cuda0=(79.1, 79.6), cpu=(19.0, 23.5))
    config = doctor.check_config(str(qwen_config(tmp_path, "micro_batch_tokens = 20480")))[1]
    first = doctor.check_memory(config)[0]
    assert first.status == "WARN" and first.detail.endswith(", over it")
    assert first.fix.startswith("[backend.options] micro_batch_tokens = 20480")
    run = doctor.check_run(config, "r.toml")
    assert run[0].status == "FAIL" and "micro_batch_tokens = 20480" in run[0].detail


def test_explain_names_the_bf16_layout_of_each_device(tmp_path, capsys, monkeypatch, no_caches):
    """bf16 mode is the whole model on a GPU and the blocks' matmuls on a CPU."""
    simulate(monkeypatch, cuda0=(79.1, 79.6), cpu=(20.0, 24.0))
    path = qwen_config(tmp_path, 'dtype = "bf16"')
    gpu = explain(path, capsys)[1]
    cpu = explain(path, capsys, "--devices", "cpu")[1]
    assert "Compute:     bf16 model (float32" in gpu
    assert "Compute:     bf16 matmuls (float32" in cpu
    fp32 = explain(qwen_config(tmp_path, 'dtype = "fp32"'), capsys)[1]
    assert "Compute:     fp32 matmuls (float32" in fp32
    simulate(monkeypatch, cap=(7, 0), cuda0=(31.0, 32.0))  # a V100: auto is fp32, and why
    v100 = explain(qwen_config(tmp_path), capsys)[1]
    assert (
        "Compute:     fp32 matmuls (float32 adapter and logits; auto: compute capability 7.0 "
        "has no native bf16)" in v100
    )
    assert (
        "auto: compute capability"
        not in explain(qwen_config(tmp_path, 'dtype = "fp32"'), capsys)[1]
    )


def test_explain_leaves_auto_to_the_start_where_the_gpu_is_unknown(
    tmp_path, capsys, monkeypatch, no_caches
):
    """GPUs of different models without PCI order: which is gpu:0 is unknown, so its
    capability is too; torch decides bf16 at the start, and explain says so."""
    simulate(monkeypatch, cap=None, cuda0=None, cuda1=None)
    why = "GPUs of different models (A, B) without CUDA_DEVICE_ORDER = PCI_BUS_ID: ..."
    monkeypatch.setattr("retrain.hardware.gpu_order_unknown", lambda *args, **kw: why)
    out = explain(qwen_config(tmp_path), capsys)[1]
    assert f"backward; auto: bf16 unless torch's gpu:0 lacks it ({why}))" in out
    assert "auto: bf16 unless" not in explain(qwen_config(tmp_path, 'dtype = "bf16"'), capsys)[1]


def test_triton_work_in_bf16_is_refused_on_a_gpu_without_native_bf16(
    tmp_path, capsys, monkeypatch, no_caches
):
    """Triton, which compiles FlexAttention and the compiled decode step, has no bf16 on a
    GPU below compute capability 8.0 (a V100 here): asking for either with dtype = "bf16"
    is a config error at the start (explain shows it, exit 2), naming the key, the GPU's
    capability and the fix; with attention = "auto" bf16 keeps the dense mask instead.
    On an H100, or with dtype = "auto" (fp32 on the V100), nothing is refused."""
    simulate(monkeypatch, cap=(7, 0), cuda0=(31.0, 32.0))  # with triton
    for option, key in (('attention = "flex"', "attention"), ('decode = "compiled"', "decode")):
        code, text, _ = explain(qwen_config(tmp_path, 'dtype = "bf16"', option), capsys)
        assert code == 2
        (line,) = [x for x in text.splitlines() if f"ERROR: [backend.options] {key} (" in x]
        assert "with triton, which has no bf16 on 'gpu:0' (compute capability 7.0 has no " in line
        assert 'Fix: dtype = "auto" (fp32 there), or' in line
        code, text, _ = explain(qwen_config(tmp_path, 'dtype = "auto"', option), capsys)
        assert "has no bf16 on" not in text
    # a bf16 sampler ([inference] dtype) beside an fp32 trainer compiles its step in bf16 too
    path = qwen_config(tmp_path, 'dtype = "auto"', 'decode = "compiled"')
    path.write_text(path.read_text() + '\n[inference]\ndtype = "bf16"\n')
    code, text, _ = explain(path, capsys)
    assert code == 2 and "ERROR: [backend.options] decode (" in text
    assert 'and [inference] dtype = "bf16". Fix: [inference] dtype = "auto", or decode' in text
    code, text, _ = explain(qwen_config(tmp_path, 'dtype = "bf16"'), capsys)
    assert code == 0
    assert (  # auto: FlexAttention is out of reach here, and explain says why
        "attention: dense mask (not FlexAttention: bf16 matmuls (compute capability 7.0 has "
        "no native bf16; triton has none there)), on SDPA's memory-efficient kernel\n"
    ) in text
    simulate(monkeypatch, cap=(9, 0), cuda0=(79.1, 79.6))
    code, text, _ = explain(qwen_config(tmp_path, 'dtype = "bf16"'), capsys)
    assert code == 0
    assert (
        "attention: FlexAttention for rows of 2048+ positions, dense mask below, on SDPA's "
        "memory-efficient kernel\n"
    ) in text
    code, text, _ = explain(qwen_config(tmp_path, 'dtype = "bf16"', 'attention = "flex"'), capsys)
    assert code == 0
