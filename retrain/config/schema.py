"""The configuration schema: one dataclass per TOML table, nested under `Config`.

Each field carries its documentation and its checks in `metadata`, so validation,
CLI flags, `retrain man`'s reference block and `config_to_toml()` (config/toml_writer.py)
all derive from this one place. Defaults follow the product specification.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

Check = Any  # callable(value) -> error text or None


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    registry_name: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    check: Check | None = None,
    fix: str = "",
    secret: bool = False,
    key: str | None = None,
    item: str | None = None,
) -> Any:
    """A schema field. `registry_name` validates against a registry in retrain.registry;
    `check(value)` returns an error text or None; `fix` is appended to any error."""
    meta = {
        "help": help,
        "choices": choices,
        "registry": registry_name,
        "ge": ge,
        "gt": gt,
        "le": le,
        "check": check,
        "fix": fix,
        "secret": secret,
        "key": key,
        "item": item,  # element type of a list: "int", "str" or "dict"
    }
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: _copy(d), metadata=meta)
    return field(default=default, metadata=meta)


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


_DEVICE = re.compile(r"^(cpu|gpu:\d+|cuda:\d+|mps)$")


def _check_devices(value: str) -> str | None:
    parts = [p.strip() for p in value.split(",")]
    bad = [p for p in parts if not _DEVICE.match(p)]
    if not value.strip() or bad:
        return f"malformed device list {value!r} (bad part: {bad[0] if bad else '<empty>'!r})"
    gpus = [p for p in parts if p != "cpu"]
    if len(set(gpus)) != len(gpus):  # cpu may repeat: split mode on one CPU (tests, debugging)
        return f"device list {value!r} repeats a device"
    return None


def _one_device(value: str) -> str | None:
    if _DEVICE.match(value.strip()):
        return None
    return f"malformed device {value!r}: use e.g. 'cpu' or 'gpu:0'"


def _non_empty(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


# Caps far above any real run, so that a mistyped number is a config error rather than a
# run (or explain's estimate) that allocates or loops without end: a billion steps is
# decades at a second a step; a million prompts a step and a hundred thousand completions a
# prompt are orders of magnitude past what RL runs use (hundreds to thousands of prompts,
# tens to hundreds of completions); a held-out set of 100,000 problems takes hours to
# evaluate.
MAX_STEPS = 10**9
MAX_PROMPTS = 10**6
MAX_GROUP = 10**5
MAX_HELD_OUT = 10**5
# reasoning_gym's held-out seeds start EVAL_SEED_OFFSET above [data] seed (problem i is
# drawn from seed + i): a training set this size never reaches them.
MAX_GENERATED = 10**7


# [environment] max_turns = -1 where the environment sets no cap of its own (an OpenEnv
# environment never does): a conversation must end somewhere.
FALLBACK_MAX_TURNS = 8


def _turn_cap(value: int) -> str | None:
    return (
        None
        if value == -1 or value >= 1
        else f"must be -1 (the environment's cap) or >= 1, got {value}"
    )


def _grams(value: str) -> str | None:
    """Parsed when the config loads, not when the run builds its detector."""
    from retrain.advantages.planning import parse_grams

    try:
        parse_grams(value)
    except ValueError as exc:
        return str(exc).removeprefix("[logging] strategic_grams").lstrip(": ")
    return None


def _decay(value: float) -> str | None:
    if value < 1:
        return None
    return f"must be < 1, got {value!r}: at 1 the average would never move from its first value"


def _zero_or_above_one(value: float) -> str | None:
    return None if value == 0 or value > 1 else f"must be 0 (off) or > 1, got {value}"


def _positive_ints(value: list) -> str | None:
    if any(v < 1 for v in value):
        return f"every entry must be >= 1, got {value}"
    return None


def _unique(value: list) -> str | None:
    return (
        None if len(set(map(str, value))) == len(value) else f"entries must be unique, got {value}"
    )


def _seeds(value: list) -> str | None:
    """`[campaign] seeds`, checked once here rather than as each run's [training] seed."""
    if not value:
        return "must name at least one seed: a campaign of no runs does nothing"
    if any(v < -1 for v in value):
        return f"every seed must be >= -1 (-1 = unseeded), got {value}"
    return _unique(value)


def _few_shot(value: list) -> str | None:
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"user", "assistant"}:
            return f"entry {i} must be a table with exactly the keys 'user' and 'assistant'"
        if not all(isinstance(v, str) for v in item.values()):
            return f"entry {i}: 'user' and 'assistant' must be strings"
    return None


