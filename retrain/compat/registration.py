"""The original retrain API's ``register_*`` functions: short names for plugin objects.

``register_transform_mode(name, spec_or_fn)`` & co. keep the object here, in
:data:`REGISTERED`, and add an :class:`~retrain.registry.Entry` pointing at it to the
kind's registry (``Registry.add``, with ``plugin=True``), so config validation,
``retrain explain`` and ``retrain plugins`` know the name, and resolving it passes the
object through the kind's adapters like a dotted path. Registering a name again
replaces it, as in the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from retrain import registry
from retrain.compat.plugin_specs import AdvantageSpec, AlgorithmSpec, TransformSpec, UncertaintySpec
from retrain.compat.transform_specs import is_token_varying

# Objects registered at run time, one namespace per kind; entries point here.
REGISTERED = SimpleNamespace(
    advantage_mode=SimpleNamespace(),
    transform_mode=SimpleNamespace(),
    algorithm_mode=SimpleNamespace(),
    uncertainty_kind=SimpleNamespace(),
)
_PREFIX = f"{__name__}:REGISTERED."


def is_registered(entry: registry.Entry | None) -> bool:
    """True for an entry added by a ``register_*`` call (its target lives here)."""
    return entry is not None and entry.target.startswith(_PREFIX)


def _describe(obj: Any, fallback: str) -> str:
    doc = inspect.getdoc(obj) if callable(obj) and not isinstance(obj, type) else None
    return doc.strip().splitlines()[0] if doc else fallback


def _register(kind: str, name: str, obj: Any, **entry_fields: Any) -> None:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(
            f"{kind} name must be non-empty and cannot contain '.'; use a dotted path in "
            "the TOML for a plugin module"
        )
    reg = registry.ALL_REGISTRIES[kind]
    setattr(getattr(REGISTERED, kind), name, obj)
    entry = registry.Entry(name, f"{_PREFIX}{kind}.{name}", plugin=True, **entry_fields)
    reg.add(entry, replace=True)


def _check_type(kind: str, name: str, obj: Any, spec_type: type) -> None:
    if not isinstance(obj, spec_type) and not callable(obj):
        raise TypeError(
            f"{kind} registration for {name!r} must be a {spec_type.__name__} or a callable, "
            f"got {type(obj).__name__}"
        )


def _description(obj: Any, spec_type: type, what: str) -> str:
    if isinstance(obj, spec_type):
        return f"{what} spec {obj.name!r}"
    return _describe(obj, "registered at run time")


def register_advantage_mode(name: str, compute: Callable | AdvantageSpec) -> None:
    """Add (or replace) the advantage mode `name`: ``compute(rewards[, params])``,
    ``compute(ctx)`` or an :class:`AdvantageSpec`."""
    _check_type("advantage_mode", name, compute, AdvantageSpec)
    _register(
        "advantage_mode", name, compute, description=_describe(compute, "registered at run time")
    )


def register_transform_mode(name: str, spec_or_fn: TransformSpec | Callable) -> None:
    """Add (or replace) the transform mode `name`: a :class:`TransformSpec` or a
    context callable ``fn(ctx: TransformContext)``."""
    _check_type("transform_mode", name, spec_or_fn, TransformSpec)
    varying = not isinstance(spec_or_fn, TransformSpec) or is_token_varying(spec_or_fn)
    description = _description(spec_or_fn, TransformSpec, "transform")
    _register("transform_mode", name, spec_or_fn, description=description, token_varying=varying)


def register_algorithm_mode(name: str, spec_or_fn: AlgorithmSpec | Callable) -> None:
    """Add (or replace) the algorithm mode `name`: an :class:`AlgorithmSpec` or a
    callable ``fn(ctx: AlgorithmContext)``."""
    _check_type("algorithm_mode", name, spec_or_fn, AlgorithmSpec)
    description = _description(spec_or_fn, AlgorithmSpec, "algorithm")
    _register("algorithm_mode", name, spec_or_fn, description=description)


def register_uncertainty_kind(name: str, spec_or_fn: UncertaintySpec | Callable) -> None:
    """Add (or replace) the uncertainty kind `name`: an :class:`UncertaintySpec` or a
    callable ``compute(ctx: UncertaintyContext)`` (one completion per call)."""
    _check_type("uncertainty_kind", name, spec_or_fn, UncertaintySpec)
    description = _description(spec_or_fn, UncertaintySpec, "uncertainty")
    _register("uncertainty_kind", name, spec_or_fn, description=description)
