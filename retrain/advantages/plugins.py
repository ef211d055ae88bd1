"""Resolving the pipeline's names into callables, calling plugins, checking their output.

Everything here runs when an :class:`~retrain.advantages.pipeline.AdvantagePipeline` is
built (resolution) or on each plugin call (calling and validation). A built-in name is
read from its :class:`~retrain.registry.Entry`; a dotted path is imported through the
same registry, and a registry's adapters (``Registry.resolve_plugin``) turn plugins of
another convention into the kind's own (retrain.compat installs those of the original
retrain API). Errors name the plugin: an unknown name, a target that is not callable,
an exception inside the plugin or a malformed result all raise
:class:`~retrain.errors.PluginError`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from retrain import registry
from retrain.errors import PluginError, RetrainError

# The kept groups' rewards (one array per group), the advantage params and the groups'
# completion lengths (trained tokens, one array per group; read by a built-in whose entry
# says `reads_lengths`) -> one episode advantage per completion, all groups concatenated.
EpisodeFn = Callable[[list[np.ndarray], dict, list[np.ndarray]], np.ndarray]

# ------------------------------------------------------------------ resolution


def builtin_entry(reg: registry.Registry, name: str) -> registry.Entry | None:
    """The registry entry of a built-in `name`, None for a dotted path. An unknown or
    unbuilt name raises PluginError listing the valid names."""
    problem = reg.check(name)
    if problem:
        raise PluginError(problem)
    return reg.entry(name)


def positional_arity(fn: Callable) -> int:
    """How many positional arguments `fn` can take (2 means 'two or more')."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 2
    n = 0
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return 2
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            n += 1
    return min(n, 2)


def resolve_callable(reg: registry.Registry, name: str, search_paths: Iterable[str]) -> Callable:
    """The plugin (dotted path or run-time registration) behind `name`, through the
    kind's adapters; PluginError when the result is not callable."""
    fn = reg.resolve_plugin(name, search_paths)
    if not callable(fn):
        raise PluginError(f"{reg.kind} plugin {name!r} is not callable (got {type(fn).__name__})")
    return fn


def _rewards_and_params(fn: Callable) -> Callable[[list[float], dict], Any]:
    """An advantage plugin as ``fn(rewards, params)``: one taking only the rewards
    (one positional parameter) is called without the params."""
    if positional_arity(fn) >= 2:
        return fn
    return lambda rewards, params: fn(rewards)


def episode_fn(name: str, search_paths: Iterable[str]) -> EpisodeFn:
    """The advantage mode `name` as an :data:`EpisodeFn`: a built-in's batched form when
    its entry names one (one call for all groups), else one call per group."""
    entry = builtin_entry(registry.ADVANTAGE_MODES, name)
    if entry is not None and entry.grouped:
        grouped = registry.import_object(entry.grouped)
        reads_lengths = entry.reads_lengths

        def run_grouped(rewards: list[np.ndarray], params: dict, lengths: list) -> np.ndarray:
            sizes = np.array([r.size for r in rewards], dtype=np.int64)
            args = (np.concatenate(rewards), sizes, params)
            if reads_lengths:
                return np.asarray(grouped(*args, lengths=np.concatenate(lengths)), np.float64)
            return np.asarray(grouped(*args), dtype=np.float64)

        return run_grouped
    if entry is not None and not entry.plugin:
        fn = registry.ADVANTAGE_MODES.resolve(name)

        def run_builtin(rewards: list[np.ndarray], params: dict, lengths: list) -> np.ndarray:
            return np.concatenate([np.asarray(fn(r, params), dtype=np.float64) for r in rewards])

        return run_builtin
    plugin = _rewards_and_params(resolve_callable(registry.ADVANTAGE_MODES, name, search_paths))

    def run_plugin(rewards: list[np.ndarray], params: dict, lengths: list) -> np.ndarray:
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
    AlgorithmOutput / AdvantageResult, and optional ``extra_metrics``), or a list.
    (Reading ``token_advs`` by name keeps that API's own result types working without
    this module knowing them.)"""
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
