"""Typed records that cross module boundaries.

data -> Example -> trainer -> backend.sample -> Sample -> rollout -> GroupRollout
-> advantages (TokenGroup) -> Datum -> backend.train_step -> TrainResult -> StepResult -> logs.

Per-token fields are numpy arrays from the engine to the backend: no list -> numpy ->
list -> tensor round trips. Capability and option records describe registry entries
(see :mod:`retrain.registry`); they live here so config validation, the CLI and the
backends read them without importing one another. Importing this module is cheap
(numpy only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Example:
    """One training problem. `prompt` is the question text (before any chat template);
    `reference` the answer a reward compares against; `meta` carries source-specific
    data (e.g. the reasoning-gym entry its task needs to score an answer)."""

    prompt: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


# ---------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float
    seed: int | None = None
    return_entropy: bool = False
    # Nucleus sampling: draw from the smallest set of tokens whose probability reaches
    # top_p, renormalised. The recorded logprob is that of the truncated distribution
    # the token was drawn from (the true behaviour policy), so the importance ratio
    # exp(logp_trainer - logp_sampler) stays honest; 1.0 = no truncation.
    top_p: float = 1.0
    # Under torchrun, the index of this rank's first prompt in the step's whole batch: the
    # engine draws as if the earlier ranks' prompts came first in one call, so N ranks
    # sample what one process sampling the whole batch would (retrain/world.py).
    prompt_offset: int = 0
    # A held-out evaluation's sampling, between training steps: not part of any step's
    # measurements (a step's gpu_peak_memory_gb).
    held_out: bool = False


def _ids(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) and x.dtype == np.int64 else np.asarray(x, np.int64)


def _floats(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) and x.dtype == np.float64 else np.asarray(x, np.float64)


def _mask(x: Any, n: int, what: str) -> np.ndarray | None:
    if x is None:
        return None
    mask = x if isinstance(x, np.ndarray) and x.dtype == np.bool_ else np.asarray(x, np.bool_)
    if mask.shape != (n,):
        raise ValueError(f"{what} has {n} tokens but a loss mask of shape {mask.shape}")
    return mask


@dataclass
class Sample:
    """One sampled completion. `logprobs_T[t]` is the sampler's logprob of token t at the
    sampling temperature (the behaviour policy of the importance ratio)."""

    token_ids: np.ndarray  # int64, (T,)
    logprobs: np.ndarray  # float64, (T,)
    stop_reason: str  # "eos" | "length"
    entropies: np.ndarray | None = None  # float64, (T,): full-vocabulary entropies
    # Multi-turn trajectories (retrain.multiturn): True where the model sampled the token,
    # False where the environment wrote it (kept as context, never trained on; its
    # logprob is 0). None = every token is the model's (single-turn sampling).
    loss_mask: np.ndarray | None = None  # bool, (T,)

    def __post_init__(self):
        self.token_ids = _ids(self.token_ids)
        self.logprobs = _floats(self.logprobs)
        if self.entropies is not None:
            self.entropies = _floats(self.entropies)
        if self.logprobs.shape != self.token_ids.shape:
            raise ValueError(
                f"a sample has {self.token_ids.size} tokens but {self.logprobs.size} logprobs"
            )
        self.loss_mask = _mask(self.loss_mask, self.token_ids.size, "a sample")

    def model_tokens(self, values: Any) -> Any:
        """`values` (one per token, or None) at the model's tokens only."""
        return values if values is None or self.loss_mask is None else values[self.loss_mask]

    def __len__(self) -> int:
        return int(self.token_ids.size)


@dataclass
class GroupRollout:
    """One prompt's completions with their decoded texts and scores. `correct[i]` is
    whether reward i passed the run's correctness threshold (correct_rate, SEPA gate)."""

    example: Example
    prompt_ids: list[int]
    samples: list[Sample]
    texts: list[str]
    rewards: list[float]
    answers: list[str | None]
    correct: list[bool]
    # Multi-turn rollouts: per completion, the transcript as messages
    # {"role", "content", "turn"} (emergence/generations.jsonl); None for single-turn.
    transcripts: list[list[dict[str, Any]]] | None = None
    # Multi-turn rollouts: per completion, whether its conversation failed (an
    # environment error or timeout): reward 0, no datum, and left out of the group's
    # advantage statistics, which it would otherwise bias. None: none failed.
    failed: list[bool] | None = None

    @property
    def num_correct(self) -> int:
        return sum(self.correct)

    def __len__(self) -> int:
        return len(self.samples)


