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
