"""retrain: a TOML-first trainer for reinforcement learning with verifiable rewards.

The names below are the plugin API (retrain's own contexts, and the original retrain
API's specs and ``register_*`` functions, both working) and ``load_config``, which
reads the original retrain's configs too. They import lazily so that ``import retrain``
(and ``retrain --help``) stays instant; all but ``Example`` and ``ConfigError`` come from
:mod:`retrain.compat`, whose import installs the compatibility layer.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {"Example": "retrain.types", "ConfigError": "retrain.errors"}
# The original retrain's plugin API, served from retrain.compat (the contexts and outputs
# there are supersets of retrain's own, answering to the original names too); also served
# by retrain.advantages, and listed once, here.
ORIGINAL_API = (
    "AdvantageContext",
    "AdvantageOutput",
    "AdvantageSpec",
    "AlgorithmContext",
    "AlgorithmOutput",
    "AlgorithmSpec",
    "PostProcessFn",
    "TransformContext",
    "TransformOutput",
    "TransformSpec",
    "UncertaintyContext",
    "UncertaintySpec",
    "entropy_mask_post_process",
    "register_advantage_mode",
    "register_algorithm_mode",
    "register_transform_mode",
    "register_uncertainty_kind",
    "surprisal_mask_post_process",
)
_FROM_COMPAT = (*ORIGINAL_API, "load_config")  # and the compatibility-aware loader

__all__ = ["__version__", *_FROM_COMPAT, *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _FROM_COMPAT:
        import retrain.compat

        return getattr(retrain.compat, name)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'retrain' has no attribute {name!r}")
