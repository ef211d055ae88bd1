"""The composition root: a validated Config in, the run's components out.

This is the one place that maps config tables onto constructors. Each builder takes its
own table (nothing is filtered by signature, so no option can be silently dropped), and
every plugin is resolved once, here. `build` first runs the startup checks
(retrain/startup.py), so nothing heavy loads for a config this machine would refuse.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

# The original project's plugin forms (spec records, factories, fn(ctx)) resolve through
# the adapters this installs, for runs started from the library as from the CLI.
import retrain.compat  # noqa: F401
from retrain import hardware, registry
from retrain.advantages import AdvantagePipeline, PlanningDetector, make_detector
from retrain.backends.base import Backend, BackendInfo, backend_info
from retrain.backpressure import BackPressureController
from retrain.config import Config
from retrain.config.validate import (
    samples_through_engine,
    training_device,
)
from retrain.models import (
    model_shape,
)
from retrain.roofline import StepWork, step_work
from retrain.sepa import SEPAScheduler
from retrain.settings import (
    EngineSettings,
    LocalOptions,
    LocalSettings,
    LoraSettings,
    OptimizerSettings,
    PrimeRLOptions,
    PrimeRLSettings,
    TinkerOptions,
    TinkerSettings,
)
from retrain.shaping import Shaping
from retrain.types import BackendCapabilities, SamplingParams, StepResult, TrainHyper
from retrain.world import World, world_from_env

if TYPE_CHECKING:  # heavy modules: imported where the components are built
    from retrain.data import DataSource
    from retrain.data.prompts import PromptRenderer
    from retrain.engines.base import Engine, UnboundEngine
    from retrain.evaluate import Evaluator
    from retrain.rewards import Reward
    from retrain.rollout import RolloutFn, VocabTable


@dataclass
class Components:
    """Everything a run is made of, built once before step 0."""

    capabilities: BackendCapabilities
    pipeline: AdvantagePipeline
    rollout: RolloutFn  # sample + score one step's groups (single- or multi-turn)
    tokenizer: Any  # a transformers tokenizer
    vocab: VocabTable
    data: DataSource
    renderer: PromptRenderer
    reward: Reward
    detector: PlanningDetector
    sepa: SEPAScheduler
    backpressure: BackPressureController | None
    backend: Backend
    sampling: SamplingParams  # the seed is set per step
    hyper: TrainHyper  # the learning rate is set per step
    evaluator: Evaluator | None = None  # when [eval] every > 0
    shaping: Shaping = Shaping()  # [training] batch shaping; the default changes nothing

    def close(self, say: Callable[[str], None]) -> None:
        """Release the rollout's event loop (multi-turn), the reward's workers, the
        backend and the data source; a failure is reported, never raised (it must not
        hide the run's own error)."""
        for obj in (self.rollout, self.reward, self.backend, self.data):
            close = getattr(obj, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:
                    say(f"warning: closing {type(obj).__name__} failed: {exc}")


def build_pipeline(config: Config) -> AdvantagePipeline:
    a = config.algorithm
    return AdvantagePipeline(
        advantage_mode=a.advantage_mode,
        transform_mode=a.transform_mode,
        algorithm_mode=a.algorithm_mode,
        gtpo_beta=config.gtpo.beta,
        hicra_alpha=config.hicra.alpha,
        uncertainty_kind=a.uncertainty_kind,
        surprisal_mask_rho=a.surprisal_mask_rho,
        advantage_params=a.advantage_params,
        transform_params=a.transform_params,
        search_paths=tuple(config.plugins.search_paths),
    )


def backend_line(info: BackendInfo) -> str:
    """The run's first line: what its backend guarantees (the capabilities `retrain
    explain` and `retrain backends` list), the missing ones said too."""
    c = info.capabilities
    said = [
        "reports its loss" if c.reports_sync_loss else "no loss reported (a placeholder)",
        "per-token advantages" if c.preserves_token_advantages else "one advantage per completion",
        "resumes from checkpoints" if c.supports_checkpoint_resume else "cannot resume",
    ]
    if c.resume_runtime_dependent:
        said.append("resume needs its service to keep the checkpoints")
    if c.multi_process:
        said.append("trains under torchrun")
    data = f"; token data: {', '.join(c.token_data)}" if c.token_data else ""
    options = f"; {len(c.loss_options)} loss options" if c.loss_options else "; no loss options"
    source = {"plugin/default": "plugin without capability hooks: conservative defaults"}
    return (
        f"Backend: {info.name} ({source.get(info.source, info.source)}): "
        f"{', '.join(said)}{data}{options}"
    )


def seed_everything(seed: int) -> None:
    """Python's and numpy's global RNGs (torch's is seeded by the backend)."""
    if seed >= 0:
        random.seed(seed)
        np.random.seed(seed % 2**32)


def build_data(config: Config, tokenizer, say: Callable[[str], None]):
    from retrain.data import build_data_source
    from retrain.data.prompts import PromptRenderer, resolve_instruction

    t, d = config.training, config.data
    say("Loading dataset...")
    data = build_data_source(
        d,
        environment=config.environment,
        max_examples=t.max_examples,
        shuffle_seed=t.seed if t.seed >= 0 else int.from_bytes(os.urandom(4), "little"),
        search_paths=tuple(config.plugins.search_paths),
    )
    say(f"Loaded {len(data)} examples")
    renderer = PromptRenderer(
        tokenizer,
        system_prompt=d.system_prompt,
        instruction=resolve_instruction(d.instruction, d.source),
        few_shot=d.few_shot,
    )
    for example in data.examples:
        renderer.encode(example)
    say(f"Pre-encoded {len(data)} prompts")
    return data, renderer


def build_sepa(config: Config) -> SEPAScheduler:
    s = config.sepa
    return SEPAScheduler(
        steps=s.steps,
        schedule=s.schedule,
        delay_steps=s.delay_steps,
        correct_rate_gate=s.correct_rate_gate,
        ema_decay=s.ema_decay,
        var_threshold=s.var_threshold,
        warmup=s.warmup,
    )


def build_backpressure(config: Config) -> BackPressureController | None:
    bp, t = config.backpressure, config.training
    if not bp.enabled:
        return None
    return BackPressureController(
        warmup_steps=bp.warmup_steps,
        ema_decay=bp.ema_decay,
        throttle_margin=bp.throttle_margin,
        increase_margin=bp.increase_margin,
        min_batch_size=bp.min_batch_size,
        max_batch_size=bp.max_batch_size,
        peak_gflops=bp.peak_gflops,
        peak_bw_gb_s=bp.peak_bw_gb_s,
        group_size=t.group_size,
        initial_batch_size=t.batch_size,
        multiple=world_of(config).size,  # each rank samples whole prompts
    )


def sampling_params(config: Config, pipeline: AdvantagePipeline) -> SamplingParams:
    t = config.training
    return SamplingParams(
        max_tokens=t.max_tokens,
        temperature=t.temperature,
        top_p=t.top_p,
        return_entropy=pipeline.needs_entropies,
    )


def batch_shaping(config: Config) -> Shaping:
    t = config.training
    return Shaping(
        dynamic_sampling=t.dynamic_sampling,
        max_rounds=t.dynamic_sampling_max_rounds,
        mask_truncated=t.mask_truncated,
        overlong_buffer=t.overlong_buffer,
        overlong_penalty=t.overlong_penalty,
        max_tokens=t.max_tokens,
    )


def train_hyper(config: Config) -> TrainHyper:
    t, o = config.training, config.optimizer
    return TrainHyper(
        lr=t.lr,
        weight_decay=t.weight_decay,
        beta1=o.beta1,
        beta2=o.beta2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
        temperature=t.temperature,
        policy_loss=t.policy_loss,
        clip_eps=t.clip_eps,
        clip_eps_high=t.clip_eps_high or t.clip_eps,
        clip_ratio_c=t.clip_ratio_c,
        ratio_level=t.ratio_level,
        sapo_tau_pos=t.sapo_tau_pos,
        sapo_tau_neg=t.sapo_tau_neg,
        vespo_k_pos=t.vespo_k_pos,
        vespo_lambda_pos=t.vespo_lambda_pos,
        vespo_k_neg=t.vespo_k_neg,
        vespo_lambda_neg=t.vespo_lambda_neg,
        clip_cov_fraction=t.clip_cov_fraction,
        clip_cov_lb=t.clip_cov_lb,
        clip_cov_ub=t.clip_cov_ub,
        kl_cov_fraction=t.kl_cov_fraction,
        kl_cov_beta=t.kl_cov_beta,
        dppo_kl_coef=t.dppo_kl_coef,
        adv_clip_max=t.adv_clip_max,
        loss_agg=t.loss_agg,
        max_tokens=t.max_tokens,
        bnpo_batch_size=t.bnpo_batch_size,
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        tis_cap=t.tis_cap,
        is_correction=t.is_correction,
        is_level=t.is_level,
        is_low=t.is_low,
        is_high=t.is_high,
    )


def build_rollout(config: Config, data: Any, backend: Any, reward: Any, renderer: Any) -> Any:
    """Single-turn sampling, or the turn-by-turn rollout when the environment talks back
    (a multi-turn verifiers environment; see retrain/multiturn.py)."""
    from retrain.rollout import Rollout

    turn_env = getattr(data, "turn_environment", None)
    if turn_env is None:
        return Rollout(backend, reward, renderer, config.reward.correct_threshold)
    from retrain.multiturn import MultiTurnRollout

    return MultiTurnRollout(
        backend,
        turn_env,
        renderer,
        config.reward.correct_threshold,
        turn_timeout_s=config.environment.turn_timeout_s,
    )


def build(
    config: Config, say: Callable[[str], None], info: BackendInfo, pipeline: AdvantagePipeline
) -> Components:
    """Every component of a run, in the order that keeps runs reproducible, from a config
    that passed the startup checks and the flow's preflight (`info`, `pipeline`: both
    made by retrain/startup.py's `checked_build`, the one caller)."""
    from retrain.evaluate import build_evaluator, prepare_held_out
    from retrain.models import load_tokenizer
    from retrain.rewards import build_reward
    from retrain.rollout import VocabTable

    search_paths = tuple(config.plugins.search_paths)
    say(backend_line(info))
    seed_everything(config.training.seed)
    say(f"Loading tokenizer for {config.model.model} ...")
    tokenizer = load_tokenizer(config.model.model)
    say("Loading vocabulary table...")
    vocab = VocabTable(tokenizer)
    say(f"Vocabulary table: {len(vocab)} entries")
    data, renderer = build_data(config, tokenizer, say)
    if getattr(data, "needs_tools", False):  # before any model loads
        from retrain.tool_calls import require_format

        say(f"Tool calls: {require_format(tokenizer, config.model.model).name} format")
    held_out = prepare_held_out(config, data, renderer, say) if config.eval.every > 0 else None
    # A verifiers environment scores with its own rubric.
    reward = getattr(data, "reward", None) or build_reward(config.reward, search_paths)
    p = config.planning
    detector = make_detector(
        p.detector, config.logging.strategic_grams or None, p.model, p.threshold
    )
    backend = build_backend(config, tokenizer, say)
    parts = Components(
        capabilities=info.capabilities,
        pipeline=pipeline,
        rollout=build_rollout(config, data, backend, reward, renderer),
        tokenizer=tokenizer,
        vocab=vocab,
        data=data,
        renderer=renderer,
        reward=reward,
        detector=detector,
        sepa=build_sepa(config),
        backpressure=build_backpressure(config),
        backend=backend,
        sampling=sampling_params(config, pipeline),
        hyper=train_hyper(config),
        shaping=batch_shaping(config),
    )
    if held_out is not None:
        parts.evaluator = build_evaluator(config, parts.rollout, held_out)
    return parts


# ---------------------------------------------------------------- engines and backends


def engine_settings(config: Config) -> EngineSettings:
    """`[inference]` (and what a server retrain starts must serve) for the engine."""
    inf = config.inference
    # The in-process engine's decoding options are options of the backend it samples for
    # (`[backend.options]` prompt_batch and decode, with that backend's defaults).
    entry = registry.BACKENDS.entry(config.backend.backend)
    schema = entry.options if entry is not None else {}

    def option(key: str, default: Any) -> Any:
        spec = schema.get(key)
        return config.backend.options.get(key, spec.default if spec else default)

    return EngineSettings(
        engine=inf.engine,
        url=inf.url,
        api_key=inf.api_key,
        timeout=inf.timeout,
        max_retries=inf.max_retries,
        max_connections=inf.max_connections,
        dtype=inf.dtype,
        prefix_caching=inf.prefix_caching,
        prompt_batch=option("prompt_batch", 0),
        decode=option("decode", "auto"),
        model=config.model.model,
        lora_rank=config.model.lora_rank,
    )


def build_engine(
    settings: EngineSettings, tokenizer: Any, say: Callable[[str], None]
) -> Engine | UnboundEngine:
    """The `[inference]` engine, from its registry entry's factory (a server engine is
    reached here, before any model loads, so a server that is down fails first)."""
    factory = registry.ENGINES.resolve(settings.engine)
    return factory(settings, tokenizer=tokenizer, say=say)


def local_settings(config: Config) -> LocalSettings:
    from retrain.loss import resolve_objective

    m, t, o = config.model, config.training, config.optimizer
    return LocalSettings(
        model=m.model,
        lora=LoraSettings(
            rank=m.lora_rank,
            alpha=config.lora.alpha,
            dropout=config.lora.dropout,
            target_modules=tuple(config.lora.target_modules),
        ),
        optimizer=OptimizerSettings(
            lr=t.lr, weight_decay=t.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps
        ),
        devices=config.backend.devices,
        adapter_path=config.backend.adapter_path,
        seed=t.seed,
        options=LocalOptions.from_mapping(config.backend.options),
        loss=resolve_objective(t.policy_loss, tuple(config.plugins.search_paths)),
        world=world_of(config),
        max_tokens=t.max_tokens,
    )


def ignored_settings(config: Config, ignores: tuple[str, ...]) -> tuple[str, ...]:
    """The settings named by a registry entry's `ignores` ("[table]", "[table] key" or
    "[table] a/b/c") that the config sets to non-default values (the backend says so)."""
    import dataclasses

    from retrain.config.schema import TABLES

    out = []
    for spec in ignores:
        table, _, keys = spec.lstrip("[").partition("]")
        section, default = getattr(config, table), TABLES[table]()
        names = (
            keys.strip().split("/")
            if keys.strip()
            else [f.name for f in dataclasses.fields(section)]
        )
        changed = [n for n in names if getattr(section, n) != getattr(default, n)]
        if changed:
            out.append(f"[{table}] " + ", ".join(changed))
    return tuple(out)


def tinker_settings(config: Config) -> TinkerSettings:
    m, b = config.model, config.backend
    return TinkerSettings(
        model=m.model,
        base_url=m.base_url,
        lora_rank=m.lora_rank,
        seed=config.training.seed,
        temperature=config.training.temperature,
        throttle_dir=b.throttle_dir,
        max_concurrent=b.max_concurrent,
        options=TinkerOptions.from_mapping(b.options),
        ignored=ignored_settings(config, registry.BACKENDS.entry("tinker").ignores),
    )


def prime_rl_settings(config: Config) -> PrimeRLSettings:
    return PrimeRLSettings(
        model=config.model.model,
        output_dir=config.backend.adapter_path,
        url=config.inference.url,
        options=PrimeRLOptions.from_mapping(config.backend.options),
        ignored=ignored_settings(config, registry.BACKENDS.entry("prime_rl").ignores),
    )


# The built-in backends' settings, read from the Config (a dotted-path plugin backend is
# constructed from the Config itself: `Cls(config, tokenizer, say=...)`, its contract).
BACKEND_SETTINGS: dict[str, Callable[[Config], Any]] = {
    "local": local_settings,
    "tinker": tinker_settings,
    "prime_rl": prime_rl_settings,
}


def step_work_of(config: Config) -> Callable[[StepResult], StepWork] | None:
    """Each step's FLOPs and bytes for back pressure's roofline hint (retrain/roofline.py),
    where it asks (both peaks set) and the model's config.json, on disk by the time the
    run steps, gives its sizes; None otherwise (no hint). Weights count in the local
    backend's matmul dtype on its training device, else bf16 (a service's)."""
    bp = config.backpressure
    if not (bp.enabled and bp.peak_gflops > 0 and bp.peak_bw_gb_s > 0):
        return None
    shape = model_shape(config.model.model)
    if shape is None:
        return None
    value_bytes = 2
    if config.backend.backend == "local":
        _, kind, index = training_device(config)
        option = str(config.backend.options.get("dtype", "auto"))
        dtype = hardware.matmul_dtype(option, kind, index)
        value_bytes = 2 if dtype == "bf16" else 4

    def work(result: StepResult) -> StepWork:
        rows = [(len(g.prompt_ids), len(s.token_ids)) for g in result.groups for s in g.samples]
        return step_work(shape, value_bytes, rows)

    return work


def build_backend(
    config: Config, tokenizer: Any, say: Callable[[str], None], **extra: Any
) -> Backend:
    """The configured backend, from typed settings; a backend that samples through the
    `[inference]` engine gets it built first. `extra` reaches the constructor (tests
    hand the local backend a model)."""
    name = config.backend.backend
    cls = registry.BACKENDS.resolve(name, tuple(config.plugins.search_paths))
    entry = registry.BACKENDS.entry(name)
    if entry is None:  # a plugin gets the Config, its options' schema defaults filled in
        schema = backend_info(name, tuple(config.plugins.search_paths)).options
        if schema:
            options = {key: spec.default for key, spec in schema.items()}
            options.update(config.backend.options)
            config = replace(config, backend=replace(config.backend, options=options))
        return cls(config, tokenizer, say=say, **extra)
    settings = BACKEND_SETTINGS[entry.name](config)
    if samples_through_engine(config):
        extra = {"engine": build_engine(engine_settings(config), tokenizer, say), **extra}
    return cls(settings, tokenizer, say=say, **extra)


def world_of(config: Config) -> World:
    """This process's place in the run: torchrun's environment, with the local backend's
    `[backend.options]` collective_timeout_s and shard."""
    opts = config.backend.options
    return world_from_env(
        timeout_s=float(opts.get("collective_timeout_s", 600)), shard=opts.get("shard") is True
    )