@dataclass
class TokenGroup:
    """What the advantage pipeline needs of one group: G rewards and, per completion,
    its per-token arrays (ragged lengths). `planning_G_T=None` means no planning tokens;
    `entropies_G_T` is given only when the uncertainty kind needs entropies."""

    rewards_G: np.ndarray
    logprobs_G_T: list[np.ndarray]
    planning_G_T: list[np.ndarray] | None = None
    entropies_G_T: list[np.ndarray] | None = None


# ---------------------------------------------------------------- training


@dataclass
class Datum:
    """One completion ready for training: per-token arrays of equal length."""

    prompt_ids: list[int]
    completion_ids: np.ndarray  # int64, (T,)
    sampler_logprobs: np.ndarray  # float64, (T,)
    advantages: np.ndarray  # float64, (T,)
    # True = trained on (the model's tokens); False = context only (a multi-turn
    # environment's tokens: advantage 0, logprob 0, out of the loss). None = all True.
    loss_mask: np.ndarray | None = None  # bool, (T,)

    def __post_init__(self):
        self.completion_ids = _ids(self.completion_ids)
        self.sampler_logprobs = _floats(self.sampler_logprobs)
        self.advantages = _floats(self.advantages)
        n = self.completion_ids.size
        if self.sampler_logprobs.size != n or self.advantages.size != n:
            raise ValueError(
                f"a datum has {n} tokens, {self.sampler_logprobs.size} logprobs and "
                f"{self.advantages.size} advantages"
            )
        self.loss_mask = _mask(self.loss_mask, n, "a datum")

    @property
    def trained_mask(self) -> np.ndarray:
        """Which completion tokens the loss sees (all of them unless masked)."""
        if self.loss_mask is None:
            return np.ones(self.completion_ids.size, dtype=np.bool_)
        return self.loss_mask

    @property
    def num_trained_tokens(self) -> int:
        n = self.completion_ids.size
        return n if self.loss_mask is None else int(self.loss_mask.sum())


@dataclass(frozen=True)
class TrainHyper:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    max_grad_norm: float = 0.0
    # The sampling temperature: the trainer scores tokens at it, so its logprobs are those
    # of the distribution the sampler drew from ([training] temperature).
    temperature: float = 1.0
    # The objective (retrain/loss/); the defaults are the plain importance-sampling
    # policy gradient averaged over the step's tokens.
    policy_loss: str = "is"  # a retrain.registry.OBJECTIVES name or a dotted path
    # ppo_clip, gspo, cispo, clip_cov: the ratio's lower bound 1 - clip_eps; gmpo: the log
    # ratio's, -clip_eps; dppo: the drop of the token's probability p - p_sampler
    clip_eps: float = 0.2
    clip_eps_high: float = 0.2  # ... and the upper bound (1 + clip_eps_high, clip_eps_high)
    clip_ratio_c: float = 0.0  # dual clip for negative advantages (ppo_clip, gspo); 0 = off
    ratio_level: str = "token"  # cispo, sapo: "token" (r_t) | "sequence" (GSPO's s_i)
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature where A > 0
    sapo_tau_neg: float = 1.05  # sapo: ... where A <= 0
    vespo_k_pos: float = 2.0  # vespo: the Gamma weight's power where A >= 0
    vespo_lambda_pos: float = 3.0  # vespo: ... its decay where A >= 0
    vespo_k_neg: float = 3.0  # vespo: the power where A < 0
    vespo_lambda_neg: float = 2.0  # vespo: the decay where A < 0
    clip_cov_fraction: float = 0.0002  # clip_cov: share of the step's tokens detached
    clip_cov_lb: float = 1.0  # clip_cov: covariance band the detached tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_fraction: float = 0.0002  # kl_cov: share of the step's tokens penalised
    kl_cov_beta: float = 1.0  # kl_cov: the penalty's coefficient on |logp - logp_sampler|
    dppo_kl_coef: float = 0.0  # dppo: coefficient of (logp - logp_sampler)^2; 0 = off
    adv_clip_max: float = 0.0  # advantages clipped to [-max, max]; 0 = off
    # "token_mean" | "seq_mean_token_sum" | "seq_mean_token_mean" | "seq_mean_token_sum_norm"
    # | "bnpo" (retrain.loss.aggregation)
    loss_agg: str = "token_mean"
    max_tokens: int = 0  # seq_mean_token_sum_norm's constant ([training] max_tokens)
    bnpo_batch_size: int = 0  # bnpo: completions per local batch; 0 = the whole step
    kl_coef: float = 0.0  # KL penalty to the reference (LoRA-off) model; 0 = off
    kl_estimator: str = "k3"  # "k1" | "k2" | "k3"
    # Off-policy correction between the trainer and the sampler (retrain.loss.correction)
    tis_cap: float = 0.0  # token truncation at this cap (= is_correction "truncate"); 0 = off
    is_correction: str = "none"  # "none" | "truncate" | "mask"
    is_level: str = "token"  # "token" | "sequence" | "geometric"
    is_low: float = 0.0  # the weight's lower bound (0 = none)
    is_high: float = 2.0  # the weight's upper bound


