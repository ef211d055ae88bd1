"""What this machine can do, read without importing torch (so `explain` and `doctor` can
say it): the CPU's bf16 support, the matmul dtype a device gets, and a device's free and
total memory (nvidia-smi for CUDA, /proc/meminfo for the CPU)."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MATMUL_DTYPES = ("auto", "fp32", "bf16")


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AVX512-BF16 or AMX-BF16 (False where unreadable)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & flags)


# Device kinds whose bf16 mode holds the whole model in bf16 (retrain/kernels/precision.py
# `bf16_weights`). On a GPU a float32 residual stream doubled the activations' memory and
# sent attention to float32 kernels (the headline shape on an H100: 113 bytes per
# position, hidden unit and layer, and a 4k-position micro-batch through FlexAttention in
# ~4 s, against ~94 bytes and ~0.55 s wholly in bf16), while its gain, a sampler closer to
# the trainer, is what the importance ratio corrects anyway. A CPU keeps bf16 matmuls
# only (`bf16_linears`): there the float32 rest costs little and halves the mismatch.
WHOLE_BF16 = frozenset({"cuda"})


def whole_model_bf16(dtype: str, device_type: str) -> bool:
    """Whether the model is wholly bf16 with matmul dtype `dtype` (`matmul_dtype`'s
    answer) on a device kind: bf16 mode on a kind in WHOLE_BF16."""
    return dtype == "bf16" and device_type in WHOLE_BF16


@functools.cache
def f32_out_matmul(device_type: str) -> bool:
    """Whether torch multiplies two bf16 matrices into a float32 result on `device_type`
    (`torch.mm(..., out_dtype=torch.float32)`: CUDA only, torch >= 2.8), read from the
    installed version without importing torch. Such a product is exact up to the order
    of sums (a product of two bf16 numbers fits a float32), so float32 logits need no
    float32 copy of the output layer (retrain/kernels/precision.py `linear_f32`)."""
    return device_type == "cuda" and torch_at_least(2, 8)


@functools.cache
def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is `major.minor` or newer, read from its package's
    metadata without importing it (False: no torch, or a version we cannot read)."""
    try:
        from importlib.metadata import version

        have = tuple(int(part) for part in version("torch").split(".")[:2])
    except (ImportError, ValueError):
        return False
    return have >= (major, minor)


def sums_in_f32(device_type: str) -> bool:
    """Whether a wholly bf16 model's LoRA linears on `device_type` add the adapter to the
    base output in float32 and round once (retrain/kernels/lora_layers.py): where a bf16
    matmul can give a float32 result without float32 copies of its operands (CUDA, torch
    >= 2.8), and on a CPU (only its tests run the wholly bf16 layout there; the copies
    cost time, not the answer). Elsewhere the sum is rounded twice, as PEFT's."""
    return device_type == "cpu" or f32_out_matmul(device_type)


def matmul_dtype(option: str, device_type: str, index: int = 0) -> str:
    """`[backend.options] dtype` resolved for a device kind ("cpu", "cuda", "mps") and a
    CUDA device's index: "auto" is bf16 on a GPU with native bf16 (compute capability 8.0
    and later, or unknown: no nvidia-smi) and on a CPU with native bf16 dot products,
    else fp32. A pre-Ampere GPU (V100, T4) runs bf16 matmuls slowly, and
    triton, hence FlexAttention and the compiled decode step, has no bf16 there."""
    if option != "auto":
        return option
    if device_type == "cuda":
        return "fp32" if no_native_bf16(index) else "bf16"
    return "bf16" if device_type == "cpu" and cpu_has_native_bf16() else "fp32"


def no_native_bf16(index: int = 0) -> str | None:
    """Why torch's `cuda:index` has no native bf16 (its compute capability, below 8.0);
    None when it has, or nvidia-smi cannot say."""
    cap = compute_capability(index)
    if cap is None or cap >= (8, 0):
        return None
    return f"compute capability {cap[0]}.{cap[1]} has no native bf16"


