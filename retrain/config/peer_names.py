"""The names other trainers give to retrain's settings, and where each comes from.

Users arrive with the keys of the trainer they used before (`learning_rate`,
`num_generations`, `actor_rollout_ref.rollout.n`), so an unknown key, table, flag or
`[[campaign.conditions]]` key is first looked up here (:func:`find`); spelling is only the
fallback (:mod:`retrain.config.hints`). Each :class:`PeerName` says which retrain key is
the same setting, how to convert a value whose meaning differs, or, when retrain has no
such setting, what is close.

Looked up in the peers' own sources (names only): TRL's `GRPOConfig` and `ModelConfig`
(trl/trainer/grpo_config.py, model_config.py; `max_prompt_length` until TRL 0.28),
transformers' `TrainingArguments` (`warmup_ratio` and `logging_dir` are transformers 4's;
5.23 has neither), peft's `LoraConfig`, verl's `ppo_trainer.yaml`, prime-rl's configs
(prime_rl/configs/orchestrator.py, trainer.py; `rollouts_per_example` before it became
`group_size`). These are not the original retrain's keys: those live in retrain.compat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retrain.config.schema import all_fields

TRL = "TRL's GRPOConfig"
TRL_MODEL = "TRL's ModelConfig"
HF = "transformers' TrainingArguments (TRL's configs extend it)"
PEFT = "peft's LoraConfig"
VERL = "verl's trainer config (ppo_trainer.yaml)"
PRIME = "prime-rl's config (rl.toml)"
COMMON = "several trainers"

_PPO = 'clipping applies with [training] policy_loss = "ppo_clip"'
_EPOCHS = "retrain counts optimizer steps: set [training] max_steps (one epoch = examples / batch_size steps)"
_PROMPT = (
    "retrain does not cut prompts: drop over-long prompts from the data "
    "([training] max_tokens bounds the completions)"
)
_ONE_STEP = "retrain takes one optimizer step per sampled batch of [training] batch_size prompts"
_CKPT = "set [backend.options] checkpointing = true (the local backend)"
_SAMPLING = "retrain samples with [training] temperature and top_p only"
_RATIO = "warmup_steps = the ratio x [training] max_steps"
_ALL_LINEAR = '"all-linear" is [] here (every attention and MLP projection)'


@dataclass(frozen=True)
class PeerName:
    """One peer's name for a setting."""

    name: str  # as the peer writes it, dotted for nested keys
    source: str  # the trainer (and config class) it comes from
    target: tuple[str, str] | None  # retrain's (table, key); None: retrain has none
    note: str = ""  # what else to know; with no target: what is close
    convert: str = ""  # set when a value cannot be copied as it is: how to convert it

    @property
    def label(self) -> str:
        return f"[{self.target[0]}] {self.target[1]}" if self.target else ""


def _peers(source: str, names: str, target: str | None, note: str = "", convert: str = ""):
    table_key = tuple(target.split(".", 1)) if target else None
    return [PeerName(n, source, table_key, note, convert) for n in names.split()]


_ACTOR = "actor_rollout_ref.actor."
_OPTIM = "actor_rollout_ref.actor.optim."
_ROLLOUT = "actor_rollout_ref.rollout."
_MODEL = "actor_rollout_ref.model."

