"""Compatibility with the original retrain (github.com/teilomillet/retrain).

One place knows every key and flag of the original, so a config written for it loads
here unchanged or fails naming the key:

- `ORIGINAL_FIELDS`: the original's config fields of 2026-02-25 and the `[table] key`
  each one is here. Its CLI flags were `--{field}` in kebab case (`--bp-enabled`,
  `--optim-beta1`, `--tinker-max-concurrent`); `alias_flags()` turns them into aliases
  of our schema-derived flags, and the same names work as `[[campaign.conditions]]`
  keys.
- `RENAMED`: TOML keys the original accepted under another name; the loader reads them
  as the key named here, and `retrain migrate-config --write` rewrites them.
- `LEGACY_PRIME_RL`: `[backend] prime_rl_*` keys that the original itself had moved into
  `[backend.options]`: an error here as there; migrate-config moves them.
- `LATER`: keys of later versions of the original (after 2026-02-25) that this build does
  not implement: each is an error that names the version it comes from and what to do
  (the loader, the flag parser and migrate-config all read this one table).

Nothing here is silently ignored: a known key is either mapped or refused by name; an
unknown key is still an unknown key, with its did-you-mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retrain.config.schema import TABLES

ORIGINAL_DATE = "2026-02-25"
ORIGINAL = f"the original retrain of {ORIGINAL_DATE}"
LATER_MODULE = f"the original retrain after {ORIGINAL_DATE} (its retrain/config.py)"
LATER_PACKAGE = f"the original retrain after {ORIGINAL_DATE} (its retrain/config/ package)"
MIGRATE_HINT = "`retrain migrate-config FILE` lists every such key with what to do"


def _fields(table: str, pairs: str) -> dict[str, tuple[str, str]]:
    """'field:key field2:key2' -> {field: (table, key)}; a bare name is both."""
    out = {}
    for item in pairs.split():
        field, _, key = item.partition(":")
        out[field] = (table, key or field)
    return out


# The original's config fields of 2026-02-25 -> our (table, key).
ORIGINAL_FIELDS: dict[str, tuple[str, str]] = {
    **_fields(
        "algorithm",
        "algorithm_mode advantage_mode transform_mode uncertainty_kind surprisal_mask_rho "
        "algorithm_params:transform_params advantage_params transform_params",
    ),
    **_fields(
        "backend",
        "backend devices adapter_path backend_options:options "
        "tinker_throttle_dir:throttle_dir tinker_max_concurrent:max_concurrent",
    ),
    **_fields("model", "model base_url lora_rank"),
    **_fields(
        "training",
        "seed max_steps batch_size group_size max_tokens temperature top_p lr weight_decay "
        "max_examples save_every",
    ),
    **_fields("optimizer", "optim_beta1:beta1 optim_beta2:beta2 optim_eps:eps"),
    **_fields("lora", "lora_alpha:alpha lora_dropout:dropout"),
    **_fields("gtpo", "gtpo_beta:beta"),
    **_fields("hicra", "hicra_alpha:alpha"),
    **_fields(
        "sepa",
        "sepa_steps:steps sepa_schedule:schedule sepa_delay_steps:delay_steps "
        "sepa_correct_rate_gate:correct_rate_gate",
    ),
    **_fields(
        "planning",
        "planning_detector:detector planning_model:model planning_threshold:threshold",
    ),
    **_fields(
        "backpressure",
        "bp_enabled:enabled bp_warmup_steps:warmup_steps bp_ema_decay:ema_decay "
        "bp_throttle_margin:throttle_margin bp_increase_margin:increase_margin "
        "bp_min_batch_size:min_batch_size bp_max_batch_size:max_batch_size "
        "bp_peak_gflops:peak_gflops bp_peak_bw_gb_s:peak_bw_gb_s",
    ),
    **_fields(
        "inference",
        "inference_engine:engine inference_url:url attention_kernel inference_dtype:dtype "
        "kv_cache_dtype prefix_caching",
    ),
    **_fields("data", "data_source:source"),
    **_fields(
        "environment",
        "environment_provider:provider environment_id:id environment_args:args "
        "environment_max_turns:max_turns environment_auto_install:auto_install",
    ),
    **_fields(
        "reward",
        "reward_type:type reward_judge_model:judge_model reward_custom_module:custom_module "
        "reward_custom_function:custom_function",
    ),
    **_fields("resume", "resume_from:from"),
    **_fields(
        "logging",
        "log_dir wandb_project wandb_run_name wandb_entity wandb_group wandb_tags strategic_grams",
    ),
    **_fields("plugins", "plugins_search_paths:search_paths plugins_strict:strict"),
}
# Dict-valued fields had no `--field` flag in the original (they had the repeatable
# `--backend-opt k=v`, `--algorithm-param k=v`, ... instead: PARAM_FLAGS).
_NO_FLAG = {"algorithm_params", "advantage_params", "transform_params", "backend_options"}

# The original's repeatable `--flag key=value` -> the table they add to.
PARAM_FLAGS: dict[str, tuple[str, str]] = {
    "--backend-opt": ("backend", "options"),
    "--algorithm-param": ("algorithm", "transform_params"),
    "--advantage-param": ("algorithm", "advantage_params"),
    "--transform-param": ("algorithm", "transform_params"),
}


@dataclass(frozen=True)
class Renamed:
    """A key the original accepted that is another key here."""

    table: str
    key: str
    origin: str  # which original accepted it
    note: str = ""


RENAMED: dict[tuple[str, str], Renamed] = {
    ("algorithm", "entropy_mask_rho"): Renamed("algorithm", "surprisal_mask_rho", ORIGINAL),
    ("algorithm", "params"): Renamed(
        "algorithm",
        "transform_params",
        ORIGINAL,
        "algorithm_mode plugins read [algorithm.transform_params] here",
    ),
    ("optimizer", "grad_clip_norm"): Renamed("optimizer", "max_grad_norm", LATER_MODULE),
}
# Later fields that map onto a key of ours (usable as flags and condition keys too).
LATER_FIELDS_SUPPORTED: dict[str, tuple[str, str]] = {
    "grad_clip_norm": ("optimizer", "max_grad_norm"),
    # The loss options keep the later original's names and meanings (0 = off for all but
    # clip_eps, whose 0 meant "no clipping": see ppo_from_clip_eps).
    **_fields("training", "clip_eps clip_eps_high clip_ratio_c adv_clip_max"),
}


def ppo_from_clip_eps(section: dict[str, Any]) -> None:
    """The later original turned PPO clipping on with `clip_eps > 0` (0 = off); here it is
    `policy_loss = "ppo_clip"`. A `[training]` table that sets clip_eps but not
    policy_loss means what it meant there: ppo_clip when clip_eps > 0, and the plain
    loss (the key dropped) when clip_eps = 0."""
    if "policy_loss" in section or "clip_eps" not in section:
        return
    value = section["clip_eps"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0:
            section["policy_loss"] = "ppo_clip"
        elif value == 0:
            del section["clip_eps"]


# The original's [backend] prime_rl_* keys -> their [backend.options] name.
LEGACY_PRIME_RL: dict[str, str] = {
    f"prime_rl_{k}": k
    for k in ("transport", "zmq_host", "zmq_port", "zmq_hwm", "strict_advantages")
} | {f"prime_rl_{k}": k for k in ("sync_wait_s", "sync_poll_s")}


@dataclass(frozen=True)
class Later:
    """A key of a later original that this build does not implement."""

    table: str
    key: str
    field: str  # the original's config field (its flag and campaign-condition name)
    origin: str
    advice: str

    @property
    def label(self) -> str:
        return f"[{self.table}] {self.key}"

    def message(self) -> str:
        return f"not supported in this build: a key of {self.origin}. Fix: {self.advice}"


_COV = (
    "KL-Cov / Clip-Cov entropy control is not in this build: remove the key "
    '(this build trains like policy_loss_mode = "standard")'
)
_TL = "TL-GRPO (turn-level branching) is not in this build: remove the key"
_SFT = (
    "SFT warm-up is not in this build: fine-tune with another tool first, then set "
    "[model] model to the result"
)
_ECHO = (
    "ECHO (a supervised loss on prompt-side tokens) is not in this build: remove the [echo] table"
)
_GEN = (
    "this build always writes every completion to {log_dir}/emergence/generations.jsonl: "
    "remove the key"
)
_REPLAY = "optimizer-batch capture/replay is not in this build: remove the [optimizer_batch] table"
_ROLL = "remove the key: verifiers environments are rolled out in-process here"

_LATER_SPEC: tuple[tuple[str, str, str, str], ...] = (
    # (table, keys, origin, advice); a field is the key, prefixed for echo/model/...
    (
        "training",
        "policy_loss_mode kl_cov_percent kl_cov_coef clip_cov_ratio clip_cov_min clip_cov_max",
        LATER_MODULE,
        _COV,
    ),
    (
        "training",
        "batch_advantage_norm",
        LATER_MODULE,
        "batch-wide advantage normalisation is not built in: remove the key, or normalise in "
        'an advantage plugin ([algorithm] advantage_mode = "pkg.module.fn")',
    ),
    (
        "training",
        "trainer trainer_command",
        LATER_MODULE,
        "external trainers are not supported: remove the key (retrain runs its own loop)",
    ),
    (
        "training",
        "tl_grpo tl_grpo_branch_mode tl_grpo_branch_size tl_grpo_lookahead_steps "
        "tl_grpo_ema_decay tl_grpo_ema_init",
        LATER_MODULE,
        _TL,
    ),
    ("training", "sft_warmup_steps sft_data_path sft_lr sft_loss_fn", LATER_MODULE, _SFT),
    (
        "training",
        "sft_data_sha256 sft_data_rows sft_audit_path sft_audit_sha256 sft_token_audit_path "
        "sft_token_audit_sha256 sft_batch_size sft_max_tokens sft_batch_order "
        "sft_length_bucket_size sft_reshuffle_each_epoch",
        LATER_PACKAGE,
        _SFT,
    ),
    (
        "echo",
        "enabled weight loss_fn max_tokens_per_step max_token_ratio entropy_floor "
        "min_prompt_overlap",
        LATER_MODULE,
        _ECHO,
    ),
    ("echo", "target_retention require_live_observation_bridge", LATER_PACKAGE, _ECHO),
    (
        "model",
        "revision",
        LATER_PACKAGE,
        "download that revision (huggingface-cli download MODEL --revision R --local-dir DIR) "
        "and set [model] model = DIR",
    ),
    (
        "model",
        "local_files_only",
        LATER_PACKAGE,
        "remove the key and set HF_HUB_OFFLINE=1 in the environment (or .env)",
    ),
    ("environment", "rollout_env_workers rollout_buffer_size", LATER_PACKAGE, _ROLL),
    (
        "logging",
        "log_generations generation_log_samples_per_prompt generation_top_surprisal_limit",
        LATER_MODULE,
        _GEN,
    ),
    (
        "logging",
        "checkpoint_artifacts",
        LATER_PACKAGE,
        "remove the key: checkpoints are written under [backend] adapter_path",
    ),
    (
        "optimizer_batch",
        "capture replay_path expected_logical_sha256 expected_manifest_sha256",
        LATER_PACKAGE,
        _REPLAY,
    ),
)
# Tables whose keys kept the table name as a field prefix in the original.
_FIELD_PREFIX = {
    "echo": "echo_",
    "model": "model_",
    "environment": "environment_",
    "optimizer_batch": "optimizer_batch_",
}


def _later_table() -> dict[tuple[str, str], Later]:
    out: dict[tuple[str, str], Later] = {}
    for table, keys, origin, advice in _LATER_SPEC:
        for key in keys.split():
            field = _FIELD_PREFIX.get(table, "") + key
            out[(table, key)] = Later(table, key, field, origin, advice)
    return out


LATER: dict[tuple[str, str], Later] = _later_table()
LATER_BY_FIELD: dict[str, Later] = {entry.field: entry for entry in LATER.values()}
# Whole tables of a later original ([echo], [optimizer_batch]).
LATER_TABLES = frozenset(t for t, _ in LATER) - set(TABLES)


def _kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def alias_flags() -> dict[str, tuple[str, str]]:
    """The original's `--field` flags (and supported later ones) -> our (table, key)."""
    flags = {_kebab(f): target for f, target in ORIGINAL_FIELDS.items() if f not in _NO_FLAG}
    flags.update({_kebab(f): target for f, target in LATER_FIELDS_SUPPORTED.items()})
    return flags


