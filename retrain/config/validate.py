"""Checks that span several keys. Each returns (`[table] key`, message with a fix).

Everything here reads the registry entries (retrain.registry) and the config; nothing
imports a backend. The two flow checks live in :func:`flow_problems`, which config
loading calls with the capabilities of built-in entries and the run preflight calls
with the facts it probed (a plugin backend's hooks, the built pipeline).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from retrain import registry
from retrain.backpressure import batch_ladder
from retrain.config import hints
from retrain.config.schema import MAX_PROMPTS, Config, away_from_defaults
from retrain.hardware import HIDDEN_FIX, TorchBuild, compiler_missing, torch_without_gpu
from retrain.settings import prime_rl_run_dir_problem
from retrain.types import USER_OBJECTIVE, BackendCapabilities, EngineTraits, check_option

Problems = list[tuple[str, str]]


# ---------------------------------------------------------------- the advantage flow


def static_token_varying(config: Config) -> bool | None:
    """Whether the configured flow gives different advantages to tokens of one
    completion, as far as the registry entries say: None when the transform or the
    algorithm is a dotted-path plugin (only probing it can tell)."""
    algo = config.algorithm
    transform = algo.transform_mode
    if algo.algorithm_mode:
        entry = registry.ALGORITHM_MODES.entry(algo.algorithm_mode)
        if entry is None or entry.alias_of is None:
            return None
        transform = entry.alias_of[1]
    entry = registry.TRANSFORM_MODES.entry(transform)
    return None if entry is None else entry.token_varying


def _flow_key(config: Config) -> str:
    if config.algorithm.algorithm_mode:
        return "[algorithm] algorithm_mode"
    return "[algorithm] transform_mode"


def samples_through_engine(config: Config) -> bool:
    """Whether the backend samples with the `[inference]` engine (a built-in backend
    that ignores `[inference]` samples by other means; a plugin backend may use it)."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    if entry is None:
        return True
    return not any(s in ("[inference]", "[inference] engine") for s in entry.ignores)


def _missing_entropies(config: Config, capabilities: BackendCapabilities) -> str | None:
    """Why per-token entropies would not arrive, or None when they do."""
    backend = config.backend.backend
    if "entropy" not in capabilities.token_data:
        return f"backend {backend!r} returns only logprobs"
    if not samples_through_engine(config):
        return None
    engine = registry.ENGINES.entry(config.inference.engine)
    if engine is None:
        return f"engine {config.inference.engine!r} is a plugin not known to return entropies"
    if "entropy" not in engine.engine_traits.token_data:
        return f"backend {backend!r} with engine {engine.name!r} returns only logprobs"
    return None


def loss_options_used(config: Config) -> list[tuple[str, str]]:
    """(`[training] key`, loss option) for each part of the objective beyond the default
    importance-sampling token mean (the names of BackendCapabilities.loss_options): a
    built-in policy_loss other than "is" under its own name, a dotted path as
    USER_OBJECTIVE."""
    t = config.training
    used = []
    if t.policy_loss != "is":
        builtin = registry.OBJECTIVES.is_builtin(t.policy_loss)
        option = registry.OBJECTIVES.canonical(t.policy_loss) if builtin else USER_OBJECTIVE
        used.append(("[training] policy_loss", option))
    if t.policy_loss in ("ppo_clip", "gspo") and t.clip_ratio_c > 0:
        used.append(("[training] clip_ratio_c", "dual_clip"))
    if t.policy_loss in ("cispo", "sapo") and t.ratio_level == "sequence":
        used.append(("[training] ratio_level", "sequence_ratio"))
    if t.adv_clip_max > 0:
        used.append(("[training] adv_clip_max", "adv_clip"))
    if t.loss_agg != "token_mean":
        used.append(("[training] loss_agg", t.loss_agg))
    if t.kl_coef > 0:
        used.append(("[training] kl_coef", "kl"))
    if t.tis_cap > 0:
        used.append(("[training] tis_cap", "tis"))
    if t.is_correction != "none":
        used.append(("[training] is_correction", "tis" if t.is_correction == "truncate" else "mis"))
        if t.is_level != "token":
            used.append(("[training] is_level", "sequence_is"))
    return used


def _loss_option_problems(config: Config, capabilities: BackendCapabilities) -> Problems:
    backend = config.backend.backend
    supported = ", ".join(capabilities.loss_options) or "none"
    problems: Problems = []
    for key, option in loss_options_used(config):
        if option in capabilities.loss_options:
            continue
        if option == USER_OBJECTIVE:
            usable = ("is", *capabilities.loss_options)
            builtins = [n for n in registry.OBJECTIVES.names(available_only=True) if n in usable]
            problem = (
                f"{config.training.policy_loss!r} is your own objective (a dotted path); only a "
                f"backend that computes the loss in-process can run it, and backend {backend!r} "
                f"does not list loss_options {USER_OBJECTIVE!r}. Fix: a built-in policy_loss it "
                f'runs ({", ".join(builtins)}), or backend = "local"'
            )
        else:
            problem = (
                f"backend {backend!r} does not implement the loss option {option!r} (it "
                f"supports: {supported}). Fix: remove the key, or use a backend whose "
                f"capabilities list loss_options {option!r} (local)"
            )
        problems.append((key, problem))
    return problems


