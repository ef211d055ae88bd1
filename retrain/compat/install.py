"""Installing the compatibility layer into retrain's extension points, once.

- each advantage-pipeline kind's registry gets its adapter
  (:mod:`retrain.compat.plugin_adapters`, via ``Registry.add_adapter``);
- config loading gets the original retrain's key dialect
  (:mod:`retrain.compat.key_dialect`, via ``retrain.config.dialect.install``).

Both are idempotent: installing again changes nothing.
"""

from __future__ import annotations

from retrain import registry
from retrain.compat import plugin_adapters
from retrain.compat.key_dialect import ORIGINAL_DIALECT
from retrain.config import dialect

ADAPTERS = (
    (registry.ADVANTAGE_MODES, plugin_adapters.adapt_advantage),
    (registry.TRANSFORM_MODES, plugin_adapters.adapt_transform),
    (registry.ALGORITHM_MODES, plugin_adapters.adapt_algorithm),
    (registry.UNCERTAINTY_KINDS, plugin_adapters.adapt_uncertainty),
)


def install() -> None:
    """Install the adapters and the key dialect (see the module docstring)."""
    for reg, adapter in ADAPTERS:
        reg.add_adapter(adapter)
    dialect.install(ORIGINAL_DIALECT)
