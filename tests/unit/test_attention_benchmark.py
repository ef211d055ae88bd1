"""benchmarks/attention.py's decode candidate computes what the decode step's attention
computes (`flex.grouped_decode`), so its timing against it compares equals."""

from __future__ import annotations

import pytest
from benchmark_module import load

torch = pytest.importorskip("torch")

from retrain.kernels import flex  # noqa: E402

attention = load("attention")


@pytest.mark.parametrize("span", [1, 7, 40])
def test_the_decode_candidate_is_grouped_decode(span):
    g = torch.Generator().manual_seed(span)
    rows, heads, kv_heads, dim = 5, 8, 2, 16
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, span, dim, generator=g) for _ in "kv")
    mask = torch.zeros(rows, 1, 1, span + 3)  # wider than the keys: only the first span read
    mask[:2, :, :, : span // 2] = float("-inf")
    for scaling in (None, 0.3):
        want = flex.grouped_decode(q, k, v, mask, scaling)
        for candidate in (attention.decode_matmul, attention.decode_efficient):
            got = candidate(q, k, v, mask, scaling)
            assert got.shape == want.shape == (rows, 1, heads, dim)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the bound reads every key: on rows with nothing masked it is the same attention
    unmasked = torch.zeros(rows, 1, 1, span)
    torch.testing.assert_close(
        attention.decode_unmasked(q, k, v, unmasked, None),
        flex.grouped_decode(q, k, v, unmasked, None),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("span", [1, 7, 40])
def test_the_flash_layout_reads_what_the_mask_lets_through(span):
    """`decode_flash_offsets`'s cache (`flash_layout`: token-major, each row from its first
    unmasked key) asked as the kernel is (`flash_reference`, SDPA row by row: the kernel is
    CUDA's) is the decode step's attention; the lease times the kernel once it agrees."""
    g = torch.Generator().manual_seed(span)
    rows, heads, kv_heads, dim = 5, 8, 2, 16
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, span, dim, generator=g) for _ in "kv")
    mask = torch.zeros(rows, 1, 1, span)
    mask[:2, :, :, : span // 2] = float("-inf")  # left-padded rows
    keys, values, starts, counts = attention.flash_layout(k, v, mask)
    assert keys.shape == (rows * span, kv_heads, dim) and keys.is_contiguous()
    pads = [span // 2] * 2 + [0] * (rows - 2)
    assert starts.tolist() == [i * span + pad for i, pad in enumerate(pads)] + [rows * span]
    assert counts.tolist() == [span - pad for pad in pads]
    for scaling in (None, 0.3):
        got = attention.flash_reference(q, keys, values, starts, counts, scaling)
        want = flex.grouped_decode(q, k, v, mask, scaling)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