def flow_problems(
    config: Config, capabilities: BackendCapabilities, *, token_varying: bool | None
) -> Problems:
    """The advantage flow and the objective against what the backend carries: (a)
    token-varying advantages on a backend that aggregates them per completion; (b) an
    uncertainty kind that needs entropies the backend (or its engine) does not return;
    (c) a loss option (`[training] policy_loss`, ...) the backend does not implement.
    `token_varying=None` means unknown (a plugin, before probing): (a) is skipped."""
    problems: Problems = _loss_option_problems(config, capabilities)
    if token_varying and not capabilities.preserves_token_advantages:
        problems.append(
            (
                _flow_key(config),
                f"backend {config.backend.backend!r} does not preserve token-level advantages, so "
                f"{config.condition!r} would be silently aggregated. Fix: use "
                'transform_mode = "none" or a backend whose capabilities include '
                "preserves_token_advantages (local, tinker)",
            )
        )
    kind = registry.UNCERTAINTY_KINDS.canonical(config.algorithm.uncertainty_kind)
    why = _missing_entropies(config, capabilities) if kind == "shannon_entropy" else None
    if why:
        problems.append(
            (
                "[algorithm] uncertainty_kind",
                f"shannon_entropy needs per-token entropies, but {why}. Fix: use "
                'uncertainty_kind = "surprisal", or a backend and engine that return '
                'entropies (token_data "entropy": the local backend with the pytorch engine)',
            )
        )
    return problems


