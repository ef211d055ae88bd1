"""retrain: a TOML-first trainer for reinforcement learning with verifiable rewards."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Imported lazily so `import retrain` (and `retrain --help`) stays instant.
_LAZY = {
    "TransformContext": "retrain.advantages.context",
    "TransformOutput": "retrain.advantages.context",
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
