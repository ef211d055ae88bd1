"""The bf16 operands of the trainer's wholly bf16 LoRA linears, kept between forward passes.

On a wholly bf16 model (a GPU's bf16 mode) each trained LoRA linear that rounds its sum
once (retrain/kernels/lora_layers.py `_RoundOnce`), alone or as a set of siblings
reading one input (`SiblingLoras`), multiplies bf16 copies of its float32 factors: A
(the members' A's stacked) and B (their B's set block-diagonally). Built at every call,
that is a cast of each factor, a concatenation, a zeroed matrix and a copy per member:
15 operators a Llama-family block, 450 per forward pass of SmolLM2's 30 blocks, each a
kernel a GPU's host launches (what a small model's training step costs: docs/
performance.md), for values that change only when the factors do, once per optimizer
step, while a step runs a forward pass per micro-batch (and per recomputed block, per
logprob pass).

`StagedFactors` keeps them between passes, in buffers laid out as the per-call build
lays them out, and at the first pass after any factor changed (an optimizer step, a
resume, a factor replaced) copies every unit's from the factors at once (`copy_many`: on
CUDA a few kernels for the A's and the lone layers' B's, and one for each B of a set, 5 a
block, a block of a block-diagonal buffer being what CUDA's foreach copy cannot take in
its fast path). A change is seen as the sampling copy sees it
(retrain/engines/sampling_copy.py `refresh`): a factor's identity or its version counter,
which every in-place update advances. The same casts into the same layout: the same
operands, so the same outputs and gradients, to the bit.

The staged A's and B's are what a step's backward keeps of them anyway (the products'
operands); kept between steps they add the sampler's copy of the adapter once more
(retrain/memory.py `staged_adapter_bytes`). Not in compiled blocks (`compile = true`:
inductor fuses the per-call build into the block's kernels) nor on a sharded base.
"""

from __future__ import annotations

import torch

from retrain.kernels.lora_layers import (
    SiblingLoras,
    factor_versions,
    lora_a,
    lora_b,
    plain_lora_layers,
    rounds_once,
    runs_lean,
)


def copy_many(copies: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """copies[i].copy_(sources[i]) for every i, in as few kernels as CUDA allows. torch's
    foreach copy runs a whole list in a few kernels only where every pair shares its
    sizes and strides, and otherwise copies pair by pair (one kernel each): a row slice
    of a stacked buffer (an A of a set, a lone layer's B) shares them with its factor, a
    block of a block-diagonal buffer (a B of a set) does not. So the pairs that share them
    go in one call, the others in a second, instead of all of them one by one."""
    alike = [c.shape == s.shape and c.stride() == s.stride() for c, s in zip(copies, sources)]
    with torch.no_grad():
        for want in (True, False):
            pairs = [(c, s) for c, s, same in zip(copies, sources, alike) if same is want]
            if pairs:
                torch._foreach_copy_([c for c, _ in pairs], [s for _, s in pairs])


class Staged:
    """One unit's operands (a lone LoRA linear, or a set of siblings): views of the bf16
    buffers `StagedFactors.refresh` fills, A stacked and B block-diagonal."""

    def __init__(self, owner: StagedFactors, layers: list, a: torch.Tensor, b: torch.Tensor):
        self.owner, self.layers, self.a, self.b = owner, layers, a, b
        self.slots = []  # (layer, its A's rows of a, its B's block of b)
        rows = cols = 0
        for layer in layers:
            r, out = lora_b(layer).weight.shape[1], lora_b(layer).weight.shape[0]
            self.slots.append((layer, a[cols : cols + r], b[rows : rows + out, cols : cols + r]))
            rows, cols = rows + out, cols + r
        self.seen: tuple = ()  # the factors' (identity, version) when last copied

    def __deepcopy__(self, memo) -> None:
        """A copy of the model (the sampler's, or split mode's on the other device) holds
        no staged operands of its own (its layers then build theirs per call), nor this
        one's, which are the trained model's on its device: not 0.19 GiB more at
        Qwen3-4B r32 while the copy is made."""
        return None

    def operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) in `dtype`, current with the factors; None where they are built per call
        instead: another dtype, or inside a graph being compiled."""
        if dtype != self.a.dtype or torch.compiler.is_compiling():
            return None
        if self.seen != factor_versions(self.layers):
            self.owner.refresh()
        return self.a, self.b


class StagedFactors:
    """Every unit's staged operands (`Staged`), refreshed together (module docstring)."""

    def __init__(self, units: list[list], dtype: torch.dtype):
        self.units = []
        for layers in units:
            ranks = sum(lora_a(m).weight.shape[0] for m in layers)
            outs = sum(lora_b(m).weight.shape[0] for m in layers)
            first = lora_a(layers[0]).weight
            a = first.new_empty((ranks, first.shape[1]), dtype=dtype)
            b = first.new_zeros((outs, ranks), dtype=dtype)  # off the diagonal: zero for good
            self.units.append(Staged(self, layers, a, b))
        self.refreshes = 0  # how many times the factors were copied (tests read it)

    def refresh(self) -> None:
        """Copy every unit's factors into its operands, all at once (`copy_many`)."""
        copies, sources = [], []
        for unit in self.units:
            for layer, a, b in unit.slots:
                copies += [a, b]
                sources += [lora_a(layer).weight, lora_b(layer).weight]
        copy_many(copies, sources)
        for unit in self.units:
            unit.seen = factor_versions(unit.layers)
        self.refreshes += 1

    def nbytes(self) -> int:
        return sum(u.a.nbytes + u.b.nbytes for u in self.units)


def stage_factors(model, groups: list[SiblingLoras]) -> StagedFactors | None:
    """Staged bf16 operands for each set of siblings in `groups` (`group.staged`) and
    every other plain LoRA linear of `model` that runs the lean forward and rounds its
    sum once on a bf16 input (`layer.staged`); None when there is none (a float32 model,
    PEFT layers that are not all plain)."""
    grouped = {id(m) for g in groups for m in g.layers}
    lone = [
        layer
        for _, layer in plain_lora_layers(model)
        if id(layer) not in grouped
        and runs_lean(layer)
        and rounds_once(layer, torch.bfloat16, layer.base_layer.weight.device.type)
    ]
    owners = [*groups, *lone]
    if not owners:
        return None
    staged = StagedFactors([g.layers for g in groups] + [[m] for m in lone], torch.bfloat16)
    for owner, unit in zip(owners, staged.units):
        owner.__dict__["staged"] = unit  # not a submodule: PEFT's layers are nn.Modules
    return staged
