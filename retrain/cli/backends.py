"""`retrain backends [NAME...] [--json] [--config PATH]`: every backend, its capabilities,
dependencies, `[backend.options]` schema and the plugin metadata hooks; and every
inference engine, whether it is built in this version and what it needs.

Built-ins come from their entries in :mod:`retrain.registry` (no torch import). An entry
that is not built in this version is listed as such, with its fix, never as available.
Dotted-path backends are added from the command line, from the config's `[backend]
backend`, and from plugin modules found on `[plugins] search_paths`; a plugin without
capability hooks is reported with conservative defaults as `source=plugin/default`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from retrain import registry
from retrain.backends.base import (
    CAPABILITY_HOOKS,
    OPTION_SCHEMA_HOOKS,
    BackendInfo,
    backend_info,
)
from retrain.errors import ConfigError, PluginError
from retrain.registry import Entry
from retrain.types import LOSS_OPTIONS, BackendCapabilities

CAPABILITY_FIELDS = tuple(f.name for f in fields(BackendCapabilities))
CAPABILITY_HELP = {
    "reports_sync_loss": "train_step returns the real loss (false: a placeholder, optimisation runs elsewhere)",
    "preserves_token_advantages": "per-token advantages reach the optimiser (false: one scalar per completion; token-varying flows fail preflight)",
    "supports_checkpoint_resume": "--resume restores the adapter weights",
    "resume_runtime_dependent": "resume also depends on the remote runtime (e.g. the service must still hold the checkpoint)",
    "token_data": "per-token data besides logprobs (entropy: full-vocabulary entropies for shannon_entropy)",
    "loss_options": "objective options beyond the importance-sampling token mean ("
    + ", ".join(LOSS_OPTIONS)
    + "; retrain man --topic loss)",
    "multi_process": "one run trains on several processes under torchrun (docs/distributed.md)",
}


def missing_modules(entry: Entry) -> list[str]:
    """The entry's required Python modules that cannot be found here."""
    from retrain.cli.startup_checks import missing_modules as missing

    return missing(entry.requires)


def _options(info: BackendInfo | None) -> dict[str, Any]:
    return {k: v.as_dict() for k, v in info.options.items()} if info is not None else {}


def _builtin_row(entry: Entry) -> dict[str, Any]:
    """A built-in backend; one that is not built has no capabilities and gives its fix."""
    info = backend_info(entry.name) if entry.available else None
    missing = missing_modules(entry) if entry.available else []
    return {
        "name": entry.name,
        "source": "builtin",
        "description": entry.description,
        "available": entry.available,
        "not_built": entry.not_built,
        "installed": entry.available and not missing,
        "missing_modules": missing,
        "dependency_hint": entry.install,
        "capabilities": info.capabilities.as_dict() if info is not None else None,
        "options": _options(info),
        "ignored_sections": list(entry.ignores),
        "error": None,
    }


def _plugin_row(name: str, search_paths: tuple[str, ...]) -> dict[str, Any]:
    """A dotted-path backend, described by its hooks; one that cannot be imported gets
    the conservative defaults and the error."""
    error = None
    try:
        info = backend_info(name, search_paths)
    except (PluginError, TypeError, ValueError) as exc:
        error = str(exc)
        info = BackendInfo(name, BackendCapabilities(), {}, "plugin/default")
    return {
        "name": name,
        "source": info.source,
        "description": "dotted-path plugin",
        "available": error is None,
        "not_built": "",
        "installed": error is None,
        "missing_modules": [],
        "dependency_hint": "",
        "capabilities": info.capabilities.as_dict(),
        "options": _options(info),
        "ignored_sections": [],
        "error": error,
    }


def engine_rows() -> list[dict[str, Any]]:
    """Every built-in inference engine: built or not, what it needs, whether that is here."""
    rows = []
    for e in registry.ENGINES.entries:
        missing = missing_modules(e) if e.available else []
        rows.append(
            {
                "name": e.name,
                "description": e.description,
                "available": e.available,
                "not_built": e.not_built,
                "requires": list(e.requires),
                "installed": e.available and not missing,
                "missing_modules": missing,
                "dependency_hint": e.install,
                "supports": engine_support(e.name),
            }
        )
    return rows


def engine_support(name: str) -> dict[str, Any]:
    """What an engine supports: from its traits, and a server engine's wire dialect."""
    from retrain.engines.dialects import DIALECTS

    traits = registry.ENGINES.entry(name).engine_traits
    if traits.in_process:
        return {
            "where": "in-process",
            "token_ids": True,
            "entropy": "entropy" in traits.token_data,
            "lora_sync": "shared weights",
        }
    d = DIALECTS[name]
    started = "(none: retrain starts the server itself)" if d.starts_own_server else "(required)"
    return {
        "where": "server over HTTP /v1/completions",
        "default_url": d.default_url or started,
        "token_ids": d.token_prompts,
        "entropy": "entropy" in traits.token_data,
        "lora_sync": d.lora.describe,
        "verified": d.verified or "wire format only (no real server here)",
    }


