"""The sampling copy of a PEFT LoRA model: each adapted linear folded into a plain layer
holding W + scaling * B @ A, re-merged after each optimizer step (retrain/engines/pytorch.py
samples from it)."""

from __future__ import annotations

import torch

from retrain.kernels.precision import bf16_linears


class MergedSampler:
    """An adapter-free copy of a PEFT LoRA model for sampling: each adapted linear is a
    plain `nn.Linear` holding W + scaling * B @ A, re-merged when the adapter changed.

    In the model's own dtype the copy shares every weight that LoRA does not touch (only
    the merged weights are new memory); with another dtype (bf16) it is a full copy."""

    def __init__(self, model, pairs: list, dtype: torch.dtype | None):
        self.model = model
        self.pairs = pairs  # (PEFT lora.Linear in the trained model, nn.Linear in the copy)
        self.dtype = dtype
        self._seen: tuple = ()

    @classmethod
    def build(cls, peft_model, dtype: torch.dtype | None) -> MergedSampler | None:
        """None when `peft_model` is not a PEFT model with plain LoRA linears only (DoRA,
        several active adapters, embeddings, ...): the engine then samples from it as is."""
        import copy

        layers = _plain_lora_layers(peft_model)
        if not layers:
            return None
        base = peft_model.get_base_model()
        own = next(base.parameters()).dtype
        same = dtype is None or dtype == own
        # Sharing the frozen weights through deepcopy's memo keeps them out of the copy.
        memo = {id(p): p for p in base.parameters()} if same else {}
        copy_ = copy.deepcopy(base, memo)
        pairs = []
        for name, layer in layers:
            parent_name, _, attr = name.rpartition(".")
            parent = copy_.get_submodule(parent_name.removeprefix("base_model.model."))
            w = layer.base_layer.weight
            # the same class: a bf16-mode layer (Bf16Linear) keeps its bf16 matmul
            plain = type(layer.base_layer)(w.shape[1], w.shape[0], bias=False, device=w.device)
            plain.weight = torch.nn.Parameter(torch.empty_like(w), requires_grad=False)
            if layer.base_layer.bias is not None:
                plain.bias = layer.base_layer.bias if same else copy.deepcopy(layer.base_layer.bias)
            setattr(parent, attr, plain)
            pairs.append((layer, plain))
        if not same:
            copy_.to(dtype)
            if dtype == torch.bfloat16:
                # the tiled bf16 layer: on a CPU its matmuls run in a fixed set of row
                # counts, so oneDNN's per-shape kernel caches stop growing (precision.py)
                bf16_linears(copy_)
        copy_.requires_grad_(False)
        copy_.eval()
        return cls(copy_, pairs, None if same else dtype)

    def refresh(self) -> None:
        """Re-merge when any adapter tensor was replaced or updated in place."""
        seen = tuple(
            (id(t), t._version)
            for layer, _ in self.pairs
            for t in (_lora_a(layer).weight, _lora_b(layer).weight)
        )
        if seen == self._seen:
            return
        with torch.no_grad():
            for layer, plain in self.pairs:
                adapter = layer.active_adapters[0]
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                w = layer.base_layer.weight
                if w.dtype == a.dtype == plain.weight.dtype:
                    torch.addmm(w, b, a, alpha=layer.scaling[adapter], out=plain.weight)
                else:  # a bf16 base with PEFT's float32 adapter: merge in float32, round once
                    merged = torch.addmm(w.to(a.dtype), b, a, alpha=layer.scaling[adapter])
                    plain.weight.copy_(merged)
        self._seen = seen


def _lora_a(layer):
    return layer.lora_A[layer.active_adapters[0]]


def _lora_b(layer):
    return layer.lora_B[layer.active_adapters[0]]


def _plain_lora_layers(model) -> list:
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
        plain = type(module) is LoraLinear and len(module.active_adapters) == 1
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
