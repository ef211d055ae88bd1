"""`retrain plugins [--json] [--config PATH] [--search-path DIR]`: built-in names of every
pluggable kind, and the plugins found on `[plugins] search_paths`.

Discovery imports each top-level module of each search-path directory (files named
`test_*`, `conftest.py` and `_*` are skipped) and classifies the public functions and
classes defined there by their signatures:

- ``fn(ctx: TransformContext)`` (or a first parameter named ``ctx``) -> transform
- ``fn(ctx: AlgorithmContext)`` -> algorithm
- ``fn(rewards[, params])`` -> advantage mode
- ``fn(response, reference)`` -> custom reward
- ``fn(logprobs[, entropies])`` -> uncertainty kind
- a class with ``sample`` and ``train_step`` methods, or backend capability hooks -> backend
- a DataSource subclass -> data source

A module may state kinds explicitly, which wins over the guess:
``RETRAIN_PLUGINS = {"my_fn": "transform", "MySource": "data_source"}``.
Dotted paths named in the config are resolved and listed too.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from retrain import registry
from retrain.errors import ConfigError
from retrain.registry import Entry

KINDS = (
    "advantage_mode",
    "transform_mode",
    "algorithm_mode",
    "uncertainty_kind",
    "planning_detector",
    "reward",
    "data_source",
    "backend",
    "engine",
    "policy_loss",
)
# Accepted spellings in RETRAIN_PLUGINS -> the kind key used here.
KIND_ALIASES = {
    "advantage": "advantage_mode",
    "advantage_mode": "advantage_mode",
    "transform": "transform_mode",
    "transform_mode": "transform_mode",
    "algorithm": "algorithm_mode",
    "algorithm_mode": "algorithm_mode",
    "uncertainty": "uncertainty_kind",
    "uncertainty_kind": "uncertainty_kind",
    "reward": "reward",
    "data": "data_source",
    "data_source": "data_source",
    "backend": "backend",
    "engine": "engine",
    "planning_detector": "planning_detector",
    "objective": "policy_loss",
    "policy_loss": "policy_loss",
}
KIND_TITLES = {
    "advantage_mode": "Advantage modes ([algorithm] advantage_mode)",
    "transform_mode": "Transforms ([algorithm] transform_mode)",
    "algorithm_mode": "Algorithms ([algorithm] algorithm_mode)",
    "uncertainty_kind": "Uncertainty kinds ([algorithm] uncertainty_kind)",
    "planning_detector": "Planning detectors ([planning] detector)",
    "reward": "Rewards ([reward] type)",
    "data_source": "Data sources ([data] source)",
    "backend": "Backends ([backend] backend)",
    "engine": "Inference engines ([inference] engine)",
    "policy_loss": "Policy losses ([training] policy_loss)",
}
TOML_KEYS = {
    "advantage_mode": ("algorithm", "advantage_mode"),
    "transform_mode": ("algorithm", "transform_mode"),
    "algorithm_mode": ("algorithm", "algorithm_mode"),
    "uncertainty_kind": ("algorithm", "uncertainty_kind"),
    "planning_detector": ("planning", "detector"),
    "data_source": ("data", "source"),
    "backend": ("backend", "backend"),
    "engine": ("inference", "engine"),
    "policy_loss": ("training", "policy_loss"),
}
_SKIP_FILES = ("conftest.py", "setup.py")


def toml_snippet(kind: str, module: str, attr: str) -> str:
    """How to select a plugin in a TOML."""
    if kind == "reward":
        return f'[reward] type = "custom", custom_module = "{module}", custom_function = "{attr}"'
    table, key = TOML_KEYS[kind]
    return f'[{table}] {key} = "{module}.{attr}"'


def _annotation_text(param: inspect.Parameter) -> str:
    ann = param.annotation
    if ann is inspect.Parameter.empty:
        return ""
    return ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))


def classify(obj: Any) -> str | None:
    """Guess the plugin kind of a function or class (None: not a plugin)."""
    if inspect.isclass(obj):
        from retrain.backends.base import CAPABILITY_HOOKS, OPTION_SCHEMA_HOOKS

        if any(hasattr(obj, h) for h in (*CAPABILITY_HOOKS, *OPTION_SCHEMA_HOOKS)) or (
            callable(getattr(obj, "sample", None)) and callable(getattr(obj, "train_step", None))
        ):
            return "backend"
        try:
            from retrain.data.base import DataSource
        except ImportError:  # pragma: no cover - data package always present
            return None
        if issubclass(obj, DataSource):
            return "data_source"
        return None
    if not inspect.isfunction(obj):
        return None
    try:
        params = [
            p
            for p in inspect.signature(obj).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return None
    if not params:
        return None
    first = params[0]
    ann = _annotation_text(first)
    if "AlgorithmContext" in ann:
        return "algorithm_mode"
    if "TransformContext" in ann or first.name in ("ctx", "context"):
        return "transform_mode"
    names = [p.name for p in params]
    if "LossInputs" in ann or names[:2] == ["inputs", "hyper"]:
        return "policy_loss"
    if names[0] in ("rewards", "rewards_G") and len(names) <= 2:
        return "advantage_mode"
    if (
        len(names) >= 2
        and names[0] in ("response", "completion", "text")
        and names[1] in ("reference", "answer", "ground_truth")
    ):
        return "reward"
    if names[0] in ("logprobs", "logprobs_T") and len(names) <= 2:
        return "uncertainty_kind"
    return None


def _first_doc_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _modules_in(directory: Path) -> list[tuple[str, Path]]:
    out = []
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.suffix == ".py":
            name = path.stem
            if (
                name.startswith(("_", "test_"))
                or path.name in _SKIP_FILES
                or name.endswith("_test")
            ):
                continue
            out.append((name, path))
        elif path.is_dir() and (path / "__init__.py").is_file() and path.name.isidentifier():
            if path.name.startswith(("_", "test")):
                continue
            out.append((path.name, path / "__init__.py"))
    return [(n, p) for n, p in out if n.isidentifier()]


def _same_file(module: Any, path: Path) -> bool:
    file = getattr(module, "__file__", None)
    try:
        return file is not None and Path(file).resolve() == path.resolve()
    except OSError:
        return False


def _directories(search_paths: Iterable[str]) -> list[Path]:
    """Each search path that is a directory, once ("plugins" and its absolute path are
    one directory, listed once)."""
    out: dict[Path, Path] = {}
    for raw in search_paths:
        if raw and Path(raw).is_dir():
            out.setdefault(Path(raw).resolve(), Path(raw))
    return list(out.values())


def discover(
    search_paths: Iterable[str], kinds: set[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Plugins defined in the modules of each search-path directory.
    Returns (plugins, problems); a problem is {"module", "file", "error"}."""
    found: list[dict[str, Any]] = []
    problems: list[dict[str, str]] = []
    for directory in _directories(search_paths):
        absolute = str(directory.resolve())
        if absolute not in sys.path:
            sys.path.insert(0, absolute)
        importlib.invalidate_caches()  # files may have appeared since the last import
        for mod_name, path in _modules_in(directory):
            existing = sys.modules.get(mod_name)
            if existing is not None and not _same_file(existing, path):
                problems.append(
                    {
                        "module": mod_name,
                        "file": str(path),
                        "error": f"the name is taken by the already-imported module {getattr(existing, '__file__', None) or mod_name!r}; rename the file",
                    }
                )
                continue
            try:
                module = importlib.import_module(mod_name)
            except Exception as exc:  # a broken plugin must not hide the others
                problems.append(
                    {
                        "module": mod_name,
                        "file": str(path),
                        "error": f"import failed: {type(exc).__name__}: {exc}",
                    }
                )
                continue
            if not _same_file(module, path):
                problems.append(
                    {
                        "module": mod_name,
                        "file": str(path),
                        "error": f"`import {mod_name}` finds {getattr(module, '__file__', '?')} instead; rename the file",
                    }
                )
                continue
            declared = getattr(module, "RETRAIN_PLUGINS", None)
            declared = dict(declared) if isinstance(declared, dict) else {}
            for attr, obj in sorted(vars(module).items()):
                foreign = (
                    attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__
                )
                if foreign and attr not in declared:
                    continue
                kind = KIND_ALIASES.get(str(declared[attr])) if attr in declared else classify(obj)
                if attr in declared and kind is None:
                    problems.append(
                        {
                            "module": mod_name,
                            "file": str(path),
                            "error": f"RETRAIN_PLUGINS[{attr!r}] = {declared[attr]!r} is not a kind; use one of {', '.join(sorted(KIND_ALIASES))}",
                        }
                    )
                    continue
                if kind is None or (kinds is not None and kind not in kinds):
                    continue
                found.append(
                    {
                        "kind": kind,
                        "name": f"{mod_name}.{attr}",
                        "module": mod_name,
                        "attr": attr,
                        "file": str(path),
                        "doc": _first_doc_line(obj),
                        "toml": toml_snippet(kind, mod_name, attr),
                        "source": "search_path",
                    }
                )
    return found, problems


