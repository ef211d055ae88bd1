"""Turning what a plugin name points at into what the pipeline calls, and the original
API's ``register_*`` functions.

A dotted path (or a name registered at run time) may point at a callable in retrain's
own conventions, at a spec object of the original API (:mod:`retrain.advantages.spec`),
or at a zero-argument factory returning either. The ``as_*`` functions below reduce all
of these to one calling convention per kind:

- transform: ``fn(ctx: TransformContext)`` (a :class:`TransformSpec` runs as its
  module docstring says);
- algorithm: ``fn(ctx: AlgorithmContext)``;
- advantage: ``fn(rewards: list, params: dict)`` (one-argument plugins, ``params=``
  keyword plugins and ``fn(ctx: AdvantageContext)`` are wrapped);
- uncertainty: a flat ``fn(logprobs, entropies)`` as before, or a
  :class:`ContextUncertainty` for ``compute(ctx: UncertaintyContext)`` plugins, which
  the pipeline calls once per completion.

``register_transform_mode(name, spec_or_fn)`` & co. store the object here and add an
:class:`~retrain.registry.Entry` to the kind's registry (``Registry.add``), so config
validation, ``retrain explain`` and ``retrain plugins`` know the name. Registering a
name again replaces it, as in the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from retrain import registry
from retrain.advantages.context import TransformContext, TransformOutput
from retrain.advantages.spec import (
    AdvantageContext,
    AdvantageOutput,
    AdvantageSpec,
    AlgorithmSpec,
    TransformSpec,
    UncertaintyContext,
    UncertaintySpec,
    gtpo_list,
    hicra_list,
)
from retrain.advantages.uncertainty import UncertaintyUnavailableError, positional_arity
from retrain.errors import PluginError, RetrainError

# Objects registered at run time, one namespace per kind; entries point here.
REGISTERED = SimpleNamespace(
    advantage_mode=SimpleNamespace(),
    transform_mode=SimpleNamespace(),
    algorithm_mode=SimpleNamespace(),
    uncertainty_kind=SimpleNamespace(),
)
_PREFIX = f"{__name__}:REGISTERED."

# ------------------------------------------------------------------ shared


def is_registered(entry: registry.Entry | None) -> bool:
    """True for an entry added by a ``register_*`` call (its target lives here)."""
    return entry is not None and entry.target.startswith(_PREFIX)


def _first_parameter(fn: Callable) -> str:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ""
    return params[0].name if params else ""


def _takes_context(fn: Callable) -> bool:
    return positional_arity(fn) == 1 and _first_parameter(fn) in ("ctx", "context")


def _unfactory(kind: str, name: str, obj: Any, spec_type: type) -> Any:
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


def _not_callable(kind: str, name: str, obj: Any) -> PluginError:
    return PluginError(f"{kind} plugin {name!r} is not callable (got {type(obj).__name__})")


# ------------------------------------------------------------------ transforms


def run_transform_spec(spec: TransformSpec, ctx: TransformContext) -> Any:
    """One prompt group through a :class:`TransformSpec` (see retrain.advantages.spec)."""
    if spec.compute_context is not None:
        return spec.compute_context(ctx)
    episode = ctx.episode_advantages
    if not spec.use_gtpo:
        return TransformOutput([[a] * n for a, n in zip(episode, ctx.lengths)])
    masks = ctx.planning_masks_G if spec.needs_planning else [[0] * n for n in ctx.lengths]
    lam = ctx.sepa_lambda if spec.uses_sepa_controller else 0.0
    raw = [np.asarray(h, dtype=np.float64).tolist() for h in ctx.uncertainties_G_T]
    advs = []
    for a, h, mask in zip(episode, raw, masks):
        if spec.entropy_transform is not None:
            h = spec.entropy_transform(list(h), list(mask), lam)
        token_advs = gtpo_list(a, h, ctx.gtpo_beta)
        if spec.apply_hicra:
            token_advs = hicra_list(token_advs, mask, ctx.hicra_alpha)
        advs.append(token_advs)
    if spec.post_process is None:
        return TransformOutput(advs)
    params = {
        "uncertainty_kind": ctx.uncertainty_kind,
        "surprisal_mask_rho": ctx.surprisal_mask_rho,
        "entropy_mask_rho": ctx.surprisal_mask_rho,
        **ctx.params,
    }
    out, metrics = spec.post_process(advs, [list(h) for h in raw], params)
    return TransformOutput(out, metrics)


def as_transform(name: str, obj: Any) -> Callable[[TransformContext], Any]:
    obj = _unfactory("transform_mode", name, obj, TransformSpec)
    if isinstance(obj, TransformSpec):
        spec = obj

        def run_spec(ctx: TransformContext) -> Any:
            return run_transform_spec(spec, ctx)

        run_spec.__name__ = f"transform_spec[{spec.name}]"
        return run_spec
    if not callable(obj):
        raise _not_callable("transform_mode", name, obj)
    return obj


def as_algorithm(name: str, obj: Any) -> Callable:
    obj = _unfactory("algorithm_mode", name, obj, AlgorithmSpec)
    if isinstance(obj, AlgorithmSpec):
        return obj.compute
    if not callable(obj):
        raise _not_callable("algorithm_mode", name, obj)
    return obj


# ------------------------------------------------------------------ advantages


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


def as_advantage(name: str, obj: Any) -> Callable[[list[float], dict], Any]:
    """``fn(rewards, params)`` for any advantage plugin form; the output is the plugin's
    own (an :class:`AdvantageOutput` is unwrapped), checked by the caller."""
    obj = _unfactory("advantage_mode", name, obj, AdvantageSpec)
    if isinstance(obj, AdvantageSpec):
        return obj.compute
    if not callable(obj):
        raise _not_callable("advantage_mode", name, obj)
    fn = obj
    if _takes_context(fn):

        def with_context(rewards: list[float], params: dict) -> Any:
            out = fn(AdvantageContext(rewards=rewards, params=params))
            return out.advantages if isinstance(out, AdvantageOutput) else out

        return with_context
    if positional_arity(fn) >= 2:
        return fn
    if _accepts_params_keyword(fn):
        return lambda rewards, params: fn(rewards, params=params)
    return lambda rewards, params: fn(rewards)


# ------------------------------------------------------------------ uncertainty


class ContextUncertainty:
    """An uncertainty plugin of the original API: ``compute(ctx: UncertaintyContext)``
    per completion, returning one value per token."""

    def __init__(self, name: str, compute: Callable, needs_entropies: bool = False):
        self.name = name
        self.compute = compute
        self.needs_entropies = needs_entropies

    def __call__(self, logprobs_T: np.ndarray, entropies_T: np.ndarray | None = None) -> np.ndarray:
        """All tokens as one completion without planning tokens (``compute_uncertainty``)."""
        lp = np.asarray(logprobs_T, dtype=np.float64).reshape(-1)
        ent = None if entropies_T is None else [np.asarray(entropies_T, dtype=np.float64)]
        return self.per_completion([lp], ent, [np.zeros(lp.size, dtype=bool)], {})

    def per_completion(
        self,
        logprobs: Sequence[np.ndarray],
        entropies: Sequence[np.ndarray] | None,
        planning: Sequence[np.ndarray],
        params: Mapping[str, Any],
    ) -> np.ndarray:
        """h of every token, the completions concatenated (a checked float64 array)."""
        if self.needs_entropies and entropies is None:
            raise UncertaintyUnavailableError(
                f"uncertainty_kind {self.name!r} needs per-token entropies "
                "(needs_distributions=True) and the backend returned none"
            )
        out = []
        for i, lp in enumerate(logprobs):
            ctx = UncertaintyContext(
                logprobs=lp.tolist(),
                precomputed_entropy=None if entropies is None else entropies[i].tolist(),
                planning_mask=np.asarray(planning[i], dtype=int).tolist(),
                params=params,
            )
            out.append(self._checked(i, self._call(ctx), lp.size))
        return np.concatenate(out) if out else np.zeros(0)

    def _call(self, ctx: UncertaintyContext) -> Any:
        try:
            return self.compute(ctx)
        except RetrainError:
            raise
        except Exception as exc:
            raise PluginError(
                f"uncertainty_kind plugin {self.name!r} raised {type(exc).__name__}: {exc}"
            ) from exc

    def _checked(self, i: int, values: Any, n: int) -> np.ndarray:
        try:
            h = np.asarray(values, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise PluginError(
                f"uncertainty_kind plugin {self.name!r} must return numbers "
                f"(completion {i}), got {type(values).__name__}"
            ) from exc
        if h.size != n:
            raise PluginError(
                f"uncertainty_kind plugin {self.name!r} returned {h.size} value(s) for "
                f"completion {i} of {n} tokens: one value per token"
            )
        if not np.all(np.isfinite(h)):
            raise PluginError(
                f"uncertainty_kind plugin {self.name!r} returned NaN or infinite values"
            )
        return h


def as_uncertainty(name: str, obj: Any, *, context_style: bool = False) -> Any:
    """A :class:`ContextUncertainty` for the original API's forms (a spec, a factory, a
    callable whose first parameter is ``ctx``/``context``, or any callable when
    `context_style`), else `obj` itself (retrain's flat ``fn(logprobs[, entropies])``)."""
    obj = _unfactory("uncertainty_kind", name, obj, UncertaintySpec)
    if isinstance(obj, UncertaintySpec):
        return ContextUncertainty(name, obj.compute, obj.needs_distributions)
    if not callable(obj):
        raise _not_callable("uncertainty_kind", name, obj)
    if context_style or _takes_context(obj):
        return ContextUncertainty(name, obj)
    return obj


# ------------------------------------------------------------------ registration


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
    entry = registry.Entry(name, f"{_PREFIX}{kind}.{name}", **entry_fields)
    reg.add(entry, replace=True)


def _check_type(kind: str, name: str, obj: Any, spec_type: type) -> None:
    if not isinstance(obj, spec_type) and not callable(obj):
        raise TypeError(
            f"{kind} registration for {name!r} must be a {spec_type.__name__} or a callable, "
            f"got {type(obj).__name__}"
        )


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
    varying = not (
        isinstance(spec_or_fn, TransformSpec)
        and spec_or_fn.compute_context is None
        and not spec_or_fn.use_gtpo
    )
    what = f"transform spec {spec_or_fn.name!r}" if isinstance(spec_or_fn, TransformSpec) else ""
    description = what or _describe(spec_or_fn, "registered at run time")
    _register("transform_mode", name, spec_or_fn, description=description, token_varying=varying)


def register_algorithm_mode(name: str, spec_or_fn: AlgorithmSpec | Callable) -> None:
    """Add (or replace) the algorithm mode `name`: an :class:`AlgorithmSpec` or a
    callable ``fn(ctx: AlgorithmContext)``."""
    _check_type("algorithm_mode", name, spec_or_fn, AlgorithmSpec)
    what = f"algorithm spec {spec_or_fn.name!r}" if isinstance(spec_or_fn, AlgorithmSpec) else ""
    _register(
        "algorithm_mode",
        name,
        spec_or_fn,
        description=what or _describe(spec_or_fn, "registered at run time"),
    )


def register_uncertainty_kind(name: str, spec_or_fn: UncertaintySpec | Callable) -> None:
    """Add (or replace) the uncertainty kind `name`: an :class:`UncertaintySpec` or a
    callable ``compute(ctx: UncertaintyContext)`` (one completion per call)."""
    _check_type("uncertainty_kind", name, spec_or_fn, UncertaintySpec)
    what = (
        f"uncertainty spec {spec_or_fn.name!r}" if isinstance(spec_or_fn, UncertaintySpec) else ""
    )
    _register(
        "uncertainty_kind",
        name,
        spec_or_fn,
        description=what or _describe(spec_or_fn, "registered at run time"),
    )