@dataclass
class BackendConfig:
    backend: str = opt(
        "local",
        "Training backend: local (PyTorch/PEFT), tinker (remote service), or a dotted path",
        registry_name="backend",
    )
    devices: str = opt(
        "gpu:0",
        "Comma-separated devices (gpu:N or cpu). Two or more enable split mode: inference on the first, training on the last",
        check=_check_devices,
        fix="use e.g. 'gpu:0', 'gpu:0,gpu:1' or 'cpu'",
    )
    adapter_path: str = opt(
        "/tmp/retrain_adapter",
        "Directory for LoRA adapter checkpoints (checkpoint_step_N/, final/)",
        check=_non_empty,
    )
    options: dict = opt(
        {},
        "Backend-specific options ([backend.options]); each backend documents its own schema (retrain backends)",
    )
    max_concurrent: int = opt(
        4, "Max concurrent Tinker API calls across parallel campaign workers", ge=1
    )
    throttle_dir: str = opt(
        "",
        "Directory for the file-based Tinker throttle. Empty = {campaign_dir}/tinker_throttle in campaigns, off otherwise",
    )


@dataclass
class ModelConfig:
    model: str = opt(
        "Qwen/Qwen3-4B-Instruct-2507",
        "Hugging Face model id, local directory, or .gguf file",
        check=_non_empty,
    )
    base_url: str = opt("", "Tinker service URL (tinker backend only). Empty = SDK default")
    lora_rank: int = opt(32, "LoRA rank", ge=1)


@dataclass
class AlgorithmConfig:
    advantage_mode: str = opt(
        "maxrl",
        "Episode-level advantage, one per completion from its group's rewards: grpo (r - "
        "mean, Dr. GRPO), grpo_std (GRPO: / the group's std), maxrl (/ the mean reward), rloo "
        "(leave-one-out), reinforce_pp and reinforce_pp_baseline (REINFORCE++: normalised over "
        "the step's batch), opo (r - the length-weighted mean reward of the group), or a "
        "dotted path fn(rewards[, params]) (retrain man --topic advantages)",
        registry_name="advantage_mode",
    )
    transform_mode: str = opt(
        "gtpo_sepa",
        "Token-level transform: none, gtpo, gtpo_hicra, gtpo_sepa, or a dotted path fn(ctx)",
        registry_name="transform_mode",
    )
    algorithm_mode: str = opt(
        "",
        "Replaces the whole advantage pipeline (built-in name or dotted path). Empty = advantage_mode + transform_mode",
        registry_name="algorithm_mode",
    )
    uncertainty_kind: str = opt(
        "surprisal",
        "Per-token uncertainty: surprisal, predictive_variance, shannon_entropy, or a dotted path",
        registry_name="uncertainty_kind",
    )
    surprisal_mask_rho: float = opt(
        0.0,
        'Surprisal mask of transform_mode = "entropy_mask" (Yue et al.): in each prompt group only the '
        "top rho fraction of tokens by uncertainty keep their advantage. 0 = off. Alias: entropy_mask_rho",
        ge=0.0,
        le=1.0,
    )
    advantage_params: dict = opt(
        {},
        "Parameters of the advantage mode ([algorithm.advantage_params]): eps for grpo_std "
        "(default 1e-6), maxrl (1e-6), reinforce_pp and reinforce_pp_baseline (1e-8); rloo and "
        "opo read none; a dotted-path mode gets the whole table",
    )
    transform_params: dict = opt(
        {}, "Parameters passed to a dotted-path transform/algorithm ([algorithm.transform_params])"
    )


