"""The one map from other trainers' loss settings to retrain's `[training]` keys: a typed
record per peer setting. The opt-in cross-check (tests/integration/test_trl_crosscheck.py,
marker `trl`) drives TRL's own loss with every TRL row whose `checked_by` names it and
asserts equal losses and gradients; the manual's map is written from this table.

Each row holds the peer's arguments it stands for (`peer_settings`, the values the
cross-check runs with), the retrain `[training]` keys that reproduce them
(`settings`), and notes: where the peer differs from its paper, which one retrain
follows, and what the mapping assumes. A row whose `checked_by` is empty was mapped by
reading the peer's code and paper, not by running it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

TRL = "trl 1.16.0"
TRL_CHECK = "tests/integration/test_trl_crosscheck.py"


@dataclass(frozen=True)
class PeerLoss:
    """One peer setting and the retrain settings that reproduce it."""

    peer: str  # the trainer and its version, e.g. "trl 1.16.0"
    name: str  # the peer's name for it, e.g. "loss_type=grpo, importance_sampling_level=token"
    settings: Mapping[str, Any]  # retrain `[training]` keys
    notes: str = ""
    peer_settings: Mapping[str, Any] = field(default_factory=dict)  # the peer's arguments
    checked_by: str = ""  # the test that runs the peer against retrain; "" = by reading

    def __post_init__(self) -> None:  # frozen, and so are the dicts
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "peer_settings", MappingProxyType(dict(self.peer_settings)))


# The cross-check's local batches: per_device_train_batch_size completions each, two
# gradient-accumulation steps per optimizer step (one retrain step), one process.
TRL_BATCH = {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2}
TRL_MAX_COMPLETION = 16
_CLIP = {"epsilon": 0.2, "epsilon_high": 0.28}
_RETRAIN_CLIP = {"clip_eps": 0.2, "clip_eps_high": 0.28}

_AGGREGATION = {  # TRL loss_type -> (retrain loss_agg settings, note)
    "grpo": (
        {"loss_agg": "seq_mean_token_mean"},
        "GRPO (Shao et al. 2024): each completion's token mean, averaged over completions.",
    ),
    "dapo": (
        {"loss_agg": "token_mean"},
        "DAPO (Yu et al. 2025): normalised by the active tokens of the accumulated batch, "
        "TRL's num_items_in_batch; a retrain step is one optimizer step, so its N tokens.",
    ),
    "bnpo": (
        {"loss_agg": "bnpo", "bnpo_batch_size": TRL_BATCH["per_device_train_batch_size"]},
        "TRL's bnpo is a token mean per local batch (per_device_train_batch_size "
        "completions) averaged over accumulation steps; retrain's local batches are a fixed "
        "partition of the step into bnpo_batch_size consecutive completions (not its "
        "micro-batches), so the loss does not depend on the split. The BNPO paper (Xiao et "
        "al. 2025, 'BNPO: Beta Normalization Policy Optimization') normalises advantages "
        "with a Beta distribution, which TRL's bnpo loss type does not do: retrain follows "
        "TRL's definition of the aggregation, and has no Beta normalisation.",
    ),
    "dr_grpo": (
        {"loss_agg": "seq_mean_token_sum_norm", "max_tokens": TRL_MAX_COMPLETION},
        "Dr. GRPO (Liu et al. 2025): token sums over G x max_completion_length; retrain's "
        "constant is [training] max_tokens (set it to TRL's max_completion_length). TRL "
        "divides by the local batch's row count, so with equal local batches it is G.",
    ),
    "luspo": (
        {"loss_agg": "seq_mean_token_sum"},
        "LUSPO: GSPO's sequence loss scaled by the completion's length, i.e. token sums "
        "averaged over completions; TRL's luspo at the token level is PPO with that "
        "aggregation.",
    ),
}


def _trl_clipped(loss_type: str, level: str) -> PeerLoss:
    agg, note = _AGGREGATION[loss_type]
    objective = {"policy_loss": "gspo"} if level == "sequence" else {"policy_loss": "ppo_clip"}
    if level == "sequence":
        note += (
            " Sequence level: GSPO (Zheng et al. 2025). TRL differentiates s_i through the "
            "mean of the log ratios; retrain uses the paper's GSPO-token ratio (value s_i, "
            "gradient s_i d logp_t), equal in value and gradient when the advantage is "
            "constant over a completion (TRL's case), and per-token with token advantages."
        )
    return PeerLoss(
        TRL,
        f"loss_type={loss_type}, importance_sampling_level={level}",
        {**objective, **_RETRAIN_CLIP, **agg},
        note,
        {"loss_type": loss_type, "importance_sampling_level": level, **_CLIP},
        TRL_CHECK,
    )


def _trl_level(loss_type: str, level: str, settings: dict, note: str, args: dict) -> PeerLoss:
    ratio = {"ratio_level": "sequence"} if level == "sequence" else {}
    return PeerLoss(
        TRL,
        f"loss_type={loss_type}, importance_sampling_level={level}",
        {**settings, **ratio},
        note,
        {"loss_type": loss_type, "importance_sampling_level": level, **args},
        TRL_CHECK,
    )


_CISPO_NOTE = (
    "CISPO (MiniMax 2025, 'MiniMax-M1'): sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp. "
    "TRL follows ScaleRL's parametrisation (Khatri et al. 2025): epsilon_high is the "
    "ratio's absolute cap (5.0 recommended) and there is no lower bound; retrain follows "
    "MiniMax-M1's 1 + clip_eps_high, so clip_eps_high = epsilon_high - 1, and clip_eps = 1 "
    "for no lower bound (as MiniMax-M1 trained). Aggregated like dapo."
)
_SAPO_NOTE = (
    "SAPO (Gao et al. 2025): gate sigmoid(tau (r - 1)) 4 / tau, tau_pos where A > 0, "
    "tau_neg otherwise; GRPO's per-completion mean, as in the paper."
)
_VESPO_NOTE = (
    "VESPO: sg(phi(w)) A logp, phi(w) = w^k exp(lambda (1 - w)), w the sequence's product "
    "ratio, (k, lambda) by the sign of A (A >= 0: _pos); dapo's aggregation. TRL clamps "
    "log w to [log 1e-8, 20] as a numerical guard, retrain does not (phi only differs "
    "where it is ~0). importance_sampling_level does not change TRL's vespo loss."
)
_VESPO_ARGS = {
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}

TRL_ROWS: tuple[PeerLoss, ...] = (
    *(
        _trl_clipped(loss_type, level)
        for loss_type in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo")
        for level in ("token", "sequence")
    ),
    *(
        _trl_level(
            "cispo",
            level,
            {"policy_loss": "cispo", "clip_eps": 1.0, "clip_eps_high": 4.0},
            _CISPO_NOTE,
            {"epsilon_high": 5.0},
        )
        for level in ("token", "sequence")
    ),
    *(
        _trl_level(
            "sapo",
            level,
            {
                "policy_loss": "sapo",
                "sapo_tau_pos": 1.0,
                "sapo_tau_neg": 1.05,
                "loss_agg": "seq_mean_token_mean",
            },
            _SAPO_NOTE,
            {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
        )
        for level in ("token", "sequence")
    ),
    *(
        PeerLoss(
            TRL,
            f"loss_type=vespo, importance_sampling_level={level}",
            {"policy_loss": "vespo", **_VESPO_ARGS},
            _VESPO_NOTE,
            {"loss_type": "vespo", "importance_sampling_level": level, **_VESPO_ARGS},
            TRL_CHECK,
        )
        for level in ("token", "sequence")
    ),
    PeerLoss(
        TRL,
        "loss_type=grpo, delta=3.0",
        {
            "policy_loss": "ppo_clip",
            **_RETRAIN_CLIP,
            "clip_ratio_c": 3.0,
            "loss_agg": "seq_mean_token_mean",
        },
        "INTELLECT-2's two-sided clipping caps the unclipped ratio at delta; for "
        "delta > 1 + epsilon_high it equals dual clip (Ye et al. 2020) with c = delta.",
        {"loss_type": "grpo", "delta": 3.0, **_CLIP},
        TRL_CHECK,
    ),
    PeerLoss(
        TRL,
        "loss_type=dapo, beta=0.04, use_bias_correction_kl=False",
        {"policy_loss": "ppo_clip", **_RETRAIN_CLIP, "kl_coef": 0.04, "kl_estimator": "k3"},
        "The k3 KL to the reference model, added after the policy loss. TRL's default "
        "use_bias_correction_kl=True multiplies the KL term by the importance ratio; retrain "
        "has no such weight. TRL's reference is a second model, retrain's the LoRA-off base.",
        {"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False, **_CLIP},
        TRL_CHECK,
    ),
)

_READ_ONLY_NOTE = "Mapped by reading the peer's code; not run by a test."

OTHER_ROWS: tuple[PeerLoss, ...] = (
    PeerLoss(
        TRL,
        "vllm_importance_sampling_mode=token_truncate",
        {"is_correction": "truncate", "is_level": "token", "is_high": 3.0},
        "TIS. TRL weighs a PPO ratio against its own recomputed logprobs by the clipped "
        "trainer/sampler ratio; retrain's objectives weigh by r = trainer/sampler itself and "
        "the correction replaces r's mismatch part by the clipped one, which is the same "
        "weight, but retrain's PPO clip also acts on the mismatch. " + _READ_ONLY_NOTE,
        {
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_max": 3.0,
        },
    ),
    PeerLoss(
        TRL,
        "vllm_importance_sampling_mode=token_mask",
        {"is_correction": "mask", "is_level": "token", "is_high": 3.0},
        "Token-level MIS: tokens whose ratio leaves the band get weight 0. " + _READ_ONLY_NOTE,
        {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 3.0},
    ),
    PeerLoss(
        TRL,
        "vllm_importance_sampling_mode=sequence_truncate",
        {"is_correction": "truncate", "is_level": "sequence", "is_high": 3.0},
        "Sequence-level TIS: every token weighed by the truncated product ratio. "
        + _READ_ONLY_NOTE,
        {
            "vllm_importance_sampling_mode": "sequence_truncate",
            "vllm_importance_sampling_clip_max": 3.0,
        },
    ),
    PeerLoss(
        TRL,
        "vllm_importance_sampling_mode=sequence_mask",
        {"is_correction": "mask", "is_level": "sequence", "is_high": 3.0},
        "Differs: TRL weighs the kept sequences by their product ratio (Liu et al. 2025's "
        "seq-MIS); retrain's mask only rejects (SkyRL's product mask) and the kept tokens "
        "keep their own ratios. " + _READ_ONLY_NOTE,
        {
            "vllm_importance_sampling_mode": "sequence_mask",
            "vllm_importance_sampling_clip_max": 3.0,
        },
    ),
    PeerLoss(
        "SkyRL",
        "off_policy_correction.sequence_mask_metric=geometric",
        {"is_correction": "mask", "is_level": "geometric", "is_low": 0.99, "is_high": 1.01},
        "The geometric-mean sequence mask (geo_mask_low / geo_mask_high). SkyRL also drops "
        "masked tokens from the token-mean's denominator; retrain keeps them in it. "
        + _READ_ONLY_NOTE,
        {"sequence_mask_metric": "geometric", "geo_mask_low": 0.99, "geo_mask_high": 1.01},
    ),
    PeerLoss(
        "verl",
        "policy_loss.loss_mode=clip_cov",
        {
            "policy_loss": "clip_cov",
            "clip_cov_fraction": 0.0002,
            "clip_cov_lb": 1.0,
            "clip_cov_ub": 5.0,
        },
        "Clip-Cov (Cui et al. 2025); verl's clip_cov_ratio is clip_cov_fraction. verl selects within each micro-batch (its means, its "
        "token count); retrain selects once over the step. " + _READ_ONLY_NOTE,
        {"loss_mode": "clip_cov", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    ),
    PeerLoss(
        "verl",
        "policy_loss.loss_mode=kl_cov",
        {"policy_loss": "kl_cov", "kl_cov_fraction": 0.0002, "kl_cov_beta": 1.0},
        "KL-Cov (Cui et al. 2025); verl's kl_cov_ratio and ppo_kl_coef are kl_cov_fraction "
        "and kl_cov_beta. Selection as for "
        "clip_cov. " + _READ_ONLY_NOTE,
        {"loss_mode": "kl_cov", "kl_cov_ratio": 0.0002, "ppo_kl_coef": 1.0},
    ),
)

VERL_GMPO_CLIP = {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}  # GMPO's recipe: e^-0.4, e^0.4

POLICY_GRADIENT_ROWS: tuple[PeerLoss, ...] = (
    PeerLoss(
        "verl",
        "policy_loss.loss_mode=gpg",
        {"policy_loss": "gpg"},
        "GPG (Chu et al. 2025): -A logp, no ratio, aggregated by loss_agg_mode (token-mean by "
        "default, retrain's token_mean). verl's GPG recipe also sets adv_estimator = gpg, "
        "alpha (r - group mean) with alpha = B / (number of nonzero rewards in the batch), "
        "which retrain does not build (the paper's alpha counts the samples of informative "
        'groups instead); without alpha it is advantage_mode = "grpo". ' + _READ_ONLY_NOTE,
        {"loss_mode": "gpg"},
    ),
    PeerLoss(
        "verl",
        "policy_loss.loss_mode=geo_mean",
        {
            "policy_loss": "gmpo",
            "clip_eps": 0.4,
            "clip_eps_high": 0.4,
            "loss_agg": "seq_mean_token_mean",
        },
        "GMPO (Zhao et al. 2025): -A_i x the geometric mean of the completion's token ratios, "
        "each clipped in log space to [-clip_ratio_low, clip_ratio_high]; verl averages over "
        "the completions whatever its loss_agg_mode (seq_mean_token_mean here). verl clips "
        "with each token's advantage sign and averages the token advantages, retrain with "
        "the sign of that average: the same for one advantage per completion, the only case "
        "verl supports. verl's pg_clipfrac counts every token outside the band, retrain's "
        "clip_fraction only those the clip cut (upper side for A > 0, lower for A < 0). "
        + _READ_ONLY_NOTE,
        {"loss_mode": "geo_mean", **VERL_GMPO_CLIP},
    ),
    PeerLoss(
        "verl",
        "policy_loss.loss_mode=dppo_tv",
        {"policy_loss": "dppo", "is_correction": "truncate", "is_high": 20.0},
        "DPPO-Binary-TV (arXiv 2602.04879): clip_ratio_low / clip_ratio_high are the region "
        "on p - p_old (clip_eps / clip_eps_high), and verl weighs the kept tokens by "
        "sg(min(r, clip_ratio_c)) logp, clip_ratio_c = 20: the gradient of retrain's "
        "-A r under token truncation at is_high = 20 (the logged loss differs: verl's "
        "surrogate is -A w logp). verl's dppo_kl (a binary-KL region) has no retrain "
        "equivalent. " + _READ_ONLY_NOTE,
        {"loss_mode": "dppo_tv", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 20},
    ),
    PeerLoss(
        "prime-rl",
        "trainer.loss (type = default)",
        {"policy_loss": "dppo", "dppo_kl_coef": 0.001},
        "prime-rl's default_loss_fn: DPPO-Binary-TV plus kl_tau (trainer - inference log "
        "ratio)^2 on every loss token (the Kimi K2.5 term; not a KL to a reference model, so "
        "not kl_coef), summed and divided by the step's loss tokens (token_mean). "
        "dppo_mask_low / dppo_mask_high are clip_eps / clip_eps_high (0.2 both). adv_tau "
        "(1.0) scales the advantages and has no key: adv_tau = c is dppo_kl_coef = kl_tau / "
        "c with the loss scaled by c. Its ipo loss type (a symmetric region |p - p_inf|) has "
        "no retrain equivalent. " + _READ_ONLY_NOTE,
        {
            "type": "default",
            "dppo_mask_low": 0.2,
            "dppo_mask_high": 0.2,
            "adv_tau": 1.0,
            "kl_tau": 1e-3,
        },
    ),
)

PEER_LOSSES: tuple[PeerLoss, ...] = TRL_ROWS + OTHER_ROWS + POLICY_GRADIENT_ROWS
