"""What the run checks at its start, done without loading a model: `explain` and
`doctor` report these before a run would refuse them (the run's own checks are in
retrain/startup.py; these add the installed modules)."""

from __future__ import annotations

from retrain import registry
from retrain.config import Config
from retrain.errors import ConfigError
from retrain.logs import ownership
from retrain.models import HubAsk, ask_hub
from retrain.startup import startup_problems as run_startup_problems
from retrain.world import World


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    import importlib.util

    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def configured_entries(config: Config, engine: bool = True) -> list[tuple[str, str, str]]:
    """(registry kind, config key, name) of the built-in names the run will resolve (the
    inference engine's only with `engine`)."""
    named = [
        ("backend", "[backend] backend", config.backend.backend),
        ("reward", "[reward] type", config.reward.type),
        ("planning_detector", "[planning] detector", config.planning.detector),
    ]
    if not config.environment.provider:
        named.append(("data_source", "[data] source", config.data.source))
    backend = registry.BACKENDS.entry(config.backend.backend)
    if engine and (backend is None or "[inference]" not in backend.ignores):
        named.append(("engine", "[inference] engine", config.inference.engine))
    return named


def module_problems(config: Config) -> list[tuple[str, str]]:
    """Modules a configured built-in entry `requires` that are not installed."""
    problems = []
    for kind, key, name in configured_entries(config):
        entry = registry.ALL_REGISTRIES[kind].entry(name)
        if entry is None or not entry.available or not entry.requires:
            continue
        missing = missing_modules(entry.requires)
        if missing:
            how = f"; {entry.install}" if entry.install else ""
            problems.append(
                (key, f"{name} needs {', '.join(missing)}, which is not installed{how}")
            )
    if config.environment.provider == "verifiers" and missing_modules(("verifiers",)):
        problems.append(
            (
                "[environment] provider",
                "verifiers is not installed; pip install 'retrain[verifiers]'",
            )
        )
    return problems


def startup_problems(
    config: Config, ask: HubAsk | None = ask_hub, world: World | None = None
) -> list[tuple[str, str]]:
    """(key, problem) for everything the run would refuse at start before its first step,
    found without loading a model: missing modules of the configured entries, and the
    run's own startup checks (retrain/startup.py: the devices, the model, the resume
    directory, the tinker backend's API key, the plugins and the custom reward imported,
    the reasoning-gym task and its args, the output directories). The files the config names are checked when it loads; the flow
    checks (the run's preflight) and the backend's probe are reported beside these."""
    return module_problems(config) + run_startup_problems(config, ask, world)


def where_set(
    config: Config, path: str | None, key: str, launch: ownership.Launch | None = None
) -> str:
    """ " (from --flag)" of `[table] key` when a flag of `launch` set it, else " (FILE:LINE)"
    when the config file sets it to the value the run uses. The startup checks run on
    the loaded Config, which keeps no origin; a value set otherwise gets no line rather
    than a wrong one."""
    from retrain.config.load import locate_keys, read_toml
    from retrain.config.schema import TABLES, table_fields

    table, _, name = key.lstrip("[").partition("] ")
    # a key of a table-valued key (`[backend.options] shard`, `[algorithm.advantage_params]
    # eps`) is set by its own flag entry or by the flag of the whole table
    top, _, field = table.partition(".")
    if launch is not None:
        parent = (top, field) if field else (table, name)
        for t, k in dict.fromkeys([(table, name), parent]):
            if (flag := launch.origin(t, k)).startswith(" (from "):
                return flag
    spec = (
        next((f for f in table_fields(table) if f.key == name), None) if table in TABLES else None
    )
    try:
        raw, text = read_toml(path) if path else ({}, "")
    except (ConfigError, OSError):
        return ""
    if field and top in TABLES:
        outer = next((f for f in table_fields(top) if f.key == field), None)
        inner = raw.get(top, {}).get(field) if isinstance(raw.get(top), dict) else None
        written = inner.get(name) if isinstance(inner, dict) and outer is not None else None
        used = getattr(getattr(config, top), outer.attr, {}) if written is not None else {}
        same = written is not None and written == used.get(name)
        lines = locate_keys(text) if same else {}
        # an inline table (`advantage_params = {eps = 1}`) has only the outer key's line
        line = lines.get((table, name)) or lines.get((top, field))
        return f" ({path}:{line})" if line else ""
    written = raw.get(table, {}).get(name) if isinstance(raw.get(table), dict) else None
    if spec is None or written is None or written != getattr(getattr(config, table), spec.attr):
        return ""
    line = locate_keys(text).get((table, name))
    return f" ({path}:{line})" if line else ""
