"""Masked attention on CUDA through SDPA's memory-efficient kernel, called by name
(retrain/kernels/masked_attention.py), run on this CPU: the branch is taken by patching
its device query, and the kernel and its backward (CUDA's only) are given CPU kernels
here that compute the plain formula in float32. So these tests check the plumbing (which
calls take the path, the keys repeated for grouped heads, the mask broadcast and aligned,
the layout out, the gradient wiring) against SDPA's own path; the `-m gpu` test checks
the real kernel, bit for bit against SDPA held to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_packing import _tiny_llama as tiny_llama

from retrain.kernels import flex, masked_attention
from retrain.kernels.masked_attention import ALIGNMENT, aligned, applies, attend
from retrain.kernels.packing import additive, completion_logprobs, pack

_LIBS: list = []
CALLS: list[tuple] = []  # (bias shape, bias strides, logsumexp asked) per kernel call


def _scores(q, k, bias, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return (q.float() @ k.float().transpose(-2, -1)) * scale + bias.float()


def _forward(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    CALLS.append((tuple(bias.shape), bias.stride(), compute_log_sumexp))
    s = _scores(q, k, bias, scale)
    out = (s.softmax(-1) @ v.float()).to(q.dtype)
    seed = torch.empty((), dtype=torch.int64)
    return out, torch.logsumexp(s, -1), seed, seed.clone()


def _backward(grad, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal=False, *, scale=None):  # fmt: skip
    # by hand: a kernel runs below autograd, which records nothing there
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = _scores(q, k, bias, scale).softmax(-1)
    g = grad.float()
    dp = g @ v.float().transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    gq, gk, gv = (
        ds @ k.float() * scale,
        ds.transpose(-2, -1) @ q.float() * scale,
        p.transpose(-2, -1) @ g,
    )
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), torch.zeros_like(bias)


@pytest.fixture
def cuda_branch(monkeypatch):
    return take_cuda_branch(monkeypatch)


def take_cuda_branch(monkeypatch) -> list[tuple]:
    """This CPU takes the CUDA branch, the kernel given the CPU kernels above; the
    kernel's calls are recorded in the list returned."""
    if not _LIBS:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_scaled_dot_product_efficient_attention", _forward, "CPU")
        lib.impl("_scaled_dot_product_efficient_attention_backward", _backward, "CPU")
        _LIBS.append(lib)
    monkeypatch.setattr(masked_attention, "on_cuda", lambda device_type: True)
    monkeypatch.setattr(masked_attention, "kernel_takes", lambda *tensors: True)
    CALLS.clear()
    return CALLS


def _layout(seed: int):
    """Two packed rows (prompt + completions) and their additive mask."""
    rng = np.random.default_rng(seed)
    groups = [
        (rng.integers(0, 40, 4).tolist(), [rng.integers(0, 40, k) for k in (3, 5)]),
        (rng.integers(0, 40, 2).tolist(), [rng.integers(0, 40, 4)]),
    ]
    return groups, pack(groups, "bool")


