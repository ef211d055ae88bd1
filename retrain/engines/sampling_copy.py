"""The sampling copy of a PEFT LoRA model (retrain/engines/pytorch.py samples from it):
an adapter-free copy of the model that computes what the trained model computes, with
fewer operators per adapted linear, refreshed after each optimizer step.

Each adapted linear becomes one of two layers:

- **merged**, when the copy's layer holds its weight in the adapter's dtype (float32):
  a plain linear holding W + scaling * B @ A, equal to the adapter's output to float32
  rounding (~1e-6);
- **beside**, when the weight is in a narrower dtype than the adapter (bf16 blocks under
  the local backend's bf16 mode, or a wholly bf16 copy): the bf16 W as it is, plus
  scaling * B @ A applied beside it in the dtype the trained layer computes it in: the
  adapter's float32, as PEFT does it, or on a wholly bf16 model (a GPU's bf16 mode) bf16,
  as the trainer then does (retrain/kernels/lora_layers.py), in two operators with no
  casts. Folding the adapter into bf16 weights would not do: W is already a
  bf16 number, so W + delta rounds back to W wherever delta is under half a bf16 step
  (0.4% of W), which is most of a young adapter's update. Such a sampler lags the
  trainer by the update it rounded away: on the quickstart the largest gap between its
  and the trainer's logprob of a token was 1.3-1.9 nats in a median step (0.12-0.15
  with the adapter beside), and held-out accuracy after 30 steps was lower
  (docs/performance.md).

Sibling projections that read the same input (q/k/v, gate/up: `precision.SIBLINGS`) then
run as one (`Siblings`): one matmul over their weights laid out as consecutive rows of one
tensor (the trainer's own, rearranged in place: no memory added), and beside it one
matmul with their A's stacked and one with their B's set block-diagonally, each
projection taking its columns: 8 small matmuls per layer instead of 14, and 4 weight
matmuls instead of 7. On the CPU that took back most of the decode rate the adapter
beside the weights had cost (docs/performance.md). It is the unfused computation up to
the order of float32 sums (the CPU's kernels sum differently by width), which a bf16
input downstream can turn into ~1e-3 in a logit; the trainer, running other row counts,
differs from the sampler by more than that anyway.
"""

from __future__ import annotations

import copy

import torch

from retrain.hardware import f32_out_matmul
from retrain.kernels.lora_layers import (
    OneInput,
    adapter_dtype,
    factor_versions,
    lora_a,
    lora_b,
    lora_scaling,
    lora_sum_f32,
    plain_lora_layers,
    rounds_once,
    runs_lean,
)
from retrain.kernels.norms import fuse_rms_norms, fused_norms
from retrain.kernels.precision import (
    bf16_linears,
    bf16_weights,
    linear_f32,
    share_sibling_storage,
    sibling_sets,
    stack_in_place,
    stacked,
)
from retrain.kernels.staged_factors import copy_many


def add_beside(flat: torch.Tensor, x: torch.Tensor, a, b, scaling: float) -> None:
    """flat (rows, out) += scaling * (x @ A^T) @ B^T in place, the product in A's dtype
    (float32, or bf16 on a wholly bf16 model) in PEFT's order; `flat` may be a column
    slice of a wider output."""
    h = torch.mm(x.reshape(-1, x.shape[-1]).to(a.dtype), a.t())
    if flat.dtype == h.dtype:  # the adapter in the stream's dtype (float32, or all bf16)
        flat.addmm_(h, b.t(), alpha=scaling)
    else:  # a bf16 residual stream: added in float32, rounded once (PEFT's order), into
        # the float32 copy itself (an addmm into a new tensor copies its input there first)
        flat.copy_(flat.to(h.dtype).addmm_(h, b.t(), alpha=scaling))