# Flat names first: where a verl or prime-rl path ends in the same name, this one wins.
PEER_NAMES: tuple[PeerName, ...] = (
    *_peers(TRL, "num_generations", "training.group_size"),
    *_peers(TRL, "num_generations_eval", "eval.samples"),
    *_peers(TRL, "max_completion_length", "training.max_tokens"),
    *_peers(TRL, "max_prompt_length", None, _PROMPT),
    *_peers(TRL, "temperature", "training.temperature"),
    *_peers(TRL, "top_p", "training.top_p"),
    *_peers(TRL, "top_k min_p repetition_penalty", None, _SAMPLING),
    *_peers(
        TRL,
        "beta",
        "training.kl_coef",
        "TRL's beta is the KL coefficient; [gtpo] beta is GTPO's entropy weighting, unrelated",
    ),
    *_peers(TRL, "epsilon", "training.clip_eps", _PPO),
    *_peers(TRL, "epsilon_high", "training.clip_eps_high", _PPO),
    *_peers(TRL, "num_iterations", None, _ONE_STEP + " (TRL's num_iterations = 1)"),
    *_peers(
        TRL,
        "loss_type",
        "training.loss_agg",
        convert='"grpo" is "seq_mean_token_mean", "dapo" is "token_mean", "bnpo" is "bnpo", '
        '"dr_grpo" is "seq_mean_token_sum_norm", "luspo" is "seq_mean_token_sum"; "cispo", '
        '"sapo" and "vespo" are [training] policy_loss values (the whole map: retrain man '
        "--topic algorithms)",
    ),
    *_peers(
        TRL,
        "scale_rewards",
        "algorithm.advantage_mode",
        convert='"group" is "grpo_std", "none" is "grpo" (the group mean subtracted, no '
        'division), "mean" is "maxrl"; "batch" (the whole batch\'s std) is not built in '
        "(advantage_mode takes a dotted path)",
    ),
    *_peers(
        TRL,
        "importance_sampling_level",
        None,
        '"token" is the default; "sequence" is policy_loss = "gspo" with the ppo loss types, '
        'ratio_level = "sequence" with cispo and sapo (retrain man --topic algorithms)',
    ),
    *_peers(TRL, "mask_truncated_completions", "training.mask_truncated"),
    *_peers(
        TRL,
        "use_vllm",
        "inference.engine",
        convert='use_vllm = true is engine = "vllm", a vLLM server at [inference] url',
    ),
    *_peers(
        TRL,
        "vllm_mode",
        "inference.engine",
        convert='"server" is engine = "vllm" with [inference] url; there is no colocated vLLM '
        '(the in-process sampler is engine = "pytorch")',
    ),
    *_peers(TRL, "vllm_server_base_url", "inference.url"),
    *_peers(TRL, "shuffle_dataset", "data.shuffle"),
    *_peers(
        TRL,
        "log_completions",
        None,
        "retrain always writes every completion to {log_dir}/emergence/generations.jsonl",
    ),
    *_peers(HF, "learning_rate", "training.lr"),
    *_peers(
        HF,
        "per_device_train_batch_size",
        "training.batch_size",
        convert="TRL counts completions per device and micro-step, retrain's batch_size counts "
        "prompts per optimizer step: batch_size = per_device_train_batch_size x GPUs x "
        "gradient_accumulation_steps / num_generations",
    ),
    *_peers(
        HF,
        "gradient_accumulation_steps",
        None,
        _ONE_STEP + " (fold it into batch_size, see per_device_train_batch_size); "
        "[backend.options] micro_batch_tokens bounds the memory of one micro-batch",
    ),
    *_peers(HF, "num_train_epochs", None, _EPOCHS),
    *_peers(HF, "max_steps", "training.max_steps"),
    *_peers(HF, "seed", "training.seed"),
    *_peers(
        HF,
        "output_dir",
        "logging.log_dir",
        "metrics and state go to [logging] log_dir, adapter checkpoints to [backend] adapter_path",
    ),
    *_peers(HF, "logging_dir", "logging.log_dir"),
    *_peers(HF, "save_steps", "training.save_every"),
    *_peers(HF, "eval_steps", "eval.every"),
    *_peers(HF, "warmup_steps", "training.warmup_steps", "a whole number of steps"),
    *_peers(HF, "warmup_ratio", "training.warmup_steps", convert=_RATIO),
    *_peers(
        HF,
        "lr_scheduler_type",
        "training.lr_schedule",
        convert='"constant", "linear" and "cosine" (to 0 at max_steps) are the same; '
        '"constant_with_warmup" is "constant" with [training] warmup_steps; the others are not '
        "built in",
    ),
    *_peers(HF, "weight_decay", "training.weight_decay"),
    *_peers(HF, "adam_beta1", "optimizer.beta1"),
    *_peers(HF, "adam_beta2", "optimizer.beta2"),
    *_peers(HF, "adam_epsilon", "optimizer.eps"),
    *_peers(
        HF,
        "max_grad_norm",
        "optimizer.max_grad_norm",
        "transformers clips at 1.0 unless told otherwise; retrain's default 0 does not clip",
    ),
    *_peers(
        HF,
        "bf16 fp16",
        None,
        'the local backend picks the base weights\' dtype: [backend.options] dtype = "auto" '
        '(bf16 where the device supports it), "bf16" or "fp32"; the adapter stays float32',
    ),
    *_peers(HF, "gradient_checkpointing", None, _CKPT),
    *_peers(
        HF,
        "report_to",
        "logging.wandb_project",
        convert='"wandb" is [logging] wandb_project = "NAME"; metrics always go to '
        "{log_dir}/metrics.jsonl",
    ),
    *_peers(HF, "run_name", "logging.wandb_run_name"),
    *_peers(HF, "logging_steps", None, "retrain logs every step"),
    *_peers(HF, "optim", None, "retrain trains with AdamW ([optimizer] beta1, beta2, eps)"),
    *_peers(
        HF, "resume_from_checkpoint", "resume.from", "the log directory with trainer_state.json"
    ),
    *_peers(PEFT, "r", "model.lora_rank"),
    *_peers(PEFT, "lora_alpha", "lora.alpha"),
    *_peers(PEFT, "lora_dropout", "lora.dropout"),
    *_peers(PEFT, "target_modules", "lora.target_modules", _ALL_LINEAR),
    *_peers(TRL_MODEL, "model_name_or_path", "model.model"),
    *_peers(TRL_MODEL, "lora_r", "model.lora_rank"),
    *_peers(TRL_MODEL, "lora_target_modules", "lora.target_modules"),
    *_peers(
        TRL_MODEL, "use_peft", None, "retrain always trains a LoRA adapter ([model] lora_rank)"
    ),
    *_peers(COMMON, "lr", "training.lr"),
    *_peers(COMMON, "batch_size", "training.batch_size", "prompts per optimizer step"),
    *_peers(COMMON, "epochs num_epochs", None, _EPOCHS),
    *_peers(
        COMMON,
        "n_samples n_samples_per_prompt samples_per_prompt rollouts_per_prompt num_rollouts",
        "training.group_size",
        "completions sampled per prompt",
    ),
    *_peers(COMMON, "max_new_tokens", "training.max_tokens"),
    *_peers(COMMON, "model_name model_id model_path", "model.model"),
    *_peers(COMMON, "total_steps num_steps train_steps", "training.max_steps"),
    *_peers(VERL, "algorithm.filter_groups.enable", "training.dynamic_sampling"),
    *_peers(
        VERL,
        "algorithm.filter_groups.max_num_gen_batches",
        "training.dynamic_sampling_max_rounds",
        convert="verl counts every generation batch (0 = no bound), retrain the extra rounds "
        "after the first: max_num_gen_batches - 1 (retrain always has a bound)",
    ),
    *_peers(
        VERL,
        "algorithm.filter_groups.metric",
        None,
        "[training] dynamic_sampling drops the groups whose rewards (the overlong penalty "
        "included) are all equal",
    ),
    *_peers(
        VERL,
        "reward_model.overlong_buffer.enable reward_model.overlong_buffer.len",
        "training.overlong_buffer",
        convert="enable = true with len = N is overlong_buffer = N (0 = off)",
    ),
    *_peers(VERL, "reward_model.overlong_buffer.penalty_factor", "training.overlong_penalty"),
    *_peers(VERL, _OPTIM + "lr", "training.lr"),
    *_peers(VERL, _OPTIM + "weight_decay", "training.weight_decay"),
    *_peers(VERL, _OPTIM + "lr_warmup_steps", "training.warmup_steps"),
    *_peers(VERL, _OPTIM + "lr_warmup_steps_ratio", "training.warmup_steps", convert=_RATIO),
    *_peers(
        VERL,
        f"{_OPTIM}lr_scheduler_type {_OPTIM}warmup_style",
        "training.lr_schedule",
        convert='"constant" and "cosine" are the same; the others are not built in',
    ),
    *_peers(
        VERL,
        _OPTIM + "betas",
        "optimizer.beta1",
        convert="betas = [b1, b2] is [optimizer] beta1 = b1 and beta2 = b2",
    ),
    *_peers(VERL, f"{_OPTIM}clip_grad {_ACTOR}grad_clip", "optimizer.max_grad_norm"),
    *_peers(
        VERL,
        _ACTOR + "ppo_mini_batch_size",
        None,
        _ONE_STEP + " (verl splits data.train_batch_size into mini-batches of this many)",
    ),
    *_peers(VERL, _ACTOR + "ppo_epochs", None, _ONE_STEP + " (verl's ppo_epochs = 1)"),
    *_peers(VERL, f"{_ACTOR}clip_ratio {_ACTOR}clip_ratio_low", "training.clip_eps", _PPO),
    *_peers(VERL, _ACTOR + "clip_ratio_high", "training.clip_eps_high", _PPO),
    *_peers(VERL, _ACTOR + "clip_ratio_c", "training.clip_ratio_c", "retrain's 0 = off"),
    *_peers(
        VERL,
        _ACTOR + "loss_agg_mode",
        "training.loss_agg",
        convert='"token-mean", "seq-mean-token-sum" and "seq-mean-token-mean" are token_mean, '
        'seq_mean_token_sum and seq_mean_token_mean; "seq-mean-token-sum-norm" is '
        "seq_mean_token_sum_norm",
    ),
    *_peers(
        VERL, _ACTOR + "use_kl_loss", "training.kl_coef", convert="kl_coef > 0 turns the KL loss on"
    ),
    *_peers(VERL, _ACTOR + "kl_loss_coef", "training.kl_coef"),
    *_peers(
        VERL,
        _ACTOR + "kl_loss_type",
        "training.kl_estimator",
        convert='"kl"/"k1" is k1, "mse"/"k2" is k2, "low_var_kl"/"k3" is k3; "abs" and "full" '
        "are not built in",
    ),
    *_peers(VERL, _ACTOR + "entropy_coeff", None, "there is no entropy bonus in this build"),
    *_peers(VERL, _ROLLOUT + "n", "training.group_size"),
    *_peers(VERL, _ROLLOUT + "temperature", "training.temperature"),
    *_peers(VERL, _ROLLOUT + "top_p", "training.top_p"),
    *_peers(VERL, _ROLLOUT + "top_k", None, _SAMPLING),
    *_peers(
        VERL,
        _ROLLOUT + "name",
        "inference.engine",
        convert='"vllm" and "sglang" are engines here too (a server at [inference] url)',
    ),
    *_peers(VERL, f"{_ROLLOUT}response_length data.max_response_length", "training.max_tokens"),
    *_peers(VERL, f"{_ROLLOUT}prompt_length data.max_prompt_length", None, _PROMPT),
    *_peers(VERL, _MODEL + "path", "model.model"),
    *_peers(VERL, _MODEL + "lora_rank", "model.lora_rank"),
    *_peers(VERL, _MODEL + "lora_alpha", "lora.alpha"),
    *_peers(VERL, _MODEL + "target_modules", "lora.target_modules", convert=_ALL_LINEAR),
    *_peers(VERL, _MODEL + "enable_gradient_checkpointing", None, _CKPT),
    *_peers(VERL, "data.train_batch_size", "training.batch_size", "prompts per step, as in verl"),
    *_peers(
        VERL,
        "data.train_files",
        "data.path",
        convert='[data] source = "jsonl" reads one JSONL file at [data] path; source = "math" '
        "reads a directory of parquet/jsonl files",
    ),
    *_peers(VERL, "data.val_files", "eval.path"),
    *_peers(VERL, "data.prompt_key", "data.prompt_field"),
    *_peers(
        VERL,
        "algorithm.adv_estimator",
        "algorithm.advantage_mode",
        convert='"grpo" is "grpo_std" ("grpo" with norm_adv_by_std_in_grpo = false); "rloo", '
        '"opo", "reinforce_plus_plus" and "reinforce_plus_plus_baseline" are the same names; '
        '"gae" needs a critic and "remax", "gpg" and the others are not built in',
    ),
    *_peers(
        VERL,
        "algorithm.norm_adv_by_std_in_grpo",
        "algorithm.advantage_mode",
        convert='true is advantage_mode = "grpo_std", false is "grpo"',
    ),
    *_peers(
        VERL, "algorithm.use_kl_in_reward", None, "retrain's KL is a loss term: [training] kl_coef"
    ),
    *_peers(
        VERL,
        "algorithm.kl_ctrl.kl_coef",
        "training.kl_coef",
        "verl subtracts it from the reward; retrain's kl_coef weights a KL loss term",
    ),
    *_peers(VERL, "trainer.total_epochs", None, _EPOCHS),
    *_peers(VERL, "trainer.total_training_steps", "training.max_steps"),
    *_peers(VERL, "trainer.save_freq", "training.save_every"),
    *_peers(VERL, "trainer.test_freq", "eval.every"),
    *_peers(VERL, "trainer.project_name", "logging.wandb_project"),
    *_peers(VERL, "trainer.experiment_name", "logging.wandb_run_name"),
    *_peers(
        VERL,
        "trainer.logger",
        "logging.wandb_project",
        convert='"wandb" in the list is [logging] wandb_project = "NAME"; the console is always on',
    ),
    *_peers(VERL, "trainer.default_local_dir", "backend.adapter_path"),
    *_peers(
        VERL,
        "trainer.n_gpus_per_node",
        "backend.devices",
        convert='retrain trains on one device, or samples on one and trains on another: devices = "gpu:0,gpu:1"',
    ),
    *_peers(
        VERL, "custom_reward_function.path", "reward.custom_module", '[reward] type = "custom"'
    ),
    *_peers(
        VERL,
        "custom_reward_function.name",
        "reward.custom_function",
        "retrain calls fn(response, reference) -> float",
    ),
    *_peers(PRIME, "model.name", "model.model"),
    *_peers(
        PRIME,
        "orchestrator.batch_size",
        "training.batch_size",
        convert="prime-rl counts rollouts (completions) per step, retrain's batch_size counts "
        "prompts: batch_size = orchestrator batch_size / group_size",
    ),
    *_peers(
        PRIME, "orchestrator.group_size orchestrator.rollouts_per_example", "training.group_size"
    ),
    *_peers(
        PRIME,
        "orchestrator.seq_len",
        None,
        "retrain bounds completions only, [training] max_tokens, and does not cut prompts",
    ),
    *_peers(PRIME, "sampling.max_tokens sampling.max_completion_tokens", "training.max_tokens"),
    *_peers(PRIME, "sampling.temperature", "training.temperature"),
    *_peers(PRIME, "optim.lr", "training.lr"),
    *_peers(PRIME, "optim.weight_decay", "training.weight_decay"),
    *_peers(
        PRIME,
        "optim.max_norm",
        "optimizer.max_grad_norm",
        "prime-rl clips at 1.0 unless told otherwise; retrain's default 0 does not clip",
    ),
    *_peers(PRIME, "optim.betas1", "optimizer.beta1"),
    *_peers(PRIME, "optim.betas2", "optimizer.beta2"),
    *_peers(PRIME, "lora.rank", "model.lora_rank"),
    *_peers(PRIME, "ckpt.interval", "training.save_every"),
    *_peers(PRIME, "wandb.project", "logging.wandb_project"),
    *_peers(PRIME, "wandb.name", "logging.wandb_run_name"),
)

