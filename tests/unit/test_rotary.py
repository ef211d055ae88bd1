"""retrain/kernels/rotary.py: the rotary turn in fewer operators equals transformers' own
to the bit, forward and backward, on random inputs and in whole models (the GPU's wholly
bf16 layout and the CPU's float32 one); it is made once per pass, hands every other call
to the original, replaces only a function that agrees on the probe, and removes the
operators it says it does."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import transformers.models.llama.modeling_llama as llama
import transformers.models.qwen3.modeling_qwen3 as qwen3
from hypothesis import given
from hypothesis import strategies as st
from op_count import OpCount
from tiny_qwen3 import LAYERS, VOCAB, qwen3_lora

from retrain.kernels import rotary

# transformers' function, whether or not a model built earlier in this process turned it
ORIGINAL = getattr(llama.apply_rotary_pos_emb, "original", llama.apply_rotary_pos_emb)
OURS = rotary.rotate(ORIGINAL)


def _inputs(shape, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    b, h, s, d = shape
    layout = (b, h, s, d) if dim == 1 else (b, s, h, d)
    q, k, gq, gk = (torch.randn(layout, generator=gen).to(dtype) for _ in range(4))
    cos, sin = (torch.randn(b, s, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, gq, gk, cos, sin


def _turned(fn, q, k, gq, gk, cos, sin, dim):
    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
    outs = fn(qs, ks, cos, sin, dim)
    torch.autograd.backward(outs, (gq, gk))
    return [*outs, qs.grad, ks.grad]


@given(
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    s=st.integers(1, 7),
    half=st.integers(1, 16),
    dim=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_the_turn_and_its_gradients_are_transformers_to_the_bit(b, h, s, half, dim, dtype, seed):
    q, k, gq, gk, cos, sin = _inputs((b, h, s, 2 * half), dim, dtype, seed)
    want = _turned(ORIGINAL, q, k, gq, gk, cos, sin, dim)
    got = _turned(OURS, q, k, gq, gk, cos, sin, dim)
    for a, w in zip(got, want, strict=True):
        assert a.dtype == w.dtype and torch.equal(a, w)


def test_a_wrong_sign_or_swap_is_caught():
    """The comparison above sees a turn the wrong way round, or halves not exchanged."""
    q, k, gq, gk, cos, sin = _inputs((2, 3, 5, 8), 1, torch.float32, 0)
    want = _turned(ORIGINAL, q, k, gq, gk, cos, sin, 1)
    wrong = rotary.rotate(lambda *a: None)
    real = rotary.swap
    for broken in (lambda x: x, lambda x: -real(x)):
        rotary.swap = broken
        try:
            got = _turned(wrong, q, k, gq, gk, cos, sin, 1)
        finally:
            rotary.swap = real
        assert not torch.equal(got[0], want[0])


def test_without_gradients_the_turn_is_the_same():
    q, k, _, _, cos, sin = _inputs((2, 3, 5, 8), 1, torch.bfloat16, 1)
    with torch.inference_mode():
        for a, w in zip(OURS(q, k, cos, sin), ORIGINAL(q, k, cos, sin), strict=True):
            assert torch.equal(a, w)


@pytest.mark.parametrize("case", ["part of the head", "promoted dtype", "sin takes gradients"])
def test_every_other_call_goes_to_the_original(case):
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        if cos.shape[-1] != q.shape[-1]:  # a partial rotary's own function's business
            return q, k
        return ORIGINAL(q, k, cos, sin, unsqueeze_dim)

    q, k, _, _, cos, sin = _inputs((2, 3, 5, 8), 1, torch.float32, 2)
    if case == "part of the head":  # a partial rotary's cos covers part of each head
        cos, sin = cos[..., :4], sin[..., :4]
    elif case == "promoted dtype":
        q, k = q.bfloat16(), k.bfloat16()
    else:
        sin.requires_grad_()
    out = rotary.rotate(original)(q, k, cos, sin, 1)
    assert calls == [1] and len(out) == 2
    if case == "sin takes gradients":  # its gradient flows, as the original's does
        out[0].sum().backward()
        assert sin.grad is not None


def test_the_signed_sines_are_made_once_per_pass_and_again_when_changed(monkeypatch):
    made = []
    real = rotary._signed
    monkeypatch.setattr(rotary, "_signed", lambda sin: made.append(1) or real(sin))
    q, k, _, _, cos, sin = _inputs((2, 3, 5, 8), 1, torch.float32, 3)
    for _ in range(3):  # three layers of one pass
        OURS(q, k, cos, sin)
    assert len(made) == 1
    want = ORIGINAL(q, k, cos, sin)
    sin.mul_(0.5)  # the same tensor, changed in place
    got = OURS(q, k, cos, sin)
    assert len(made) == 2 and torch.equal(got[0], ORIGINAL(q, k, cos, sin)[0])
    assert not torch.equal(got[0], want[0])
    OURS(q, k, cos, sin.clone())  # another tensor
    assert len(made) == 3


def _logits_and_grads(model):
    ids = torch.arange(3, 3 + 2 * 11).reshape(2, 11) % VOCAB
    logits = model(input_ids=ids).logits.float()
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


@pytest.mark.parametrize("bf16", [True, False], ids=["gpu layout", "float32"])
def test_a_turned_model_gives_the_same_logits_and_gradients(monkeypatch, bf16):
    kw = {"switch": True, "recompute": True, "lean": True} if bf16 else {}
    monkeypatch.setattr(qwen3, "apply_rotary_pos_emb", ORIGINAL)  # restored after
    model = qwen3_lora(bf16=bf16, **kw)
    want_logits, want = _logits_and_grads(model)
    assert rotary.turn_rotary(model) == 1
    assert qwen3.apply_rotary_pos_emb.original is ORIGINAL
    assert rotary.turn_rotary(model) == 1  # again: nothing more to do
    got_logits, got = _logits_and_grads(model)
    assert torch.equal(got_logits, want_logits)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_training_pass_dispatches_fewer_operators(monkeypatch):
    """Per layer: no slice_backward (each a zero tensor and a copy), no negation, and at
    least seven operators fewer a block (two of them in the forward)."""
    monkeypatch.setattr(qwen3, "apply_rotary_pos_emb", ORIGINAL)
    model = qwen3_lora(bf16=True, switch=True, recompute=True, lean=True)
    counts = []
    for _ in range(2):
        with OpCount() as ops:
            _logits_and_grads(model)
        counts.append(ops.seen)
        rotary.turn_rotary(model)
    before, after = counts
    assert before["slice_backward"] >= 2 * 2 * LAYERS and "slice_backward" not in after
    assert before["neg"] >= 2 * LAYERS and after["neg"] == 1  # the signed sines', once
    assert sum(before.values()) - sum(after.values()) >= 7 * LAYERS


def test_a_function_that_computes_otherwise_is_left_alone(monkeypatch):
    """A modeling module whose apply_rotary_pos_emb turns the other way (or has another
    signature) keeps it."""
    for name, fn in {
        "other_way": lambda q, k, cos, sin, unsqueeze_dim=1: ORIGINAL(
            q, k, cos, -sin, unsqueeze_dim
        ),
        "other_signature": lambda q, k, cos, sin, position_ids=None, unsqueeze_dim=1: (q, k),
    }.items():
        module = types.ModuleType(f"fake_modeling_{name}")
        module.apply_rotary_pos_emb = fn
        layer = type("Attention", (torch.nn.Module,), {"__module__": module.__name__})
        monkeypatch.setitem(sys.modules, module.__name__, module)
        assert rotary.turn_rotary(layer()) == 0 and module.apply_rotary_pos_emb is fn