def beside(
    base: torch.nn.Linear, x: torch.Tensor, a, b, scaling: float, once: bool = False
) -> torch.Tensor:
    """base(x) + scaling * (x @ A^T) @ B^T as (rows, out). `once` (a wholly bf16 model:
    `rounds_once`): the sum is the trainer's, in float32, rounded to bf16 once
    (retrain/kernels/lora_layers.py `lora_sum_f32`); otherwise the base output, then the
    adapter added (`add_beside`)."""
    flat = x.reshape(-1, x.shape[-1])
    if once:
        return lora_sum_f32(flat, base.weight, base.bias, a, b, scaling).to(x.dtype)
    y = base(flat).contiguous()
    add_beside(y, flat, a, b, scaling)
    return y


class LoraBeside(torch.nn.Module):
    """base(x) + scaling * (x @ A^T) @ B^T, the adapter's part computed in the dtype
    the trained layer computes it in, beside a base layer that may run in bf16: PEFT's
    LoRA linear in two operators (no dropout, no per-call dtype checks), with PEFT's
    operand layout, so on the same rows its output is PEFT's (to the bit when scaling is a
    power of two; a pre-transposed A and B ran the small matmuls ~25% faster alone, but
    rounded differently and sampled no faster). A and B are this layer's copies, refreshed in
    place (`SamplingCopy.refresh`), so a captured CUDA graph reads the new values."""

    def __init__(self, base: torch.nn.Module, rank: int, dtype: torch.dtype, once: bool):
        """A and B in `dtype` (the trainer's float32 B is read in bf16 where the sum is
        rounded once, so the copy holds it so); `once`: the sum rounded once (`beside`)."""
        super().__init__()
        self.base = base
        w = base.weight
        self.register_buffer("a", torch.zeros(rank, w.shape[1], dtype=dtype, device=w.device))
        self.register_buffer("b", torch.zeros(w.shape[0], rank, dtype=dtype, device=w.device))
        self.scaling = 0.0
        self.once = once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = beside(self.base, x, self.a, self.b, self.scaling, self.once)
        return y.view(*x.shape[:-1], y.shape[-1])


class Siblings(torch.nn.Module):
    """Sibling layers (each a merged linear or a `LoraBeside`) that read the same input,
    run as one: `base` holds their weights stacked (a view of the same storage, so a
    refresh of a merged weight reaches it) and runs one matmul; beside it, one matmul
    with their A's stacked and one with their B's set block-diagonally (the members' own
    A and B are views into these, so a refresh reaches them). Each member's `Sibling`
    asks for its columns; the first to ask with a new input computes them all."""

    def __init__(self, linears: list, sides: list, weight: torch.Tensor, bias):
        """`linears`: the members' weight layers, `weight` their weights stacked; `sides`:
        the members when they are `LoraBeside`s, else []."""
        super().__init__()
        base = type(linears[0])(weight.shape[1], weight.shape[0], bias=False, device="meta")
        base.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            base.bias = torch.nn.Parameter(bias, requires_grad=False)
        self.base = base
        bounds = [0]
        for m in linears:
            bounds.append(bounds[-1] + m.weight.shape[0])
        self.bounds = bounds
        self.sides = sides
        self.a = self.b = None
        if sides:  # the members' A and B become views of the stacked ones
            ranks = [0]
            for side in sides:
                ranks.append(ranks[-1] + side.a.shape[0])
            self.a = weight.new_zeros((ranks[-1], weight.shape[1]), dtype=sides[0].a.dtype)
            self.b = weight.new_zeros((bounds[-1], ranks[-1]), dtype=sides[0].b.dtype)
            for i, side in enumerate(sides):
                side.a = self.a[ranks[i] : ranks[i + 1]]
                side.b = self.b[bounds[i] : bounds[i + 1], ranks[i] : ranks[i + 1]]
        self.waiting = OneInput()  # the members' outputs, computed by the first to ask

    def output(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Member i's output for `x` (`OneInput`: the first member to ask with a new
        input computes them all)."""
        return self.waiting.take(x, i, self._outputs)

    def _outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.sides:  # the members share one scaling (_fuse_siblings checks)
            side = self.sides[0]  # one scaling and one `once` for all
            flat = beside(self.base, x, self.a, self.b, side.scaling, side.once)
        else:
            flat = self.base(x).reshape(-1, self.bounds[-1])
        lead = x.shape[:-1]
        return [flat[:, lo:hi].view(*lead, hi - lo) for lo, hi in zip(self.bounds, self.bounds[1:])]


class Sibling(torch.nn.Module):
    """Stands where one of `Siblings`' members stood; `part` is that member."""

    def __init__(self, group: Siblings, index: int, part: torch.nn.Module):
        super().__init__()
        self.group, self.index, self.part = group, index, part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


