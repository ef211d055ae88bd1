"""Row tiles of the bf16 matmuls (retrain/kernels/precision.py): the fixed sizes worked
by hand and as properties, `Bf16Linear` against a plain bf16 linear (values and input
gradients), and the memory it saves: oneDNN's per-shape kernel caches stop growing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from retrain.kernels.precision import (  # noqa: E402
    EXACT_ROWS,
    ROW_TILE,
    Bf16Linear,
    padded_rows,
    row_tiles,
)

SIZES = {padded_rows(r) for r in range(1, ROW_TILE + 1)}


def test_sizes_worked_by_hand():
    assert [padded_rows(r) for r in range(1, 17)] == list(range(1, 17))  # exact
    # 4 sizes per octave above 16: 20 24 28 32 | 40 48 56 64 | 80 ...
    assert [padded_rows(r) for r in (17, 20, 21, 32, 33, 41, 100, 129, 500, 512)] == [
        20,
        20,
        24,
        32,
        40,
        48,
        112,
        160,
        512,
        512,
    ]
    assert row_tiles(5) == [(0, 5, 5)]
    assert row_tiles(1100) == [(0, 512, 512), (512, 512, 512), (1024, 76, 80)]
    assert len(SIZES) == 36


@given(st.integers(min_value=1, max_value=6000))
def test_tiles_cover_the_rows_in_fixed_sizes(rows):
    tiles = row_tiles(rows)
    assert [t[0] for t in tiles] == list(range(0, rows, ROW_TILE))  # back to back
    assert sum(n for _, n, _ in tiles) == rows
    for _, n, padded in tiles:
        assert padded in SIZES and n <= padded <= ROW_TILE
        assert padded == n if n <= EXACT_ROWS else (padded - n) < n / 4


@given(st.integers(min_value=1, max_value=ROW_TILE - 1))
def test_sizes_are_monotonic(rows):
    assert padded_rows(rows) <= padded_rows(rows + 1)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 19), (1, 600), (5, 230)])
def test_bf16_linear_equals_a_plain_bf16_linear(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    layer = torch.nn.Linear(24, 40)
    with torch.no_grad():
        layer.weight.normal_(0, 0.3, generator=gen)
        layer.bias.normal_(0, 0.3, generator=gen)
    layer.weight.data = layer.weight.data.to(torch.bfloat16)
    layer.bias.data = layer.bias.data.to(torch.bfloat16)
    ref_w, ref_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.__class__ = Bf16Linear
    x = torch.randn(*shape, 24, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    calls = []
    linear = torch.nn.functional.linear

    def recording(inp, *args):
        calls.append(inp.shape[0])
        return linear(inp, *args)

    torch.nn.functional.linear = recording
    try:
        out = layer(x)
    finally:
        torch.nn.functional.linear = linear
    ref = linear(x_ref.to(torch.bfloat16), ref_w, ref_b).float()
    assert out.dtype == torch.float32 and out.shape == (*shape, 40)
    # the same bf16 products; only the order of a few sums may differ between row counts
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert all(c in SIZES for c in calls)
    assert len(calls) == len(row_tiles(shape[0] * shape[1]))
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-2, atol=1e-2)


# Runs in a fresh process, so the kernel caches start empty: malloc'd bytes still in use
# after bf16 linears over 200 different row counts, through Bf16Linear and then directly.
MEMORY_PROBE = textwrap.dedent(
    """
    import ctypes, json, torch
    from retrain.kernels.precision import Bf16Linear

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    torch.set_num_threads(1)
    layer = torch.nn.Linear(576, 576, bias=False)
    layer.weight.data = layer.weight.data.to(torch.bfloat16)
    plain = torch.nn.functional.linear
    layer.__class__ = Bf16Linear

    def growth(run):
        run(torch.randn(3, 576))
        before = libc.mallinfo2().uordblks
        for rows in range(17, 217):
            run(torch.randn(rows, 576))
        return (libc.mallinfo2().uordblks - before) / 2**20

    with torch.no_grad():
        tiled = growth(layer)
        direct = growth(lambda x: plain(x.to(torch.bfloat16), layer.weight))
    print(json.dumps({"tiled_mb": tiled, "direct_mb": direct}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_bf16_linear_keeps_the_kernel_caches_small():
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    mb = json.loads(proc.stdout.strip().splitlines()[-1])
    # 200 row counts fall into 14 tile sizes; run directly, each count is a new kernel
    # (~0.5 MB each in oneDNN's caches on an AVX512-BF16 CPU)
    assert mb["tiled_mb"] < 20, mb
