"""The trained model's cheap element-wise parts keeping only their inputs for the
backward, on a wholly bf16 model (a GPU's bf16 mode).

Autograd keeps what each operator's backward needs, and two cheap parts of a
Llama-family block keep more than their inputs:

- an RMS norm (transformers' formula: cast to float32, normalise, cast back, times the
  weight) keeps the float32 copy of its bf16 input: twice the input's bytes. A Qwen3
  block has four norms, two over the hidden state and one each over the queries and
  keys of every head;
- a gated MLP's `act(gate) * up` keeps `gate` (for the activation's backward) and also
  `act(gate)` and `up` (for the product's): three intermediate-width tensors where
  `gate` and `up` are enough.

At Qwen3-4B's block shapes these are ~16 of the 64 bytes a trained position keeps per
hidden unit and layer (counted on a CPU; tests/unit/test_recompute.py counts them on a
small model). `recompute_elementwise` has each such part keep its inputs only:

- a norm becomes torch's `rms_norm` with the weight (retrain/kernels/norms.py
  `RmsNorm`) where that is one kernel with one for its backward (`fused_norms`: CUDA):
  it keeps the input and each vector's reciprocal RMS, so nothing is recomputed and
  the backward runs one kernel per norm. Elsewhere (a CPU, torch < 2.9) the norm runs
  its forward again in the backward (`RecomputedRmsNorm`): torch's rms_norm is
  transformers' operators there, and the gradients are the model's own to the bit;
- a gated MLP keeps gate and up and runs act(gate) * up again in the backward (the
  matmuls are not recomputed), only where a probe finds `down(act(gate(x)) * up(x))`
  its output to the bit.

Norms are replaced only where a probe finds `RmsNorm` computing the same (to one
rounding step of the dtype). The price of a recomputed part is CPU-side: an autograd
call in the backward (~0.15 ms a part on this project's CPU), which a GPU busy with
large micro-batches hides and a small model's step, bound by the host, does not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from retrain.kernels.norms import RmsNorm, fused_norms, probe, rms_norm_candidate, rounded_twice


class _Recompute(torch.autograd.Function):
    """fn(*inputs), keeping only the inputs; the backward runs fn again with grad on."""

    @staticmethod
    def forward(ctx, fn: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        needs = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs)]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, *(next(grads) if t.requires_grad else None for t in inputs))


def recomputed(fn: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), recomputed in the backward when a gradient will be asked of it; a
    plain call otherwise (sampling, evaluation: nothing is kept either way)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _Recompute.apply(fn, *inputs)
    return fn(*inputs)


class RecomputedRmsNorm(RmsNorm):
    """transformers' norm (`norms.rounded_twice`: the same operators on a CPU) keeping
    only its input (and the weight it shares) for the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._normed, x, self.weight)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rounded_twice(x, weight, self.eps)


class GatedMlp(torch.nn.Module):
    """down(act(gate(x)) * up(x)) with the gated product recomputed in the backward:
    the same projection modules (so the same parameter names), keeping `gate` and `up`
    rather than `gate`, `act(gate)` and `up`."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(recomputed(self._gated, self.gate_proj(x), self.up_proj(x)))

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up


MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _mlp_candidate(module: torch.nn.Module) -> GatedMlp | None:
    """A `GatedMlp` of `module`'s projections when `module` is a gated MLP of exactly
    those parts whose output a `GatedMlp` equals to the bit on a probe; else None."""
    if type(module) is GatedMlp or {n for n, _ in module.named_children()} != MLP_PARTS:
        return None
    width = getattr(module.gate_proj, "in_features", None)  # a Linear, or PEFT's over one
    if not isinstance(module.act_fn, torch.nn.Module) or not isinstance(width, int):
        return None
    ours = GatedMlp(module)
    outputs = probe(module, ours, width, next(module.gate_proj.parameters()))
    return ours if outputs is not None and torch.equal(*outputs) else None


def recompute_elementwise(model: torch.nn.Module, mlps: bool = True) -> tuple[int, int]:
    """Every RMS norm and (with `mlps`) gated MLP of `model` that qualifies (module
    docstring) replaced, in place, by one keeping its inputs only; returns (norms, MLPs)
    replaced. The replacements hold the same parameters under the same names. Compiled
    blocks (retrain/kernels/compiled_blocks.py) take no MLP's: its backward calls
    autograd, which a compiled graph cannot hold, and the compiler recomputes itself."""
    norms = replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            ours = _mlp_candidate(child) if mlps else None
            if ours is None:
                ours = rms_norm_candidate(child, _norm_kind(child))
            if ours is not None:
                setattr(parent, name, ours)
                replaced += isinstance(ours, GatedMlp)
                norms += isinstance(ours, RmsNorm)
    return norms, replaced


def _norm_kind(module: torch.nn.Module) -> type[RmsNorm]:
    """The norm that keeps only its input for `module`'s device (module docstring)."""
    weight = getattr(module, "weight", None)
    device = weight.device.type if isinstance(weight, torch.Tensor) else "cpu"
    return RmsNorm if fused_norms(device) else RecomputedRmsNorm
