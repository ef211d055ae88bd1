"""One-line descriptions of what a config does (`retrain explain` prints them; doctor
and the campaign report reuse them). Pure functions of the Config: no torch."""

from __future__ import annotations

from typing import Any

from retrain import registry
from retrain.config import Config


def uses_sepa(config: Config) -> bool:
    """Whether the flow's transform reads the SEPA lambda (gtpo_sepa and its amp forms)."""
    algo = config.algorithm
    alias = registry.ALGORITHM_MODES.entry(algo.algorithm_mode) if algo.algorithm_mode else None
    transform = (
        alias.alias_of[1] if alias is not None else algo.algorithm_mode or algo.transform_mode
    )
    return "sepa" in transform


def builtin_transform(config: Config) -> str | None:
    """The built-in transform the flow runs (an algorithm alias's own), or None where a
    dotted-path transform or algorithm plugin runs (it may read any key)."""
    algo = config.algorithm
    if algo.algorithm_mode:
        alias = registry.ALGORITHM_MODES.entry(algo.algorithm_mode)
        return alias.alias_of[1] if alias is not None and alias.alias_of else None
    entry = registry.TRANSFORM_MODES.entry(algo.transform_mode)
    return entry.name if entry is not None else None


def sepa_summary(config: Config) -> str:
    if not uses_sepa(config):
        return f"not used by {config.condition}"
    s = config.sepa
    if s.steps == 0:
        ramp = f"lambda jumps to 1 at step {s.delay_steps}"
    else:
        ramp = f"lambda 0 until step {s.delay_steps}, rises linearly to 1 at step {s.delay_steps + s.steps}"
    if s.schedule == "auto":
        ramp += f"; auto: after {s.warmup} warmup steps lambda also follows the decay of execution-uncertainty variance (threshold {s.var_threshold}, EMA {s.ema_decay})"
    gate = (
        f"gate: opens once a batch correct rate >= {s.correct_rate_gate} (sticky)"
        if s.correct_rate_gate > 0
        else "no correctness gate"
    )
    if config.training.max_steps <= s.delay_steps and s.schedule == "linear":
        ramp += f" (never reached: max_steps is {config.training.max_steps})"
    return f"{s.schedule}: {ramp}; {gate}"


