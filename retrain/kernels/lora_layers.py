"""PEFT's plain LoRA linears, and the adapter computed in the model's dtype on a wholly
bf16 model.

PEFT computes each LoRA linear's adapter in the adapter's dtype (float32): it casts the
layer's input to float32 first, and that float32 copy is what the backward keeps for the
gradient of A. On a wholly bf16 model (a GPU's bf16 mode) that is one float32 copy per
adapted layer, so three of the same hidden state for q/k/v and two for gate/up: at
Qwen3-4B's block shapes ~42 of the 89 bytes a trained position kept for the backward per
hidden unit and layer (counted on a CPU; tests/unit/test_lora_layers.py counts them on a
small model). `adapter_in_input_dtype` has every plain LoRA linear compute its adapter in
its input's dtype instead (bf16 matmuls reading float32 A and B cast per call, as
autocast does for a bf16 trainer): the backward keeps the bf16 input the layer was given,
one tensor for all the siblings that read it (89 -> 64 bytes at Qwen3-4B's shapes). A
and B, their gradients and the optimizer's state stay float32; only the product is
rounded to bf16, as the base layer's output is. A float32 model is unchanged (its input
is float32).

`lean_lora_forward` gives every plain LoRA linear a shorter forward for training:
PEFT's runs base(x), then (x A^T) B^T, times the scaling, plus the base output, so two
element-wise passes over each layer's whole output (the multiply and the add, and the
multiply again in the backward) beside Python bookkeeping per call. The lean one puts
the scaling and the sum in the matmul's epilogue, addmm(base(x), x A^T, B^T, alpha =
scaling): the same value up to the order of float sums, with one rounding where PEFT
has three in bf16, and the very operation the sampling copy runs for the same layer
(retrain/engines/sampling_copy.py `add_beside`), so sampler and trainer round alike.

On a wholly bf16 model the lean forward adds the adapter to the base output in float32
and rounds the sum to bf16 once (`lora_sum_f32`, `_RoundOnce`). Added to the base output
already rounded to bf16, as PEFT and a bf16 addmm do, an adapter output under half a bf16
step of it (0.2-0.4% of the value) rounds back to it: exactly what a young adapter's
update is, so most of it was dropped from the forward while its gradient still flowed,
until B grew past that threshold. Rounded once, the base output's own rounding error
dithers the threshold and the update comes through on average. On this CPU with the
GPU's layout (benchmarks/gpu_layout_learning.py, docs/performance.md "Learning in the
GPU's layout"), the quickstart's held-out rate after 5 steps was 55.7% (seeds 0-2) with
the rounding twice and 75.5% once (the CPU's layout: 72.9%). The backward is the plain
LoRA backward, its matmuls on bf16 operands, as before.

`fuse_sibling_loras` then has each set of sibling LoRA linears reading one input (q/k/v,
gate/up) compute as one, with the matmuls the sampling copy runs for them: fewer
operators, which is what a small model's training step on a GPU costs (its host
launching them).
"""

from __future__ import annotations

import copy
import math

import torch

from retrain.hardware import sums_in_f32
from retrain.kernels.precision import (
    addmm_f32_,
    mm_f32,
    share_sibling_storage,
    sibling_sets,
    stacked,
)


def plain_lora_layers(model) -> list:
    """(name, layer) of every LoRA layer when all are plain, unmerged, single-adapter LoRA
    linears (weights stored out x in); else []."""
    try:
        from peft import PeftModel
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    if not isinstance(model, PeftModel):
        return []
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        kind = type(module)
        plain = kind in (LoraLinear, _lean_class()) and len(module.active_adapters) == 1
        adapter = module.active_adapters[0] if plain else None
        if (
            not plain
            or module.merged
            or module.fan_in_fan_out
            or module.use_dora.get(adapter, False)
            or getattr(module, "lora_bias", {}).get(adapter, False)
            or adapter not in module.lora_A
            or not isinstance(module.base_layer, torch.nn.Linear)
        ):
            return []
        layers.append((name, module))
    return layers


def lora_a(layer) -> torch.nn.Linear:
    return layer.lora_A[layer.active_adapters[0]]


def lora_b(layer) -> torch.nn.Linear:
    return layer.lora_B[layer.active_adapters[0]]


