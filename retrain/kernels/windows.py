"""Attention windows: how far back each attention layer of a model may look.

Some models limit attention to the last W positions (a sliding window): in every layer
(Mistral, Phi-3: `sliding_window` set and no `layer_types`) or in some layers (Gemma 2
and 3, GPT-OSS, Qwen2/3 with `use_sliding_window`: `layer_types` lists
"full_attention" and "sliding_attention"). From a 2-D mask transformers builds each
layer's mask itself, window included. A 4-D mask, though, is taken as it is for every
layer, and retrain hands the model 4-D masks twice: for packed rows in training
(retrain/kernels/packing.py) and in the static decoder (retrain/engines/static_decode.py).
Without the window in them, training would compute other logprobs than the sampler drew
with once a sequence outgrows the window, and the static cache's short sliding layers
would not match the mask.

`windows_of(config)` reads which masks a model needs; `Windows.masks(build)` builds each
distinct one once and hands the model one mask when all its layers share it, else a
dict keyed by layer type, which models with `layer_types` take in place of the mask.
Layers that carry state along the sequence (linear attention, convolutions, chunked
attention) cannot be packed or masked this way, so such a model is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from retrain.errors import BackendError

FULL, SLIDING = "full_attention", "sliding_attention"
NO_ATTENTION = ("moe", "mlp")  # layer types without attention: nothing to mask

T = TypeVar("T")


@dataclass(frozen=True)
class Windows:
    """A model's attention layer types, each with its window (None: unlimited)."""

    by_type: tuple[tuple[str, int | None], ...]

    @property
    def sliding(self) -> int | None:
        """The sliding layers' window, or None when no layer slides."""
        return next((w for _, w in self.by_type if w is not None), None)

    def masks(self, build: Callable[[int | None], T]) -> T | dict[str, T]:
        """The model's `attention_mask` argument: `build(window)` once per distinct
        window; one mask when every layer takes the same, else one per layer type."""
        made = {w: build(w) for w in dict.fromkeys(w for _, w in self.by_type)}
        if len(made) == 1:
            return next(iter(made.values()))
        return {kind: made[w] for kind, w in self.by_type}


NO_WINDOW = Windows(((FULL, None),))


def within(q_position, kv_position, window: int | None):
    """The window's rule, as transformers applies it: a query sees the keys less than
    `window` positions before it (itself included). True everywhere when None."""
    if window is None:
        return True
    return q_position - kv_position < window


def windows_of(config: Any, model: str = "the model") -> Windows:
    """The attention windows of a transformers config (its text decoder's); a model with
    layers `refusal` names raises it."""
    problem = refusal(config.to_dict(), model)
    if problem:
        raise BackendError(problem)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)  # None when use_sliding_window is off
    types = getattr(text, "layer_types", None)
    if types is None:  # one kind of layer, sliding when the config sets a window
        return Windows(((SLIDING, window),)) if window is not None else NO_WINDOW
    kinds = [t for t in dict.fromkeys(types) if t not in NO_ATTENTION]
    by_type = tuple((t, window if t == SLIDING else None) for t in kinds)
    return Windows(by_type) if by_type else NO_WINDOW


def refusal(config: Mapping[str, Any], model: str = "the model") -> str:
    """Why the local backend cannot train a model with this config.json mapping (or a
    transformers config's `to_dict()`): layers other than full or sliding-window
    attention (listed in `layer_types`, or chunked attention). "" when it can."""
    text = config.get("text_config")
    merged = {**config, **text} if isinstance(text, Mapping) else config
    kinds = [
        t
        for t in dict.fromkeys(merged.get("layer_types") or ())
        if t not in (FULL, SLIDING, *NO_ATTENTION)
    ]
    if merged.get("attention_chunk_size") is not None and "chunked_attention" not in kinds:
        kinds.append("chunked_attention")
    if not kinds:
        return ""
    return (
        f"{model} has {', '.join(repr(k) for k in kinds)} layers. The local backend packs "
        "a prompt's completions into one row and masks full and sliding-window attention "
        "only; layers that carry state along the sequence would mix the completions. "
        'Fix: a model with full or sliding-window attention, or backend = "tinker" / '
        '"prime_rl"'
    )