def later_flag(flag: str) -> Later | None:
    """The later-original key behind an unknown flag such as `--clip-eps`, if any."""
    return LATER_BY_FIELD.get(flag.removeprefix("--").replace("-", "_"))


def later_field_message(name: str) -> str | None:
    """Why a campaign-condition key or flag name of a later original is refused (None
    when `name` is not one)."""
    entry = LATER_BY_FIELD.get(name)
    if entry is None:
        return None
    return f"{entry.field} ({entry.label}) is {entry.message()}"


# ---------------------------------------------------------------- normalising a TOML


@dataclass(frozen=True)
class Problem:
    table: str
    key: str
    message: str


def _merge_renamed(
    section: dict[str, Any], old: str, new: Renamed, problems: list[Problem], table: str
) -> None:
    """Move section[old] to section[new.key]; dicts merge, equal values are fine."""
    value = section.pop(old)
    if new.key not in section:
        section[new.key] = value
        return
    current = section[new.key]
    if isinstance(value, dict) and isinstance(current, dict):
        clash = sorted(k for k in value if k in current and current[k] != value[k])
        if not clash:
            section[new.key] = {**value, **current}
            return
        what = f"both set {', '.join(clash)} differently"
    elif value == current:
        return
    else:
        what = "both are set, to different values"
    problems.append(
        Problem(
            table,
            old,
            f"{old} is the original's name for {new.key}, and {what}. Fix: keep only {new.key}",
        )
    )