def factor_versions(layers) -> tuple:
    """(identity, version) of every A and B of `layers` (plain LoRA linears): what changes
    when a factor is replaced or updated in place (an optimizer step, a resume), which the
    sampling copy and the trainer's staged operands compare to know they are stale."""
    return tuple(
        (id(t), t._version)
        for layer in layers
        for t in (lora_a(layer).weight, lora_b(layer).weight)
    )


def lora_scaling(layer) -> float:
    return layer.scaling[layer.active_adapters[0]]


class InputDtypeLinear(torch.nn.Linear):
    """A LoRA factor (PEFT's lora_A or lora_B) whose weight is read in its input's dtype:
    the cast is part of the graph, so the gradient reaches the float32 weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def adapter_in_input_dtype(model) -> int:
    """Every plain LoRA linear of `model` computes its adapter in its input's dtype
    (module docstring), in place; returns how many. 0, and PEFT's float32 adapter left
    as it is, when the LoRA layers are not all plain (DoRA, biases, several adapters)."""
    layers = plain_lora_layers(model)
    for _, layer in layers:
        layer.cast_input_dtype_enabled = False  # PEFT's switch (peft >= 0.15)
        for factor in (lora_a(layer), lora_b(layer)):
            factor.__class__ = InputDtypeLinear
    return len(layers)


def adapter_dtype(layer, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype `layer` (a plain LoRA linear) computes its adapter in for an input of
    `input_dtype`: that dtype after `adapter_in_input_dtype`, else PEFT's, the adapter's."""
    if isinstance(lora_a(layer), InputDtypeLinear):
        return input_dtype
    return lora_a(layer).weight.dtype


def rounds_once(layer, input_dtype: torch.dtype, device_type: str) -> bool:
    """Whether the plain LoRA linear `layer`, given `input_dtype` rows on `device_type`,
    is one that adds its adapter to the base output in float32 and rounds once: a
    wholly bf16 layer (bf16 input, base weight and adapter computation) with a plain
    linear base, where `sums_in_f32`. Its lean forward then does (unless its LoRA
    dropout is active), and so does the sampling copy of it (`lora_sum_f32`)."""
    base = layer.base_layer
    return (
        input_dtype == base.weight.dtype == adapter_dtype(layer, input_dtype) == torch.bfloat16
        and type(base) is torch.nn.Linear
        and sums_in_f32(device_type)
    )


def lora_sum_f32(x, weight, bias, a, b, scaling: float) -> torch.Tensor:
    """x W^T + bias + scaling (x A^T) B^T in float32, as (rows, out), from the bf16 rows
    `x` (rows, in), the bf16 weight and A, and B (float32, the trainer's, or bf16, the
    sampling copy's): three products of bf16 operands with float32 results
    (`precision.mm_f32`, `addmm_f32_`), x A^T and B read in bf16 for the last, which adds
    into the base output in its epilogue. The caller rounds it to bf16 once; the trainer
    (`_RoundOnce`) and the sampling copy run it alike. (B's product took float32
    operands before, and with them the CUDA cores' float32 GEMM, at ~20% of an H100's
    decode step; in bf16 it moves the adapter's term by ~2^-8 of itself, a fraction of a
    bf16 step of the sum where the term is a few per cent of the base output.)"""
    return _sum_and_mid(x, weight, bias, a, b, scaling)[0]


