"""The sampling copy of a PEFT LoRA model (retrain/engines/pytorch.py samples from it):
an adapter-free copy of the model that computes what the trained model computes, with
fewer operators per adapted linear, refreshed after each optimizer step.

Each adapted linear becomes one of two layers:

- **merged**, when the copy's layer holds its weight in the adapter's dtype (float32):
  a plain linear holding W + scaling * B @ A, equal to the adapter's output to float32
  rounding (~1e-6);
- **beside**, when the weight is in a narrower dtype than the adapter (bf16 blocks under
  the local backend's bf16 mode, or a wholly bf16 copy): the bf16 W as it is, plus
  scaling * B @ A applied beside it in the adapter's float32, as PEFT does it in the
  trained model. Folding the adapter into bf16 weights would not do: W is already a
  bf16 number, so W + delta rounds back to W wherever delta is under half a bf16 step
  (0.4% of W), which is most of a young adapter's update. Such a sampler lags the
  trainer by the update it rounded away: on the quickstart the largest gap between its
  and the trainer's logprob of a token was 1.3-1.9 nats in a median step (0.12-0.15
  with the adapter beside), and held-out accuracy after 30 steps was lower
  (docs/performance.md).
"""

from __future__ import annotations

import copy

import torch

from retrain.kernels.precision import bf16_linears


class LoraBeside(torch.nn.Module):
    """base(x) + scaling * (x @ A^T) @ B^T, the adapter's part computed in its own dtype
    (float32) beside a base layer that may run in bf16: PEFT's LoRA linear in two
    operators (no dropout, no per-call dtype checks), with PEFT's operand layout, so on
    the same rows its output is PEFT's (to the bit when scaling is a power of two; a
    pre-transposed A and B ran the small matmuls ~25% faster alone, but rounded
    differently and sampled no faster). A and B are this layer's copies, refreshed in
    place (`SamplingCopy.refresh`), so a captured CUDA graph reads the new values."""

    def __init__(self, base: torch.nn.Module, rank: int, dtype: torch.dtype):
        super().__init__()
        self.base = base
        w = base.weight
        self.register_buffer("a", torch.zeros(rank, w.shape[1], dtype=dtype, device=w.device))
        self.register_buffer("b", torch.zeros(w.shape[0], rank, dtype=dtype, device=w.device))
        self.scaling = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x).contiguous()
        h = torch.mm(x.reshape(-1, x.shape[-1]).to(self.a.dtype), self.a.t())
        flat = y.view(-1, y.shape[-1])
        if flat.dtype == h.dtype:  # a float32 residual stream: added in place
            flat.addmm_(h, self.b.t(), alpha=self.scaling)
            return y
        # a bf16 residual stream: added in float32, rounded once (PEFT's order)
        return (
            torch.addmm(flat.to(h.dtype), h, self.b.t(), alpha=self.scaling).to(y.dtype).view_as(y)
        )


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
        layers = _plain_lora_layers(peft_model)
        if not layers:
            return None
        base = peft_model.get_base_model()
        same = dtype is None or dtype == next(base.parameters()).dtype
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
            merge = weight_dtype == _lora_a(layer).weight.dtype == torch.float32
            if merge:  # a fresh weight for W + scaling * B @ A; the same class keeps its matmul
                w = inner.weight
                plain = type(inner)(w.shape[1], w.shape[0], bias=False, device=w.device)
                plain.weight = torch.nn.Parameter(torch.empty_like(w), requires_grad=False)
                plain.bias = inner.bias
                inner = plain
            setattr(parent, attr, inner)
            slots.append((layer, parent, attr, merge))
        if not same:
            copy_.to(dtype)
            if dtype == torch.bfloat16:
                # the tiled bf16 layer: on a CPU its matmuls run in a fixed set of row
                # counts, so oneDNN's per-shape kernel caches stop growing (precision.py)
                bf16_linears(copy_)
        pairs = []
        for layer, parent, attr, merge in slots:
            inner = getattr(parent, attr)
            if not merge:  # built after the cast: A and B stay in the adapter's dtype
                a = _lora_a(layer).weight
                inner = LoraBeside(inner, a.shape[0], a.dtype)
                setattr(parent, attr, inner)
            pairs.append((layer, inner))
        copy_.requires_grad_(False)
        copy_.eval()
        return cls(copy_, pairs)

    def refresh(self) -> None:
        """Bring the copy up to the adapter when any adapter tensor was replaced or
        updated in place (an optimizer step, a resume)."""
        seen = tuple(
            (id(t), t._version)
            for layer, _ in self.pairs
            for t in (_lora_a(layer).weight, _lora_b(layer).weight)
        )
        if seen == self._seen:
            return
        with torch.no_grad():
            for layer, inner in self.pairs:
                adapter = layer.active_adapters[0]
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                scaling = layer.scaling[adapter]
                if isinstance(inner, LoraBeside):
                    inner.a.copy_(a)
                    inner.b.copy_(b)
                    inner.scaling = scaling
                else:
                    torch.addmm(layer.base_layer.weight, b, a, alpha=scaling, out=inner.weight)
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