def _later_problems(table: str, section: Mapping[str, Any]) -> list[Problem]:
    out = []
    for key in list(section):
        entry = LATER.get((table, key))
        if entry is not None:
            out.append(Problem(table, key, f"{entry.message()}. {MIGRATE_HINT}"))
    return out


def _prime_rl_problems(section: Mapping[str, Any]) -> list[Problem]:
    out = []
    for key, new in LEGACY_PRIME_RL.items():
        if key in section:
            out.append(
                Problem(
                    "backend",
                    key,
                    f"a legacy PRIME-RL key, which {ORIGINAL} already refused: it belongs in "
                    f"[backend.options] as {new}. Fix: `retrain migrate-config --write FILE` moves it",
                )
            )
    return out


def _later_table_problems(table: str, section: Any) -> list[Problem]:
    keys = list(section) if isinstance(section, Mapping) else []
    out = _later_problems(table, section) if isinstance(section, Mapping) else []
    known = {k for t, k in LATER if t == table}
    origin = next(e.origin for (t, _), e in LATER.items() if t == table)
    what = f"not supported in this build: [{table}] is a table of {origin}"
    for key in keys:
        if key not in known:
            out.append(Problem(table, key, f"{what}. {MIGRATE_HINT}"))
    if not keys:
        out.append(Problem(table, "", f"{what}. Fix: remove the table"))
    return out


