"""The backend protocol, its capability record and option schemas.

Importing this module is cheap (no torch): `explain`, `backends` and config
validation read capabilities and option schemas without loading a backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from retrain import registry
from retrain.errors import PluginError
from retrain.types import (
    BackendCapabilities,
    Datum,
    OptionSpec,
    Sample,
    SamplingParams,
    TrainHyper,
    TrainResult,
)

BackendOptionSpec = OptionSpec  # TODO(helper A): drop


def backend_options(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """A built-in backend's `[backend.options]`: its schema's defaults, overridden by the
    (already validated) values the config gives."""
    options = registry.BACKENDS.entry(name).options
    return {**{key: spec.default for key, spec in options.items()}, **given}


def _positive(value: Any) -> str | None:
    return None if value > 0 else f"must be > 0, got {value!r}"


def _strict_only(value: Any) -> str | None:
    return (
        None
        if value
        else "strict_advantages=false is not allowed: it would silently aggregate token advantages"
    )


BUILTIN_CAPABILITIES: dict[str, BackendCapabilities] = {
    "local": BackendCapabilities(True, True, True, False, token_data=("entropy",)),
    "tinker": BackendCapabilities(True, True, True, True),
    "prime_rl": BackendCapabilities(False, False, True, False),
}

BUILTIN_OPTIONS: dict[str, dict[str, BackendOptionSpec]] = {
    "local": {
        "micro_batch_tokens": BackendOptionSpec(
            "int",
            4096,
            "Token budget per forward/backward micro-batch (bounds memory)",
            validator=_positive,
        ),
        "threads": BackendOptionSpec("int", 0, "torch CPU threads. 0 = torch's default"),
        "prompt_batch": BackendOptionSpec(
            "int", 0, "Prompts sampled together in one generate call. 0 = all of the step's prompts"
        ),
    },
    "tinker": {
        "max_retries": BackendOptionSpec(
            "int", 5, "Attempts per Tinker call before giving up", validator=_positive
        ),
        "retry_backoff_s": BackendOptionSpec(
            "float", 2.0, "First retry delay; doubles per attempt", validator=_positive
        ),
        "timeout_s": BackendOptionSpec(
            "float", 600.0, "Seconds to wait for one Tinker call", validator=_positive
        ),
        "keepalive_s": BackendOptionSpec(
            "float",
            60.0,
            "Heartbeat period that keeps the session alive during local work. 0 = off",
        ),
    },
    "prime_rl": {
        "transport": BackendOptionSpec(
            "str", "filesystem", "PRIME-RL transport", choices=("filesystem", "zmq")
        ),
        "strict_advantages": BackendOptionSpec(
            "bool", True, "Reject token-varying advantages", validator=_strict_only
        ),
        "zmq_host": BackendOptionSpec("str", "localhost", "ZMQ host"),
        "zmq_port": BackendOptionSpec("int", 5555, "ZMQ port"),
        "zmq_hwm": BackendOptionSpec("int", 10, "ZMQ high-water mark"),
        "sync_wait_s": BackendOptionSpec("float", 30.0, "Seconds to wait for a weight broadcast"),
        "sync_poll_s": BackendOptionSpec("float", 0.5, "Poll period while waiting for weights"),
    },
}

DEPENDENCY_HINTS = {
    "local": "pip install 'retrain[local]'  (torch, transformers, peft, safetensors, gguf)",
    "tinker": "pip install 'retrain[tinker]'  (the tinker SDK)",
    "prime_rl": "install prime-rl next to retrain and start its trainer + inference",
}

# Sections each built-in backend ignores (explain and startup say so).
IGNORED_SECTIONS = {
    "local": (),
    "tinker": (
        "[inference]",
        "[backend] devices",
        "[backend] adapter_path",
        "[lora] alpha/dropout/target_modules",
    ),
    "prime_rl": ("[inference] engine",),
}

CAPABILITY_HOOKS = ("retrain_backend_capabilities", "RETRAIN_BACKEND_CAPABILITIES")
OPTION_SCHEMA_HOOKS = ("retrain_backend_option_schema", "RETRAIN_BACKEND_OPTION_SCHEMA")


@dataclass(frozen=True)
class BackendInfo:
    name: str
    capabilities: BackendCapabilities
    options: dict[str, BackendOptionSpec]
    source: str  # "builtin" | "plugin" | "plugin/default"
    dependency_hint: str = ""


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
    if isinstance(value, Mapping):
        known = {
            "reports_sync_loss",
            "preserves_token_advantages",
            "supports_checkpoint_resume",
            "resume_runtime_dependent",
            "token_data",
        }
        unknown = set(value) - known
        if unknown:
            raise PluginError(f"backend {name}: capability hook has unknown keys {sorted(unknown)}")
        data = dict(value)
        if "token_data" in data:
            data["token_data"] = tuple(data["token_data"])
        return BackendCapabilities(**data)
    raise PluginError(
        f"backend {name}: capability hook returned {type(value).__name__}, expected BackendCapabilities or dict"
    )


def _options_from(value: Any, name: str) -> dict[str, BackendOptionSpec]:
    if not isinstance(value, Mapping):
        raise PluginError(f"backend {name}: option schema hook must return a mapping")
    out = {}
    for key, spec in value.items():
        if isinstance(spec, BackendOptionSpec):
            out[key] = spec
        elif isinstance(spec, Mapping):
            typ = spec.get("type", spec.get("value_type"))
            typ = getattr(typ, "__name__", typ)
            out[key] = BackendOptionSpec(
                str(typ),
                spec.get("default"),
                spec.get("help", ""),
                tuple(spec["choices"]) if spec.get("choices") else None,
                spec.get("validator"),
            )
        else:
            raise PluginError(
                f"backend {name}: option {key!r} spec must be BackendOptionSpec or dict"
            )
    return out


def backend_info(
    name: str, search_paths: tuple[str, ...] = (), *, import_plugins: bool = True
) -> BackendInfo:
    """Capabilities and options of a built-in backend or a dotted-path plugin. Plugins
    without hooks get conservative defaults (no token advantages) as plugin/default."""
    canon = registry.BACKENDS.canonical(name)
    if canon in BUILTIN_CAPABILITIES:
        return BackendInfo(
            canon,
            BUILTIN_CAPABILITIES[canon],
            BUILTIN_OPTIONS[canon],
            "builtin",
            DEPENDENCY_HINTS[canon],
        )
    if not import_plugins:
        return BackendInfo(name, BackendCapabilities(), {}, "plugin/default")
    import importlib

    obj = registry.BACKENDS.resolve(name, search_paths)
    module = importlib.import_module(obj.__module__) if hasattr(obj, "__module__") else None
    caps = _hook(obj, module, CAPABILITY_HOOKS)
    opts = _hook(obj, module, OPTION_SCHEMA_HOOKS)
    source = "plugin" if caps is not None else "plugin/default"
    return BackendInfo(
        name,
        _capabilities_from(caps, name) if caps is not None else BackendCapabilities(),
        _options_from(opts, name) if opts is not None else {},
        source,
    )


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

    def save_checkpoint(self, directory: Path) -> dict[str, Any]:
        """Save weights (+ optimizer) as `directory` (`adapter_path/checkpoint_step_N` or
        `adapter_path/final`; a remote backend uses its last part as the checkpoint name).
        Returns what load_checkpoint needs; "adapter" (local dir) or "sampler_path"
        (remote) says where the adapter can be read."""

    def load_checkpoint(self, info: dict[str, Any]) -> None:
        """Restore what save_checkpoint returned."""

    def close(self) -> None: ...