@dataclass
class TrainResult:
    loss: float
    num_tokens: int
    grad_norm: float | None = None
    # Mean of (trainer logprob - sampler logprob) over the trained tokens: how far the
    # sampler drifted from the weights being trained.
    log_ratio_mean: float | None = None
    log_ratio_max_abs: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class CheckpointInfo:
    """What a backend's save_checkpoint returns and its load_checkpoint takes back.

    `adapter` says where the adapter can be read (a local PEFT directory, or a remote
    `tinker://` sampler-weights path; what `retrain squeeze` accepts); `state` where the
    full training state lives (weights + optimizer), which is the same local directory
    for the local backend. `extra` holds backend-specific details."""

    backend: str
    adapter: str = ""
    state: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointInfo:
        """Read the record back, including the untyped dicts written before it existed
        (local: {"adapter": dir}; tinker: {"backend": "tinker", "path": ..., ...})."""
        if "state" in data or "extra" in data:
            return cls(
                backend=str(data.get("backend", "")),
                adapter=str(data.get("adapter") or ""),
                state=str(data.get("state") or ""),
                extra=dict(data.get("extra") or {}),
            )
        known = {"backend", "adapter", "path", "sampler_path"}
        extra = {k: v for k, v in data.items() if k not in known}
        if "adapter" in data:  # the local backend's old format
            return cls(
                str(data.get("backend", "local")), str(data["adapter"]), str(data["adapter"])
            )
        return cls(
            backend=str(data.get("backend", "")),
            adapter=str(data.get("sampler_path") or ""),
            state=str(data.get("path") or ""),
            extra=extra,
        )


# ---------------------------------------------------------------- registry records