def normalize(
    raw: Mapping[str, Any],
) -> tuple[dict[str, Any], list[Problem], dict[tuple[str, str], tuple[str, str]]]:
    """`raw` with the original's renamed keys under their names here, its comma-string
    `[plugins] search_paths` split, and its later or legacy keys taken out as problems.
    Returns (raw, problems, {(table, new key): (table, key as written)})."""
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    renamed: dict[tuple[str, str], tuple[str, str]] = {}
    for table, section in raw.items():
        if table in LATER_TABLES:
            problems += _later_table_problems(table, section)
            continue
        if not isinstance(section, dict):
            out[table] = section
            continue
        section = dict(section)
        problems += _later_problems(table, section)
        if table == "backend":
            problems += _prime_rl_problems(section)
        for key in [k for k in section if _refused(table, k)]:
            del section[key]
        for key in [k for k in section if (table, k) in RENAMED]:
            new = RENAMED[(table, key)]
            _merge_renamed(section, key, new, problems, table)
            renamed[(new.table, new.key)] = (table, key)
        if table == "training":
            ppo_from_clip_eps(section)
        if table == "plugins" and isinstance(section.get("search_paths"), str):
            section["search_paths"] = split_paths(section["search_paths"])
        out[table] = section
    return out, problems, renamed


def _refused(table: str, key: str) -> bool:
    return (table, key) in LATER or (table == "backend" and key in LEGACY_PRIME_RL)


def split_paths(text: str) -> list[str]:
    """The original's comma-separated form of `[plugins] search_paths`."""
    return [p.strip() for p in text.split(",") if p.strip()]
