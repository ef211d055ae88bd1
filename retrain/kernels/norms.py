"""RMS norms as one kernel each on CUDA, for the sampler and the trainer.

transformers' Llama-family RMSNorm (Llama, Qwen2/3, Mistral, ...) runs about eight
operators: cast to float32, square, mean, add epsilon, reciprocal square root, multiply,
cast back, multiply by the weight. A decode step of one token per row is hundreds of such
small kernels (a Qwen3 block has four norms: before attention, before the MLP, and on
each head's queries and keys), and on a GPU their count, not their work, sets the step's
time: even replayed from a CUDA graph each kernel costs a few microseconds. torch's
`rms_norm` with the weight is one fused kernel on CUDA (torch >= 2.9; float32 inside,
the weight applied there, the result rounded once to the input's dtype) and one for its
backward, which keeps only the input and each vector's reciprocal RMS. `RmsNorm` is that
kernel. transformers rounds twice (the normalised vector to the input's dtype, then its
product with the weight): the two differ by at most one rounding step of the dtype, and
the sampler and the trainer both run `RmsNorm`, so they round alike. On a CPU torch's
`rms_norm` is the same eight operators, so nothing is replaced there (`fused_norms`).

Only norms whose output equals `RmsNorm`'s on a probe (to the rounding of their dtype)
are replaced: Gemma's (1 + weight), a norm with a bias or another formula keeps its own.
"""

from __future__ import annotations

import torch

from retrain.hardware import torch_at_least

# Device kinds where torch's rms_norm is one fused kernel, from torch 2.9 (`fused_norms`).
FUSED_NORM_DEVICES = frozenset({"cuda"})


def fused_norms(device_type: str) -> bool:
    """Whether torch's rms_norm is one kernel (and one for its backward) on `device_type`
    with the installed torch."""
    return device_type in FUSED_NORM_DEVICES and torch_at_least(2, 9)


class RmsNorm(torch.nn.Module):
    """rms_norm(x) * weight in float32, rounded once to x's dtype (module docstring)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normed(x, self.weight)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype != x.dtype:  # torch's kernel takes one dtype
            return rounded_twice(x, weight, self.eps)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)


def rounded_twice(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' formula: x normalised in float32, rounded to x's dtype, times the
    weight."""
    return weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


def probe(
    module: torch.nn.Module,
    ours: torch.nn.Module,
    width: int,
    like: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(module's output, ours') for one seeded random input of 4 rows of `width`
    features (times `scale`) in `like`'s dtype and device; None when `module` does not
    take one such tensor."""
    gen = torch.Generator(device=like.device).manual_seed(0)
    x = (torch.randn(4, width, generator=gen, device=like.device) * scale).to(like.dtype)
    with torch.no_grad():
        try:
            want = module(x)
        except Exception:  # not a module of one tensor
            return None
        return want, ours(x)


def rms_norm_candidate(module: torch.nn.Module, make: type[RmsNorm] = RmsNorm) -> RmsNorm | None:
    """A `make` (RmsNorm or a subclass) sharing `module`'s weight when `module` is not
    one already, looks like an RMS norm (one 1-D weight, an epsilon, no children) and
    computes the same on a probe; else None."""
    params = dict(module.named_parameters(recurse=False))
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = params.get("weight")
    if (
        type(module) is make
        or list(params) != ["weight"]
        or weight.dim() != 1
        or not isinstance(eps, float)
        or any(True for _ in module.children())
    ):
        return None
    ours = make(weight, eps)
    outputs = probe(module, ours, weight.shape[0], weight, scale=3.0)
    if outputs is None:
        return None
    want, got = outputs
    if want.shape != got.shape or want.dtype != got.dtype:
        return None
    # one rounding step of the dtype: the fused kernel sums in its own order
    tol = 2 * torch.finfo(weight.dtype).eps
    if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        return None
    return ours


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Replace every RMS norm of `model` that `RmsNorm` computes the same as (module
    docstring) by one sharing its weight, in place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            ours = rms_norm_candidate(child)
            if ours is not None:
                setattr(parent, name, ours)
                count += 1
    return count
