"""Data sources: where the training problems come from.

    source = build_data_source(DataConfig(source="reasoning_gym", task="chain_sum"))
    batch = source.next_batch(8)          # list[Example], cycling through epochs
    state = source.state_dict()           # {"position": ..., ...}: saved with checkpoints
    source.load_state_dict(state)         # resume: the same next batches

Built-ins (`[data] source`): math (default), reasoning_gym, jsonl; `[environment]
provider = "verifiers"` overrides the source. A dotted path `pkg.mod.attr` names your own
source: a DataSource subclass, or a callable returning a DataSource or a list of Examples
(called with the `[data]` keys its signature names).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from retrain.data.base import DataSource, ExampleStream
from retrain.errors import DataError, PluginError
from retrain.types import Example

if TYPE_CHECKING:
    from retrain.config.schema import DataConfig, EnvironmentConfig

__all__ = ["DataSource", "ExampleStream", "build_data_source"]


def _call_plugin(factory: Any, data: DataConfig) -> Any:
    """A plugin source is called with the `[data]` keys its signature names (it may take
    **kwargs for all of them). The keys come from the validated schema, so nothing the
    user wrote can be dropped here; a parameter that is not a `[data]` key is an error."""
    options = {f.name: getattr(data, f.name) for f in fields(data)}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory(**options)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return factory(**options)
    unknown = [
        n
        for n, p in params.items()
        if n not in options and p.default is p.empty and p.kind is not p.VAR_POSITIONAL
    ]
    if unknown:
        raise DataError(
            f"[data] source {data.source!r}: parameter(s) {unknown} are not [data] keys; "
            f"a data source plugin may take any of: {', '.join(options)}"
        )
    return factory(**{k: v for k, v in options.items() if k in params})


def build_data_source(
    data: DataConfig,
    *,
    environment: EnvironmentConfig | None = None,
    max_examples: int = 0,
    shuffle_seed: int | None = None,
    search_paths: Sequence[str] = (),
) -> DataSource:
    """The data source for the `[data]` table (or `[environment]` when its provider is
    set). `max_examples` comes from `[training]`; `shuffle_seed` from the run's seed."""
    if environment is not None and environment.provider == "openenv":
        from retrain.data.openenv_source import OpenEnvSource

        for p in search_paths:  # the Environment class's folder
            if p and p not in sys.path:
                sys.path.insert(0, p)
        source = OpenEnvSource(
            {
                "id": environment.id,
                "base_url": environment.base_url,
                "args": environment.args,
                "max_turns": environment.max_turns,
                "turn_timeout_s": environment.turn_timeout_s,
            },
            size=data.size,
            seed=data.seed,
        )
        return source
    if environment is not None and environment.provider:
        from retrain.data.verifiers import VerifiersSource

        return VerifiersSource.from_config(
            environment,
            data,
            max_examples=max_examples,
            shuffle_seed=shuffle_seed,
            search_paths=tuple(search_paths),
        )

    from retrain.registry import DATA_SOURCES

    try:
        factory = DATA_SOURCES.resolve(data.source, search_paths)
    except PluginError as exc:
        raise DataError(f"[data] source: {exc}") from exc
    if DATA_SOURCES.is_builtin(data.source):
        return factory.from_config(data, max_examples=max_examples, shuffle_seed=shuffle_seed)
    result = _call_plugin(factory, data)
    if isinstance(result, DataSource):
        return result
    if isinstance(result, (list, tuple)) and all(isinstance(e, Example) for e in result):
        return DataSource(
            result,
            name=data.source,
            max_examples=max_examples,
            shuffle=data.shuffle,
            shuffle_seed=shuffle_seed,
            seed=data.seed,
        )
    raise DataError(
        f"[data] source {data.source!r} returned {type(result).__name__}; expected a DataSource "
        "or a list of retrain.types.Example"
    )
