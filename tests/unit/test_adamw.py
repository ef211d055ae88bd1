"""The local backend's AdamW: fused on CUDA (`retrain/backends/local.py adamw_options`),
torch's default elsewhere, and the fused update is torch's AdamW update."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from retrain.backends.local import adamw_options  # noqa: E402


def test_cuda_takes_the_fused_adamw_and_a_cpu_the_default():
    assert adamw_options(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_options(torch.device("cpu")) == {}


def test_the_fused_update_is_adamws():
    """Torch's fused AdamW (its CPU kernel here; CUDA's is the same algorithm) and the
    default one, from the same weights and gradients over a few steps with weight decay:
    the same weights to float32 rounding, and both moved."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(16, 8, generator=gen), torch.randn(8, 32, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(4)]
    finals = []
    for options in ({}, {"fused": True}):
        params = [p.clone().requires_grad_() for p in start]
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **options)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        finals.append([p.detach() for p in params])
    for default, fused, first in zip(*finals, start):
        assert (default - first).abs().max() > 1e-3
        torch.testing.assert_close(fused, default, rtol=1e-6, atol=1e-6)