def _qkv(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, length, 8, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, length, 8, generator=g).requires_grad_() for _ in "kv")
    return q, k, v


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernel_path_gives_sdpas_attention_and_gradients(cuda_branch, seed):
    """Grouped heads (4 query heads over 2), a block-diagonal packed mask and a scale:
    the output (batch, L, heads, dim) and the gradients of q, k and v are SDPA's."""
    _, packed = _layout(seed)
    mask = additive(packed.mask, torch.float32)
    length = mask.shape[-1]
    q, k, v = _qkv(length, seed)
    probe = torch.randn(2, length, 4, 8, generator=torch.Generator().manual_seed(9))
    out = attend(q, k, v, mask, 0.3)
    (out * probe).sum().backward()
    mine = [out.detach(), *(t.grad.clone() for t in (q, k, v))]
    for t in (q, k, v):
        t.grad = None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, packed.mask, scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    (ref * probe).sum().backward()
    for a, b in zip(mine, [ref.detach(), *(t.grad for t in (q, k, v))], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the mask reached the kernel broadcast over the heads, rows ALIGNMENT apart, and the
    # logsumexp was asked for since a backward may follow
    (shape, strides, lse), *_ = cuda_branch
    assert shape == (2, 4, length, length) and strides[1] == 0 and lse
    assert all(s % ALIGNMENT == 0 for s in strides[:-1]) and strides[-1] == 1


def test_without_gradients_no_logsumexp_is_asked_for(cuda_branch):
    _, packed = _layout(3)
    q, k, v = (t.detach() for t in _qkv(packed.ids.shape[1], 3))
    with torch.no_grad():
        attend(q, k, v, additive(packed.mask, torch.float32), None)
    assert [lse for *_, lse in cuda_branch] == [False]


def test_where_the_kernel_declines_sdpa_decides_as_before(monkeypatch):
    """Off the kernel (here: its own check on a CPU tensor) the same call goes to SDPA
    with the keys repeated, the transformers path's result to the bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(masked_attention, "on_cuda", lambda device_type: True)
    _, packed = _layout(4)
    mask = additive(packed.mask, torch.float32)
    q, k, v = _qkv(mask.shape[-1], 4)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.5)
    assert not masked_attention.kernel_takes(q, k, v, mask)
    assert torch.equal(attend(q, k, v, mask, 0.5), theirs)


def test_what_takes_the_path():
    q = torch.zeros(1, 4, 5, 8)
    mask = torch.zeros(1, 1, 5, 5)
    assert not applies(q, mask, 0.0, {})  # a CPU tensor: SDPA's path, unchanged here
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(masked_attention, "on_cuda", lambda device_type: True)
        assert applies(q, mask, 0.0, {"sliding_window": None})
        assert not applies(q[:, :, :1], mask[:, :, :1], 0.0, {})  # a decode step
        assert not applies(q, mask.bool(), 0.0, {})  # bool: SDPA converts it
        assert not applies(q, mask.bfloat16(), 0.0, {})  # another dtype than the query's
        assert not applies(q, None, 0.0, {})
        assert not applies(q, mask, 0.1, {})  # dropout
        assert not applies(q, mask, 0.0, {"softcap": 30.0})
        assert not applies(q, mask, 0.0, {"s_aux": torch.zeros(4)})


@pytest.mark.parametrize("width", [5, 8, 13])
def test_masks_are_laid_out_aligned_and_an_unaligned_one_is_padded(width):
    allowed = torch.rand(2, 1, 3, width, generator=torch.Generator().manual_seed(width)) > 0.5
    made = additive(allowed, torch.bfloat16)
    assert made.stride()[-1] == 1 and all(s % ALIGNMENT == 0 for s in made.stride()[:-1])
    assert aligned(made) is made
    assert torch.equal(made, torch.where(allowed, 0.0, float("-inf")).bfloat16())
    plain = made.contiguous()
    fixed = aligned(plain)
    assert torch.equal(fixed, plain)
    assert (fixed is plain) == (width % ALIGNMENT == 0)
    assert all(s % ALIGNMENT == 0 for s in fixed.stride()[:-1])


def _tiny_llama():
    model = tiny_llama("sdpa")
    flex.use_flex(model)  # retrain's attention, as the local backend sets on CUDA
    return model


def _logprobs_and_grads(model, groups):
    model.zero_grad()
    logp = completion_logprobs(model, groups, 1.0, "bool", torch.device("cpu"))
    probe = torch.linspace(-1, 1, logp.numel()).view_as(logp)
    (logp * probe).sum().backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_packed_pass_through_the_kernel_gives_sdpas_logprobs_and_gradients(monkeypatch):
    """The tiny Llama on retrain's attention, a packed micro-batch forward and backward:
    through the kernel path (each layer's call taken by it) the same logprobs and
    gradients as through SDPA."""
    model = _tiny_llama()
    groups, _ = _layout(5)
    theirs = _logprobs_and_grads(model, groups)
    with pytest.MonkeyPatch.context() as mp:
        calls = take_cuda_branch(mp)
        mine = _logprobs_and_grads(model, groups)
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(mine[0], theirs[0], atol=1e-5, rtol=1e-5)
    assert len(mine[1]) == len(theirs[1]) > 0
    for a, b in zip(mine[1], theirs[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
