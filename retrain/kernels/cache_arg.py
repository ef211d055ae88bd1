"""The keyword a model's forward takes its KV cache under. transformers 5.24 renamed
`past_key_values` to `cache` (the old name still works but warns, and goes in 5.40);
earlier versions only know `past_key_values`. Read from the forward's signature, not the
version, so a model class that has not moved yet keeps working."""

from __future__ import annotations

import functools
import inspect
from typing import Any


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for `model(...)`; a PEFT wrapper is looked through to its model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_keyword(type(base)): cache}


@functools.cache
def _keyword(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