def configured(config: Any) -> list[tuple[str, str]]:
    """(kind, dotted path) of every plugin a config names."""
    a = config.algorithm
    out = []
    for kind, value in (
        ("advantage_mode", a.advantage_mode),
        ("transform_mode", a.transform_mode),
        ("algorithm_mode", a.algorithm_mode),
        ("uncertainty_kind", a.uncertainty_kind),
        ("data_source", config.data.source),
        ("backend", config.backend.backend),
        ("engine", config.inference.engine),
        ("policy_loss", config.training.policy_loss),
    ):
        reg = registry.ALL_REGISTRIES[kind]
        if value and not reg.is_builtin(value):
            out.append((kind, value))
    if config.reward.type == "custom" and config.reward.custom_module:
        out.append(("reward", config.reward.custom_module))
    return out


def builtin_row(entry: Entry) -> dict[str, Any]:
    """One built-in entry as listed: an alias entry (an algorithm mode) has no target of
    its own and names the pair it stands for; an entry not built in this version has
    no target and gives its fix."""
    return {
        "name": entry.name,
        "description": entry.description,
        "aliases": list(entry.aliases),
        "target": entry.target,
        "alias_of": list(entry.alias_of) if entry.alias_of else None,
        "available": entry.available,
        "not_built": entry.not_built,
    }