@dataclass
class TrainingConfig:
    # at most 2**63 - 1, as every int key (config/values.py), which every consumer takes:
    # torch.manual_seed (up to 2**64 - 1), random (any int), numpy (seed % 2**32), the
    # step seeds (% (2**63 - 1)), the Tinker SDK's LoRA seed (a JSON integer)
    seed: int = opt(-1, "RNG seed. -1 disables seeding", ge=-1)
    max_steps: int = opt(500, "Total training steps", ge=1, le=MAX_STEPS)
    batch_size: int = opt(8, "Prompts per step", ge=1, le=MAX_PROMPTS)
    group_size: int = opt(
        16,
        "Completions sampled per prompt",
        ge=2,
        le=MAX_GROUP,
        fix="GRPO-style advantages compare a prompt's completions: use 2 or more, e.g. 16",
    )
    max_tokens: int = opt(2048, "Max new tokens per completion", ge=1)
    temperature: float = opt(0.7, "Sampling temperature", gt=0.0)
    top_p: float = opt(
        0.95,
        "Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p "
        "(the sampler logprob is that of the truncated distribution). 1 = off",
        gt=0.0,
        le=1.0,
    )
    lr: float = opt(4e-5, "Learning rate", gt=0.0, fix="use a positive learning rate such as 4e-5")
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0.0)
    max_examples: int = opt(0, "Limit dataset size. 0 = use all", ge=0)
    save_every: int = opt(20, "Checkpoint every N steps (0 = only at the end)", ge=0)
    zero_signal_steps: int = opt(
        5,
        "Stop the run (exit 1, last checkpoint kept) after this many consecutive steps with "
        "no trainable datum: every trajectory failed, no answer extracted, or every group's "
        "rewards equal (each such step is flagged on its step line). 0 = never stop",
        ge=0,
    )
    # The objective (retrain/loss/; `retrain man --topic loss`).
    policy_loss: str = opt(
        "is",
        "Policy loss: is (importance-sampling policy gradient, -A r), ppo_clip "
        "(-min(A r, A clip(r, 1 - clip_eps, 1 + clip_eps_high))), gspo (ppo_clip on GSPO's "
        "length-normalised sequence ratio), cispo (-sg(clip(r, ...)) A logp), sapo (a soft "
        "gate in place of the clip), vespo (a Gamma weight of the sequence ratio), clip_cov "
        "or kl_cov (high-covariance tokens cut out or KL-penalised), gpg (-A logp, no ratio), "
        "gmpo (GMPO: the geometric mean of the completion's log-clipped ratios), dppo "
        "(DPPO-Binary-TV, prime-rl's loss: -A r, dropped where p - p_sampler leaves "
        "[-clip_eps, clip_eps_high]), or a dotted path to your "
        "objective fn(inputs, hyper) -> TokenLoss (local backend only; retrain man --topic loss)",
        registry_name="policy_loss",
    )
    clip_eps: float = opt(
        0.2,
        "ppo_clip, gspo, cispo, clip_cov: lower clip range, the ratio is kept >= 1 - clip_eps "
        "(cispo: 1 = no lower bound); gmpo: the log ratio is kept >= -clip_eps; dppo: a token "
        "whose probability fell by more than clip_eps (A < 0) is dropped",
        gt=0.0,
        le=1.0,
    )
    clip_eps_high: float = opt(
        0.0,
        "ppo_clip, gspo, cispo, clip_cov: upper clip range (1 + clip_eps_high); above clip_eps "
        "is DAPO's clip-higher; gmpo: the log ratio's upper bound; dppo: the probability's "
        "largest rise (A > 0). 0 = clip_eps",
        ge=0.0,
    )
    clip_ratio_c: float = opt(
        0.0,
        "ppo_clip, gspo: dual clip for negative advantages, the token loss is at most -c A "
        "(c > 1). 0 = off",
        ge=0.0,
        check=_zero_or_above_one,
        fix="use 0 to turn dual clip off, or a bound such as 3.0",
    )
    ratio_level: str = opt(
        "token",
        "cispo, sapo: the importance ratio they weigh by, token (r_t) or sequence (GSPO's "
        "s_i = exp of the completion's mean log ratio; TRL's importance_sampling_level)",
        choices=("token", "sequence"),
    )
    sapo_tau_pos: float = opt(1.0, "sapo: the gate's temperature where A > 0", gt=0.0)
    sapo_tau_neg: float = opt(1.05, "sapo: the gate's temperature where A <= 0", gt=0.0)
    vespo_k_pos: float = opt(2.0, "vespo: the Gamma weight's power k where A >= 0", ge=0.0)
    vespo_lambda_pos: float = opt(3.0, "vespo: the Gamma weight's decay where A >= 0", gt=0.0)
    vespo_k_neg: float = opt(3.0, "vespo: the Gamma weight's power k where A < 0", ge=0.0)
    vespo_lambda_neg: float = opt(2.0, "vespo: the Gamma weight's decay where A < 0", gt=0.0)
    clip_cov_fraction: float = opt(
        0.0002,
        "clip_cov: the share of the step's trained tokens cut out (at least one)",
        gt=0.0,
        le=1.0,
    )
    clip_cov_lb: float = opt(
        1.0, "clip_cov: tokens are drawn from those whose covariance is above this"
    )
    clip_cov_ub: float = opt(5.0, "clip_cov: ... and below this (must be > clip_cov_lb)")
    kl_cov_fraction: float = opt(
        0.0002,
        "kl_cov: the share of the step's trained tokens (largest covariance) penalised",
        gt=0.0,
        le=1.0,
    )
    kl_cov_beta: float = opt(
        1.0, "kl_cov: the penalty's coefficient on |logp - logp_sampler|", ge=0.0
    )
    dppo_kl_coef: float = opt(
        0.0,
        "dppo: coefficient of (logp - logp_sampler)^2 on every trained token (prime-rl's "
        "kl_tau, 1e-3 there; a penalty towards the sampler, not the reference model). 0 = off",
        ge=0.0,
    )
    adv_clip_max: float = opt(
        0.0, "Clip token advantages to [-adv_clip_max, adv_clip_max] in the loss. 0 = off", ge=0.0
    )
    loss_agg: str = opt(
        "token_mean",
        "Loss aggregation: token_mean (mean over the step's tokens), seq_mean_token_sum "
        "(Dr. GRPO: per-completion token sums, averaged over completions), "
        "seq_mean_token_mean (GRPO: per-completion token means, averaged over completions), "
        "seq_mean_token_sum_norm (token sums over completions x max_tokens: TRL's dr_grpo) "
        "or bnpo (token means of local batches of bnpo_batch_size completions, averaged)",
        choices=(
            "token_mean",
            "seq_mean_token_sum",
            "seq_mean_token_mean",
            "seq_mean_token_sum_norm",
            "bnpo",
        ),
    )
    bnpo_batch_size: int = opt(
        0,
        "bnpo: completions per local batch (consecutive in the step; TRL's "
        "per_device_train_batch_size). 0 = the whole step (bnpo is then token_mean)",
        ge=0,
    )
    kl_coef: float = opt(
        0.0,
        "KL penalty to the reference model (the base weights, LoRA disabled). 0 = off",
        ge=0.0,
    )
    kl_estimator: str = opt(
        "k3",
        "KL estimator (Schulman's note, d = logp - logp_ref): k1 = d, k2 = d^2/2, "
        "k3 = exp(-d) + d - 1",
        choices=("k1", "k2", "k3"),
    )
    tis_cap: float = opt(
        0.0,
        "Truncated importance sampling: a token whose ratio exp(logp - logp_sampler) exceeds "
        "tis_cap is weighted tis_cap / ratio (no gradient through the weight), bounding "
        "large sampler/trainer mismatches (server engines); the same as is_correction = "
        '"truncate", is_high = tis_cap. 0 = off',
        ge=0.0,
        check=_zero_or_above_one,
        fix="use 0 to turn it off, or a cap such as 2.0",
    )
    is_correction: str = opt(
        "none",
        "Off-policy correction of the trainer/sampler importance weight: none, truncate "
        "(clip it to [is_low, is_high]) or mask (drop tokens or completions whose weight "
        "leaves that band)",
        choices=("none", "truncate", "mask"),
    )
    is_level: str = opt(
        "token",
        "The weight is_correction bounds: token (the token's ratio), sequence (the "
        "completion's product of ratios) or geometric (their geometric mean)",
        choices=("token", "sequence", "geometric"),
    )
    is_low: float = opt(
        0.0,
        "is_correction: the weight's lower bound (below 1; 0 = none)",
        ge=0.0,
        check=lambda v: None if v < 1 else f"must be below 1 (a ratio of 1 always passes), got {v}",
        fix="use 0 for no lower bound, or a bound such as 0.5",
    )
    is_high: float = opt(2.0, "is_correction: the weight's upper bound (above 1)", gt=1.0)
    # Batch shaping (retrain/shaping.py; `retrain man --topic advantages`)
    dynamic_sampling: bool = opt(
        False,
        "DAPO's dynamic sampling (verl's filter_groups): groups whose rewards are all equal "
        "are dropped from training and more prompts are sampled until the step has "
        "batch_size informative groups, at most dynamic_sampling_max_rounds extra rounds",
    )
    dynamic_sampling_max_rounds: int = opt(
        3,
        "dynamic_sampling: extra sampling rounds per step at most; when they are spent the "
        "step trains on the informative groups it has (with a warning)",
        ge=1,
        fix="use 1 or more extra rounds, or dynamic_sampling = false for one round per step",
    )
    mask_truncated: bool = opt(
        False,
        "TRL's mask_truncated_completions: a completion cut at max_tokens (no end-of-sequence "
        "token) gets a zero loss mask; its reward still counts in its group's advantages",
    )
    overlong_buffer: int = opt(
        0,
        "DAPO's soft overlong penalty: tokens before max_tokens where the reward is lowered "
        "linearly, down to -overlong_penalty at max_tokens. 0 = off",
        ge=0,
    )
    overlong_penalty: float = opt(
        1.0,
        "overlong_buffer: the penalty at max_tokens (its factor; added to the reward)",
        gt=0.0,
        fix="use a positive factor such as 1.0, or overlong_buffer = 0 for no penalty",
    )
    lr_schedule: str = opt(
        "constant",
        "Learning-rate schedule after warmup: constant, linear (to 0 at max_steps) or cosine "
        "(to 0 at max_steps)",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps: int = opt(
        0,
        "Linear learning-rate warmup: step s < warmup_steps uses lr * (s + 1) / warmup_steps",
        ge=0,
    )


@dataclass
class OptimizerConfig:
    beta1: float = opt(0.9, "AdamW beta1", ge=0.0, le=0.999999)
    beta2: float = opt(0.95, "AdamW beta2", ge=0.0, le=0.999999)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0.0)
    max_grad_norm: float = opt(0.0, "Clip the gradient norm to this value. 0 = no clipping", ge=0.0)


