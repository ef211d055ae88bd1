"""The advantage pipeline: episode advantages (GRPO, MaxRL), token transforms (GTPO,
HICRA, SEPA), uncertainty kinds and planning-token detection. Pure numpy: no torch, no
config. Build an :class:`AdvantagePipeline` once, call it with each step's groups; see
:mod:`retrain.advantages.pipeline` for the order of the steps."""

from retrain.advantages.context import AlgorithmContext, TransformContext, TransformOutput
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
    token_advantages_flat,
    transform_gtpo,
    transform_gtpo_hicra,
    transform_gtpo_sepa,
    transform_none,
)
from retrain.advantages.uncertainty import (
    SURPRISAL_CAP,
    UncertaintyUnavailableError,
    compute_uncertainty,
    predictive_variance,
    requires_entropies,
    resolve_uncertainty,
    shannon_entropy,
    surprisal,
)

__all__ = [
    "DEFAULT_STRATEGIC_GRAMS",
    "SURPRISAL_CAP",
    "AdvantagePipeline",
    "AdvantageStats",
    "AlgorithmContext",
    "BatchAdvantages",
    "PlanningDetector",
    "RegexPlanningDetector",
    "Segments",
    "SemanticPlanningDetector",
    "TransformContext",
    "TransformOutput",
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
    "token_advantages_flat",
    "transform_gtpo",
    "transform_gtpo_hicra",
    "transform_gtpo_sepa",
    "transform_none",
]
