"""Compatibility with the original retrain (github.com/teilomillet/retrain): its configs,
CLI flags and plugin forms, accepted unchanged.

Nothing in retrain's core imports this package (tests/unit/test_compat_boundary.py
checks it); the core exposes extension points, and importing this package installs
itself into them, once (:mod:`retrain.compat.install`): an adapter per plugin kind in
the registry (``Registry.add_adapter``) and the original's key dialect for config loading
(``retrain.config.dialect.install``). It is imported by the CLI (every command, and so
every campaign worker), by the composition root (retrain/build.py, so a run started from
the library resolves original plugin forms too), by the façades ``retrain`` and ``retrain.advantages`` when one of
the names below is asked for, and by library code that wants original configs to load
(``retrain.load_config`` is this package's).

Plugins: :mod:`~retrain.compat.plugin_specs` (spec records), :mod:`~retrain.compat.list_helpers`
(``gtpo_list`` & co., the masking hook), :mod:`~retrain.compat.contexts` and
:mod:`~retrain.compat.outputs` (the contexts and outputs with the original names),
:mod:`~retrain.compat.transform_specs` (how a TransformSpec runs),
:mod:`~retrain.compat.context_uncertainty` (``compute(ctx)`` uncertainties),
:mod:`~retrain.compat.plugin_adapters` (the registry adapters),
:mod:`~retrain.compat.registration` (``register_*``).

Configs: :mod:`~retrain.compat.original_keys` (fields, flags, renamed keys),
:mod:`~retrain.compat.later_keys` (later versions' keys, refused by name),
:mod:`~retrain.compat.toml_normalize`, :mod:`~retrain.compat.key_dialect` (the record the
loader reads), :mod:`~retrain.compat.migrate` (``retrain migrate-config``).
"""

from retrain import ORIGINAL_API  # the names this package serves to the façades
from retrain.compat.contexts import AlgorithmContext, TransformContext
from retrain.compat.install import install
from retrain.compat.list_helpers import entropy_mask_post_process, surprisal_mask_post_process
from retrain.compat.outputs import AlgorithmOutput, TransformOutput
from retrain.compat.plugin_specs import (
    AdvantageContext,
    AdvantageOutput,
    AdvantageSpec,
    AlgorithmSpec,
    PostProcessFn,
    TransformSpec,
    UncertaintyContext,
    UncertaintySpec,
)
from retrain.compat.registration import (
    register_advantage_mode,
    register_algorithm_mode,
    register_transform_mode,
    register_uncertainty_kind,
)

# retrain's own loaders, which read the original's keys once this package is imported:
# taking them from here guarantees that it is.
from retrain.config.load import config_from_dict, load_config

install()

__all__ = [*ORIGINAL_API, "config_from_dict", "install", "load_config"]