@dataclass
class LoraConfig:
    alpha: int = opt(0, "LoRA alpha. 0 = auto (2 x rank)", ge=0)
    dropout: float = opt(
        0.0,
        "LoRA dropout rate, below 1",
        ge=0.0,
        check=lambda v: (
            None if v < 1 else f"must be < 1, got {v!r}: every LoRA input would be dropped"
        ),
        fix="a small rate such as 0.05, or 0 for none",
    )
    target_modules: list = opt(
        [],
        "Module names to adapt. [] = all attention and MLP projections",
        check=_unique,
        item="str",
    )


@dataclass
class DataConfig:
    source: str = opt(
        "math",
        "Data source: math, reasoning_gym, jsonl, or a dotted path (ignored when [environment] is set)",
        registry_name="data_source",
    )
    path: str = opt(
        "",
        "jsonl: the file to read; math: a local copy of the dataset (directory of parquet/jsonl files)",
    )
    task: str = opt("", "reasoning_gym: task name, e.g. chain_sum or basic_arithmetic")
    args: dict = opt({}, "reasoning_gym: task options ([data.args]), e.g. min_terms = 2")
    size: int = opt(1000, "reasoning_gym: number of generated problems", ge=1, le=MAX_GENERATED)
    seed: int = opt(
        0,
        "Seed of the generated dataset (reasoning_gym). Kept apart from [training] seed so every run sees the same problems",
        ge=0,
    )
    split: str = opt("train", "Dataset split to load")
    prompt_field: str = opt("question", "jsonl: field holding the question", check=_non_empty)
    answer_field: str = opt("answer", "jsonl: field holding the reference answer", check=_non_empty)
    shuffle: bool = opt(
        True, "Shuffle the example order (from [training] seed); reshuffled each epoch"
    )
    system_prompt: str = opt(
        "", "System message for the chat template. Empty = the model template's default"
    )
    instruction: str = opt(
        "auto",
        "Appended to every question. auto = none for source math (the problem alone, as the "
        "original retrain sent it), the boxed-answer line otherwise; empty = none",
    )
    few_shot: list = opt(
        [],
        "Worked exchanges placed before the question ([[data.few_shot]] with user and assistant)",
        check=_few_shot,
        item="dict",
    )


