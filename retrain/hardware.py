"""What this machine can do, read without importing torch (so `explain` can say it)."""

from __future__ import annotations

from pathlib import Path

MATMUL_DTYPES = ("auto", "fp32", "bf16")


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AVX512-BF16 or AMX-BF16 (False where unreadable)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def matmul_dtype(option: str, device_type: str) -> str:
    """`[backend.options] dtype` resolved for a device kind ("cpu", "cuda", "mps"): "auto"
    is bf16 on a GPU and on a CPU with native bf16 dot products, else fp32."""
    if option != "auto":
        return option
    if device_type == "cuda" or (device_type == "cpu" and cpu_has_native_bf16()):
        return "bf16"
    return "fp32"
