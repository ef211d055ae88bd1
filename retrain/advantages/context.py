"""What transform and algorithm plugins receive and return.

A transform plugin (``[algorithm] transform_mode = "pkg.mod.fn"``) is called once per
prompt group as ``fn(ctx: TransformContext) -> TransformOutput`` and returns one array of
token advantages per completion. An algorithm plugin (``[algorithm] algorithm_mode``)
replaces the whole pipeline: ``fn(ctx: AlgorithmContext)`` returns the same (a
TransformOutput, or just the list of arrays) starting from the raw rewards.

All per-token arrays are float64 numpy arrays (planning masks are bool), one per
completion, in the group's completion order. Treat them as read-only.

The contexts also answer to the names of the original retrain plugin API, as plain
Python lists built on first use: ``episode_advantages``, ``logprobs_G``,
``planning_masks_G`` (0/1 ints), ``token_distributions_G`` (always None: no backend
returns full distributions), and for algorithms ``precomputed_entropies_G``; with the
helpers ``ctx.gtpo``, ``ctx.hicra``, ``ctx.sepa_pool`` and ``ctx.sepa_amp`` (see
:mod:`retrain.advantages.spec` for their formulas). ``TransformOutput`` accepts that
API's ``token_advs=`` keyword (and its ``has_stats``, ``stats``, ``needs_planning``,
``uses_sepa_controller``, which retrain records but does not need: it computes the
statistics itself, always detects planning tokens and always runs the SEPA schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from retrain.advantages import spec as _spec


class _OriginalNames:
    """The original API's list views and helpers, shared by both contexts."""

    logprobs_G_T: list[np.ndarray]
    planning_G_T: list[np.ndarray]
    entropies_G_T: list[np.ndarray] | None
    sepa_lambda: float
    gtpo_beta: float
    hicra_alpha: float

    @cached_property
    def logprobs_G(self) -> list[list[float]]:
        return [np.asarray(x, dtype=np.float64).tolist() for x in self.logprobs_G_T]

    @cached_property
    def planning_masks_G(self) -> list[list[int]]:
        return [np.asarray(x, dtype=bool).astype(int).tolist() for x in self.planning_G_T]

    @property
    def token_distributions_G(self) -> None:
        return None

    def gtpo(
        self, advantage: float, surprisals: Sequence[float], beta: float | None = None
    ) -> list[float]:
        """GTPO weighting of one completion (beta defaults to ``[gtpo] beta``)."""
        return _spec.gtpo_list(advantage, surprisals, self.gtpo_beta if beta is None else beta)

    def hicra(
        self, token_advs: Sequence[float], planning_mask: Sequence[int], alpha: float | None = None
    ) -> list[float]:
        """HICRA on one completion (alpha defaults to ``[hicra] alpha``)."""
        return _spec.hicra_list(
            token_advs, planning_mask, self.hicra_alpha if alpha is None else alpha
        )

    def sepa_pool(
        self,
        surprisals: Sequence[float],
        planning_mask: Sequence[int],
        lambda_t: float | None = None,
    ) -> list[float]:
        """SEPA pooling of one completion (lambda defaults to this step's)."""
        lam = self.sepa_lambda if lambda_t is None else lambda_t
        return _spec.sepa_pool_list(surprisals, planning_mask, lam)

    def sepa_amp(
        self,
        surprisals: Sequence[float],
        planning_mask: Sequence[int],
        lambda_t: float | None = None,
    ) -> list[float]:
        """SEPA amplification of one completion (lambda defaults to this step's)."""
        lam = self.sepa_lambda if lambda_t is None else lambda_t
        return _spec.sepa_amp_list(surprisals, planning_mask, lam)