@dataclass
class EnvironmentConfig:
    provider: str = opt(
        "",
        "Optional environment provider: '', 'verifiers' or 'openenv'",
        choices=("", "verifiers", "openenv"),
    )
    id: str = opt(
        "",
        "verifiers: the environment id (e.g. primeintellect/gsm8k); openenv: the dotted "
        "path of an Environment class to run in-process (pkg.mod.MyEnv)",
    )
    module: str = opt(
        "",
        "verifiers: the module to import, instead of looking the id up (verifiers' "
        "bundled tasksets, then installed packages, then retrain's own)",
    )
    base_url: str = opt(
        "", "openenv: the URL of a running OpenEnv server (one WebSocket session per trajectory)"
    )
    args: Any = opt(
        {},
        "Environment kwargs as a TOML table (or a JSON string); openenv: the Environment "
        "class's constructor kwargs (in-process) or reset() kwargs (a server)",
    )
    max_turns: int = opt(
        -1,
        "Multi-turn: the cap on model turns per conversation. -1 = the environment's own "
        f"cap, or {FALLBACK_MAX_TURNS} where it sets none (an OpenEnv environment never does)",
        check=_turn_cap,
    )
    auto_install: bool = opt(False, "Install a missing Prime Hub environment automatically")
    turn_timeout_s: float = opt(
        60.0,
        "Multi-turn: seconds an environment may take to answer one turn (or to score); "
        "a conversation past it fails (reward 0, not trained on, counted)",
        gt=0.0,
    )


@dataclass
class PlanningConfig:
    detector: str = opt(
        "regex", "Planning token detector: regex or semantic", registry_name="planning_detector"
    )
    model: str = opt(
        "all-MiniLM-L6-v2", "Sentence-transformer model for the semantic detector", check=_non_empty
    )
    threshold: float = opt(0.02, "Semantic detector threshold", ge=0.0, le=1.0)


@dataclass
class GtpoConfig:
    beta: float = opt(0.1, "Entropy weighting strength. 0 disables GTPO weighting", ge=0.0)


@dataclass
class HicraConfig:
    alpha: float = opt(
        0.2,
        "Planning token amplification. 0 disables HICRA; at most 1 so no advantage flips sign",
        ge=0.0,
        le=1.0,
        fix="at most 1: HICRA scales a planning token's advantage by 1 + alpha where it is "
        "positive and 1 - alpha where negative, so above 1 a negative advantage would flip sign",
    )


