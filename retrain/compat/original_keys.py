"""The original retrain's config fields and flags, and the keys it spelled differently.

- :data:`ORIGINAL_FIELDS`: the original's config fields of 2026-02-25 and the
  `[table] key` each one is here. Its CLI flags were `--{field}` in kebab case
  (`--bp-enabled`, `--optim-beta1`, `--tinker-max-concurrent`); :func:`alias_flags`
  turns them into aliases of retrain's schema-derived flags, and the same names work as
  `[[campaign.conditions]]` keys.
- :data:`PARAM_FLAGS`: its repeatable `--backend-opt key=value`-style flags.
- :data:`RENAMED`: TOML keys the original accepted under another name; the loader reads
  them as the key named here, and `retrain migrate-config --write` rewrites them.
- :data:`LEGACY_PRIME_RL`: `[backend] prime_rl_*` keys that the original itself had
  moved into `[backend.options]`: an error here as there; migrate-config moves them.
- :data:`LATER_FIELDS_SUPPORTED`: fields of later versions that map onto a key here.

Keys of later versions that this build does not implement are in
:mod:`retrain.compat.later_keys`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

# The original's [backend] prime_rl_* keys -> their [backend.options] name.
LEGACY_PRIME_RL: dict[str, str] = {
    f"prime_rl_{k}": k
    for k in ("transport", "zmq_host", "zmq_port", "zmq_hwm", "strict_advantages")
} | {f"prime_rl_{k}": k for k in ("sync_wait_s", "sync_poll_s")}


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


def split_paths(text: str) -> list[str]:
    """The original's comma-separated form of `[plugins] search_paths`."""
    return [p.strip() for p in text.split(",") if p.strip()]


def _kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def alias_flags() -> dict[str, tuple[str, str]]:
    """The original's `--field` flags (and supported later ones) -> our (table, key)."""
    flags = {_kebab(f): target for f, target in ORIGINAL_FIELDS.items() if f not in _NO_FLAG}
    flags.update({_kebab(f): target for f, target in LATER_FIELDS_SUPPORTED.items()})
    return flags
