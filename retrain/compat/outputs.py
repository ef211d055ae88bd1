"""retrain's plugin output with the original retrain API's keywords added.

:class:`TransformOutput` accepts that API's ``token_advs=`` keyword for
``token_advantages`` (and its ``has_stats``, ``stats``, ``needs_planning``,
``uses_sepa_controller``, which retrain keeps but does not need: it computes the
statistics itself, always detects planning tokens and always runs the SEPA schedule).
:class:`AlgorithmOutput` is that API's algorithm result. The pipeline's output check
reads either ``token_advantages`` or ``token_advs``, so it needs neither class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retrain.advantages import context as core


class TransformOutput(core.TransformOutput):
    """retrain's :class:`~retrain.advantages.context.TransformOutput`; ``token_advs`` is
    the original API's name for ``token_advantages`` (either keyword works)."""

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
        super().__init__(chosen, extra_metrics)
        self.has_stats = has_stats
        self.stats = stats
        self.needs_planning = needs_planning
        self.uses_sepa_controller = uses_sepa_controller

    @property
    def token_advs(self) -> list[Any]:
        return self.token_advantages


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
