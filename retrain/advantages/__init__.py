"""The advantage pipeline: episode advantages (GRPO, MaxRL), token transforms (GTPO,
HICRA, SEPA pooling and amplification, surprisal masking), uncertainty kinds and
planning-token detection. Pure numpy: no torch, no config. Build an
:class:`AdvantagePipeline` once, call it with each step's groups; see
:mod:`retrain.advantages.pipeline` for the order of the steps. The original retrain
plugin API (spec records, ``register_*``) is here too: :mod:`retrain.advantages.spec`."""

from retrain.advantages.adapt import (
    register_advantage_mode,
    register_algorithm_mode,
    register_transform_mode,
    register_uncertainty_kind,
)
from retrain.advantages.context import (
    AlgorithmContext,
    AlgorithmOutput,
    TransformContext,
    TransformOutput,
)
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
from retrain.advantages.spec import (
    AdvantageContext,
    AdvantageOutput,
    AdvantageSpec,
    AlgorithmSpec,
    PostProcessFn,
    TransformSpec,
    UncertaintyContext,
    UncertaintySpec,
    entropy_mask_post_process,
    surprisal_mask_post_process,
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
    "AdvantageContext",
    "AdvantageOutput",
    "AdvantagePipeline",
    "AdvantageSpec",
    "AdvantageStats",
    "AlgorithmContext",
    "AlgorithmOutput",
    "AlgorithmSpec",
    "BatchAdvantages",
    "PlanningDetector",
    "PostProcessFn",
    "RegexPlanningDetector",
    "Segments",
    "SemanticPlanningDetector",
    "TransformContext",
    "TransformOutput",
    "TransformSpec",
    "UncertaintyContext",
    "UncertaintySpec",
    "UncertaintyUnavailableError",
    "compute_token_advantages",
    "compute_uncertainty",
    "entropy_mask_post_process",
    "grpo",
    "gtpo_weights",
    "make_detector",
    "maxrl",
    "parse_grams",
    "predictive_variance",
    "register_advantage_mode",
    "register_algorithm_mode",
    "register_transform_mode",
    "register_uncertainty_kind",
    "requires_entropies",
    "resolve_uncertainty",
    "shannon_entropy",
    "surprisal",
    "surprisal_mask",
    "surprisal_mask_post_process",
    "token_advantages_flat",
    "transform_entropy_mask",
    "transform_gtpo",
    "transform_gtpo_hicra",
    "transform_gtpo_sepa",
    "transform_gtpo_sepa_amp",
    "transform_gtpo_sepa_amp_c",
    "transform_none",
]