def builtins() -> dict[str, list[dict[str, Any]]]:
    return {kind: [builtin_row(e) for e in registry.ALL_REGISTRIES[kind].entries] for kind in KINDS}


def _load_config(path: str | None) -> tuple[Any | None, list[str]]:
    from retrain.config import load_config

    p = Path(path or "retrain.toml")
    if not path and not p.is_file():
        return None, []
    try:
        return load_config(p), []
    except ConfigError as exc:
        if path:
            raise
        return None, [f"{p}: not used ({exc.problems[0]})"]


def _resolved(path: str) -> Path:
    return Path(path).expanduser().resolve()


def collect(config_path: str | None = None, extra_paths: Iterable[str] = ()) -> dict[str, Any]:
    """The JSON payload of `retrain plugins`."""
    config, warnings = _load_config(config_path)
    search_paths = list(config.plugins.search_paths) if config is not None else ["plugins"]
    strict = config.plugins.strict if config is not None else True
    configured_paths = [p for p in search_paths if p != "plugins"]  # "plugins": the default
    search_paths += [p for p in extra_paths if _resolved(p) not in map(_resolved, search_paths)]
    # a path that names no directory finds nothing: say so, or a typo passes as "no plugins"
    for raw, flag in [(p, "[plugins] search_paths") for p in configured_paths] + [
        (p, "--search-path") for p in extra_paths if p not in configured_paths
    ]:
        if not Path(raw).exists():
            warnings.append(f"{flag} {raw}: no such directory; nothing is searched there")
        elif not Path(raw).is_dir():
            warnings.append(f"{flag} {raw}: a file, not a directory; nothing is searched there")
    found, problems = discover(search_paths)
    if config is not None:
        known = {(p["kind"], p["name"]) for p in found}
        known |= {("reward", p["module"]) for p in found if p["kind"] == "reward"}
        for kind, name in configured(config):
            if (kind, name) in known:
                continue
            entry: dict[str, Any] = {
                "kind": kind,
                "name": name,
                "module": name.rpartition(".")[0] if kind != "reward" else name,
                "attr": name.rpartition(".")[2]
                if kind != "reward"
                else config.reward.custom_function,
                "file": "",
                "doc": "",
                "toml": "",
                "source": "config",
            }
            try:
                if kind == "reward":
                    from retrain.rewards.custom import load_custom_function

                    obj = load_custom_function(name, config.reward.custom_function, search_paths)
                else:
                    obj = registry.ALL_REGISTRIES[kind].resolve(name, search_paths)
                entry["doc"] = _first_doc_line(obj)
                entry["file"] = str(inspect.getsourcefile(obj) or "") if callable(obj) else ""
            except Exception as exc:
                problems.append(
                    {
                        "module": name,
                        "file": "",
                        "error": f"configured {kind} cannot be loaded: {exc}",
                    }
                )
                continue
            found.append(entry)
    return {
        "builtin": builtins(),
        "discovered": found,
        "problems": problems,
        "search_paths": search_paths,
        "strict": strict,
        "warnings": warnings,
    }


