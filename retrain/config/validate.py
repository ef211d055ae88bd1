"""Checks that span several keys. Each returns (`[table] key`, message with a fix)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retrain import registry
from retrain.backends.base import BUILTIN_CAPABILITIES, BUILTIN_OPTIONS, check_option
from retrain.config.schema import Config

TOKEN_VARYING_TRANSFORMS = ("gtpo", "gtpo_hicra", "gtpo_sepa")


def token_varying(config: Config) -> bool:
    """Whether the configured flow gives different advantages to tokens of one completion
    (built-ins known statically; dotted paths are probed at preflight)."""
    algo = config.algorithm
    if algo.algorithm_mode:
        return registry.ALGORITHM_MODES.is_builtin(algo.algorithm_mode)
    return algo.transform_mode in TOKEN_VARYING_TRANSFORMS


def cross_checks(config: Config, raw: Mapping[str, Any]) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    add = problems.append
    bp = config.backpressure
    if bp.min_batch_size > bp.max_batch_size:
        add(
            (
                "[backpressure] min_batch_size",
                f"must be <= max_batch_size ({bp.max_batch_size}), got {bp.min_batch_size}",
            )
        )

    if config.reward.type == "custom" and not config.reward.custom_module:
        add(
            (
                "[reward] custom_module",
                "reward type 'custom' needs custom_module (a module name or a .py path). Fix: set [reward] custom_module = \"my_rewards\"",
            )
        )

    env = config.environment
    if env.provider == "verifiers" and not env.id:
        add(
            (
                "[environment] id",
                "provider 'verifiers' needs an environment id, e.g. id = \"primeintellect/gsm8k\"",
            )
        )
    if not env.provider:
        if config.data.source == "jsonl" and not config.data.path:
            add(("[data] path", "source 'jsonl' needs path = \"file.jsonl\""))
        if config.data.source == "reasoning_gym" and not config.data.task:
            add(
                (
                    "[data] task",
                    "source 'reasoning_gym' needs a task name, e.g. task = \"chain_sum\"",
                )
            )

    backend = registry.BACKENDS.canonical(config.backend.backend)
    if backend == "local" and config.inference.engine != "pytorch" and not config.inference.url:
        add(
            (
                "[inference] url",
                f'engine {config.inference.engine!r} talks to a server: set url = "http://localhost:8000"',
            )
        )

    # A token-varying flow on a backend that aggregates advantages would silently lose
    # credit assignment: refuse it here for built-ins (plugins are probed at preflight).
    caps = BUILTIN_CAPABILITIES.get(backend)
    if caps is not None and not caps.preserves_token_advantages and token_varying(config):
        key = (
            "[algorithm] algorithm_mode"
            if config.algorithm.algorithm_mode
            else "[algorithm] transform_mode"
        )
        add(
            (
                key,
                f'backend {backend!r} does not preserve token-level advantages, so {config.condition!r} would be silently aggregated. Fix: use transform_mode = "none" or a backend such as local/tinker',
            )
        )

    options = BUILTIN_OPTIONS.get(backend)
    if options is not None:
        for name, value in config.backend.options.items():
            spec = options.get(name)
            if spec is None:
                valid = ", ".join(options) or "(none)"
                add(
                    (
                        "[backend] options",
                        f"unknown option {name!r} for backend {backend!r}{registry.suggest(name, options)}; valid: {valid}",
                    )
                )
                continue
            problem = check_option(name, spec, value)
            if problem:
                add(("[backend] options", problem))

    sq = config.squeeze
    if sq is not None and sq.source_rank:
        if sq.compress_to > sq.source_rank:
            add(
                (
                    "[squeeze] compress_to",
                    f"must be <= source_rank ({sq.source_rank}), got {sq.compress_to}",
                )
            )
        too_big = [r for r in sq.target_ranks if r > sq.source_rank]
        if too_big:
            add(("[squeeze] target_ranks", f"ranks {too_big} exceed source_rank {sq.source_rank}"))
    return problems
