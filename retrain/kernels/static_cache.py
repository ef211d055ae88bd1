"""The static decoder's KV cache (retrain/engines/static_decode.py): transformers'
StaticCache with every layer at full length, each writing its keys and values at cache
positions the decoder sets once per forward pass.

transformers' StaticLayer works out where to write from its own fill count, in every
layer of every forward pass: an arange, an add and an in-place add of the count, three
kernels a layer (108 per decoded token at Qwen3-4B's 36 layers, inside the captured
step), each layer computing the same positions, since a forward pass writes every layer
at the same place. Here the decoder sets those positions once (`Writes.at`, a tensor
with a fixed address, so a captured graph reads its new value at every replay) and each
layer does only its two index copies: the same cache contents, to the bit.

Sliding-window layers are full length too: the masks, not the cache, apply the window,
so every layer's keys sit at the same cache positions.

A prefill may feed each distinct prompt once (a group's completions share one): then
`Writes.fan` says which fed row each cache row copies, every cache row is written, and
the layer hands the attention the fed rows' own keys and values, all a prefill into an
emptied cache reads.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer


class Writes:
    """The cache positions the next forward pass writes, shared by every layer:
    (tokens fed,) long on the cache's device. The first of them is also how many
    positions the cache held before that pass (`get_seq_length`), since a row's tokens
    are written back to back from position 0."""

    def __init__(self, at: torch.Tensor):
        self.at = at
        # during a prefill of distinct prompts only: (cache rows,) the fed row each copies
        self.fan: torch.Tensor | None = None


class WrittenAt(StaticLayer):
    """A StaticLayer that writes where `writes.at` says instead of counting for itself
    (module docstring). Its own fill count stays 0: nothing reads it but
    `get_seq_length`, which this layer answers from the shared positions."""

    def __init__(self, max_cache_len: int, writes: Writes):
        super().__init__(max_cache_len=max_cache_len)
        self.writes = writes

    def update(self, key_states, value_states, *args, **kwargs):
        fan = self.writes.fan
        keys, values = key_states, value_states
        if fan is not None:  # each cache row gets its fed row's (module docstring)
            keys, values = keys.index_select(0, fan), values.index_select(0, fan)
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        at = self.writes.at
        self.keys.index_copy_(2, at, keys)
        self.values.index_copy_(2, at, values)
        if fan is not None:
            return key_states, value_states
        return self.keys, self.values

    def get_seq_length(self):
        return self.writes.at[0] if self.is_initialized else 0


PLAIN = (StaticLayer, StaticSlidingWindowLayer)  # keys and values only, nothing else kept


def full_length_cache(model, length: int, writes: Writes) -> StaticCache:
    """A StaticCache for `model` with `length` positions in every layer, sliding ones
    included: each plain attention layer writing at `writes.at`; a layer that keeps more
    than keys and values (an indexer, linear-attention state) as transformers makes it,
    at full length if it was sliding."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    for i, layer in enumerate(cache.layers):
        if type(layer) in PLAIN:
            cache.layers[i] = WrittenAt(length, writes)
        elif layer.is_sliding:
            cache.layers[i] = StaticLayer(max_cache_len=length)
    return cache
