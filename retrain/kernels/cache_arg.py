"""The keyword a model's forward takes its KV cache under. transformers 5.24 renamed
`past_key_values` to `cache` (the old name still works but warns, and goes in 5.40);
earlier versions only know `past_key_values`. Read from the forward's signature, not the
version, so a model class that has not moved yet keeps working."""

from __future__ import annotations

import inspect
from typing import Any

# model class -> keyword; a plain dict, which torch.compile traces through (the decode
# step calls cache_kwargs inside the compiled region), where it warns on a functools cache
_KEYWORDS: dict[type, str] = {}


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for `model(...)`; a PEFT wrapper is looked through to its model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_keyword(type(base)): cache}


def _keyword(cls: type) -> str:
    if cls not in _KEYWORDS:
        params = inspect.signature(cls.forward).parameters
        _KEYWORDS[cls] = "cache" if "cache" in params else "past_key_values"
    return _KEYWORDS[cls]