def _plugin_names(
    config_path: str | None, extra: list[str]
) -> tuple[list[str], tuple[str, ...], list[str]]:
    """Dotted-path backend names to report, the search paths, and warnings."""
    from retrain.cli.plugins import discover
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
    found, problems = discover(search_paths, kinds={"backend"})
    names += [p["name"] for p in found]
    warnings += [f"{p['module']}: {p['error']}" for p in problems]
    return list(dict.fromkeys(names)), search_paths, warnings


def collect(names: list[str] | None = None, config_path: str | None = None) -> dict[str, Any]:
    """The JSON payload of `retrain backends`."""
    rows = [_builtin_row(e) for e in registry.BACKENDS.entries]
    plugin_names, search_paths, warnings = _plugin_names(config_path, list(names or []))
    rows += [
        _plugin_row(name, search_paths)
        for name in plugin_names
        if not registry.BACKENDS.is_builtin(name)
    ]
    return {
        "backends": rows,
        "engines": engine_rows(),
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


def _status(row: dict[str, Any]) -> str:
    if not row["available"] and row["not_built"]:
        return "not built"
    if row["installed"]:
        return "installed"
    return f"missing {', '.join(row['missing_modules'])}"


def _render_options(options: dict[str, Any]) -> list[str]:
    if not options:
        return []
    lines = ["  [backend.options]:"]
    width = max(len(k) for k in options)
    for key, spec in options.items():
        choices = f", one of {spec['choices']}" if spec.get("choices") else ""
        text = f"    {key.ljust(width)}  {spec['type']}, default {json.dumps(spec['default'])}{choices}"
        lines.append(text + (f"  {spec['help']}" if spec.get("help") else ""))
    return lines


def _render_backend(b: dict[str, Any]) -> list[str]:
    head = f"{b['name']}  (source={b['source']}"
    lines = [head + (f", {_status(b)})" if b["source"] == "builtin" else ")")]
    if b["description"]:
        lines.append(f"  {b['description']}")
    if b["not_built"]:
        lines.append(f"  not built in this version; fix: {b['not_built']}")
        return lines
    if b["error"]:
        lines.append(f"  error: {b['error']}")
    if b["dependency_hint"]:
        lines.append(f"  install: {b['dependency_hint']}")
    caps = b["capabilities"]
    lines.append("  capabilities: " + ", ".join(f"{k}={_yes(caps[k])}" for k in CAPABILITY_FIELDS))
    if b["ignored_sections"]:
        lines.append("  ignores: " + ", ".join(b["ignored_sections"]))
    return lines + _render_options(b["options"])


def _render_engines(engines: list[dict[str, Any]]) -> list[str]:
    lines = ["Inference engines ([inference] engine):"]
    width = max(len(e["name"]) for e in engines)
    state_width = max(len(_status(e)) for e in engines)
    for e in engines:
        needs = f"; needs {', '.join(e['requires'])}" if e["requires"] else ""
        lines.append(
            f"  {e['name'].ljust(width)}  {_status(e).ljust(state_width)}  {e['description']}{needs}"
        )
        sup = e.get("supports") or {}
        if sup and e["available"]:
            url = f", url {sup['default_url']}" if "default_url" in sup else ""
            lines.append(
                f"  {''.ljust(width)}  {''.ljust(state_width)}  {sup['where']}{url}; prompts as "
                f"{'token ids' if sup['token_ids'] else 'text'}; entropy {_yes(sup['entropy'])}; "
                f"LoRA sync: {sup['lora_sync']}"
                + (f"; verified: {sup['verified']}" if "verified" in sup else "")
            )
    fixes = dict.fromkeys(e["not_built"] for e in engines if e["not_built"])
    lines += [f"  fix (not built): {fix}" for fix in fixes]
    return lines


def _render_hooks(payload: dict[str, Any]) -> list[str]:
    hooks, default = payload["hooks"], payload["plugin_default"]
    return [
        'Dotted-path backends ([backend] backend = "pkg.mod.Class") describe themselves with '
        "hooks on the class or its module:",
        f"  capabilities:  {' / '.join(hooks['capabilities'])}  (BackendCapabilities or a dict)",
        f"  option schema: {' / '.join(hooks['option_schema'])}  (name -> OptionSpec or "
        "{type|value_type, default, choices?, validator?})",
        "  without hooks: source=plugin/default, "
        + ", ".join(f"{k}={_yes(default[k])}" for k in CAPABILITY_FIELDS),
    ]


def render(payload: dict[str, Any]) -> str:
    lines: list[str] = []
    for b in payload["backends"]:
        lines += [*_render_backend(b), ""]
    lines += [*_render_engines(payload["engines"]), ""]
    lines += _render_hooks(payload)
    lines += [f"warning: {w}" for w in payload["warnings"]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="retrain backends",
        description="List training backends and inference engines with capabilities, options, dependencies and plugin hooks.",
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
    named = [b for b in payload["backends"] if b["name"] in args.names]
    return 1 if any(b["error"] or not b["available"] for b in named) else 0