# A dotted-path `[training] policy_loss` (retrain.loss): only a backend that computes the
# loss in-process can run a user's objective.
USER_OBJECTIVE = "user_objective"
# What a backend may list in BackendCapabilities.loss_options: the parts of the objective
# beyond policy_loss = "is" with loss_agg = "token_mean", which every backend implements
# (config/validate.py's loss_options_used names the keys that ask for each).
LOSS_OPTIONS = (
    "ppo_clip",
    "gspo",
    "cispo",
    "sapo",
    "vespo",
    "clip_cov",
    "kl_cov",
    "gpg",
    "gmpo",
    "dppo",
    "dual_clip",
    "sequence_ratio",  # ratio_level = "sequence" (cispo, sapo)
    "adv_clip",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "bnpo",
    "kl",
    "tis",  # importance weights truncated (tis_cap, or is_correction = "truncate")
    "mis",  # importance weights masked (is_correction = "mask")
    "sequence_is",  # the correction at the sequence or geometric level (is_level)
    USER_OBJECTIVE,
)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend guarantees; the trainer and validation branch on these, never on
    backend names or hasattr."""

    reports_sync_loss: bool = False
    preserves_token_advantages: bool = False
    supports_checkpoint_resume: bool = False
    resume_runtime_dependent: bool = False
    # Per-token data the backend returns besides logprobs (e.g. "entropy").
    token_data: tuple[str, ...] = ()
    # Loss options implemented beyond the default objective (names from LOSS_OPTIONS);
    # config loading refuses an option the backend does not list.
    loss_options: tuple[str, ...] = ()
    # Trains one run on several processes under torchrun (docs/distributed.md).
    multi_process: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_data"] = list(self.token_data)
        d["loss_options"] = list(self.loss_options)
        return d


@dataclass(frozen=True)
class EngineTraits:
    """What an inference engine is, as config validation, `explain` and the local backend
    need to know it without building one (they branch on these, never on engine names).

    `in_process`: it samples from the trained model itself, in this process (no weights
    to push; it is bound to the model once the backend has loaded it); otherwise it is a
    server, reached over HTTP, to which the backend pushes the adapter after every step.
    `token_data`: per-token data it returns besides logprobs ("entropy"). `dtypes`: the
    `[inference] dtype` values it applies (a server picks its dtype when it starts).
    `needs_url`: it has no default address, so `[inference] url` is required."""

    in_process: bool = False
    token_data: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("auto",)
    needs_url: bool = False


@dataclass(frozen=True)
class OptionSpec:
    """One option of a registry entry (e.g. a `[backend.options]` key)."""

    # "int" | "float" | "bool" | "str", or a type and the words it also takes in its
    # place, after "/": "int/auto" is an int or the string "auto"
    type: str
    default: Any
    help: str = ""
    choices: tuple[Any, ...] | None = None
    # checks a value of the type (never one of the words)
    validator: Callable[[Any], str | None] | None = field(default=None, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "default": self.default,
            "help": self.help,
            "choices": list(self.choices) if self.choices else None,
        }


class BackendOptionSpec(OptionSpec):
    """The original retrain's name for an option schema entry of a plugin backend
    (`retrain_backend_option_schema`), kept so its plugins run unchanged: an OptionSpec,
    built the original's way, `BackendOptionSpec(value_type=int, default=0, choices=None,
    validator=None)`. A plain alias would refuse those fields (OptionSpec names its type
    by string: `type="int"`)."""

    def __init__(
        self,
        value_type: Any,
        default: Any,
        choices: tuple[Any, ...] | None = None,
        validator: Callable[[Any], str | None] | None = None,
        *,
        help: str = "",
    ) -> None:
        name = str(getattr(value_type, "__name__", value_type))  # int -> "int"
        super().__init__(name, default, help, tuple(choices) if choices else None, validator)


_OPTION_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str}


def check_option(spec: OptionSpec, value: Any) -> str | None:
    """None when `value` suits `spec`, else what is wrong (the caller names the option)."""
    base, *words = spec.type.split("/")
    if words and isinstance(value, str) and value in words:
        return None
    expected = _OPTION_TYPES.get(base)
    if expected and (
        not isinstance(value, expected) or (base != "bool" and isinstance(value, bool))
    ):
        what = " or ".join([base, *(f'"{w}"' for w in words)])
        return f"expects {what}, got {value!r}"
    if spec.choices is not None and value not in spec.choices:
        return f"must be one of {list(spec.choices)}, got {value!r}"
    if spec.validator is not None:
        return spec.validator(value)
    return None


# ---------------------------------------------------------------- one step


@dataclass(frozen=True)
class RunPosition:
    """Where the run stood when a step sampled: the data position and the SEPA gate.
    The step keeps its own copy: with `[backend.options] overlap` the next step has moved
    both by the time this step's row is written."""

    examples_seen: int
    epoch: int
    sepa_gate_open: bool


@dataclass(frozen=True)
class ShapingReport:
    """What batch shaping (retrain.shaping) did to one step: its metrics-row fields
    (groups_dropped, sampling_rounds, overlong_penalty_mean; those of the features turned
    on) and a warning for the console ("" when none)."""

    metrics: dict[str, float] = field(default_factory=dict)
    warning: str = ""


@dataclass
class StepResult:
    """Everything one training step produced, for the logs and the controllers."""

    step: int
    groups: list[GroupRollout]
    reward_counters: dict[str, float]  # reward_errors, reward_timeouts, no_answer_rate
    planning: list[list[np.ndarray]]  # per group, per completion: planning-token mask
    advantages: Any  # retrain.advantages.BatchAdvantages (token advantages + stats)
    num_datums: int
    train: TrainResult
    seconds: dict[str, float]  # wall time per phase: sampling, scoring, advantages, training
    batch_size: int
    group_size: int
    position: RunPosition  # as it was when this step sampled
    off_policy_steps: int  # optimizer steps between the weights sampled and those trained
    shaping: ShapingReport = field(default_factory=ShapingReport)

    @property
    def num_completions(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def num_correct(self) -> int:
        return sum(g.num_correct for g in self.groups)

    @property
    def correct_rate(self) -> float:
        n = self.num_completions
        return self.num_correct / n if n else 0.0


# ---------------------------------------------------------------- held-out evaluation


@dataclass
class EvalResult:
    """One evaluation of the current adapter on the held-out set (`[eval]`).

    `step` is the number of training steps done when it ran (0 = before training).
    `correct_rate` and `mean_reward` are over every completion; `pass_at_k` is the
    unbiased estimator of Chen et al. (2021) with n = k = `samples`, averaged over
    problems."""

    step: int
    num_problems: int
    samples: int
    temperature: float
    num_correct: int
    correct_rate: float
    mean_reward: float
    pass_at_k: float
    seconds: float
    reward_counters: dict[str, float] = field(default_factory=dict)

    @property
    def num_completions(self) -> int:
        return self.num_problems * self.samples
