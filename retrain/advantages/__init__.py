"""The advantage pipeline: episode advantages (GRPO, MaxRL), token transforms (GTPO,
HICRA, SEPA pooling and amplification, surprisal masking), uncertainty kinds and
planning-token detection. Pure numpy: no torch, no config. Build an
:class:`AdvantagePipeline` once, call it with each step's groups; see
:mod:`retrain.advantages.pipeline` for the order of the steps.

The plugin API's names (``TransformContext``, ``TransformOutput``, ``AlgorithmContext``,
``AlgorithmOutput``) and the original retrain API's (``TransformSpec`` & co.,
``register_*``) are served from :mod:`retrain.compat` on first use, so a plugin written
for either API runs unchanged (``from retrain.advantages import TransformSpec``). The
contexts served are supersets of retrain's own in :mod:`retrain.advantages.context`.
"""

from typing import Any

# The original API's names (retrain.ORIGINAL_API) are served lazily by __getattr__ from
# retrain.compat (importing it installs the layer): original plugins import them from here.
from retrain import ORIGINAL_API  # (the root package: no imports of its own)
from retrain.advantages.episode import grpo, maxrl
from retrain.advantages.pipeline import (
    AdvantagePipeline,
    AdvantageStats,
    BatchAdvantages,
    compute_token_advantages,
)
from retrain.advantages.planning import (
    DEFAULT_STRATEGIC_GRAMS,
    PlanningDetector,
    RegexPlanningDetector,
    SemanticPlanningDetector,
    make_detector,
    parse_grams,
)
from retrain.advantages.transforms import (
    Segments,
    gtpo_weights,
    surprisal_mask,
    token_advantages_flat,
    transform_entropy_mask,
    transform_gtpo,
    transform_gtpo_hicra,
    transform_gtpo_sepa,
    transform_gtpo_sepa_amp,
    transform_gtpo_sepa_amp_c,
    transform_none,
)
from retrain.advantages.uncertainty import (
    SURPRISAL_CAP,
    PerCompletionUncertainty,
    UncertaintyUnavailableError,
    compute_uncertainty,
    predictive_variance,
    requires_entropies,
    resolve_uncertainty,
    shannon_entropy,
    surprisal,
)


def __getattr__(name: str) -> Any:
    if name in ORIGINAL_API:
        import retrain.compat

        return getattr(retrain.compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_STRATEGIC_GRAMS",
    "SURPRISAL_CAP",
    "AdvantagePipeline",
    "AdvantageStats",
    "BatchAdvantages",
    "PerCompletionUncertainty",
    "PlanningDetector",
    "RegexPlanningDetector",
    "Segments",
    "SemanticPlanningDetector",
    "UncertaintyUnavailableError",
    "compute_token_advantages",
    "compute_uncertainty",
    "grpo",
    "gtpo_weights",
    "make_detector",
    "maxrl",
    "parse_grams",
    "predictive_variance",
    "requires_entropies",
    "resolve_uncertainty",
    "shannon_entropy",
    "surprisal",
    "surprisal_mask",
    "token_advantages_flat",
    "transform_entropy_mask",
    "transform_gtpo",
    "transform_gtpo_hicra",
    "transform_gtpo_sepa",
    "transform_gtpo_sepa_amp",
    "transform_gtpo_sepa_amp_c",
    "transform_none",
    *ORIGINAL_API,
]
