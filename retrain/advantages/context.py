"""What transform and algorithm plugins receive and return.

A transform plugin (``[algorithm] transform_mode = "pkg.mod.fn"``) is called once per
prompt group as ``fn(ctx: TransformContext) -> TransformOutput`` and returns one array of
token advantages per completion. An algorithm plugin (``[algorithm] algorithm_mode``)
replaces the whole pipeline: ``fn(ctx: AlgorithmContext)`` returns the same (a
TransformOutput, or just the list of arrays) starting from the raw rewards.

All per-token arrays are float64 numpy arrays (planning masks are bool), one per
completion, in the group's completion order. Treat them as read-only.

These are retrain's own names only. The original retrain API's names
(``ctx.episode_advantages``, ``ctx.logprobs_G``, ``ctx.gtpo(...)``,
``TransformOutput(token_advs=...)``, ``AlgorithmOutput``) are subclasses of these in
:mod:`retrain.compat.contexts` and :mod:`retrain.compat.outputs`; ``retrain`` and
``retrain.advantages`` export those supersets, so a plugin may use either set of names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TransformContext:
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


class TransformOutput:
    """A transform's result: one array of token advantages per completion, plus optional
    scalar metrics (averaged over the step's groups and logged with the step)."""

    def __init__(
        self,
        token_advantages: Sequence[Any] | None = None,
        extra_metrics: dict[str, float] | None = None,
    ):
        self.token_advantages = list(token_advantages) if token_advantages is not None else []
        self.extra_metrics = dict(extra_metrics or {})

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.token_advantages)} completion(s), "
            f"extra_metrics={self.extra_metrics!r})"
        )


@dataclass
class AlgorithmContext:
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