def triton_lacks_bf16(dtype: str, device_type: str, index: int = 0) -> str | None:
    """Why triton, which compiles FlexAttention and the compiled decode step, cannot run
    the resolved matmul `dtype` on a device: bf16 on a GPU without native bf16 (only an
    explicit `dtype = "bf16"` gets there: "auto" is fp32 on it); None otherwise."""
    return no_native_bf16(index) if dtype == "bf16" and device_type == "cuda" else None


def compute_capability(
    index: int = 0,
    *,
    run: Callable[[list[str]], str | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[int, int] | None:
    """(major, minor) of torch's `cuda:index` from nvidia-smi, without torch; None where
    unknown (no nvidia-smi, a driver too old to report it, the GPU hidden)."""
    out = _asked_about("compute_cap", index, run, env)
    major, dot, minor = (out or "").strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)


def gpu_name(
    index: int = 0,
    *,
    run: Callable[[list[str]], str | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """The name nvidia-smi gives torch's `cuda:index` ("NVIDIA H100 80GB HBM3"), without
    torch; None where unknown (no nvidia-smi, the GPU hidden)."""
    out = (_asked_about("name", index, run, env) or "").strip()
    return out.splitlines()[0].strip() if out else None


def _asked_about(
    field: str,
    index: int,
    run: Callable[[list[str]], str | None] | None,
    env: Mapping[str, str] | None,
) -> str | None:
    """nvidia-smi's answer for `field` of torch's `cuda:index` (`run` asks it, else asked
    once a process); None where the GPU is hidden or nvidia-smi does not answer."""
    gpu = torch_gpu_id(index, run, env)
    if gpu is None:
        return None
    query = (f"--query-gpu={field}", "--format=csv,noheader", "-i", gpu)
    return run(list(query)) if run is not None else _asked_once(query)


# Peak dense bf16 tensor-core rate (TFLOPS, with float32 accumulation) and memory
# bandwidth (TB/s) from NVIDIA's datasheets, by the names nvidia-smi gives; the first
# pattern that matches wins. explain scales what retrain measured on an H100 (SXM, the
# first lease) by them: training by the rate, sampling (a weight read per decoded
# token) by the bandwidth.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    (r"\bH200\b.*\bNVL\b", 835, 4.8),
    (r"\bH200\b", 989, 4.8),
    (r"\bH100\b.*\bPCIe\b", 756, 2.0),
    (r"\bH100\b.*\bNVL\b", 835, 3.9),
    (r"\bH100\b", 989, 3.35),
    (r"\bA100\b.*80GB.*PCIe|\bA100\b.*PCIe.*80GB", 312, 1.935),
    (r"\bA100\b.*80GB", 312, 2.039),
    (r"\bA100\b", 312, 1.555),
    (r"\bL40S\b", 362, 0.864),
    (r"\bL40\b", 181, 0.864),
    (r"\bL4\b", 121, 0.3),
    (r"\bRTX 4090\b(?! D)", 165, 1.008),
    (r"\bRTX 3090\b(?! Ti)", 71, 0.936),
)
MEASURED_GPU = "NVIDIA H100 80GB HBM3"


def gpu_peaks(name: str | None) -> tuple[float, float] | None:
    """(bf16 TFLOPS, TB/s) of the GPU nvidia-smi names `name` (`GPU_PEAKS`); None when
    retrain has no figures for it."""
    import re

    for pattern, tflops, bandwidth in GPU_PEAKS if name else ():
        if re.search(pattern, name, re.IGNORECASE):
            return tflops, bandwidth
    return None


def compiler_missing(device_type: str) -> str | None:
    """What torch.compile's inductor needs to compile for a device kind and this machine
    lacks (None: nothing): triton for CUDA, a C++ compiler (`$CXX`, else g++, as
    inductor looks for it) elsewhere."""
    if device_type == "cuda":
        from importlib.util import find_spec

        return None if find_spec("triton") else "triton is not installed"
    cxx = os.environ.get("CXX", "g++")
    return None if shutil.which(cxx) else f"no C++ compiler ({cxx}) on PATH"


# nvidia-smi answers in well under a second; a hung driver must not hang `explain`.
NVIDIA_SMI_TIMEOUT_S = 5.0


@functools.cache
def _asked_once(args: tuple[str, ...]) -> str | None:
    """nvidia-smi's answer to a question whose answer a process never sees change (a
    GPU's compute capability), asked once: explain, the start's checks and the backend
    each need it, and each call costs tens of milliseconds."""
    return _run_nvidia_smi(list(args))


def _run_nvidia_smi(args: list[str]) -> str | None:
    """nvidia-smi's output, or None when it is absent, fails or hangs."""
    import subprocess

    try:
        proc = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def visible_gpu(index: int, visible: str | None, numbered_alike: bool = True) -> str | None:
    """The nvidia-smi id of torch's `cuda:index`: torch numbers the GPUs that
    CUDA_VISIBLE_DEVICES lists (indices or UUIDs), nvidia-smi all of them. None when the
    variable hides it, or gives an index that CUDA and nvidia-smi may read as different
    GPUs (not `numbered_alike`: `gpu_order_unknown`); a UUID names one GPU either way."""
    if visible is None:
        gpu = str(index) if index >= 0 else None
    else:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        gpu = ids[index] if 0 <= index < len(ids) else None
    if gpu is not None and gpu.isdigit() and not numbered_alike:
        return None
    return gpu


def gpu_order_unknown(
    run: Callable[[list[str]], str | None] | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """Why a CUDA index may not be nvidia-smi's index of the same GPU, or None when it is.
    nvidia-smi numbers the GPUs by PCI bus; CUDA (so torch, and CUDA_VISIBLE_DEVICES'
    indices) fastest first unless CUDA_DEVICE_ORDER = PCI_BUS_ID, and ties go by bus: the
    numbers differ only among GPUs of different models. `run` asks nvidia-smi (else
    asked once a process)."""
    env = os.environ if env is None else env
    if env.get("CUDA_DEVICE_ORDER", "").strip().upper() == "PCI_BUS_ID":
        return None
    query = ("--query-gpu=name", "--format=csv,noheader")
    out = run(list(query)) if run is not None else _asked_once(query)
    models = sorted({line.strip() for line in (out or "").splitlines() if line.strip()})
    if len(models) < 2:
        return None
    return (
        f"GPUs of different models ({', '.join(models)}) without CUDA_DEVICE_ORDER = "
        "PCI_BUS_ID: torch numbers them fastest first, nvidia-smi by PCI bus, so which "
        "is gpu:N cannot be read without torch"
    )


def torch_gpu_id(
    index: int, run: Callable[[list[str]], str | None] | None, env: Mapping[str, str] | None
) -> str | None:
    """The nvidia-smi id of torch's `cuda:index` (`visible_gpu`), or None where unknown."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return visible_gpu(index, visible, gpu_order_unknown(run, env) is None)


def parse_meminfo(text: str) -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo's text (kB lines)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key in ("MemAvailable", "MemTotal") and fields and fields[0].isdigit():
            values[key] = int(fields[0]) * 1024
    if len(values) < 2:
        return None
    return values["MemAvailable"], values["MemTotal"]


def parse_nvidia_smi_memory(text: str) -> tuple[int, int] | None:
    """(free, total) in bytes from `nvidia-smi --query-gpu=memory.free,memory.total
    --format=csv,noheader,nounits` for one GPU (MiB values: "81037, 81559")."""
    fields = [f.strip() for f in text.strip().splitlines()[0].split(",")] if text.strip() else []
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        return None
    free, total = (int(f) * 2**20 for f in fields)
    return free, total


@dataclass(frozen=True)
class TorchBuild:
    """What the installed torch was built for, read from its torch/version.py."""

    version: str  # "2.13.0+cpu"
    cuda: str | None  # the CUDA version it was built with ("12.8"); None: no CUDA
    hip: str | None = None  # ROCm's HIP version: torch.cuda runs on AMD GPUs then

    @property
    def gpu(self) -> bool:
        return self.cuda is not None or self.hip is not None

    @classmethod
    def of(cls, torch) -> TorchBuild:
        """The build of the imported `torch` module."""
        return cls(torch.__version__, torch.version.cuda, torch.version.hip)


@functools.cache
def torch_build() -> TorchBuild | None:
    """The installed torch's build, without importing torch: the constants its
    torch/version.py assigns, parsed, not run. None when torch is not installed or the
    file cannot be read."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return None
        tree = ast.parse(Path(spec.origin).with_name("version.py").read_text())
    except (OSError, SyntaxError, ImportError, ValueError):
        return None
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    if not isinstance(values.get("__version__"), str):
        return None
    return TorchBuild(values["__version__"], values.get("cuda"), values.get("hip"))


def driver_cuda(run: Callable[[list[str]], str | None] | None = None) -> tuple[int, int] | None:
    """The newest CUDA the NVIDIA driver runs, from nvidia-smi's header ("CUDA Version:
    12.4"); None without nvidia-smi or that line. `run` asks nvidia-smi (else asked once
    a process)."""
    import re

    out = run([]) if run is not None else _asked_once(())
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out or "")
    return (int(found[1]), int(found[2])) if found else None


def _major(version: str | None) -> int | None:
    head = (version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def driver_too_old(build: TorchBuild, driver: tuple[int, int] | None) -> tuple[str, str] | None:
    """(why, fix) when the driver cannot run torch's CUDA: a CUDA build of a newer major
    version than the driver runs (within a major version CUDA's minor-version
    compatibility holds); None when it can, or either is unknown."""
    major = _major(build.cuda)
    if driver is None or major is None or major <= driver[0]:
        return None
    return (
        f"the installed torch ({build.version}) is built for CUDA {build.cuda}, and this "
        f"machine's NVIDIA driver runs CUDA up to {driver[0]}.{driver[1]} (nvidia-smi), so "
        "torch will see no GPU",
        f"an NVIDIA driver for CUDA {major} (nvidia-smi's header then says CUDA Version: "
        f"{major}.x), or a torch built for CUDA {driver[0]} (PyTorch's install page gives the "
        "index URL of each CUDA build)",
    )


def torch_without_gpu(
    build: TorchBuild, gpus: int, driver: tuple[int, int] | None = None
) -> tuple[str, str] | None:
    """(why, fix) when torch numbers no CUDA device though nvidia-smi shows `gpus`: the
    installed torch's build, or the driver (`driver`: the newest CUDA it runs, where
    known), not the machine; None when nvidia-smi shows none either."""
    if not gpus:
        return None
    if not build.gpu:
        base = build.version.split("+")[0]
        return (
            f"nvidia-smi shows {gpus} GPU(s), but the installed torch ({build.version}) is "
            "built without CUDA",
            f"install torch's CUDA build (on Linux, PyPI's: pip install torch=={base}), or "
            'devices = "cpu"',
        )
    return driver_too_old(build, driver) or (
        f"torch {build.version} (CUDA {build.cuda or build.hip}) sees none of the {gpus} GPU(s) "
        "nvidia-smi shows",
        f"an NVIDIA driver new enough for CUDA {build.cuda} (nvidia-smi's header names the "
        "newest CUDA its driver runs), or a torch built for an older CUDA; check "
        "CUDA_VISIBLE_DEVICES",
    )


# The fix of GPUs that CUDA_VISIBLE_DEVICES hides (`hidden_gpus`).
HIDDEN_FIX = "list it in CUDA_VISIBLE_DEVICES (or unset it), or ask for a GPU CUDA sees"


def torch_lacks_gpus(build: TorchBuild, seen: int) -> tuple[str, str] | None:
    """(why, fix) when torch, numbering `seen` CUDA devices, lacks one asked for while
    nvidia-smi lists GPUs: with none seen, torch's build or the driver
    (`torch_without_gpu`); else CUDA_VISIBLE_DEVICES hiding some (`hidden_gpus`). None
    when nvidia-smi lists no more than torch sees. Asks nvidia-smi."""
    unusable = None if seen else torch_without_gpu(build, cuda_device_count(), driver_cuda())
    if unusable is not None:
        return unusable
    hidden = hidden_gpus()
    return None if hidden is None else (hidden, HIDDEN_FIX)


def cuda_device_count(
    *,
    run: Callable[[list[str]], str | None] = _run_nvidia_smi,
    env: Mapping[str, str] | None = None,
) -> int:
    """CUDA devices torch would number, without torch: those CUDA_VISIBLE_DEVICES lets
    CUDA see (`cuda_visible`, when it is set), else every GPU nvidia-smi lists; 0 without
    nvidia-smi."""
    present = _listed_gpus(run)
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return present if visible is None else len(cuda_visible(visible, present))


def _listed_gpus(run: Callable[[list[str]], str | None]) -> int:
    """How many GPUs nvidia-smi lists (0 without it)."""
    out = run(["--query-gpu=index", "--format=csv,noheader"])
    return len([line for line in (out or "").splitlines() if line.strip()])


def cuda_visible(visible: str, present: int) -> list[str]:
    """The entries of CUDA_VISIBLE_DEVICES that CUDA numbers, in order: those before the
    first invalid one (CUDA's documented rule: `0,2,-1,1` shows 0 and 2; invalid here: an
    index that is not one of the `present` GPUs, or an empty entry). A UUID (GPU-...,
    MIG-...) counts as valid."""
    out: list[str] = []
    for part in (p.strip() for p in visible.split(",")):
        if part.isdigit() and int(part) < present:
            out.append(str(int(part)))
        elif part.upper().startswith(("GPU-", "MIG-")):
            out.append(part)
        else:
            break
    return out


def hidden_gpus(
    *,
    run: Callable[[list[str]], str | None] = _run_nvidia_smi,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """How CUDA_VISIBLE_DEVICES hides GPUs that nvidia-smi lists, or None where it hides
    none (unset, or no nvidia-smi)."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    present = _listed_gpus(run)
    if visible is None or not present:
        return None
    seen = len(cuda_visible(visible, present))
    if seen >= present:
        return None
    return f"CUDA_VISIBLE_DEVICES = {visible!r} leaves CUDA {seen} of the {present} GPU(s) nvidia-smi lists"


def device_memory(
    device_kind: str,
    index: int = 0,
    *,
    run: Callable[[list[str]], str | None] = _run_nvidia_smi,
    meminfo: Callable[[], str] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[int, int] | None:
    """(free bytes, total bytes) of a device, without torch, or None where unknown: CUDA
    from nvidia-smi (`run` runs it), the CPU from /proc/meminfo's MemAvailable and
    MemTotal (`meminfo` reads it), MPS none (its memory is the system's, torch's to report)."""
    if device_kind == "cuda":
        gpu = torch_gpu_id(index, None if run is _run_nvidia_smi else run, env)
        if gpu is None:
            return None
        query = ["--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"]
        out = run([*query, "-i", gpu])
        return parse_nvidia_smi_memory(out) if out else None
    if device_kind == "cpu":
        try:
            text = meminfo() if meminfo else Path("/proc/meminfo").read_text()
        except OSError:
            return None
        return parse_meminfo(text)
    return None


def cuda_free_bytes(device, pools: Sequence = ()) -> int:
    """Bytes a new tensor can take on a CUDA device: the driver's free memory plus what
    torch's caching allocator holds unused (freed activations, kept for reuse), which the
    driver counts as taken; less what the private pools `pools` hold unused
    (`private_idle_bytes`: the static decoder's captured graphs', free to their own
    replays and captures only). A snapshot of each pool alone: a few segments, where one
    of the whole allocator would build a dict per block of every pool."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if not pools:
        return free + cached
    index = torch.cuda._utils._get_device_index(device, optional=True)
    idle = sum(
        private_idle_bytes(torch.cuda.memory_snapshot(pool, include_traces=False), index)
        for pool in pools
    )
    return free + cached - idle


def private_idle_bytes(segments: list[dict], index: int) -> int:
    """Bytes that private pools (a CUDA graph's: the static decoder keeps its graphs
    between steps) hold unused on device `index`, from `torch.cuda.memory_snapshot()`'s
    segments. torch's reserved and allocated counts span every pool, but only the default
    pool's unused memory goes to a new tensor."""
    return sum(
        s["total_size"] - s["allocated_size"]
        for s in segments
        if s["device"] == index and any(s["segment_pool_id"])
    )
