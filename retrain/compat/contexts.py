"""retrain's plugin contexts with the original retrain API's names added.

:class:`TransformContext` and :class:`AlgorithmContext` are subclasses of retrain's own
(:mod:`retrain.advantages.context`) that also answer, as plain Python lists built on
first use, to ``episode_advantages``, ``logprobs_G``, ``planning_masks_G`` (0/1 ints),
``token_distributions_G`` (always None: no backend returns full distributions) and, for
algorithms, ``precomputed_entropies_G``; with the helpers ``ctx.gtpo``, ``ctx.hicra``,
``ctx.sepa_pool`` and ``ctx.sepa_amp`` (formulas in :mod:`retrain.compat.list_helpers`).

The pipeline builds retrain's own contexts; the adapters
(:mod:`retrain.compat.plugin_adapters`) hand every transform and algorithm plugin a
:meth:`view` of them as these classes, which ``retrain`` and ``retrain.advantages``
export under the plain names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from functools import cached_property
from typing import Any, Self

import numpy as np

from retrain.advantages import context as core
from retrain.compat import list_helpers


class _OriginalNames:
    """The original API's list views and helpers, shared by both contexts."""

    logprobs_G_T: list[np.ndarray]
    planning_G_T: list[np.ndarray]
    sepa_lambda: float
    gtpo_beta: float
    hicra_alpha: float

    @classmethod
    def view(cls, ctx: Any) -> Self:
        """`ctx` (retrain's own context) as this class: the same field values, shared."""
        if isinstance(ctx, cls):
            return ctx
        return cls(**{f.name: getattr(ctx, f.name) for f in fields(ctx)})

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
        return list_helpers.gtpo_list(
            advantage, surprisals, self.gtpo_beta if beta is None else beta
        )

    def hicra(
        self, token_advs: Sequence[float], planning_mask: Sequence[int], alpha: float | None = None
    ) -> list[float]:
        """HICRA on one completion (alpha defaults to ``[hicra] alpha``)."""
        return list_helpers.hicra_list(
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
        return list_helpers.sepa_pool_list(surprisals, planning_mask, lam)

    def sepa_amp(
        self,
        surprisals: Sequence[float],
        planning_mask: Sequence[int],
        lambda_t: float | None = None,
    ) -> list[float]:
        """SEPA amplification of one completion (lambda defaults to this step's)."""
        lam = self.sepa_lambda if lambda_t is None else lambda_t
        return list_helpers.sepa_amp_list(surprisals, planning_mask, lam)


class TransformContext(core.TransformContext, _OriginalNames):
    """retrain's :class:`~retrain.advantages.context.TransformContext`, plus the original
    API's names (see the module docstring)."""

    @cached_property
    def episode_advantages(self) -> list[float]:
        """``episode_advantages_G`` as a list (the original API's name)."""
        return np.asarray(self.episode_advantages_G, dtype=np.float64).tolist()


class AlgorithmContext(core.AlgorithmContext, _OriginalNames):
    """retrain's :class:`~retrain.advantages.context.AlgorithmContext`, plus the original
    API's names (see the module docstring)."""

    @cached_property
    def precomputed_entropies_G(self) -> list[list[float]] | None:
        """``entropies_G_T`` as lists (the original API's name), or None."""
        if self.entropies_G_T is None:
            return None
        return [np.asarray(x, dtype=np.float64).tolist() for x in self.entropies_G_T]
