"""The composition root: a validated Config in, the run's components out.

This is the one place that maps config tables onto constructors. Each builder takes its
own table (nothing is filtered by signature, so no option can be silently dropped), and
every plugin is resolved once, here. The flow checks run before anything heavy loads.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrain import registry
from retrain.advantages import AdvantagePipeline, PlanningDetector, make_detector
from retrain.backends.base import backend_info
from retrain.backpressure import BackPressureController
from retrain.config import Config
from retrain.config.validate import flow_problems
from retrain.errors import TrainingError
from retrain.sepa import SEPAScheduler
from retrain.types import BackendCapabilities, SamplingParams, TrainHyper


@dataclass
class Components:
    """Everything a run is made of, built once before step 0."""

    capabilities: BackendCapabilities
    pipeline: AdvantagePipeline
    rollout: Any  # rollout.Rollout: sample + score
    tokenizer: Any
    vocab: Any  # rollout.VocabTable
    data: Any  # data.DataSource
    renderer: Any  # data.prompts.PromptRenderer
    reward: Any  # rewards.Reward
    detector: PlanningDetector
    sepa: SEPAScheduler
    backpressure: BackPressureController | None
    backend: Any  # backends.base.Backend
    sampling: SamplingParams  # the seed is set per step
    hyper: TrainHyper
    evaluator: Any = None  # evaluate.Evaluator when [eval] every > 0

    def close(self, say: Callable[[str], None]) -> None:
        """Release the reward's workers, the backend and the data source; a failure is
        reported, never raised (it must not hide the run's own error)."""
        for obj in (self.reward, self.backend, self.data):
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


def preflight(config: Config) -> tuple[BackendCapabilities, AdvantagePipeline]:
    """Resolve the backend's capabilities and the advantage flow, and refuse a flow the
    backend cannot carry, before any model loads."""
    search_paths = tuple(config.plugins.search_paths)
    caps = backend_info(config.backend.backend, search_paths).capabilities
    pipeline = build_pipeline(config)
    problems = flow_problems(config, caps, token_varying=pipeline.varies_per_token())
    if problems:
        raise TrainingError("; ".join(f"{key}: {message}" for key, message in problems))
    return caps, pipeline


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
    )


def sampling_params(config: Config, pipeline: AdvantagePipeline) -> SamplingParams:
    t = config.training
    return SamplingParams(
        max_tokens=t.max_tokens,
        temperature=t.temperature,
        top_p=t.top_p,
        return_entropy=pipeline.needs_entropies,
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
        policy_loss=t.policy_loss,
        clip_eps=t.clip_eps,
        clip_eps_high=t.clip_eps_high or t.clip_eps,
        clip_ratio_c=t.clip_ratio_c,
        adv_clip_max=t.adv_clip_max,
        loss_agg=t.loss_agg,
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        tis_cap=t.tis_cap,
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


def build(config: Config, say: Callable[[str], None]) -> Components:
    """Every component of a run, in the order that keeps runs reproducible."""
    from retrain.evaluate import build_evaluator, prepare_held_out
    from retrain.models import load_tokenizer
    from retrain.rewards import build_reward
    from retrain.rollout import VocabTable

    search_paths = tuple(config.plugins.search_paths)
    registry.add_search_paths(search_paths)
    caps, pipeline = preflight(config)
    seed_everything(config.training.seed)
    say(f"Loading tokenizer for {config.model.model} ...")
    tokenizer = load_tokenizer(config.model.model)
    say("Loading vocabulary table...")
    vocab = VocabTable(tokenizer)
    say(f"Vocabulary table: {len(vocab)} entries")
    data, renderer = build_data(config, tokenizer, say)
    held_out = prepare_held_out(config, data, renderer, say) if config.eval.every > 0 else None
    # A verifiers environment scores with its own rubric.
    reward = getattr(data, "reward", None) or build_reward(config.reward, search_paths)
    p = config.planning
    detector = make_detector(
        p.detector, config.logging.strategic_grams or None, p.model, p.threshold
    )
    sepa, backpressure = build_sepa(config), build_backpressure(config)
    backend_cls = registry.BACKENDS.resolve(config.backend.backend, search_paths)
    backend = backend_cls(config, tokenizer, say=say)
    parts = Components(
        caps,
        pipeline,
        build_rollout(config, data, backend, reward, renderer),
        tokenizer,
        vocab,
        data,
        renderer,
        reward,
        detector,
        sepa,
        backpressure,
        backend,
        sampling_params(config, pipeline),
        train_hyper(config),
    )
    if held_out is not None:
        parts.evaluator = build_evaluator(config, parts.rollout, held_out)
    return parts