@dataclass
class SepaConfig:
    steps: int = opt(500, "Ramp duration of the linear schedule (steps)", ge=0)
    schedule: str = opt(
        "linear",
        "linear ramps lambda 0->1; auto adapts to the decay of execution-uncertainty variance",
        choices=("linear", "auto"),
    )
    delay_steps: int = opt(50, "Steps before the linear ramp begins", ge=0)
    correct_rate_gate: float = opt(
        0.1, "Min batch correct rate that opens SEPA (sticky). 0 = no gate", ge=0.0, le=1.0
    )
    warmup: int = opt(50, "auto: steps whose variance EMA fixes the reference variance var_0", ge=1)
    ema_decay: float = opt(
        0.99, "auto: EMA decay of the execution-uncertainty variance", ge=0.0, check=_decay
    )
    var_threshold: float = opt(
        0.2, "auto: lambda = 1 - min(var_ema / var_0 / var_threshold, 1)", gt=0.0
    )


@dataclass
class InferenceConfig:
    engine: str = opt(
        "pytorch",
        "Inference engine: pytorch (in-process), or a server sampled over HTTP: vllm, sglang, "
        "trtllm, mlx, max, openai (retrain backends lists what each supports)",
        registry_name="engine",
    )
    url: str = opt(
        "",
        "Server URL of a server engine (empty = its default: vllm/max :8000, sglang :30000, "
        "trtllm :31000, mlx :8080; openai needs one), or prime_rl's inference server",
    )
    api_key: str = opt(
        "",
        "Bearer token for the server. Empty = none ($OPENAI_API_KEY for openai). Never logged",
        secret=True,
    )
    timeout: float = opt(300.0, "Seconds allowed per server request", gt=0.0)
    max_retries: int = opt(
        4, "Retries of a server request on 429/5xx, timeouts and dropped connections", ge=0
    )
    max_connections: int = opt(16, "Server requests in flight at once (one per prompt)", ge=1)
    attention_kernel: str = opt(
        "default",
        "Attention implementation: only default is applied in this version",
        choices=("default",),
        fix="the spec's flash, triton, tk and cutlass are not applied in this version (the "
        "pytorch engine picks its kernel per device; a server picks its own when it starts)",
    )
    dtype: str = opt(
        "auto",
        "Inference dtype. pytorch engine: auto (the trained model's dtype: a sampling copy "
        "that computes what the trained model does) or bf16 (a wholly bf16 sampling copy, "
        "the adapter beside its weights in float32: the sampler's logprobs are its own and "
        "the importance ratio corrects the difference; see docs/performance.md). Server "
        "engines: auto (the server's own --dtype)",
        choices=("auto", "bf16"),
        fix="the spec's fp8 and fp4 are not applied in this version (a server takes its dtype "
        "when it starts, e.g. vLLM --dtype / --quantization)",
    )
    kv_cache_dtype: str = opt(
        "auto",
        "KV cache dtype: only auto (the model's) is applied in this version",
        choices=("auto",),
        fix="the spec's bf16, fp8 and int8 are not applied in this version (a server takes its "
        "own when it starts, e.g. vLLM --kv-cache-dtype)",
    )
    prefix_caching: bool = opt(
        True,
        "Share the prompt KV cache across a group's completions (pytorch engine; a server "
        "sets its own when it starts, e.g. vLLM --enable-prefix-caching)",
    )


@dataclass
class RewardConfig:
    type: str = opt(
        "match",
        "Reward: match, math, judge, custom, or gym (reasoning-gym's own scorer)",
        registry_name="reward",
    )
    judge_model: str = opt("", "Judge LLM. Empty = gpt-4o-mini")
    judge_base_url: str = opt(
        "", "OpenAI-compatible base URL for the judge. Empty = $OPENAI_BASE_URL or api.openai.com"
    )
    judge_api_key: str = opt(
        "", "Judge API key. Empty = $OPENAI_API_KEY. Never logged", secret=True
    )
    custom_module: str = opt("", "Python module (or .py file) holding the custom reward")
    custom_function: str = opt(
        "score",
        "Function name in custom_module: fn(response, reference) -> float",
        check=_non_empty,
    )
    timeout: float = opt(5.0, "Seconds allowed per verification or judge request", gt=0.0)
    max_concurrency: int = opt(8, "Concurrent judge requests", ge=1)
    max_retries: int = opt(4, "Judge retries on 429/5xx/timeouts", ge=0)
    correct_threshold: float = opt(
        0.5,
        "A completion counts as correct (correct_rate, the SEPA gate, 'k/n correct') when its reward is above this",
    )


# reasoning_gym: the held-out seed stream starts this far above [data] seed.
EVAL_SEED_OFFSET = 1_000_000_000


