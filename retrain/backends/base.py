"""The backend protocol, what a backend says about itself, and its options.

Importing this module is cheap (no torch): built-in backends are described by their
entries in :data:`retrain.registry.BACKENDS`; a dotted-path plugin describes itself
with the hooks below (or gets conservative defaults).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from retrain import registry
from retrain.errors import PluginError
from retrain.types import BackendCapabilities, OptionSpec

if TYPE_CHECKING:  # the records the protocol exchanges: import them from retrain.types
    from retrain.types import CheckpointInfo, Datum, Sample, SamplingParams, TrainHyper, TrainResult

CAPABILITY_HOOKS = ("retrain_backend_capabilities", "RETRAIN_BACKEND_CAPABILITIES")
OPTION_SCHEMA_HOOKS = ("retrain_backend_option_schema", "RETRAIN_BACKEND_OPTION_SCHEMA")


def backend_options(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """A built-in backend's `[backend.options]`: its schema's defaults, overridden by the
    (already validated) values the config gives."""
    options = registry.BACKENDS.entry(name).options
    return {**{key: spec.default for key, spec in options.items()}, **given}


@dataclass(frozen=True)
class BackendInfo:
    """What retrain knows of a backend without building it."""

    name: str
    capabilities: BackendCapabilities
    options: dict[str, OptionSpec]
    source: str  # "builtin" | "plugin" | "plugin/default"
    ignores: tuple[str, ...] = ()  # config keys/sections a built-in does not use


def _hook(obj: Any, module: Any, names: tuple[str, ...]) -> Any:
    for holder in (obj, module):
        for name in names:
            value = getattr(holder, name, None)
            if value is not None:
                return value() if callable(value) and not isinstance(value, type) else value
    return None


def _capabilities_from(value: Any, name: str) -> BackendCapabilities:
    if isinstance(value, BackendCapabilities):
        return value
    if not isinstance(value, Mapping):
        raise PluginError(
            f"backend {name}: capability hook returned {type(value).__name__}, expected BackendCapabilities or dict"
        )
    unknown = set(value) - {f.name for f in fields(BackendCapabilities)}
    if unknown:
        raise PluginError(f"backend {name}: capability hook has unknown keys {sorted(unknown)}")
    data = dict(value)
    for key in ("token_data", "loss_options"):
        if key in data:
            data[key] = tuple(data[key])
    return BackendCapabilities(**data)


def _option_from(key: str, spec: Any, name: str) -> OptionSpec:
    if isinstance(spec, OptionSpec):
        return spec
    if not isinstance(spec, Mapping):
        raise PluginError(f"backend {name}: option {key!r} spec must be OptionSpec or dict")
    typ = spec.get("type", spec.get("value_type"))
    return OptionSpec(
        str(getattr(typ, "__name__", typ)),
        spec.get("default"),
        spec.get("help", ""),
        tuple(spec["choices"]) if spec.get("choices") else None,
        spec.get("validator"),
    )


def _options_from(value: Any, name: str) -> dict[str, OptionSpec]:
    if not isinstance(value, Mapping):
        raise PluginError(f"backend {name}: option schema hook must return a mapping")
    return {key: _option_from(key, spec, name) for key, spec in value.items()}


def _plugin_info(name: str, search_paths: tuple[str, ...]) -> BackendInfo:
    obj = registry.BACKENDS.resolve(name, search_paths)
    if not callable(obj):  # a module or a constant: the run would fail constructing it
        raise PluginError(
            f"backend {name!r} names a {type(obj).__name__}, not a backend class (the run "
            "constructs it as Cls(config, tokenizer, say=...)). Fix: the dotted path of the "
            "backend class, pkg.module.ClassName"
        )
    module_name = getattr(obj, "__module__", None)
    module = importlib.import_module(module_name) if module_name else None
    caps = _hook(obj, module, CAPABILITY_HOOKS)
    opts = _hook(obj, module, OPTION_SCHEMA_HOOKS)
    return BackendInfo(
        name,
        _capabilities_from(caps, name) if caps is not None else BackendCapabilities(),
        _options_from(opts, name) if opts is not None else {},
        "plugin" if caps is not None else "plugin/default",
    )


def backend_info(
    name: str, search_paths: tuple[str, ...] = (), *, import_plugins: bool = True
) -> BackendInfo:
    """Capabilities and options of a built-in backend (from its registry entry) or of a
    dotted-path plugin (from its hooks). Plugins without a capability hook get
    conservative defaults (no token advantages) as plugin/default. A built-in name that
    is not built in this version raises PluginError with the fix."""
    entry = registry.BACKENDS.entry(name)
    if entry is not None:
        if not entry.available:
            raise PluginError(registry.BACKENDS.check(name) or entry.not_built)
        return BackendInfo(
            entry.name,
            entry.capabilities or BackendCapabilities(),
            dict(entry.options),
            "builtin",
            entry.ignores,
        )
    if not import_plugins:
        return BackendInfo(name, BackendCapabilities(), {}, "plugin/default")
    return _plugin_info(name, search_paths)


# ---------------------------------------------------------------- the protocol


@runtime_checkable
class Backend(Protocol):
    capabilities: BackendCapabilities

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` completions for each prompt (token ids)."""

    def train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        """One optimizer step on the datums."""

    def save_checkpoint(self, directory: Path) -> CheckpointInfo:
        """Save weights (+ optimizer) as `directory` (`adapter_path/checkpoint_step_N` or
        `adapter_path/final`; a remote backend uses its last part as the checkpoint name).
        The record's `adapter` says where the adapter can be read."""

    def load_checkpoint(self, info: CheckpointInfo) -> None:
        """Restore what save_checkpoint returned."""

    def close(self) -> None: ...