# Last parts of dotted names too vague to stand for the whole name.
_VAGUE = {"n", "name", "path", "rank", "interval", "project", "logger"}


def normalize(part: str) -> str:
    """How names are compared: case and `-` versus `_` do not matter."""
    return part.strip().lower().replace("-", "_")


def _index() -> dict[str, PeerName]:
    """Every name -> its entry. A dotted name is also found by its last part, unless that
    part is vague, another entry's name, or one of retrain's own keys (a key placed in the
    wrong table is pointed to its own table, not read as a peer's)."""
    own = {spec.key for spec in all_fields()}
    index = {p.name: p for p in PEER_NAMES}
    for p in PEER_NAMES:
        leaf = p.name.rsplit(".", 1)[-1]
        if "." in p.name and leaf not in _VAGUE and leaf not in own:
            index.setdefault(leaf, p)
    return index


INDEX: dict[str, PeerName] = _index()


def find(path: Sequence[str]) -> PeerName | None:
    """The peer name `path` is (its parts as written: tables, then the key), trying the whole
    dotted name first, then ever shorter tails (`actor.optim.lr`, `optim.lr`, `lr`)."""
    parts = [normalize(p) for p in path]
    for start in range(len(parts)):
        hit = INDEX.get(".".join(parts[start:]))
        if hit is not None:
            return hit
    return None