@dataclass
class TransformContext(_OriginalNames):
    """Inputs of a token-level transform, for one prompt group of G completions.

    - ``episode_advantages_G``: the episode-level advantage A_i of each completion.
    - ``logprobs_G_T``: per completion, the logprob of every sampled token.
    - ``uncertainties_G_T``: per completion, h_t of the configured uncertainty kind.
    - ``planning_G_T``: per completion, True where the token is a planning token.
    - ``sepa_lambda``: this step's SEPA pooling strength in [0, 1].
    - ``step``: the training step.
    - ``params``: ``[algorithm.transform_params]`` from the TOML (a dict).
    - ``gtpo_beta``, ``hicra_alpha``: ``[gtpo] beta`` and ``[hicra] alpha``.
    - ``entropies_G_T``: backend-supplied full-vocabulary entropies, or None.
    - ``uncertainty_kind``: the configured kind's name.
    - ``surprisal_mask_rho``: ``[algorithm] surprisal_mask_rho`` (0 = no masking).
    """

    episode_advantages_G: np.ndarray
    logprobs_G_T: list[np.ndarray]
    uncertainties_G_T: list[np.ndarray]
    planning_G_T: list[np.ndarray]
    sepa_lambda: float = 0.0
    step: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    gtpo_beta: float = 0.1
    hicra_alpha: float = 0.2
    entropies_G_T: list[np.ndarray] | None = None
    uncertainty_kind: str = "surprisal"
    surprisal_mask_rho: float = 0.0

    @property
    def num_completions(self) -> int:
        return len(self.logprobs_G_T)

    @property
    def lengths(self) -> list[int]:
        """Number of tokens of each completion."""
        return [len(x) for x in self.logprobs_G_T]

    @cached_property
    def episode_advantages(self) -> list[float]:
        """``episode_advantages_G`` as a list (the original API's name)."""
        return np.asarray(self.episode_advantages_G, dtype=np.float64).tolist()


class TransformOutput:
    """A transform's result: one array of token advantages per completion, plus optional
    scalar metrics (averaged over the step's groups and logged with the step).

    ``token_advs`` is the original API's name for ``token_advantages`` (either keyword
    works); ``has_stats``, ``stats``, ``needs_planning`` and ``uses_sepa_controller`` are
    accepted for that API and kept, unused."""

    def __init__(
        self,
        token_advantages: Sequence[Any] | None = None,
        extra_metrics: dict[str, float] | None = None,
        *,
        token_advs: Sequence[Any] | None = None,
        has_stats: bool = False,
        stats: Any = None,
        needs_planning: bool = False,
        uses_sepa_controller: bool = False,
    ):
        if token_advantages is not None and token_advs is not None:
            raise TypeError("give token_advantages or token_advs, not both")
        chosen = token_advantages if token_advantages is not None else token_advs
        self.token_advantages = list(chosen) if chosen is not None else []
        self.extra_metrics = dict(extra_metrics or {})
        self.has_stats = has_stats
        self.stats = stats
        self.needs_planning = needs_planning
        self.uses_sepa_controller = uses_sepa_controller

    @property
    def token_advs(self) -> list[Any]:
        return self.token_advantages

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.token_advantages)} completion(s), "
            f"extra_metrics={self.extra_metrics!r})"
        )


class AlgorithmOutput(TransformOutput):
    """The original API's algorithm result: ``AlgorithmOutput(token_advs, has_stats=False,
    stats=None, extra_metrics=None)``; a :class:`TransformOutput` in every other way."""

    def __init__(
        self,
        token_advs: Sequence[Any] | None = None,
        has_stats: bool = False,
        stats: Any = None,
        extra_metrics: dict[str, float] | None = None,
        *,
        token_advantages: Sequence[Any] | None = None,
    ):
        super().__init__(
            token_advantages,
            extra_metrics,
            token_advs=token_advs,
            has_stats=has_stats,
            stats=stats,
        )


@dataclass
class AlgorithmContext(_OriginalNames):
    """Inputs of an algorithm plugin (``algorithm_mode``), for one prompt group.

    Like :class:`TransformContext`, but with the raw ``rewards_G`` instead of episode
    advantages, and both parameter tables: ``advantage_params``
    (``[algorithm.advantage_params]``) and ``params`` (``[algorithm.transform_params]``).
    """

    rewards_G: np.ndarray
    logprobs_G_T: list[np.ndarray]
    uncertainties_G_T: list[np.ndarray]
    planning_G_T: list[np.ndarray]
    sepa_lambda: float = 0.0
    step: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    advantage_params: dict[str, Any] = field(default_factory=dict)
    gtpo_beta: float = 0.1
    hicra_alpha: float = 0.2
    entropies_G_T: list[np.ndarray] | None = None
    uncertainty_kind: str = "surprisal"
    surprisal_mask_rho: float = 0.0

    @property
    def num_completions(self) -> int:
        return len(self.logprobs_G_T)

    @cached_property
    def precomputed_entropies_G(self) -> list[list[float]] | None:
        """``entropies_G_T`` as lists (the original API's name), or None."""
        if self.entropies_G_T is None:
            return None
        return [np.asarray(x, dtype=np.float64).tolist() for x in self.entropies_G_T]