@dataclass
class EvalConfig:
    every: int = opt(
        0,
        "Evaluate the current adapter on the held-out set every N steps, and also before step 0 "
        "and after the last step. 0 = off",
        ge=0,
    )
    size: int = opt(64, "Held-out problems per evaluation", ge=1, le=MAX_HELD_OUT)
    temperature: float = opt(
        0.0, "Sampling temperature of the evaluation. 0 = greedy (argmax)", ge=0.0
    )
    samples: int = opt(
        1,
        "Completions per held-out problem: the k of pass@k (with temperature 0 they are all the same)",
        ge=1,
        le=MAX_GROUP,
    )
    split: str = opt(
        "test",
        "The held-out set: math (and plugin sources) load this split; reasoning_gym draws "
        "problems from a seed stream 10^9 above [data] seed; jsonl reads path; verifiers "
        "environments use their eval dataset",
        check=_non_empty,
    )
    path: str = opt("", "jsonl: the held-out JSONL file (the same fields as [data] path)")


@dataclass
class BackpressureConfig:
    enabled: bool = opt(False, "Enable USL adaptive batch sizing")
    warmup_steps: int = opt(
        10,
        "Steps exploring batch sizes before fitting the USL model (at least 2 when enabled: "
        "the fit needs three sizes)",
        ge=0,
    )
    ema_decay: float = opt(0.9, "EMA decay for throughput tracking", ge=0.0, check=_decay)
    throttle_margin: float = opt(
        0.85, "Target fraction of the optimal concurrency p*", gt=0.0, le=1.0
    )
    increase_margin: float = opt(0.5, "Hysteresis gap for batch size increases", gt=0.0, le=1.0)
    min_batch_size: int = opt(1, "Floor for the adaptive batch size", ge=1, le=MAX_PROMPTS)
    max_batch_size: int = opt(64, "Ceiling for the adaptive batch size", ge=1, le=MAX_PROMPTS)
    peak_gflops: float = opt(0.0, "Hardware peak GFLOPS for roofline hints. 0 = skip", ge=0.0)
    peak_bw_gb_s: float = opt(0.0, "Hardware peak memory bandwidth (GB/s)", ge=0.0)


@dataclass
class SqueezeConfig:
    min_variance_retention: float = opt(0.95, "Minimum variance fraction to retain", gt=0.0, le=1.0)
    adapter_path: str = opt("", "Adapter to analyse. Required standalone, auto-filled in campaigns")
    source_rank: int = opt(0, "Expected source rank. 0 = detect from the adapter", ge=0)
    target_ranks: list = opt(
        [],
        "Ranks to evaluate. [] = powers of two up to the source rank",
        check=_positive_ints,
        item="int",
    )
    output_path: str = opt("", "Directory for the compressed adapter. Empty = analyse only")
    compress_to: int = opt(0, "Target rank for compression. 0 = the recommended rank", ge=0)
    device: str = opt("cpu", "Device for the SVDs: cpu, gpu:N (cuda:N) or mps", check=_one_device)


@dataclass
class ResumeConfig:
    from_: str = opt(
        "",
        "Log directory holding trainer_state.json to resume from (in a campaign TOML: the campaign directory holding manifest.json)",
        key="from",
    )


@dataclass
class LoggingConfig:
    log_dir: str = opt(
        "logs/train",
        "Directory for metrics.jsonl, emergence/ and trainer_state.json",
        check=_non_empty,
    )
    wandb_project: str = opt("", "wandb project. Set to enable wandb")
    wandb_run_name: str = opt("", "wandb run name. Empty = the condition label")
    wandb_entity: str = opt("", "wandb entity / team")
    wandb_group: str = opt("", "wandb group")
    wandb_tags: str = opt("", "Comma-separated wandb tags")
    strategic_grams: str = opt(
        "", "Planning grams as a JSON array or CSV. Empty = the 18 defaults", check=_grams
    )
    group_lines: int = opt(2, "How many 'group: k/n correct' lines to print per step", ge=0)
    condition_label: str = opt(
        "",
        "The run's condition label in logs, status and compare. Empty = advantage+transform "
        "(campaigns set it to adv+tx~k=v for conditions with overrides)",
    )


