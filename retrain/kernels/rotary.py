"""Rotary position embedding in fewer operators, bit for bit transformers' own.

transformers' `apply_rotary_pos_emb` (one function copied into Llama, Qwen2/3, Mistral,
Gemma, Granite, SmolLM3, ...) turns the queries and the keys of every layer with
`x * cos + rotate_half(x) * sin`, where `rotate_half(x) = cat(-x2, x1)` of x's two
halves: five operators per tensor. Autograd's backward of it is about nine more: the two
products', the negation's, and for each half's slice a zero tensor of x's size with the
slice's gradient copied in (`slice_backward`), then their sum. A small model's training
step on a GPU is host-bound, each operator costing about the same whatever its size
(docs/performance.md), and a block has two such tensors.

Written with `swap(x) = cat(x2, x1)` and `signed = cat(-sin1, sin2)`, the same turn is
`x * cos + swap(x) * signed`: four operators per tensor, `signed` made once per forward
pass (every layer is handed the same `sin`). swap is its own transpose, so the backward
is `g * cos + swap(g * signed)`: four operators (`_Turn`). Every element is the product
of the same two numbers (a sign changes no rounding) and the same one sum, forward and
backward, so the results equal transformers' to the bit (tests/unit/test_rotary.py).

`turn_rotary` replaces the function in the modeling modules of a model's layers where it
computes the same on a probe; the replacement hands anything else (a rotary part of the
head only, a dtype to promote, sines or cosines that take gradients, torch.compile's
tracing, which fuses the original itself) to the original.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch

# The one signature replaced: transformers >= 5's (q, k, cos, sin, unsqueeze_dim=1).
PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]


def swap(x: torch.Tensor) -> torch.Tensor:
    """x's two halves of its last dimension, exchanged."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """cat(-sin1, sin2) of `sin`'s halves, made once for the layers of a forward pass:
    kept on `sin` itself (so it lives as long as `sin`, on the thread that made it), and
    made again where `sin` has changed in place since."""
    # an inference tensor counts no versions; none is changed in place here
    version = None if sin.is_inference() else sin._version
    kept = getattr(sin, "_retrain_signed", None)
    if kept is not None and kept[0] == version:
        return kept[1]
    out = _signed(sin)
    sin._retrain_signed = (version, out)
    return out


def _signed(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def turned(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """x turned: rotate_half(x) * sin written as swap(x) * signed (module docstring)."""
    return x * cos + swap(x) * signed


class _Turn(torch.autograd.Function):
    """`turned`, with its backward written out (module docstring)."""

    @staticmethod
    def forward(ctx, x, cos, signed):
        ctx.save_for_backward(cos, signed)
        return turned(x, cos, signed)

    @staticmethod
    def backward(ctx, grad):
        cos, signed = ctx.saved_tensors
        return grad * cos + swap(grad * signed), None, None


def turn(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """`turned`, through `_Turn` where a gradient is to flow back to x."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Turn.apply(x, cos, signed)
    return turned(x, cos, signed)


def _ours(q, k, cos, sin) -> bool:
    """Whether the call is one `_Turn` computes as the original does: the whole head
    turned, one dtype (no promotion, whose casts autograd places per term), sines and
    cosines that take no gradient, not being traced by torch.compile."""
    width = q.shape[-1]
    return (
        width % 2 == 0
        and k.shape[-1] == cos.shape[-1] == sin.shape[-1] == width
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and not (cos.requires_grad or sin.requires_grad)
        and not torch.compiler.is_compiling()
    )


def rotate(original: Callable) -> Callable:
    """`original` (transformers' apply_rotary_pos_emb) through `_Turn` where `_ours`."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _ours(q, k, cos, sin):
            return original(q, k, cos, sin, unsqueeze_dim)
        signed = signed_sin(sin).unsqueeze(unsqueeze_dim)
        cos = cos.unsqueeze(unsqueeze_dim)
        return turn(q, cos, signed), turn(k, cos, signed)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def same_on_probe(original: Callable, ours: Callable) -> bool:
    """Whether `ours` gives `original`'s queries, keys and their gradients, to the bit,
    on seeded random inputs in float32 and bf16, both layouts of the heads."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (1, 2):
            shape = (2, 3, 5, 8) if dim == 1 else (2, 5, 3, 8)
            q, k, grad_q, grad_k = (torch.randn(shape, generator=gen) for _ in range(4))
            cos, sin = (torch.randn(2, 5, 8, generator=gen).to(dtype) for _ in range(2))
            got = []
            for fn in (original, ours):
                qs, ks = (t.to(dtype).requires_grad_() for t in (q, k))
                try:
                    outs = fn(qs, ks, cos, sin, unsqueeze_dim=dim)
                    torch.autograd.backward(outs, (grad_q.to(dtype), grad_k.to(dtype)))
                except Exception:  # not a function of these
                    return False
                got.append([*outs, qs.grad, ks.grad])
            if not all(torch.equal(a, b) for a, b in zip(*got)):
                return False
    return True


def turn_rotary(model: torch.nn.Module) -> int:
    """`rotate` transformers' apply_rotary_pos_emb in the modeling module of each of
    `model`'s modules, where it has the one signature and `same_on_probe`, in place (for
    every model of that architecture in this process: the results are the same); returns
    how many modules now run it, this model's."""
    count = 0
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        original = getattr(module, "apply_rotary_pos_emb", None)
        if original is None or not callable(original):
            continue
        if hasattr(original, "original"):  # done already
            count += 1
            continue
        try:
            parameters = list(inspect.signature(original).parameters)
        except (TypeError, ValueError):
            continue
        ours = rotate(original)
        if parameters == PARAMETERS and same_on_probe(original, ours):
            module.apply_rotary_pos_emb = ours
            count += 1
    return count