def _sum_and_mid(x, weight, bias, a, b, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_sum_f32`'s sum, and x A^T in bf16 on the way (what B's product reads, and
    what B's gradient multiplies)."""
    mid = mm_f32(x, a.t()).to(x.dtype)
    out = mm_f32(x, weight.t())
    if bias is not None:
        out += bias.float()
    return addmm_f32_(out, mid, b.to(x.dtype).t(), scaling), mid


class _RoundOnce(torch.autograd.Function):
    """bf16(lora_sum_f32(...)) with the plain LoRA backward: the rounding counts as the
    identity, as it does for any bf16 layer, and every matmul of the backward takes bf16
    operands (A's and B's gradients come out float32, their weights' dtype).

    `factors` are the A's, then the B's (float32 parameters) of one LoRA linear, or of
    sibling ones reading the same input (`fuse_sibling_loras`), whose base weights
    `weight` stacks: their A's are stacked and their B's set block-diagonally, the
    operands the sampling copy holds for the same siblings (retrain/engines/
    sampling_copy.py `Siblings`), so the two compute the same sum by the same matmuls.
    The output is then one tensor per member."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling, operands, *factors):
        outs, kept = _rounded_sums(x, weight, bias, scaling, factors, operands)
        # x A^T kept in bf16, what B's gradient multiplies; A and B as the products read
        # them (bf16, a few MB a block at Qwen3-4B's shapes, whatever the rows)
        ctx.save_for_backward(x, weight, *kept)
        ctx.scaling, ctx.ranks = scaling, [f.shape[0] for f in factors[: len(factors) // 2]]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, weight, a, b, h = ctx.saved_tensors
        need_x, _, _, _, _, *need = ctx.needs_input_grad
        parts = len(ctx.ranks)
        grads = [g.contiguous() for g in grads]
        grad = grads[0] if parts == 1 else torch.cat(grads, dim=1)
        scaling = ctx.scaling
        # the bf16 gradient times a power of two >= 1 (LoRA's default alpha = 2 x rank
        # gives 2) is exact, so scaled once before the products it gives the products
        # scaled after, to the bit, in one operator where each product took one
        scaled = grad if scaling == 1 else grad * scaling if exact_scale(scaling) else None
        gx, gas, gbs = None, [None] * parts, [None] * parts
        if any(need[parts:]):  # each member's block of grad^T h
            mids = h.split(ctx.ranks, dim=1)
            if scaled is not None:
                cols = scaled.split([g.shape[1] for g in grads], dim=1)
                gbs = [mm_f32(g.t(), mid) for g, mid in zip(cols, mids)]
            else:
                gbs = [mm_f32(g.t(), mid).mul_(scaling) for g, mid in zip(grads, mids)]
        if any(need[:parts]) or need_x:
            gh = mm_f32(grad, b).mul_(scaling) if scaled is None else mm_f32(scaled, b)
            gh = gh.to(grad.dtype)
            if any(need[:parts]):
                gas = list(mm_f32(gh.t(), x).split(ctx.ranks))
            if need_x:  # into the product's own tensor: an addmm into a new one
                # copies its input there first (`precision.addmm_f32_`)
                gx = torch.mm(grad, weight).addmm_(gh, a)
        return gx, None, None, None, None, *gas, *gbs


def exact_scale(scaling: float) -> bool:
    """Whether multiplying a float by `scaling` is exact (a power of two, at least 1:
    no bits lost below, none above short of overflow)."""
    return scaling >= 1 and math.frexp(scaling)[0] == 0.5


def _rounded_sums(x, weight, bias, scaling: float, factors, operands=None):
    """`_RoundOnce`'s outputs, and (A, B, x A^T) for its backward (module docstring).
    `operands`: A stacked and B block-diagonal in x's dtype, as built here, already
    (retrain/kernels/staged_factors.py); None: built here."""
    parts = len(factors) // 2
    if operands is None:
        operands = _stacked(factors[:parts], x.dtype), _block_diagonal(factors[parts:], x.dtype)
    a, b = operands
    out, mid = _sum_and_mid(x, weight, bias, a, b, scaling)
    if parts == 1:
        return out.to(x.dtype), (a, b, mid)
    # each member's output rounded into a tensor of its own, not a view of one: a view
    # kept by the next layer (Qwen3's q and k norms keep their inputs) would keep its
    # siblings' columns too
    widths = [f.shape[0] for f in factors[parts:]]
    return tuple(o.to(x.dtype) for o in out.split(widths, dim=1)), (a, b, mid)


def round_once(x, weight, bias, scaling: float, *factors, staged=None):
    """`_RoundOnce` where a gradient will be asked of it; its outputs alone otherwise
    (sampling, a step's logprobs without gradients, the reference model's): no autograd
    call, which dynamo failed to trace in a compiled block without gradients (the call's
    trailing factors arrived empty; torch 2.11 and 2.13). `staged`: the factors' staged
    operands (retrain/kernels/staged_factors.py `Staged`), or None."""
    operands = None if staged is None else staged.operands(x.dtype)
    if torch.is_grad_enabled():
        return _RoundOnce.apply(x, weight, bias, scaling, operands, *factors)
    return _rounded_sums(x, weight, bias, scaling, factors, operands)[0]


def _stacked(factors, dtype: torch.dtype) -> torch.Tensor:
    """The A's in `dtype`, one on top of the other (one A: itself, cast)."""
    if len(factors) == 1:
        return factors[0].to(dtype)
    return torch.cat(factors).to(dtype)


def _block_diagonal(factors, dtype: torch.dtype) -> torch.Tensor:
    """The B's in `dtype` on the diagonal of one matrix, zeros elsewhere (one B: itself,
    cast): each member's output reads its own x A^T only."""
    if len(factors) == 1:
        return factors[0].to(dtype)
    rows, cols = sum(b.shape[0] for b in factors), sum(b.shape[1] for b in factors)
    out = factors[0].new_zeros(rows, cols, dtype=dtype)
    r = c = 0
    for b in factors:
        out[r : r + b.shape[0], c : c + b.shape[1]].copy_(b)
        r, c = r + b.shape[0], c + b.shape[1]
    return out


class OneInput:
    """Outputs of layers that read one input (sibling projections), computed together by
    the first layer to ask with a new input and handed out one by one. Identity, not
    value, says whether it is the same input: a model calls such layers with one tensor,
    unchanged in between; a layer called with another input gets them recomputed. The
    trainer's `SiblingLoras` and the sampling copy's `Siblings` keep their outputs so."""

    def __init__(self):
        self._input = None  # the input whose outputs wait in _pending
        self._pending: dict[int, torch.Tensor] = {}

    def take(self, x: torch.Tensor, i: int, compute) -> torch.Tensor | None:
        """Member i's output for `x`; `compute(x)` gives every member's in order (None: it
        cannot, and nothing is kept)."""
        if self._input is not x or i not in self._pending:
            outs = compute(x)
            if outs is None:
                return None
            self._input, self._pending = x, dict(enumerate(outs))
        out = self._pending.pop(i)
        if not self._pending:
            self._input = None  # hold nothing between forward passes
        return out

    def forget(self) -> None:
        """Drop outputs computed and not yet asked for (a forward pass that failed between
        two members: they hold its activations)."""
        self._input, self._pending = None, {}


class SiblingLoras(OneInput):
    """Sibling LoRA linears reading one input (q/k/v, gate/up: `precision.SIBLINGS`) on a
    wholly bf16 model, trained as one: one `_RoundOnce` over their stacked base weights
    (laid out so in place by `precision.share_sibling_storage`), their A's stacked and
    their B's block-diagonal. Three matmuls forward where q/k/v took nine, and about half
    the operators either way; a small model's step on a GPU is the host's launching them
    (docs/performance.md). Each member asks for its output (`OneInput`)."""

    def __init__(self, layers: list):
        super().__init__()
        self.layers = layers
        self._base: tuple = ((), None, None)  # (what it was made of, weight, bias)

    def output(self, x: torch.Tensor, i: int) -> torch.Tensor | None:
        """Member i's output for `x`; None when the base weights are not stacked (then
        the member computes its own)."""
        return self.take(x, i, self._outputs)

    def __deepcopy__(self, memo) -> SiblingLoras:
        """The set for a copy of the model: its members' copies, nothing kept. (A copied
        stacked view would copy the storage under it: every member's whole weight.)"""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin  # the members point back at their set
        OneInput.__init__(twin)
        twin.layers = copy.deepcopy(self.layers, memo)
        twin._base = ((), None, None)
        return twin

    def base(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The members' base weights stacked (a view of their storage: None when they
        are not laid out so) and biases concatenated, made again only when one of them
        changed (another tensor, storage or version): frozen, they are made once, not
        per forward pass (two operators a set, or three with biases)."""
        parts = [t for m in self.layers for t in (m.base_layer.weight, m.base_layer.bias)]
        key = tuple(None if t is None else (id(t), t.data_ptr(), t._version) for t in parts)
        if key != self._base[0]:
            weights, biases = parts[::2], parts[1::2]
            bias = None if biases[0] is None else torch.cat(biases)
            # not kept: a graph's output, or an inference tensor (made while the
            # trainer's model samples), which no backward may save
            if torch.is_inference_mode_enabled() or (bias is not None and bias.requires_grad):
                return stacked(weights), bias
            self._base = (key, stacked(weights), bias)
        return self._base[1], self._base[2]

    def _outputs(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        weight, bias = self.base()
        if weight is None:
            return None
        factors = [lora_a(m).weight for m in self.layers]
        factors += [lora_b(m).weight for m in self.layers]
        flat = x.reshape(-1, x.shape[-1])
        scaling, staged = lora_scaling(self.layers[0]), self.__dict__.get("staged")
        outs = round_once(flat, weight, bias, scaling, *factors, staged=staged)
        return [o.view(*x.shape[:-1], o.shape[-1]) for o in outs]


def fuse_sibling_loras(model) -> list[SiblingLoras]:
    """Every set of sibling plain LoRA linears of `model` (a PEFT model, wholly bf16, lean
    forward) with one scaling, no dropout and biases alike trained as one (`SiblingLoras`),
    in place; the base weights laid out stacked. Returns the groups (`forget` them before
    a forward pass that may follow a failed one). Where the layers do not qualify,
    nothing changes."""
    plain = {id(layer) for _, layer in plain_lora_layers(model)}
    share_sibling_storage(model.get_base_model())
    groups = []
    for parent, names in sibling_sets(model):
        layers = [getattr(parent, n) for n in names]
        if not all(id(m) in plain and runs_lean(m) for m in layers):
            continue
        adapter = layers[0].active_adapters[0]
        if (
            len({lora_scaling(m) for m in layers}) != 1
            or len({m.base_layer.bias is None for m in layers}) != 1
            or not all(isinstance(m.lora_dropout[adapter], torch.nn.Identity) for m in layers)
            or not all(isinstance(lora_a(m), InputDtypeLinear) for m in layers)
            or stacked([m.base_layer.weight for m in layers]) is None
        ):
            continue
        group = SiblingLoras(layers)
        for i, layer in enumerate(layers):
            layer.sibling_of = (group, i)
        groups.append(group)
    return groups


def _lean_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """base(x) + scaling * (x A^T) B^T as addmm(base(x), x A^T, B^T, alpha=scaling)
    (module docstring), in the dtype PEFT computes the adapter in; PEFT's own forward for anything
    else (extra arguments, the adapter off or merged, a base output of another dtype)."""
    if args or kwargs or self.disable_adapters or self.merged:
        return super(type(self), self).forward(x, *args, **kwargs)
    adapter = self.active_adapters[0]
    a, b, dtype = lora_a(self), lora_b(self), adapter_dtype(self, x.dtype)
    dropout = self.lora_dropout[adapter]
    if rounds_once(self, x.dtype, x.device.type) and (
        isinstance(dropout, torch.nn.Identity) or not self.training
    ):  # a wholly bf16 model: the sum in float32, rounded once (module docstring)
        group = self.__dict__.get("sibling_of")
        if group is not None and (out := group[0].output(x, group[1])) is not None:
            return out
        flat, base, scaling = x.reshape(-1, x.shape[-1]), self.base_layer, self.scaling[adapter]
        staged = self.__dict__.get("staged")  # retrain/kernels/staged_factors.py
        out = round_once(flat, base.weight, base.bias, scaling, a.weight, b.weight, staged=staged)
        return out.view(*x.shape[:-1], out.shape[-1])
    result = self.base_layer(x)
    if result.dtype != dtype:
        return super(type(self), self).forward(x)
    mid = torch.nn.functional.linear(self.lora_dropout[adapter](x.to(dtype)), a.weight.to(dtype))
    flat, up = result.reshape(-1, result.shape[-1]), b.weight.to(dtype).t()
    out = torch.addmm(flat, mid.reshape(-1, mid.shape[-1]), up, alpha=self.scaling[adapter])
    return out.view(result.shape)


_LEAN: list = []  # the subclass, made on first use (peft is imported where it is used)


def _lean_class() -> type:
    if not _LEAN:
        from peft.tuners.lora.layer import Linear as LoraLinear

        _LEAN.append(type("LeanLoraLinear", (LoraLinear,), {"forward": _lean_forward}))
    return _LEAN[0]


def runs_lean(layer) -> bool:
    """Whether the LoRA linear `layer` runs the lean forward (`lean_lora_forward`)."""
    return type(layer) is _lean_class()


def lean_lora_forward(model) -> int:
    """Every plain LoRA linear of `model` runs the lean forward (module docstring), in
    place (the same modules, parameters and names); returns how many. 0 when the LoRA
    layers are not all plain."""
    layers = plain_lora_layers(model)
    for _, layer in layers:
        layer.__class__ = _lean_class()
    return len(layers)