@dataclass
class CampaignConfig:
    seeds: list = opt(
        [42, 101, 202, 303, 404, 505, 606, 707],
        "Seeds to run for every condition (-1: an unseeded run)",
        check=_seeds,
        item="int",
        fix="e.g. seeds = [42, 101, 202]",
    )
    max_steps: int = opt(500, "Steps per run (overrides [training] max_steps)", ge=1, le=MAX_STEPS)
    parallel: bool = opt(False, "Run conditions x seeds in parallel subprocess workers")
    max_workers: int = opt(0, "Max parallel workers. 0 = all runs at once", ge=0)
    stagger_seconds: float = opt(0.0, "Delay between worker launches", ge=0.0)
    executor: str = opt(
        "local", "local (sequential or subprocess workers) or ray", choices=("local", "ray")
    )
    ray_address: str = opt("", "Ray cluster address. Empty = start a local Ray instance")
    ray_num_cpus: float = opt(1.0, "CPUs requested per run (ray executor)", ge=0.0)
    ray_num_gpus: float = opt(0.0, "GPUs requested per run (ray executor)", ge=0.0)
    conditions: list = opt(
        [],
        "[[campaign.conditions]] with advantage_mode + transform_mode, plus any run keys that "
        "condition overrides (lr = 1e-4, uncertainty_kind = ..., sepa.steps = 100); its runs are "
        "labelled adv+tx~key=value,... [] = the five standard conditions",
        item="dict",  # each entry is checked by the loader (retrain/config/conditions.py)
    )


@dataclass
class PluginsConfig:
    search_paths: list = opt(
        ["plugins"], "Directories added to sys.path before resolving dotted paths", item="str"
    )
    strict: bool = opt(
        True, "Fail when a plugin cannot be imported (false: warn and skip in `retrain plugins`)"
    )


@dataclass
class Config:
    backend: BackendConfig = field(default_factory=BackendConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    gtpo: GtpoConfig = field(default_factory=GtpoConfig)
    hicra: HicraConfig = field(default_factory=HicraConfig)
    sepa: SepaConfig = field(default_factory=SepaConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backpressure: BackpressureConfig = field(default_factory=BackpressureConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    # Optional tables: their presence changes what `retrain` does.
    squeeze: SqueezeConfig | None = None  # standalone squeeze, or auto-squeeze in a campaign
    campaign: CampaignConfig | None = None  # conditions x seeds sweep

    @property
    def condition(self) -> str:
        """The condition label, e.g. `maxrl+gtpo_sepa` (or the algorithm_mode when set, or
        `[logging] condition_label` when a campaign gave the run one)."""
        if self.logging.condition_label:
            return self.logging.condition_label
        if self.algorithm.algorithm_mode:
            return self.algorithm.algorithm_mode
        return f"{self.algorithm.advantage_mode}+{self.algorithm.transform_mode}"


# Table name -> record class, in documentation order (a test checks it matches Config).
TABLES: dict[str, type] = {
    "backend": BackendConfig,
    "model": ModelConfig,
    "algorithm": AlgorithmConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "lora": LoraConfig,
    "data": DataConfig,
    "environment": EnvironmentConfig,
    "planning": PlanningConfig,
    "gtpo": GtpoConfig,
    "hicra": HicraConfig,
    "sepa": SepaConfig,
    "inference": InferenceConfig,
    "reward": RewardConfig,
    "eval": EvalConfig,
    "backpressure": BackpressureConfig,
    "resume": ResumeConfig,
    "logging": LoggingConfig,
    "plugins": PluginsConfig,
    "squeeze": SqueezeConfig,
    "campaign": CampaignConfig,
}
OPTIONAL_TABLES = frozenset({"squeeze", "campaign"})


@dataclass(frozen=True)
class FieldSpec:
    """Everything known about one TOML key."""

    table: str
    key: str  # the TOML key
    attr: str  # the dataclass attribute
    type: str  # "str" | "int" | "float" | "bool" | "list" | "dict" | "any"
    default: Any
    meta: dict

    @property
    def label(self) -> str:
        return f"[{self.table}] {self.key}"

    @property
    def help(self) -> str:
        return self.meta["help"]


def _type_name(annotation: Any) -> str:
    text = (
        annotation
        if isinstance(annotation, str)
        else getattr(annotation, "__name__", str(annotation))
    )
    return {
        "str": "str",
        "int": "int",
        "float": "float",
        "bool": "bool",
        "list": "list",
        "dict": "dict",
    }.get(text, "any")


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()


def away_from_defaults(table: Any, names: Sequence[str] | None = None) -> list[str]:
    """The fields of a table's record (`names`, default all) set to other than their
    defaults: the keys a config sets, for checks of keys nothing would read."""
    default = type(table)()
    names = [f.name for f in fields(table)] if names is None else names
    return [n for n in names if getattr(table, n) != getattr(default, n)]


def table_fields(table: str) -> list[FieldSpec]:
    cls = TABLES[table]
    return [
        FieldSpec(
            table,
            f.metadata.get("key") or f.name,
            f.name,
            _type_name(f.type),
            _default(f),
            dict(f.metadata),
        )
        for f in fields(cls)
    ]


def all_fields() -> list[FieldSpec]:
    return [spec for table in TABLES for spec in table_fields(table)]
