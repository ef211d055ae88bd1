"""An uncertainty plugin of the original retrain API, as the pipeline calls it.

Such a plugin computes ``compute(ctx: UncertaintyContext)`` for one completion at a
time, reading its planning mask and the transform params: :class:`ContextUncertainty`
is a :class:`~retrain.advantages.uncertainty.PerCompletionUncertainty`, so the pipeline
calls it per completion instead of over the flat token array.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from retrain.advantages.uncertainty import UncertaintyUnavailableError
from retrain.compat.plugin_specs import UncertaintyContext
from retrain.errors import PluginError, RetrainError


class ContextUncertainty:
    """``compute(ctx: UncertaintyContext)`` per completion, one value per token."""

    def __init__(self, name: str, compute: Callable, needs_entropies: bool = False):
        self.name = name
        self.compute = compute
        self.needs_entropies = needs_entropies

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