def _builtin_flow(config: Config) -> Problems:
    """flow_problems for a built-in backend (plugins are checked at preflight)."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    if entry is None or not entry.available:
        return []
    caps = entry.capabilities or BackendCapabilities()
    return flow_problems(config, caps, token_varying=static_token_varying(config))


# ---------------------------------------------------------------- other tables


def _backpressure(config: Config) -> Problems:
    """min_batch_size <= max_batch_size; and, when enabled, no setting under which the
    USL is never fitted (it needs 3 distinct batch sizes), so the batch size would never
    adapt: a warmup shorter than 2 steps (the ladder walk lasts 2 x warmup_steps steps at
    most), or a ladder of fewer than 3 rungs (retrain.backpressure.batch_ladder)."""
    bp = config.backpressure
    lo, hi = bp.min_batch_size, bp.max_batch_size
    problems: Problems = []
    if lo > hi:
        problems.append(
            ("[backpressure] min_batch_size", f"must be <= max_batch_size ({hi}), got {lo}")
        )
    if not bp.enabled:
        return problems
    never = "the USL fit needs 3, so the batch size would never adapt"
    if bp.warmup_steps < 2:
        seen = "the warmup sees 2 batch sizes"
        if bp.warmup_steps == 0:
            seen = "with no warmup only 1 batch size is run"
        problems.append(
            (
                "[backpressure] warmup_steps",
                f"must be >= 2 with enabled = true, got {bp.warmup_steps}: {seen} and "
                f"{never}. Fix: warmup_steps = 10 (the default), or enabled = false",
            )
        )
    ladder = batch_ladder(lo, hi) if lo <= hi else []
    if lo <= hi and len(ladder) < 3:  # (no ladder at all when min > max: said above)
        fix = f"max_batch_size = {4 * lo}" if 4 * lo <= MAX_PROMPTS else ""
        if hi >= 4:
            fix += f"{' or ' if fix else ''}min_batch_size = {hi // 4}"
        sizes = f"{len(ladder)} batch size{'s' if len(ladder) > 1 else ''}"
        problems.append(
            (
                "[backpressure] max_batch_size",
                f"must be > 2 x min_batch_size ({lo}) with enabled = true, got {hi}: the "
                f"warmup ladder {ladder} has {sizes} and {never}. Fix: {fix}, or "
                "enabled = false",
            )
        )
    return problems


def _objective(config: Config) -> Problems:
    """Keys of one built-in objective set for another (a dotted-path objective may read
    any of them from TrainHyper), the covariance band, bnpo's batch, and a warmup that
    never ends; then the off-policy correction (_correction)."""
    from dataclasses import fields

    t = config.training
    defaults = {f.name: f.default for f in fields(t)}
    users = {  # key -> the built-in objectives that read it
        "clip_eps_high": ("ppo_clip", "gspo", "cispo", "clip_cov", "gmpo", "dppo"),
        "clip_ratio_c": ("ppo_clip", "gspo"),
        "ratio_level": ("cispo", "sapo"),
        **dict.fromkeys(("sapo_tau_pos", "sapo_tau_neg"), ("sapo",)),
        **dict.fromkeys(
            ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), ("vespo",)
        ),
        **dict.fromkeys(("clip_cov_fraction", "clip_cov_lb", "clip_cov_ub"), ("clip_cov",)),
        **dict.fromkeys(("kl_cov_fraction", "kl_cov_beta"), ("kl_cov",)),
        "dppo_kl_coef": ("dppo",),
    }
    problems: Problems = []
    if registry.OBJECTIVES.is_builtin(t.policy_loss):
        name = registry.OBJECTIVES.canonical(t.policy_loss)
        for key, readers in users.items():
            if name in readers or getattr(t, key) == defaults[key]:
                continue
            fix = 'Fix: policy_loss = "gspo" (PPO on the sequence ratio), or remove the key'
            if not (key == "ratio_level" and name == "ppo_clip"):
                fix = f'Fix: set policy_loss = "{readers[0]}", or remove the key'
            names = " / ".join(f'"{r}"' for r in readers)
            problems.append(
                (
                    f"[training] {key}",
                    f"only used with policy_loss = {names} (policy_loss is {t.policy_loss!r}). "
                    f"{fix}",
                )
            )
    if t.policy_loss == "clip_cov" and t.clip_cov_lb >= t.clip_cov_ub:
        problems.append(
            (
                "[training] clip_cov_lb",
                f"must be below clip_cov_ub ({t.clip_cov_ub:g}), got {t.clip_cov_lb:g}: no "
                "covariance would lie between them. Fix: e.g. clip_cov_lb = 1, clip_cov_ub = 5",
            )
        )
    if t.kl_coef == 0 and t.kl_estimator != defaults["kl_estimator"]:
        problems.append(
            (
                "[training] kl_estimator",
                "only used with kl_coef > 0 (it is 0: no KL penalty). Fix: set kl_coef, or "
                "remove the key",
            )
        )
    if t.bnpo_batch_size and t.loss_agg != "bnpo":
        problems.append(
            (
                "[training] bnpo_batch_size",
                f'only used with loss_agg = "bnpo" (loss_agg is {t.loss_agg!r}). Fix: set '
                'loss_agg = "bnpo", or remove the key',
            )
        )
    if t.warmup_steps >= t.max_steps:
        problems.append(
            (
                "[training] warmup_steps",
                f"must be < max_steps ({t.max_steps}), got {t.warmup_steps}: the learning rate "
                "would never reach lr. Fix: fewer warmup steps",
            )
        )
    return problems + _correction(config, defaults)


def _correction(config: Config, defaults: dict) -> Problems:
    """The off-policy correction's keys: one spelling of token truncation, bounds only
    with a correction, and no sequence-level truncation of a sequence-ratio objective."""
    t = config.training
    if t.is_correction == "none":
        return [
            (
                f"[training] {key}",
                'only used with is_correction = "truncate" or "mask" (it is "none"). Fix: '
                "set is_correction, or remove the key",
            )
            for key in ("is_level", "is_low", "is_high")
            if getattr(t, key) != defaults[key]
        ]
    if t.tis_cap > 0:
        return [
            (
                "[training] tis_cap",
                f'tis_cap is the short spelling of is_correction = "truncate", is_level = '
                f'"token", is_high = tis_cap, and is_correction = {t.is_correction!r} is set '
                "too. Fix: keep one of them",
            )
        ]
    if t.is_correction == "truncate" and t.policy_loss == "gpg":
        return [
            (
                "[training] is_correction",
                "truncation replaces each token's importance ratio by a truncated weight, and "
                'policy_loss "gpg" (-A logp) has no ratio to replace. Fix: is_correction = '
                '"mask" (drop the tokens or completions outside the band), or policy_loss = '
                '"is" (-A r)',
            )
        ]
    sequence_ratio = t.policy_loss in ("gspo", "vespo", "gmpo") or (
        t.policy_loss in ("cispo", "sapo") and t.ratio_level == "sequence"
    )
    if t.is_correction == "truncate" and t.is_level != "token" and sequence_ratio:
        return [
            (
                "[training] is_level",
                f"truncation at the {t.is_level} level replaces each token's own ratio by its "
                f"completion's weight, and policy_loss {t.policy_loss!r} already weighs by a "
                'sequence ratio. Fix: is_level = "token", or is_correction = "mask"',
            )
        ]
    return []


def _shaping(config: Config) -> Problems:
    """Batch shaping (retrain/shaping.py): an overlong buffer inside max_tokens, and the
    keys that only tune a feature that is off."""
    t, defaults = config.training, type(config.training)()
    problems: Problems = []
    if t.overlong_buffer >= t.max_tokens:
        problems.append(
            (
                "[training] overlong_buffer",
                f"must be below max_tokens ({t.max_tokens}), got {t.overlong_buffer}: every "
                "completion would be penalised from its first token. Fix: a buffer such as "
                f"{max(1, t.max_tokens // 4)} (a quarter of max_tokens), or 0 to turn it off",
            )
        )
    if t.overlong_buffer == 0 and t.overlong_penalty != defaults.overlong_penalty:
        problems.append(
            (
                "[training] overlong_penalty",
                "only used with overlong_buffer > 0 (it is 0: no overlong penalty). Fix: "
                "set overlong_buffer, or remove the key",
            )
        )
    if (
        not t.dynamic_sampling
        and t.dynamic_sampling_max_rounds != defaults.dynamic_sampling_max_rounds
    ):
        problems.append(
            (
                "[training] dynamic_sampling_max_rounds",
                "only used with dynamic_sampling = true (it is false). Fix: set "
                "dynamic_sampling = true, or remove the key",
            )
        )
    return problems


# The keys of [reward] that one built-in type reads and every other built-in ignores.
_REWARD_TYPE_KEYS = {
    "custom": ("custom_module", "custom_function"),
    "judge": ("judge_model", "judge_base_url", "judge_api_key"),
}


def _reward(config: Config) -> Problems:
    """custom_module for the custom reward; the keys of one type set for another (no
    reward reads another type's keys: your own code comes in through type = "custom")."""
    r = config.reward
    if r.type == "custom" and not r.custom_module:
        return [
            (
                "[reward] custom_module",
                "reward type 'custom' needs custom_module (a module name or a .py path). "
                'Fix: set [reward] custom_module = "my_rewards"',
            )
        ]
    if not registry.REWARDS.is_builtin(r.type):
        return []  # an unknown type: its own error says so
    return [
        (
            f"[reward] {key}",
            f'only used with type = "{owner}" (type is {r.type!r}). Fix: set type = '
            f'"{owner}", or remove the key',
        )
        for owner, keys in _REWARD_TYPE_KEYS.items()
        if owner != r.type
        for key in away_from_defaults(r, keys)
    ]


def _sepa(config: Config) -> Problems:
    """The auto schedule's keys, which the linear schedule does not read."""
    if config.sepa.schedule != "linear":
        return []
    return [
        (
            f"[sepa] {key}",
            'only used with schedule = "auto" (schedule is "linear"). Fix: set schedule = '
            '"auto", or remove the key',
        )
        for key in away_from_defaults(config.sepa, ("warmup", "ema_decay", "var_threshold"))
    ]


def _model_url(config: Config) -> Problems:
    """`[model] base_url` (a training service's address) with a built-in backend that
    connects to no such service (its entry's `ignores` says so)."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    if not config.model.base_url.strip() or entry is None:
        return []
    if "[model] base_url" not in entry.ignores:
        return []
    return [
        (
            "[model] base_url",
            f"is set, but backend {entry.name!r} connects to no training service and reads "
            'no URL. Fix: backend = "tinker" (the service it addresses), or base_url = ""',
        )
    ]


def _data(config: Config) -> Problems:
    env, data = config.environment, config.data
    if env.provider == "verifiers" and not (env.id or env.module):
        return [
            (
                "[environment] id",
                "provider 'verifiers' needs an environment id, e.g. id = \"primeintellect/gsm8k\"",
            )
        ]
    if env.provider == "openenv" and bool(env.base_url) == bool(env.id):
        return [
            (
                "[environment] base_url" if env.base_url else "[environment] id",
                "provider 'openenv' needs exactly one of base_url (a running OpenEnv server, "
                'e.g. base_url = "http://127.0.0.1:8000") and id (the dotted path of an '
                'Environment class to run in-process, e.g. id = "my_env.server.MyEnvironment")',
            )
        ]
    if env.provider:
        return []
    stray = _environment_keys_without_provider(env)
    if stray:
        return [
            (
                f"[environment] {stray[0]}",
                f"is set but [environment] provider is empty: {', '.join(stray)} would be "
                f"ignored and the run would train on [data] source = {data.source!r}. Fix: "
                'provider = "verifiers" or "openenv", or remove those keys',
            )
        ]
    if data.source == "jsonl" and not data.path:
        return [("[data] path", "source 'jsonl' needs path = \"file.jsonl\"")]
    if data.source == "reasoning_gym" and not data.task:
        return [
            ("[data] task", "source 'reasoning_gym' needs a task name, e.g. task = \"chain_sum\"")
        ]
    return []


def _environment_keys_without_provider(env) -> list[str]:
    """The `[environment]` keys set to other than their defaults, which only a provider
    reads (a forgotten provider would otherwise train on [data] silently). Not
    turn_timeout_s: the multi-turn loop reads it for a plugin data source's own turns."""
    return away_from_defaults(
        env, ("id", "module", "base_url", "args", "max_turns", "auto_install")
    )


def _not_found(key: str, what: str, path: str, fix: str) -> tuple[str, str]:
    found = "is a directory" if Path(path).expanduser().is_dir() else "not found"
    return (
        key,
        f"{what} {path!r} {found} (relative paths are read from the directory retrain "
        f"runs in, {Path.cwd()}). Fix: {fix}",
    )


def _data_files(config: Config) -> Problems:
    """The files `[data]` and `[eval]` name, when the run reads them (an environment
    brings its own data)."""
    d, e = config.data, config.eval
    if config.environment.provider:
        return []
    problems: Problems = []
    if d.source == "jsonl" and d.path and not Path(d.path).expanduser().is_file():
        fix = "the path of your JSONL file (one JSON object per line), or run retrain where it is"
        problems.append(_not_found("[data] path", "JSONL file", d.path, fix))
    if d.source == "math" and d.path and not Path(d.path).expanduser().exists():
        fix = 'the directory of your MATH copy, or path = "" to load it from the hub'
        problems.append(_not_found("[data] path", "local MATH copy", d.path, fix))
    if e.every <= 0 or d.source != "jsonl":
        return problems
    if not e.path:
        problems.append(
            (
                "[eval] path",
                "a held-out evaluation of [data] source = 'jsonl' needs its own file of problems "
                'the run does not train on. Fix: path = "heldout.jsonl", or [eval] every = 0',
            )
        )
    elif not Path(e.path).expanduser().is_file():
        fix = "the path of your held-out JSONL file, or [eval] every = 0"
        problems.append(_not_found("[eval] path", "held-out JSONL file", e.path, fix))
    return problems


def _reward_file(config: Config) -> Problems:
    """A custom reward given as a .py path: the file itself, or under a search path, as
    the reward imports it (retrain/rewards/custom.py)."""
    r = config.reward
    module = r.custom_module
    if r.type != "custom" or not (module.endswith(".py") or "/" in module or os.sep in module):
        return []
    candidates = [Path(module)]
    if not Path(module).is_absolute():
        candidates += [Path(p) / module for p in config.plugins.search_paths if p]
    if any(c.is_file() for c in candidates):
        return []
    tried = ", ".join(str(c) for c in candidates)
    fix = f"the path of your reward's .py file, or a module name on [plugins] search_paths (tried {tried})"
    return [_not_found("[reward] custom_module", "reward file", module, fix)]


def _backend_options(config: Config) -> Problems:
    """`[backend.options]` against a built-in backend's option schema (a plugin's is
    checked where the plugin is imported: startup.startup_problems)."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    if entry is None or not entry.available:
        return []
    return backend_option_problems(config.backend.options, entry.options, entry.name)


def _prime_rl_run_dir(config: Config) -> Problems:
    """prime-rl's trainer trains only `run_*` directories under its output_dir: any other
    adapter_path (a campaign's runs/<name>/adapter too) would send batches no one reads."""
    if config.backend.backend != "prime_rl":
        return []
    if config.campaign is not None:
        return [
            (
                "[campaign]",
                "with backend = 'prime_rl' is not supported: a campaign gives each run its own "
                "adapter_path (runs/<name>/adapter), where no prime-rl trainer reads. Fix: run "
                "each condition as its own retrain run, with adapter_path = "
                '"<the trainer\'s output_dir>/run_<name>"',
            )
        ]
    why = prime_rl_run_dir_problem(config.backend.adapter_path)
    return [("[backend] adapter_path", why)] if why else []


def backend_option_problems(options: dict, schema: dict, backend: str) -> Problems:
    """Each of `options` against `schema` (name -> OptionSpec) of the backend `backend`."""
    problems: Problems = []
    for name, value in options.items():
        spec = schema.get(name)
        if spec is None:
            valid = ", ".join(schema) or "(none)"
            hint = registry.suggest(name, schema) or hints.table_home(name)
            problem = f"unknown option {name!r} for backend {backend!r}{hint}; valid: {valid}"
        else:
            problem = check_option(spec, value)
        if problem:
            problems.append((f"[backend.options] {name}", problem))
    return problems


def _options_of(config: Config) -> dict:
    """The option schema of a built-in backend ({} for a plugin)."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    return dict(entry.options) if entry is not None else {}


def _engine_traits(config: Config) -> EngineTraits | None:
    """The traits of the `[inference]` engine when the backend samples through it."""
    entry = registry.ENGINES.entry(config.inference.engine)
    if entry is None or not samples_through_engine(config):
        return None
    return entry.engine_traits


def _overlap(config: Config) -> Problems:
    """The local backend's `overlap` trains while the next step samples, so the sampler
    must not read the weights being trained: a second device's copy, or a server."""
    if config.backend.options.get("overlap") is not True or "overlap" not in _options_of(config):
        return []
    devices = [d for d in config.backend.devices.split(",") if d.strip()]
    traits = _engine_traits(config)
    if len(devices) > 1 or traits is None or not traits.in_process:
        return []
    return [
        (
            "[backend.options] overlap",
            f"= true needs a sampler that does not share the trained weights, but [backend] "
            f"devices = {config.backend.devices!r} is one device with the in-process "
            f'{config.inference.engine} engine. Fix: devices = "gpu:0,gpu:1" (or "cpu,cpu": '
            "a separate sampler copy), a server [inference] engine, or overlap = false",
        )
    ]


def device_part(config: Config, last: bool = False) -> str:
    """`[backend] devices`' first (sampling) or last (training) entry, as written."""
    return config.backend.devices.split(",")[-1 if last else 0].strip()


def device_kind(config: Config, last: bool = False) -> str:
    """ "cpu", "cuda" or "mps" of `device_part`."""
    kind = device_part(config, last).split(":")[0]
    return "cuda" if kind in ("gpu", "cuda") else kind


def device_index(config: Config, last: bool = False) -> int:
    """The number of `device_part` ("gpu:1" -> 1; 0 for "cpu")."""
    part = device_part(config, last)
    return int(part.split(":")[1]) if ":" in part else 0


def training_device(config: Config) -> tuple[str, str, int]:
    """(as written, kind, index) of `[backend] devices`' last entry: the device that trains."""
    return device_part(config, True), device_kind(config, True), device_index(config, True)


def _decode(config: Config) -> Problems:
    """CUDA graphs on a sampler that is not a GPU (the first of `[backend] devices`); a
    compiled decode step where torch.compile has no compiler for the sampler's device."""
    decode = config.backend.options.get("decode")
    if decode not in ("graphs", "compiled") or "decode" not in _options_of(config):
        return []
    sampler, kind = device_part(config), device_kind(config)
    if decode == "compiled":
        missing = compiler_missing(kind)
        if missing is None:
            return []
        return [
            (
                "[backend.options] decode",
                f'= "compiled" compiles the decode step with torch.compile for the sampler '
                f"({sampler!r}), but {missing}. Fix: install it, or decode = "
                '"auto"',
            )
        ]
    if kind == "cuda":
        return []
    return [
        (
            "[backend.options] decode",
            f'= "graphs" captures the decode step as a CUDA graph, but the sampler runs on '
            f"{sampler!r} ([backend] devices = {config.backend.devices!r}). Fix: decode = "
            '"auto" (graphs on a GPU, dynamic elsewhere), or a gpu device',
        )
    ]


def _attention(config: Config) -> Problems:
    """FlexAttention or flash attention's variable-length kernel for training on a device
    that is not a GPU (the last of `[backend] devices` trains): torch has no FlexAttention
    backward there, and the variable-length kernel is CUDA's; the former also on a GPU
    without triton, which compiles it; the latter also with fp32
    matmuls asked for (flash attention has no float32 kernel; `dtype = "auto"` on a GPU
    without native bf16 is the startup's check, retrain/startup.py)."""
    option = config.backend.options.get("attention")
    if option not in ("flex", "varlen") or "attention" not in _options_of(config):
        return []
    key = "[backend.options] attention"
    if device_kind(config, last=True) == "cuda":
        if option == "flex" and (missing := compiler_missing("cuda")):
            return [
                (
                    key,
                    f'= "flex" trains through FlexAttention, which torch compiles with triton, '
                    f'but {missing}. Fix: install it, or attention = "auto" (the dense mask '
                    'without triton) or "dense"',
                )
            ]
        if option == "varlen" and config.backend.options.get("dtype") == "fp32":
            return [
                (
                    key,
                    '= "varlen" runs flash attention, which has no float32 kernel, but '
                    '[backend.options] dtype = "fp32". Fix: dtype = "bf16" (or "auto"), or '
                    'attention = "auto"',
                )
            ]
        return []
    trainer = device_part(config, last=True)
    what = {
        "flex": "trains through FlexAttention, which torch runs backward on CUDA only",
        "varlen": "trains through flash attention's variable-length kernel, which is CUDA's",
    }[option]
    return [
        (
            key,
            f'= "{option}" {what}, but training runs on {trainer!r} ([backend] devices = '
            f'{config.backend.devices!r}). Fix: attention = "auto" (flex on a GPU, dense '
            'elsewhere) or "dense", or a gpu device',
        )
    ]


def _compile(config: Config) -> Problems:
    """Compiled training blocks (`compile = true`) where they cannot run: a trainer that
    is not a GPU, a machine without the compiler's triton, the blocks sharded over ranks
    (FSDP gathers them inside the block's call) or flash attention's variable-length
    kernel (its layout is not traced)."""
    opts = config.backend.options
    if opts.get("compile") is not True or "compile" not in _options_of(config):
        return []
    trainer, missing = device_part(config, last=True), compiler_missing("cuda")
    if device_kind(config, last=True) != "cuda":
        problem = (
            f"= true compiles the trained blocks for a GPU, but training runs on {trainer!r} "
            f"([backend] devices = {config.backend.devices!r}). Fix: compile = false, or a "
            "gpu device"
        )
    elif opts.get("shard") is True:
        problem = (
            "= true compiles each block, but shard = true gathers the blocks' weights inside "
            "their calls. Fix: compile = false, or shard = false"
        )
    elif opts.get("attention") == "varlen":
        problem = (
            '= true is not built for attention = "varlen" (its layout is not traced). Fix: '
            'attention = "auto", or compile = false'
        )
    elif missing:
        problem = (
            f"= true compiles the trained blocks with triton, but {missing}. Fix: install "
            "it, or compile = false"
        )
    else:
        return []
    return [("[backend.options] compile", problem)]


def _engine_settings(config: Config) -> Problems:
    """The engine-tuning keys an engine does not act on: a value other than the default is
    an error, not a silent no-op. (A server engine's dtype and caching are chosen when the
    server starts: scripts/vllm_server/start.sh.)"""
    inf, traits = config.inference, _engine_traits(config)
    if traits is None:
        return []
    where = (
        f"the {inf.engine} engine samples in {' or '.join(traits.dtypes)}"
        if traits.in_process
        else f"a {inf.engine} server sets it when it starts (e.g. vLLM --dtype, "
        "--enable-prefix-caching)"
    )
    unused = [
        (
            "[inference] dtype",
            inf.dtype not in traits.dtypes,
            " or ".join(f'"{d}"' for d in traits.dtypes),
        ),
        ("[inference] prefix_caching", not (traits.in_process or inf.prefix_caching), "true"),
    ]
    return [
        (key, f"is not applied by engine {inf.engine!r} ({where}). Fix: {fix}")
        for key, bad, fix in unused
        if bad
    ]


def _inference(config: Config) -> Problems:
    """An engine without a default address needs `[inference] url` (a plugin backend
    decides what it does with [inference])."""
    problems = _engine_settings(config)
    if problems:
        return problems
    traits = _engine_traits(config)
    if traits is None or registry.BACKENDS.entry(config.backend.backend) is None:
        return []
    if traits.in_process and config.inference.url.strip():
        engine = config.inference.engine
        return [
            (
                "[inference] url",
                f"is set, but engine {engine!r} samples in-process and reads no URL. Fix: the "
                'server\'s engine (e.g. engine = "vllm"), or url = "" to sample in-process',
            )
        ]
    if traits.needs_url and not config.inference.url.strip():
        engine = config.inference.engine
        return [
            (
                "[inference] url",
                f'engine = "{engine}" has no default URL. Fix: url = "http://HOST:PORT" of an '
                "OpenAI-compatible server with /v1/completions and logprobs",
            )
        ]
    return []


def _squeeze(config: Config) -> Problems:
    sq = config.squeeze
    if sq is None or not sq.source_rank:
        return []
    problems: Problems = []
    if sq.compress_to > sq.source_rank:
        problems.append(
            (
                "[squeeze] compress_to",
                f"must be <= source_rank ({sq.source_rank}), got {sq.compress_to}",
            )
        )
    too_big = [r for r in sq.target_ranks if r > sq.source_rank]
    if too_big:
        problems.append(
            ("[squeeze] target_ranks", f"ranks {too_big} exceed source_rank {sq.source_rank}")
        )
    return problems


CROSS_CHECKS: tuple[Callable[[Config], Problems], ...] = (
    _objective,
    _shaping,
    _backpressure,
    _reward,
    _sepa,
    _model_url,
    _data,
    _data_files,
    _reward_file,
    _builtin_flow,
    _backend_options,
    _prime_rl_run_dir,
    _overlap,
    _decode,
    _attention,
    _compile,
    _inference,
    _squeeze,
)


def cross_checks(config: Config) -> Problems:
    """Every check that spans several keys, in a stable order."""
    return [problem for check in CROSS_CHECKS for problem in check(config)]


# ---------------------------------------------------------------- this machine
# Not among the cross checks: a config loads the same on every machine; the startup
# checks (retrain/startup.py) compare it with the machine.


def kernel_problems(config: Config, lacks: Callable[[str, str, int], str | None]) -> Problems:
    """Kernels asked of a GPU that has none (`lacks(dtype, device kind, index)`:
    retrain.hardware.triton_lacks_bf16, nvidia-smi's compute capability): triton's in
    bf16, `attention = "flex"` on the training GPU or `decode = "compiled"` on the
    sampling one with `dtype = "bf16"` (for the decode step also a bf16 sampler,
    `[inference] dtype = "bf16"`), on a GPU without native bf16 ("auto" is fp32 there, and
    `attention = "auto"` keeps the dense mask with bf16); flash attention's, `attention =
    "varlen"`, on such a GPU whatever the dtype (flash attention needs bf16 matmuls and a
    GPU from Ampere on: the same GPUs); and `compile = true` with bf16 (triton's too)."""
    opts = config.backend.options
    trainer = opts.get("dtype") == "bf16" and "dtype" in _options_of(config)
    sampler = trainer or config.inference.dtype == "bf16"
    found = []
    for key, value, last, what, instead, bf16 in (
        ("attention", "flex", True, "trains packed rows through FlexAttention", "auto", trainer),
        ("decode", "compiled", False, "compiles the decode step", "graphs", sampler),
        ("attention", "varlen", True, "trains packed rows through flash attention", "auto", True),
        ("compile", True, True, "compiles the trained blocks", False, trainer),
    ):
        if not bf16 or opts.get(key) != value or device_kind(config, last) != "cuda":
            continue
        part = device_part(config, last)
        why = lacks("bf16", "cuda", device_index(config, last))
        if not why:
            continue
        if value == "varlen":
            problem = (
                f'= "varlen" {what}, which needs native bf16, and {part!r} has none '
                f'({why}). Fix: attention = "{instead}"'
            )
        else:
            asked, fix = '[backend.options] dtype = "bf16"', 'dtype = "auto" (fp32 there)'
            if not trainer:  # the sampler's own bf16 copy
                asked, fix = '[inference] dtype = "bf16"', '[inference] dtype = "auto"'
            problem = (
                f"= {_toml(value)} {what} with triton, which has no bf16 on {part!r} "
                f"({why}), and {asked}. Fix: {fix}, or {key} = {_toml(instead)}"
            )
        found.append((f"[backend.options] {key}", problem))
    return found


def _toml(value: str | bool) -> str:
    """An option's value as a TOML file spells it."""
    return str(value).lower() if isinstance(value, bool) else f'"{value}"'


def asked_gpus(devices: str) -> list[str]:
    """The CUDA entries of a `[backend] devices` value ("cpu", "gpu:0,gpu:1", ...)."""
    return [p.strip() for p in devices.split(",") if p.strip().startswith(("gpu", "cuda"))]


def devices_problems(
    config: Config,
    count_cuda: Callable[[], int],
    build: Callable[[], TorchBuild | None] = lambda: None,
    hidden: Callable[[], str | None] = lambda: None,
) -> Problems:
    """`[backend] devices` against the CUDA devices this machine has (`count_cuda()`,
    asked only when a GPU is configured; `hidden()`: how CUDA_VISIBLE_DEVICES hides some)
    and the installed torch's build (`build()`: a build without CUDA numbers none of
    them), for a built-in backend that runs the model here."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    if entry is None or "[backend] devices" in entry.ignores:
        return []
    spec = config.backend.devices
    gpus = asked_gpus(spec)
    cuda_devices = count_cuda() if gpus else 0
    absent = [p for p in gpus if int(p.split(":")[1]) >= cuda_devices]
    if not absent:
        torch = build() if gpus else None
        unseen = None if torch is None or torch.gpu else torch_without_gpu(torch, cuda_devices)
        if unseen is None:
            return []
        return [
            (
                "[backend] devices",
                f"{spec!r} asks for {', '.join(gpus)}; {unseen[0]}. Fix: {unseen[1]}",
            )
        ]
    note = hidden()
    if note is not None:  # the GPUs are there: the environment hides them
        return [
            (
                "[backend] devices",
                f"{spec!r} asks for {', '.join(absent)}, but {note}. Fix: {HIDDEN_FIX}",
            )
        ]
    if cuda_devices == 0:
        has, fix = "this machine has no CUDA device (nvidia-smi finds none)", "cpu"
    else:
        present = [f"gpu:{i}" for i in range(cuda_devices)]
        has = f"this machine has {cuda_devices} CUDA device(s): {', '.join(present)}"
        fix = ",".join(present[: len(gpus)])
    problem = (
        f'{spec!r} asks for {", ".join(absent)}, but {has}. Fix: devices = "{fix}" in '
        f"[backend] (or the flag --devices {fix})"
    )
    if spec == type(config.backend)().devices:  # why a config that never set it gets this
        problem += f"; {spec!r} is also what a config without [backend] devices asks for"
    return [("[backend] devices", problem)]
