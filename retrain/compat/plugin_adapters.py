"""Registry adapters: the original retrain API's plugin objects in each kind's calling
convention.

Each ``adapt_*`` is a :data:`retrain.registry.PluginAdapter`, installed into its kind's
registry by :mod:`retrain.compat.install`; the registry calls it with what a dotted
path or a ``register_*`` name points at. A zero-argument callable is a factory, called
once; then:

- transform: a :class:`TransformSpec` runs as :mod:`retrain.compat.transform_specs`
  says; any callable is called with the context's original-API view
  (:mod:`retrain.compat.contexts`), which retrain's own plugins read like their own.
- algorithm: an :class:`AlgorithmSpec`'s ``compute``, or any callable, likewise with
  the view.
- advantage: an :class:`AdvantageSpec`'s ``compute``; ``fn(ctx: AdvantageContext)``
  (first parameter ``ctx``/``context``) and ``fn(rewards, *, params)`` are wrapped as
  ``fn(rewards, params)``; other callables are retrain's own form.
- uncertainty: an :class:`UncertaintySpec`, a ``compute(ctx)`` callable or any
  callable given to ``register_uncertainty_kind`` becomes a
  :class:`~retrain.compat.context_uncertainty.ContextUncertainty`; other callables are
  retrain's flat form.

An adapter returns None for what it leaves to the kind's own convention (or to the
core's "not callable" error).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from retrain.advantages.plugins import positional_arity
from retrain.compat.context_uncertainty import ContextUncertainty
from retrain.compat.contexts import AlgorithmContext, TransformContext
from retrain.compat.plugin_specs import (
    AdvantageContext,
    AdvantageOutput,
    AdvantageSpec,
    AlgorithmSpec,
    TransformSpec,
    UncertaintySpec,
)
from retrain.compat.registration import is_registered
from retrain.compat.transform_specs import run_transform_spec
from retrain.errors import PluginError, RetrainError
from retrain.registry import Entry


def _first_parameter(fn: Callable) -> str:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ""
    return params[0].name if params else ""


def _takes_context(fn: Callable) -> bool:
    return positional_arity(fn) == 1 and _first_parameter(fn) in ("ctx", "context")


def _accepts_params_keyword(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "params" and p.kind is inspect.Parameter.KEYWORD_ONLY)
        for p in params
    )


def unfactory(kind: str, name: str, obj: Any, spec_type: type) -> Any:
    """A zero-argument callable is a factory: call it (once) and use what it returns."""
    if isinstance(obj, spec_type) or not callable(obj) or positional_arity(obj) != 0:
        return obj
    try:
        built = obj()
    except RetrainError:
        raise
    except Exception as exc:
        raise PluginError(
            f"{kind} plugin {name!r}: its factory raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(built, spec_type) and not callable(built):
        raise PluginError(
            f"{kind} plugin {name!r}: its factory returned {type(built).__name__}; "
            f"expected a {spec_type.__name__} or a callable"
        )
    return built


def _with_view(fn: Callable, view: type[TransformContext] | type[AlgorithmContext]) -> Callable:
    """`fn` called with the original-API view of the context the pipeline passes."""

    def call(ctx: Any) -> Any:
        return fn(view.view(ctx))

    call.__name__ = getattr(fn, "__name__", type(fn).__name__)
    return call


def adapt_transform(name: str, obj: Any, entry: Entry | None) -> Callable | None:
    obj = unfactory("transform_mode", name, obj, TransformSpec)
    if isinstance(obj, TransformSpec):
        spec = obj

        def run_spec(ctx: TransformContext) -> Any:
            return run_transform_spec(spec, ctx)

        run_spec.__name__ = f"transform_spec[{spec.name}]"
        return _with_view(run_spec, TransformContext)
    return _with_view(obj, TransformContext) if callable(obj) else None


def adapt_algorithm(name: str, obj: Any, entry: Entry | None) -> Callable | None:
    obj = unfactory("algorithm_mode", name, obj, AlgorithmSpec)
    if isinstance(obj, AlgorithmSpec):
        return _with_view(obj.compute, AlgorithmContext)
    return _with_view(obj, AlgorithmContext) if callable(obj) else None


def adapt_advantage(name: str, obj: Any, entry: Entry | None) -> Callable | None:
    built = unfactory("advantage_mode", name, obj, AdvantageSpec)
    if isinstance(built, AdvantageSpec):
        return built.compute
    if not callable(built):
        return None
    fn = built
    if _takes_context(fn):

        def with_context(rewards: list[float], params: dict) -> Any:
            out = fn(AdvantageContext(rewards=rewards, params=params))
            return out.advantages if isinstance(out, AdvantageOutput) else out

        return with_context
    if positional_arity(fn) < 2 and _accepts_params_keyword(fn):
        return lambda rewards, params: fn(rewards, params=params)
    # a factory's product is returned even in retrain's own form: it replaces the factory
    return fn if fn is not obj else None


def adapt_uncertainty(name: str, obj: Any, entry: Entry | None) -> Any:
    built = unfactory("uncertainty_kind", name, obj, UncertaintySpec)
    if isinstance(built, UncertaintySpec):
        return ContextUncertainty(name, built.compute, built.needs_distributions)
    if not callable(built):
        return None
    # a registered callable is the original API's form whatever its parameter is called
    if is_registered(entry) or _takes_context(built):
        return ContextUncertainty(name, built)
    return built if built is not obj else None
