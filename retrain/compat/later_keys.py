"""Keys of later versions of the original retrain (after 2026-02-25) that this build
does not implement.

Each is refused by name, with the version it comes from and what to do: the loader, the
flag parser, `[[campaign.conditions]]` entries and `retrain migrate-config` all read
this one table (:data:`LATER`, and :data:`LATER_BY_FIELD` for the original's field and
flag names).
"""

from __future__ import annotations

from dataclasses import dataclass

from retrain.compat.original_keys import LATER_MODULE, LATER_PACKAGE
from retrain.config.schema import TABLES


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
    'KL-Cov and Clip-Cov are built here under other names: policy_loss = "kl_cov" with '
    "kl_cov_fraction (= kl_cov_percent / 100) and kl_cov_beta (= kl_cov_coef), or "
    'policy_loss = "clip_cov" with clip_cov_fraction (= clip_cov_ratio) and clip_cov_lb / '
    "clip_cov_ub (= clip_cov_min / clip_cov_max), all under [training]; they pick tokens over "
    "the whole step where the original picked them per micro-batch (retrain man --topic "
    'loss). policy_loss_mode = "standard" is the default: remove the key'
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


def refused_field(name: str) -> tuple[str, str] | None:
    """("[table] key", why) for a field (flag or condition key) name of a later original,
    such as `kl_cov_coef`; None when `name` is not one."""
    entry = LATER_BY_FIELD.get(name)
    return None if entry is None else (entry.label, entry.message())


def refused_key(table: str, key: str) -> str | None:
    """Why `[table] key` of a later original is refused, or None."""
    entry = LATER.get((table, key))
    return None if entry is None else entry.message()


def later_field_message(name: str) -> str | None:
    """Why a campaign-condition key or flag name of a later original is refused (None
    when `name` is not one)."""
    entry = LATER_BY_FIELD.get(name)
    if entry is None:
        return None
    return f"{entry.field} ({entry.label}) is {entry.message()}"
