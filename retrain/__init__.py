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
# The plugin API's names (supersets that answer to the original API's names too) and the
# compatibility-aware load_config, from retrain.compat.
_FROM_COMPAT = (
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
    "load_config",
    "register_advantage_mode",
    "register_algorithm_mode",
    "register_transform_mode",
    "register_uncertainty_kind",
    "surprisal_mask_post_process",
)

__all__ = ["__version__", *_FROM_COMPAT, *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _FROM_COMPAT:
        import retrain.compat

        return getattr(retrain.compat, name)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'retrain' has no attribute {name!r}")
