"""Data sources: where the training problems come from.

    source = build_data_source("reasoning_gym", task="chain_sum", args={"min_terms": 2})
    batch = source.next_batch(8)          # list[Example], cycling through epochs
    state = source.state_dict()           # {"position": ..., ...}: saved with checkpoints
    source.load_state_dict(state)         # resume: the same next batches

Built-ins (`[data] source`): math (default), reasoning_gym, jsonl; `[environment]
provider = "verifiers"` overrides the source. A dotted path `pkg.mod.attr` names your own
source: a DataSource subclass, or a callable returning a DataSource or a list of Examples
(called with the `[data]` options it accepts).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from retrain.data.base import DataSource, ExampleStream
from retrain.errors import DataError, PluginError
from retrain.types import Example

__all__ = ["DataSource", "ExampleStream", "build_data_source"]


def _call_with_accepted(factory: Any, kwargs: dict[str, Any]) -> Any:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory(**kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return factory(**kwargs)
    return factory(**{k: v for k, v in kwargs.items() if k in params})


def build_data_source(
    source: str = "math",
    *,
    path: str = "",
    task: str = "",
    args: dict[str, Any] | None = None,
    size: int = 1000,
    seed: int = 0,
    split: str = "train",
    prompt_field: str = "question",
    answer_field: str = "answer",
    max_examples: int = 0,
    shuffle: bool = True,
    shuffle_seed: int | None = None,
    search_paths: Sequence[str] = (),
    environment: dict[str, Any] | None = None,
    **options: Any,
) -> DataSource:
    """The data source for `[data]` (or `[environment]` when its provider is set)."""
    kwargs: dict[str, Any] = dict(
        path=path,
        task=task,
        args=dict(args or {}),
        size=size,
        seed=seed,
        split=split,
        prompt_field=prompt_field,
        answer_field=answer_field,
        max_examples=max_examples,
        shuffle=shuffle,
        shuffle_seed=shuffle_seed,
        search_paths=tuple(search_paths or ()),
        **options,
    )
    if environment and environment.get("provider"):
        from retrain.data.verifiers import VerifiersSource

        return VerifiersSource(environment=dict(environment), **kwargs)

    from retrain.registry import DATA_SOURCES

    try:
        factory = DATA_SOURCES.resolve(source, search_paths)
    except PluginError as exc:
        raise DataError(f"[data] source: {exc}") from exc
    result = _call_with_accepted(factory, kwargs)
    if isinstance(result, DataSource):
        return result
    if isinstance(result, (list, tuple)) and all(isinstance(e, Example) for e in result):
        return DataSource(
            result,
            name=source,
            max_examples=max_examples,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            seed=seed,
        )
    raise DataError(
        f"[data] source {source!r} returned {type(result).__name__}; expected a DataSource "
        "or a list of retrain.types.Example"
    )
