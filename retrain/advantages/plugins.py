"""Resolving the pipeline's names into callables, calling plugins, checking their output.

Everything here runs when an :class:`~retrain.advantages.pipeline.AdvantagePipeline` is
built (resolution) or on each plugin call (calling and validation). A built-in name is
read from its :class:`~retrain.registry.Entry`; a dotted path is imported through the
same registry. Errors name the plugin: an unknown name, a target that is not callable,
an exception inside the plugin or a malformed result all raise
:class:`~retrain.errors.PluginError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from retrain import registry
from retrain.advantages import adapt
from retrain.errors import PluginError, RetrainError

# The kept groups' rewards (one array per group) and the advantage params -> one
# episode advantage per completion, all groups concatenated.
EpisodeFn = Callable[[list[np.ndarray], dict], np.ndarray]

# ------------------------------------------------------------------ resolution


def builtin_entry(reg: registry.Registry, name: str) -> registry.Entry | None:
    """The registry entry of a built-in `name`, None for a dotted path. An unknown or
    unbuilt name raises PluginError listing the valid names."""
    problem = reg.check(name)
    if problem:
        raise PluginError(problem)
    return reg.entry(name)


# How each kind's plugin objects become the one calling convention the pipeline uses
# (specs, factories and the original API's context forms; see advantages.adapt).
_ADAPTERS: dict[str, Callable[[str, Any], Callable]] = {
    "transform_mode": adapt.as_transform,
    "algorithm_mode": adapt.as_algorithm,
    "advantage_mode": adapt.as_advantage,
}


def resolve_callable(reg: registry.Registry, name: str, search_paths: Iterable[str]) -> Callable:
    """The plugin (dotted path or run-time registration) behind `name`, in its kind's
    calling convention; PluginError when it is none of the accepted forms."""
    obj = reg.resolve(name, search_paths)
    adapter = _ADAPTERS.get(reg.kind)
    fn = adapter(name, obj) if adapter is not None else obj
    if not callable(fn):
        raise PluginError(f"{reg.kind} plugin {name!r} is not callable")
    return fn


def episode_fn(name: str, search_paths: Iterable[str]) -> EpisodeFn:
    """The advantage mode `name` as an :data:`EpisodeFn`: a built-in's batched form when
    its entry names one (one call for all groups), else one call per group."""
    entry = builtin_entry(registry.ADVANTAGE_MODES, name)
    if entry is not None and entry.grouped:
        grouped = registry.import_object(entry.grouped)

        def run_grouped(rewards: list[np.ndarray], params: dict) -> np.ndarray:
            sizes = np.array([r.size for r in rewards], dtype=np.int64)
            return np.asarray(grouped(np.concatenate(rewards), sizes, params), dtype=np.float64)

        return run_grouped
    if entry is not None and not adapt.is_registered(entry):
        fn = registry.ADVANTAGE_MODES.resolve(name)

        def run_builtin(rewards: list[np.ndarray], params: dict) -> np.ndarray:
            return np.concatenate([np.asarray(fn(r, params), dtype=np.float64) for r in rewards])

        return run_builtin
    plugin = resolve_callable(registry.ADVANTAGE_MODES, name, search_paths)

    def run_plugin(rewards: list[np.ndarray], params: dict) -> np.ndarray:
        out = []
        for r in rewards:
            result = call_plugin("advantage_mode", name, plugin, r.tolist(), params)
            out.append(check_vector("advantage_mode", name, result, r.size))
        return np.concatenate(out)

    return run_plugin


# ------------------------------------------------------------------ calling


def call_plugin(kind: str, name: str, fn: Callable, *args: Any) -> Any:
    """fn(*args), with any exception but a RetrainError re-raised as a PluginError."""
    try:
        return fn(*args)
    except RetrainError:
        raise
    except Exception as exc:
        raise PluginError(f"{kind} plugin {name!r} raised {type(exc).__name__}: {exc}") from exc


def check_vector(kind: str, name: str, out: Any, n: int) -> np.ndarray:
    """An advantage plugin's result: n finite numbers."""
    try:
        arr = np.asarray(out, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PluginError(
            f"{kind} plugin {name!r} must return {n} numbers, got {type(out).__name__}"
        ) from exc
    if arr.shape != (n,):
        raise PluginError(
            f"{kind} plugin {name!r} returned {arr.size} value(s) (shape {arr.shape}) for a "
            f"group of {n}; it must return one advantage per completion"
        )
    if not np.all(np.isfinite(arr)):
        raise PluginError(f"{kind} plugin {name!r} returned NaN or infinite advantages")
    return arr


def check_token_output(
    kind: str, name: str, out: Any, lengths: Sequence[int]
) -> tuple[list[np.ndarray], dict[str, float]]:
    """A transform or algorithm plugin's result: (one finite float64 array per completion,
    of its length; the extra metrics as floats). Accepted: a TransformOutput (or any
    object with ``token_advantages`` or the original API's ``token_advs``, such as its
    AlgorithmOutput / AdvantageResult, and optional ``extra_metrics``), or a list."""
    arrays = getattr(out, "token_advantages", getattr(out, "token_advs", None))
    if arrays is not None and not isinstance(out, list | tuple | dict):
        extra = dict(getattr(out, "extra_metrics", None) or {})
    elif isinstance(out, list | tuple):
        arrays, extra = out, {}
    else:
        raise PluginError(
            f"{kind} plugin {name!r} must return a TransformOutput (or a list of arrays), "
            f"got {type(out).__name__}"
        )
    if len(arrays) != len(lengths):
        raise PluginError(
            f"{kind} plugin {name!r} returned token advantages for {len(arrays)} "
            f"completion(s); the group has {len(lengths)}"
        )
    where = f"{kind} plugin {name!r}: completion"
    result = [_check_tokens(f"{where} {i}", a, t) for i, (a, t) in enumerate(zip(arrays, lengths))]
    return result, _check_metrics(kind, name, extra)


def _check_tokens(where: str, values: Any, n: int) -> np.ndarray:
    try:
        arr = np.array(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{where} advantages are not numbers") from exc
    if arr.size != n:
        raise PluginError(f"{where} has {n} tokens but {arr.size} token advantages")
    if not np.all(np.isfinite(arr)):
        raise PluginError(f"{where} has NaN or infinite token advantages")
    return arr


def _check_metrics(kind: str, name: str, extra: dict) -> dict[str, float]:
    clean: dict[str, float] = {}
    for k, v in extra.items():
        try:
            clean[str(k)] = float(v)
        except (TypeError, ValueError):
            raise PluginError(
                f"{kind} plugin {name!r}: extra_metrics[{k!r}] is not a number"
            ) from None
    return clean