class Float32Head(torch.nn.Module):
    """A narrower-than-float32 output layer computing float32 logits from the hidden
    states, as the trainer computes its logits from the same bf16 hidden states and
    weights (retrain/kernels/logprobs.py), so the sampler's logprobs are not rounded to
    bf16 logits (~0.05 at logits of ~10). On CUDA it reads the shared bf16 weight with a
    float32 result (`precision.linear_f32`); elsewhere it holds a float32 copy of the
    (frozen) weight, made once, rather than one per decoded token."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        w = head.weight.detach()
        shared = f32_out_matmul(w.device.type)
        self.register_buffer("weight", w if shared else w.float())
        bias = None if head.bias is None else head.bias.detach()
        self.register_buffer("bias", bias if bias is None or shared else bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_f32(x, self.weight, self.bias)


class SamplingCopy:
    """The copy (`model`) and, per adapted linear, the trained PEFT layer and the copy's
    layer standing in for it (`pairs`).

    Only the merged weights (and the adapter's copies beside bf16 weights) are new
    memory; every other weight is shared with the trained model, unless the copy is in
    another dtype (`[inference] dtype = "bf16"` on a float32
    trainer), when it is a whole copy."""

    def __init__(self, model, pairs: list):
        self.model = model
        self.pairs = pairs  # (PEFT lora.Linear, plain linear (merged) or LoraBeside)
        self._seen: tuple = ()

    @classmethod
    def build(cls, peft_model, dtype: torch.dtype | None) -> SamplingCopy | None:
        """The copy in `dtype` (None: the model's own). None when `peft_model` is not a
        PEFT model with plain LoRA linears only (DoRA, several active adapters,
        embeddings, ...): the engine then samples from it as it is."""
        layers = plain_lora_layers(peft_model)
        if not layers:
            return None
        base = peft_model.get_base_model()
        same = dtype is None or dtype == next(base.parameters()).dtype
        if same:  # the copy shares them: the trainer's weights, rearranged in place
            share_sibling_storage(base)
        # Sharing the frozen weights through deepcopy's memo keeps them out of the copy.
        memo = {id(p): p for p in base.parameters()} if same else {}
        copy_ = copy.deepcopy(base, memo)
        slots = []
        for name, layer in layers:
            parent_name, _, attr = name.removeprefix("base_model.model.").rpartition(".")
            parent = copy_.get_submodule(parent_name)
            inner = getattr(parent, attr).base_layer  # the copy's own (or shared) base layer
            weight_dtype = inner.weight.dtype if same else dtype
            # merged only where that is exact to rounding: a float32 weight and adapter
            merge = weight_dtype == lora_a(layer).weight.dtype == torch.float32
            if merge:  # a fresh weight for W + scaling * B @ A; the same class keeps its matmul
                w = inner.weight
                plain = type(inner)(w.shape[1], w.shape[0], bias=False, device=w.device)
                plain.weight = torch.nn.Parameter(torch.empty_like(w), requires_grad=False)
                plain.bias = inner.bias
                inner = plain
            setattr(parent, attr, inner)
            slots.append((layer, parent, attr, merge))
        if not same:  # a bf16 copy of its own: `[inference] dtype = "bf16"`
            if dtype != torch.bfloat16:
                raise ValueError(f"a sampling copy of its own is bf16, not {dtype}")
            # The parameters only: the buffers (the rotary frequencies) stay float32, as
            # in the trainer and in a bf16 model transformers loads, so the rotary angles
            # are the trainer's. (Rounded to bf16, each moved by up to 2^-9 of position x
            # frequency; on 1k positions of text the logprobs moved no more than bf16's
            # own noise, RoPE's angles being relative.)
            bf16_weights(copy_)
            # the tiled bf16 layer: on a CPU its matmuls run in a fixed set of row
            # counts, so oneDNN's per-shape kernel caches stop growing (precision.py)
            bf16_linears(copy_)
            share_sibling_storage(copy_)
        head = copy_.get_output_embeddings()
        if type(head) is torch.nn.Linear and head.weight.dtype != torch.float32:
            copy_.set_output_embeddings(Float32Head(head))
        embeddings = copy_.get_input_embeddings().weight
        if fused_norms(embeddings.device.type):  # one kernel per norm, not eight
            fuse_rms_norms(copy_)
        pairs = []
        stream = embeddings.dtype  # what each layer is given
        for layer, parent, attr, merge in slots:
            inner = getattr(parent, attr)
            if not merge:  # A and B in the dtype the trained layer computes them in
                rank = lora_a(layer).weight.shape[0]
                dtype_ = adapter_dtype(layer, stream)
                # the trainer's lean forward rounds once there: so does the copy
                once = runs_lean(layer) and rounds_once(layer, stream, embeddings.device.type)
                inner = LoraBeside(inner, rank, dtype_, once)
                setattr(parent, attr, inner)
            pairs.append((layer, inner))
        _fuse_siblings(copy_, pairs)
        copy_.requires_grad_(False)
        copy_.eval()
        return cls(copy_, pairs)

    def refresh(self) -> None:
        """Bring the copy up to the adapter when any adapter tensor was replaced or
        updated in place (an optimizer step, a resume)."""
        seen = factor_versions(layer for layer, _ in self.pairs)
        if seen == self._seen:
            return
        copies, sources = [], []
        with torch.no_grad():
            for layer, inner in self.pairs:
                a, b, scaling = lora_a(layer).weight, lora_b(layer).weight, lora_scaling(layer)
                if isinstance(inner, LoraBeside):
                    copies += [inner.a, inner.b]
                    sources += [a, b]
                    inner.scaling = scaling
                else:
                    torch.addmm(layer.base_layer.weight, b, a, alpha=scaling, out=inner.weight)
            if copies:  # a few kernels on a GPU, not two per adapted layer
                copy_many(copies, sources)
        self._seen = seen


def _fuse_siblings(model, pairs: list) -> None:
    """Each set of sibling layers of the copy that are all merged or all beside, with one
    scaling and weights stacked in one tensor, replaced by a `Siblings` (a merged set gets
    its weights allocated stacked, to be filled by the first refresh)."""
    trained = {id(inner): layer for layer, inner in pairs}
    for parent, names in sibling_sets(model):
        members = [getattr(parent, n) for n in names]
        if not all(id(m) in trained for m in members):
            continue
        layers = [trained[id(m)] for m in members]
        if len({lora_scaling(layer) for layer in layers}) != 1:
            continue
        beside = {isinstance(m, LoraBeside) for m in members}
        if len(beside) != 1 or len({getattr(m, "once", False) for m in members}) != 1:
            continue
        linears = [m.base for m in members] if beside == {True} else members
        if beside == {False}:  # merged: the copy's own fresh weights, so stack them
            stack_in_place(linears)
        weight = stacked([m.weight for m in linears])
        biases = [m.bias for m in linears]
        if weight is None or len({b is None for b in biases}) != 1:
            continue
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        sides = members if beside == {True} else []
        group = Siblings(linears, sides, weight.detach(), bias)
        for i, (name, member) in enumerate(zip(names, members)):
            setattr(parent, name, Sibling(group, i, member))