def periodic_checkpoints(max_steps: int, save_every: int) -> int:
    """How many periodic checkpoints a run writes, the trainer's rule (its `_loop`): one
    after every save_every steps before the last one, whose save is the final checkpoint.
    Counted, not listed: a huge max_steps costs nothing."""
    return max(0, (max_steps - 1) // save_every) if save_every > 0 else 0


def data_summary(config: Config) -> str:
    env = config.environment
    if env.provider:
        return f"{env.provider} environment {env.id!r} (args {env.args})"
    d = config.data
    if d.source == "reasoning_gym":
        return (
            f"reasoning_gym task {d.task!r} ({d.size} problems, data seed {d.seed}, args {d.args})"
        )
    if d.source == "jsonl":
        return f"jsonl {d.path} (prompt={d.prompt_field!r}, answer={d.answer_field!r})"
    if d.source == "math":
        where = f"local copy {d.path}" if d.path else "EleutherAI/hendrycks_math from the hub"
        return f"MATH, five subjects, {where}"
    return f"plugin {d.source}"


def reward_summary(config: Config) -> str:
    """The reward type, with what a judge asks and a custom reward calls."""
    r = config.reward
    if config.environment.provider:  # the environment scores with its own rubric
        return f"the environment's rubric ({config.environment.id})"
    if r.type == "judge":
        from retrain.rewards.judge import DEFAULT_MODEL, endpoint

        base, source = endpoint(r.judge_base_url)
        where = "" if r.judge_base_url else f" ({source})"
        return f"judge: {r.judge_model or DEFAULT_MODEL} at {base}{where}"
    if r.type == "custom":
        return f"custom: {r.custom_function}() of {r.custom_module}"
    return r.type


def named_algorithm(config: Config) -> dict[str, Any] | None:
    """The rows of the map (`retrain man --topic algorithms`) the config amounts to."""
    from retrain.algorithms import describe, identify

    rows = identify(config)
    if not rows:
        return None
    return {"text": describe(rows), "rows": [row.as_dict() for row in rows]}


def backpressure_summary(config: Config) -> str:
    bp = config.backpressure
    if not bp.enabled:
        return "off"
    return f"on: batch size adapts within [{bp.min_batch_size}, {bp.max_batch_size}] after {bp.warmup_steps} warmup steps"


def shaping_summary(config: Config) -> str:
    """Batch shaping ([training]; retrain/shaping.py) in one line."""
    t, parts = config.training, []
    if t.dynamic_sampling:
        parts.append(
            f"dynamic sampling (all-equal groups dropped, up to {t.dynamic_sampling_max_rounds} "
            f"extra rounds to reach {t.batch_size} informative groups)"
        )
    if t.mask_truncated:
        parts.append(f"completions cut at {t.max_tokens} tokens masked")
    if t.overlong_buffer:
        start = t.max_tokens - t.overlong_buffer
        parts.append(
            f"overlong penalty from {start} tokens, -{t.overlong_penalty:g} at {t.max_tokens}"
        )
    return "; ".join(parts) or "off"


def objective_summary(config: Config) -> str:
    """The training objective in one line: policy loss, aggregation, off-policy
    correction, KL, lr schedule."""
    t = config.training
    if config.backend.backend == "prime_rl":  # its trainer computes the loss, not retrain
        return (
            "the prime-rl trainer's own [trainer.loss] (by default DPPO with kl_tau 1e-3, "
            "retrain's dppo + dppo_kl_coef = 0.001); retrain's [training] loss keys do not "
            f"apply; lr {t.lr:g} {t.lr_schedule}"
        )
    high = t.clip_eps_high or t.clip_eps
    band = f"[{1 - t.clip_eps:g}, {1 + high:g}]"
    dual = f", dual clip c={t.clip_ratio_c:g}" if t.clip_ratio_c > 0 else ""
    level = " of the sequence ratio" if t.ratio_level == "sequence" else ""
    losses = {
        "is": "is (importance-sampling policy gradient)",
        "ppo_clip": f"ppo_clip (ratio clipped to {band}{dual})",
        "gspo": f"gspo (sequence ratio clipped to {band}{dual})",
        "cispo": f"cispo (detached weight{level} clipped to {band})",
        "sapo": f"sapo (soft gate{level}, tau +{t.sapo_tau_pos:g} / -{t.sapo_tau_neg:g})",
        "vespo": "vespo (Gamma weight of the sequence ratio)",
        "clip_cov": f"clip_cov (ratio clipped to {band}, {t.clip_cov_fraction:g} of the tokens "
        f"with covariance in ({t.clip_cov_lb:g}, {t.clip_cov_ub:g}) cut out)",
        "kl_cov": f"kl_cov ({t.kl_cov_beta:g} |log r| on the top {t.kl_cov_fraction:g} of the "
        "tokens by covariance)",
        "gpg": "gpg (plain policy gradient -A logp, no ratio)",
        "gmpo": f"gmpo (geometric mean of the ratios, log r clipped to [{-t.clip_eps:g}, {high:g}])",
        "dppo": f"dppo (tokens whose probability moved beyond -{t.clip_eps:g} / +{high:g} "
        "dropped" + (f", {t.dppo_kl_coef:g} (log r)^2" if t.dppo_kl_coef > 0 else "") + ")",
    }
    # a dotted path otherwise (config validation admits nothing else)
    loss = losses.get(
        t.policy_loss, f"{t.policy_loss} (your objective: fn(inputs, hyper) -> TokenLoss)"
    )
    agg = f"agg {t.loss_agg}"
    if t.loss_agg == "bnpo":
        agg += f" (local batches of {t.bnpo_batch_size or 'all'} completions)"
    parts = [loss, agg]
    if t.adv_clip_max > 0:
        parts.append(f"advantages clipped to +-{t.adv_clip_max:g}")
    if t.tis_cap > 0:
        parts.append(f"IS weight truncated at {t.tis_cap:g} (token)")
    elif t.is_correction != "none":
        low = f"{t.is_low:g}" if t.is_low > 0 else "0"
        parts.append(f"IS weight {t.is_correction} to [{low}, {t.is_high:g}] ({t.is_level})")
    parts.append(
        f"KL {t.kl_estimator} x {t.kl_coef:g} to the base model (LoRA off)"
        if t.kl_coef > 0
        else "KL off"
    )
    warmup = f", {t.warmup_steps} warmup steps" if t.warmup_steps else ""
    parts.append(f"lr {t.lr:g} {t.lr_schedule}{warmup}")
    return "; ".join(parts)


def eval_summary(config: Config) -> str:
    """The held-out evaluation ([eval]) in words (its file is checked when the config loads)."""
    from retrain.evaluate import describe

    if config.eval.every <= 0:
        return "off ([eval] every = 0)"
    return describe(config)
