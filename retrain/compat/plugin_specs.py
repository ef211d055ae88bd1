"""The original retrain API's plugin records: spec objects and the contexts of its
advantage and uncertainty plugins.

A dotted path in the TOML (or a name given to ``register_*``) may name

- a context callable ``fn(ctx)`` (transform, algorithm; for an advantage mode or an
  uncertainty kind a first parameter named ``ctx`` or ``context``),
- a spec object (:class:`TransformSpec`, :class:`AdvantageSpec`,
  :class:`AlgorithmSpec`, :class:`UncertaintySpec`),
- or a zero-argument factory returning either (the README's ``make_transform_spec``);

:mod:`retrain.compat.plugin_adapters` turns each into its kind's calling convention.
How a :class:`TransformSpec` runs is in :mod:`retrain.compat.transform_specs`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retrain.compat.contexts import AlgorithmContext, TransformContext

EntropyTransformFn = Callable[[list[float], list[int], float], list[float]]
PostProcessFn = Callable[
    [list[list[float]], list[list[float]], Mapping[str, object]],
    tuple[list[list[float]], dict[str, float]],
]


@dataclass(frozen=True)
class AdvantageContext:
    """What a context-style advantage plugin ``fn(ctx)`` receives (one group)."""

    rewards: list[float]
    params: Mapping[str, object] = field(default_factory=dict)
    step: int = 0


@dataclass
class AdvantageOutput:
    """What a context-style advantage plugin may return."""

    advantages: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class AdvantageSpec:
    """An advantage mode: ``compute(rewards, params) -> one advantage per reward``."""

    name: str
    compute: Callable[[list[float], Mapping[str, object]], Sequence[float]]


@dataclass(frozen=True)
class TransformSpec:
    """A transform mode described by flags and hooks (see
    :mod:`retrain.compat.transform_specs` for how they run)."""

    name: str
    use_gtpo: bool = True
    needs_planning: bool = False
    uses_sepa_controller: bool = False
    apply_hicra: bool = False
    entropy_transform: EntropyTransformFn | None = None
    post_process: PostProcessFn | None = None
    compute_context: Callable[[TransformContext], Any] | None = None


@dataclass(frozen=True)
class AlgorithmSpec:
    """An algorithm mode: ``compute(ctx: AlgorithmContext)`` returns token advantages."""

    name: str
    compute: Callable[[AlgorithmContext], Any]
    needs_planning: bool = False
    uses_sepa_controller: bool = False


@dataclass(frozen=True)
class UncertaintyContext:
    """What an uncertainty plugin ``compute(ctx)`` receives: one completion."""

    logprobs: list[float]
    token_distributions: list[list[float]] | None = None
    precomputed_entropy: list[float] | None = None
    planning_mask: list[int] | None = None
    params: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class UncertaintySpec:
    """An uncertainty kind: ``compute(ctx: UncertaintyContext) -> one value per token``.
    ``needs_distributions`` asks for the backend's per-token entropies."""

    name: str
    compute: Callable[[UncertaintyContext], Sequence[float]]
    needs_distributions: bool = False
