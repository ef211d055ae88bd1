"""`retrain backends [NAME...] [--json] [--config PATH]`: every backend, its capabilities,
dependency hints, `[backend.options]` schema and the plugin metadata hooks.

Built-ins come from the static tables in :mod:`retrain.backends.base` (no torch import).
Dotted-path backends are added from the command line, from the config's `[backend]
backend`, and from plugin modules found on `[plugins] search_paths`; a plugin without
capability hooks is reported with conservative defaults as `source=plugin/default`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from retrain import registry
from retrain.backends.base import (
    CAPABILITY_HOOKS,
    IGNORED_SECTIONS,
    OPTION_SCHEMA_HOOKS,
    BackendCapabilities,
    BackendInfo,
    backend_info,
)
from retrain.errors import ConfigError, PluginError

# Python modules each built-in backend needs at run time.
BUILTIN_MODULES = {
    "local": ("torch", "transformers", "peft"),
    "tinker": ("tinker",),
    "prime_rl": ("prime_rl",),
}
CAPABILITY_FIELDS = (
    "reports_sync_loss",
    "preserves_token_advantages",
    "supports_checkpoint_resume",
    "resume_runtime_dependent",
    "token_data",
)
CAPABILITY_HELP = {
    "reports_sync_loss": "train_step returns the real loss (false: a placeholder, optimisation runs elsewhere)",
    "preserves_token_advantages": "per-token advantages reach the optimiser (false: one scalar per completion; token-varying flows fail preflight)",
    "supports_checkpoint_resume": "--resume restores the adapter weights",
    "resume_runtime_dependent": "resume also depends on the remote runtime (e.g. the service must still hold the checkpoint)",
    "token_data": "per-token data besides logprobs (entropy: full-vocabulary entropies for shannon_entropy)",
}


def _missing_modules(name: str) -> list[str]:
    missing = []
    for mod in BUILTIN_MODULES.get(name, ()):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(mod)
    return missing


def _entry(info: BackendInfo, *, description: str = "", error: str | None = None) -> dict[str, Any]:
    missing = _missing_modules(info.name) if info.source == "builtin" else []
    return {
        "name": info.name,
        "source": info.source,
        "description": description,
        "installed": not missing,
        "missing_modules": missing,
        "dependency_hint": info.dependency_hint,
        "capabilities": info.capabilities.as_dict(),
        "options": {k: v.as_dict() for k, v in info.options.items()},
        "ignored_sections": list(IGNORED_SECTIONS.get(info.name, ())),
        "error": error,
    }


def _plugin_names(
    config_path: str | None, extra: list[str]
) -> tuple[list[str], tuple[str, ...], list[str]]:
    """Dotted-path backend names to report, the search paths, and warnings."""
    from retrain.config import load_config

    warnings: list[str] = []
    search_paths: tuple[str, ...] = ("plugins",)
    names = list(extra)
    path = Path(config_path or "retrain.toml")
    if config_path or path.is_file():
        try:
            config = load_config(path)
        except ConfigError as exc:
            if config_path:
                raise
            warnings.append(f"{path}: not used ({exc.problems[0]})")
        else:
            search_paths = tuple(config.plugins.search_paths)
            if not registry.BACKENDS.is_builtin(config.backend.backend):
                names.append(config.backend.backend)
    from retrain.cli.plugins import discover

    found, problems = discover(search_paths, kinds={"backend"})
    names += [p["name"] for p in found]
    warnings += [f"{p['module']}: {p['error']}" for p in problems]
    return list(dict.fromkeys(names)), search_paths, warnings


def collect(names: list[str] | None = None, config_path: str | None = None) -> dict[str, Any]:
    """The JSON payload of `retrain backends`."""
    entries = []
    for name in registry.BACKENDS.names():
        entries.append(
            _entry(backend_info(name), description=registry.BACKENDS.descriptions.get(name, ""))
        )
    plugin_names, search_paths, warnings = _plugin_names(config_path, list(names or []))
    for name in plugin_names:
        if registry.BACKENDS.is_builtin(name):
            continue
        try:
            info = backend_info(name, search_paths)
            entries.append(_entry(info, description="dotted-path plugin"))
        except (PluginError, TypeError, ValueError) as exc:
            fallback = BackendInfo(name, BackendCapabilities(), {}, "plugin/default")
            entries.append(_entry(fallback, description="dotted-path plugin", error=str(exc)))
    return {
        "backends": entries,
        "capability_fields": {k: CAPABILITY_HELP[k] for k in CAPABILITY_FIELDS},
        "hooks": {
            "capabilities": list(CAPABILITY_HOOKS),
            "option_schema": list(OPTION_SCHEMA_HOOKS),
        },
        "plugin_default": BackendCapabilities().as_dict(),
        "search_paths": list(search_paths),
        "warnings": warnings,
    }


def _yes(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    return str(value)


def render(payload: dict[str, Any]) -> str:
    lines: list[str] = []
    for b in payload["backends"]:
        status = "installed" if b["installed"] else f"missing {', '.join(b['missing_modules'])}"
        head = f"{b['name']}  (source={b['source']}"
        head += f", {status})" if b["source"] == "builtin" else ")"
        lines.append(head)
        if b["description"]:
            lines.append(f"  {b['description']}")
        if b["error"]:
            lines.append(f"  error: {b['error']}")
        if b["dependency_hint"]:
            lines.append(f"  install: {b['dependency_hint']}")
        caps = b["capabilities"]
        lines.append(
            "  capabilities: " + ", ".join(f"{k}={_yes(caps[k])}" for k in CAPABILITY_FIELDS)
        )
        if b["ignored_sections"]:
            lines.append("  ignores: " + ", ".join(b["ignored_sections"]))
        if b["options"]:
            lines.append("  [backend.options]:")
            width = max(len(k) for k in b["options"])
            for key, spec in b["options"].items():
                choices = f", one of {spec['choices']}" if spec.get("choices") else ""
                lines.append(
                    f"    {key.ljust(width)}  {spec['type']}, default {json.dumps(spec['default'])}{choices}"
                    + (f"  {spec['help']}" if spec.get("help") else "")
                )
        lines.append("")
    hooks = payload["hooks"]
    lines.append(
        'Dotted-path backends ([backend] backend = "pkg.mod.Class") describe themselves with hooks on the '
        "class or its module:"
    )
    lines.append(
        f"  capabilities:  {' / '.join(hooks['capabilities'])}  (BackendCapabilities or a dict)"
    )
    lines.append(
        f"  option schema: {' / '.join(hooks['option_schema'])}  (name -> BackendOptionSpec or "
        "{type|value_type, default, choices?, validator?})"
    )
    default = payload["plugin_default"]
    lines.append(
        "  without hooks: source=plugin/default, "
        + ", ".join(f"{k}={_yes(default[k])}" for k in CAPABILITY_FIELDS)
    )
    for w in payload["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="retrain backends",
        description="List training backends with capabilities, options, dependency hints and plugin hooks.",
    )
    p.add_argument(
        "names", nargs="*", metavar="NAME", help="also describe these dotted-path backends"
    )
    p.add_argument("--json", action="store_true", help="print the payload as JSON")
    p.add_argument(
        "--config",
        default=None,
        help="config whose [backend] and [plugins] to use (default ./retrain.toml if present)",
    )
    args = p.parse_args(argv)
    payload = collect(args.names, args.config)
    print(json.dumps(payload, indent=2) if args.json else render(payload))
    return 1 if any(b["error"] for b in payload["backends"] if b["name"] in args.names) else 0
