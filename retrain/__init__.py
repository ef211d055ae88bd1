"""retrain: a TOML-first trainer for reinforcement learning with verifiable rewards.

The names below are the plugin API (retrain's own contexts, and the original retrain
API's specs and ``register_*`` functions, both working); they import lazily so that
``import retrain`` (and ``retrain --help``) stays instant.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "TransformContext": "retrain.advantages.context",
    "TransformOutput": "retrain.advantages.context",
    "AlgorithmContext": "retrain.advantages.context",
    "AlgorithmOutput": "retrain.advantages.context",
    **{
        name: "retrain.advantages.spec"
        for name in (
            "AdvantageContext",
            "AdvantageOutput",
            "AdvantageSpec",
            "AlgorithmSpec",
            "PostProcessFn",
            "TransformSpec",
            "UncertaintyContext",
            "UncertaintySpec",
            "entropy_mask_post_process",
            "surprisal_mask_post_process",
        )
    },
    **{
        f"register_{kind}": "retrain.advantages.adapt"
        for kind in ("advantage_mode", "algorithm_mode", "transform_mode", "uncertainty_kind")
    },
    "Example": "retrain.types",
    "load_config": "retrain.config",
    "ConfigError": "retrain.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'retrain' has no attribute {name!r}")