def _builtin_line(e: dict[str, Any], width: int) -> str:
    text = e["description"]
    if e["alias_of"]:
        adv, tx = e["alias_of"]
        text += f" (alias of advantage_mode {adv}, transform_mode {tx})"
    if e["aliases"]:
        text += f" (aliases: {', '.join(e['aliases'])})"
    if e["not_built"]:
        text += f" [not built; fix: {e['not_built']}]"
    return f"  {e['name'].ljust(width)}  {text.strip()}"


def _plugin_lines(p: dict[str, Any], width: int) -> list[str]:
    where = p["file"] or p["source"]
    doc = f": {p['doc']}" if p["doc"] else ""
    lines = [f"  {p['name'].ljust(width)}  plugin ({where}){doc}"]
    if p["toml"]:
        lines.append(f"  {''.ljust(width)}  use: {p['toml']}")
    return lines


def _render_kind(
    kind: str, entries: list[dict[str, Any]], found: list[dict[str, Any]]
) -> list[str]:
    width = max([len(e["name"]) for e in entries] + [len(p["name"]) for p in found] + [4])
    lines = [KIND_TITLES[kind]]
    lines += [_builtin_line(e, width) for e in entries]
    for p in found:
        lines += _plugin_lines(p, width)
    return [*lines, ""]


def render(payload: dict[str, Any]) -> str:
    lines: list[str] = []
    for kind in KINDS:
        found = [p for p in payload["discovered"] if p["kind"] == kind]
        lines += _render_kind(kind, payload["builtin"][kind], found)
    paths = ", ".join(payload["search_paths"]) or "(none)"
    lines.append(
        f"Plugin search paths: {paths}  ([plugins] search_paths; relative to the working directory)"
    )
    lines.append(
        "Scaffold a new one: retrain init-plugin --kind transform|advantage|algorithm|reward --name NAME --with-test"
    )
    lines += [f"warning: {w}" for w in payload["warnings"]]
    level = "error" if payload["strict"] else "warning (skipped)"
    lines += [f"{level}: plugin module {p['module']}: {p['error']}" for p in payload["problems"]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="retrain plugins",
        description="List built-in advantage modes, transforms, algorithms, rewards, data sources, backends and engines, and the plugins found on [plugins] search_paths.",
    )
    p.add_argument("--json", action="store_true", help="print the payload as JSON")
    p.add_argument(
        "--config",
        default=None,
        help="config whose [plugins] and dotted paths to use (default ./retrain.toml if present)",
    )
    p.add_argument(
        "--search-path",
        action="append",
        default=[],
        metavar="DIR",
        help="also search DIR (repeatable)",
    )
    args = p.parse_args(argv)
    payload = collect(args.config, args.search_path)
    print(json.dumps(payload, indent=2) if args.json else render(payload))
    return 1 if payload["problems"] and payload["strict"] else 0
