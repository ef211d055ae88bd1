"""A transformers model's transformer blocks: the unit `shard = true` shards over the ranks
(retrain/distributed.py) and `compile = true` compiles (retrain/kernels/compiled_blocks.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose class transformers names in `_no_split_modules` (the unit it never
    splits over devices), read from every module of `model` (its own, or under PEFT)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]
