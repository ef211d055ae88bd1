"""The map: every algorithm the peers name (TRL, verl, prime-rl, SkyRL, the original
retrain) as the retrain settings that reproduce it, one frozen :class:`Algorithm` per row.

A row's `[training]` keys come from the loss-level table (:mod:`retrain.loss.peers`,
whose TRL rows are cross-checked against TRL's own loss) wherever that table has the
peer's loss; this module adds the advantage (`[algorithm]`) and whatever else makes the
named algorithm, so each fact is written once. `status` says whether retrain reproduces
the row (`same`), reproduces it with a stated difference (`differs`), or does not
(`not reproduced`, with why). `kind` is `algorithm` (a whole recipe), `option` (a
correction or mask added to any recipe) or `metric` (a diagnostic, not a setting).

:func:`identify` names the rows a config amounts to (`retrain explain`): the config's
*shape* (:func:`features`: which estimator, objective, aggregation, which parts are on)
is compared with each row's; parameter values (clip ranges, temperatures, fractions) do
not change which algorithm it is. The manual's table (`retrain man --topic algorithms`,
docs/algorithms.md) is generated from :data:`ALGORITHMS` by :func:`render_markdown`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from retrain.config import config_from_dict
from retrain.config.schema import Config, table_fields
from retrain.errors import ConfigError
from retrain.loss.peers import PEER_LOSSES, PeerLoss
from retrain.registry import ADVANTAGE_MODES, ALGORITHM_MODES

SAME = "same"
DIFFERS = "differs"
NOT_REPRODUCED = "not reproduced"
ALGORITHM, OPTION, METRIC = "algorithm", "option", "metric"

TRL, VERL, PRIME, SKYRL = "TRL 1.16", "verl", "prime-rl", "SkyRL"
PRIME_LOSS = "prime-rl"  # the peer name of its row in retrain/loss/peers.py
ORIGINAL, RETRAIN = "retrain (original)", "retrain"


@dataclass(frozen=True)
class Algorithm:
    """One named algorithm and the retrain settings that reproduce it."""

    name: str  # what people call it: "GRPO", "DAPO"
    peer: str  # the trainer that names it, e.g. "TRL 1.16"
    peer_name: str  # the peer's own setting: "loss_type=dapo"
    algorithm: Mapping[str, Any]  # retrain `[algorithm]` keys
    training: Mapping[str, Any]  # retrain `[training]` keys
    status: str = SAME  # SAME | DIFFERS | NOT_REPRODUCED
    differs: str = ""  # how it differs (DIFFERS), why not (NOT_REPRODUCED), else a note
    kind: str = ALGORITHM  # ALGORITHM | OPTION | METRIC
    loss: PeerLoss | None = None  # the loss-level row its [training] keys come from

    def __post_init__(self) -> None:  # frozen, and so are the dicts
        object.__setattr__(self, "algorithm", MappingProxyType(dict(self.algorithm)))
        object.__setattr__(self, "training", MappingProxyType(dict(self.training)))

    @property
    def label(self) -> str:
        """`DAPO (TRL 1.16 loss_type=dapo)`."""
        return f"{self.name} ({self.peer} {self.peer_name})"

    @property
    def reproduced(self) -> bool:
        return self.status != NOT_REPRODUCED and self.kind != METRIC

    @property
    def checked_by(self) -> str:
        """The test that runs the peer's loss against retrain's ("" = mapped by reading)."""
        return self.loss.checked_by if self.loss else ""

    def toml(self) -> dict[str, dict[str, Any]]:
        """The row's settings as TOML tables (empty tables left out)."""
        tables = {"algorithm": dict(self.algorithm), "training": dict(self.training)}
        return {name: keys for name, keys in tables.items() if keys}

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peer": self.peer,
            "peer_name": self.peer_name,
            "kind": self.kind,
            "status": self.status,
            "settings": self.toml(),
            "differs": self.differs,
            "checked_by": self.checked_by,
        }


def peer_loss(peer: str, name: str) -> PeerLoss:
    """The loss-level row (:mod:`retrain.loss.peers`) a map row derives from."""
    for row in PEER_LOSSES:
        if row.peer == peer and row.name == name:
            return row
    raise KeyError(f"no PeerLoss row {peer!r} {name!r} in retrain/loss/peers.py")


def _from_loss(
    name: str,
    peer: str,
    peer_name: str,
    adv: str,
    loss: PeerLoss,
    extra: Mapping[str, Any] | None = None,
    *,
    status: str = SAME,
    differs: str = "",
    drop: tuple[str, ...] = ("max_tokens", "bnpo_batch_size"),
) -> Algorithm:
    """A recipe row: an advantage plus a loss-level row's [training] keys (without the
    cross-check's batch-shape parameters, `drop`, which belong to a run, not a recipe)."""
    training = {k: v for k, v in loss.settings.items() if k not in drop}
    return Algorithm(
        name,
        peer,
        peer_name,
        {"advantage_mode": adv, "transform_mode": "none"},
        {**training, **(extra or {})},
        status,
        differs,
        ALGORITHM,
        loss,
    )


def _trl(loss_type: str, level: str = "token") -> PeerLoss:
    return peer_loss("trl 1.16.0", f"loss_type={loss_type}, importance_sampling_level={level}")


def _adv(adv: str) -> dict[str, Any]:
    return {"advantage_mode": adv, "transform_mode": "none"}


# TRL's advantages: scale_rewards = "group" (its default) divides by the group's std.
_TRL_ADV = "grpo_std"
_TRL_NOTE = (
    'TRL\'s default scale_rewards = "group" is advantage_mode = "grpo_std" (the group\'s '
    "sample std; TRL uses the population std, a constant factor G/(G-1) apart in the std)."
)

_TRL_ROWS: tuple[Algorithm, ...] = (
    _from_loss("GRPO", TRL, "loss_type=grpo", _TRL_ADV, _trl("grpo"), differs=_TRL_NOTE),
    _from_loss(
        "Dr. GRPO",
        TRL,
        'loss_type=dr_grpo, scale_rewards="none"',
        "grpo",
        _trl("dr_grpo"),
        differs='No std scale (advantage_mode = "grpo"); set [training] max_tokens to TRL\'s '
        "max_completion_length, the constant the token sums are divided by.",
    ),
    _from_loss(
        "DAPO loss",
        TRL,
        "loss_type=dapo",
        _TRL_ADV,
        _trl("dapo"),
        differs="TRL's default loss_type. It is DAPO's token-mean aggregation only; the whole recipe (dynamic "
        "sampling, overlong penalty) is the verl DAPO row.",
    ),
    _from_loss(
        "BNPO",
        TRL,
        "loss_type=bnpo",
        _TRL_ADV,
        _trl("bnpo"),
        status=DIFFERS,
        differs="TRL's bnpo (and retrain's) is an aggregation: token means of local batches "
        "(set bnpo_batch_size to per_device_train_batch_size). The BNPO paper's Beta-"
        "distribution advantage normalisation is in neither.",
    ),
    _from_loss(
        "CISPO",
        TRL,
        "loss_type=cispo",
        _TRL_ADV,
        _trl("cispo"),
        differs="TRL's epsilon_high caps the ratio itself (ScaleRL's form): clip_eps_high = "
        "epsilon_high - 1, clip_eps = 1 (no lower bound).",
    ),
    _from_loss("SAPO", TRL, "loss_type=sapo", _TRL_ADV, _trl("sapo")),
    _from_loss(
        "LUSPO",
        TRL,
        'loss_type=luspo, importance_sampling_level="sequence"',
        _TRL_ADV,
        _trl("luspo", "sequence"),
    ),
    _from_loss(
        "VESPO",
        TRL,
        "loss_type=vespo",
        _TRL_ADV,
        _trl("vespo"),
        differs="TRL clamps log w to [log 1e-8, 20] as a numerical guard; retrain does not.",
    ),
    _from_loss(
        "GSPO",
        TRL,
        'loss_type=grpo, importance_sampling_level="sequence"',
        _TRL_ADV,
        _trl("grpo", "sequence"),
        differs="The GSPO paper's clip range is much narrower (3e-4 / 4e-4 on the sequence "
        "ratio): set clip_eps and clip_eps_high to match.",
    ),
    _from_loss(
        "INTELLECT-2 two-sided clip",
        TRL,
        "loss_type=grpo, delta",
        _TRL_ADV,
        peer_loss("trl 1.16.0", "loss_type=grpo, delta=3.0"),
        differs="delta is clip_ratio_c (dual clip): the same loss for delta > 1 + epsilon_high.",
    ),
    _from_loss(
        "DAPO loss + KL",
        TRL,
        "loss_type=dapo, beta > 0, use_bias_correction_kl=False",
        _TRL_ADV,
        peer_loss("trl 1.16.0", "loss_type=dapo, beta=0.04, use_bias_correction_kl=False"),
        status=DIFFERS,
        differs="TRL's default use_bias_correction_kl = True weighs the KL by the importance "
        "ratio, which retrain does not; TRL's reference is a second model, retrain's the "
        "base weights with the LoRA off.",
    ),
)


def _option(name: str, peer: str, peer_name: str, loss: PeerLoss, **kw: Any) -> Algorithm:
    kw.setdefault("differs", loss.notes)  # the loss-level row's notes say how it maps
    return Algorithm(name, peer, peer_name, {}, dict(loss.settings), kind=OPTION, loss=loss, **kw)


def _vllm(mode: str) -> PeerLoss:
    return peer_loss("trl 1.16.0", f"vllm_importance_sampling_mode={mode}")


_OPTIONS: tuple[Algorithm, ...] = (
    _option("TIS", TRL, "vllm_importance_sampling_mode=token_truncate", _vllm("token_truncate")),
    _option("token MIS", TRL, "vllm_importance_sampling_mode=token_mask", _vllm("token_mask")),
    _option(
        "sequence TIS",
        TRL,
        "vllm_importance_sampling_mode=sequence_truncate",
        _vllm("sequence_truncate"),
    ),
    _option(
        "sequence MIS",
        TRL,
        "vllm_importance_sampling_mode=sequence_mask",
        _vllm("sequence_mask"),
        status=DIFFERS,
        differs="TRL weighs the kept sequences by their product ratio; retrain's mask only "
        "rejects, the kept tokens keep their own ratios.",
    ),
    Algorithm(
        "truncated-completion mask",
        TRL,
        "mask_truncated_completions=True",
        {},
        {"mask_truncated": True},
        differs="Completions cut at max_tokens get no loss (DAPO's overlong filtering).",
        kind=OPTION,
    ),
    Algorithm(
        "rollout correction (IS)",
        VERL,
        "algorithm.rollout_is=token, rollout_is_threshold=2.0",
        {},
        {"is_correction": "truncate", "is_level": "token", "is_high": 2.0},
        differs='verl\'s sequence level (rollout_is=sequence) is is_level = "sequence".',
        kind=OPTION,
    ),
    Algorithm(
        "rollout correction (rejection sampling)",
        VERL,
        "algorithm.rollout_rs=geometric",
        {},
        {"is_correction": "mask", "is_level": "geometric", "is_low": 0.99, "is_high": 1.01},
        differs='verl\'s token and sequence rejection levels are is_level = "token" / '
        '"sequence" with is_correction = "mask".',
        kind=OPTION,
    ),
    Algorithm(
        "token TIS",
        SKYRL,
        "off_policy_correction.tis_ratio_type=token",
        {},
        {"is_correction": "truncate", "is_level": "token", "is_high": 2.0},
        kind=OPTION,
    ),
    _option(
        "geometric sequence mask",
        SKYRL,
        "off_policy_correction.sequence_mask_metric=geometric",
        peer_loss("SkyRL", "off_policy_correction.sequence_mask_metric=geometric"),
        status=DIFFERS,
        differs="SkyRL drops masked tokens from the token mean's denominator; retrain keeps "
        "them in it.",
    ),
)

# verl: loss_agg_mode = "token-mean" and dual clip (clip_ratio_c = 3) by default.
_VERL_PPO = {"policy_loss": "ppo_clip", "clip_eps": 0.2, "clip_eps_high": 0.28, "clip_ratio_c": 3.0}
_VERL_NOTE = "verl's defaults: loss_agg_mode = token-mean, dual clip c = 3."
_WHITEN = (
    "verl whitens the returns over the batch's tokens (masked_whiten), so long completions "
    "weigh more in the mean and std; retrain normalises over completions."
)


def _verl(name: str, peer_name: str, adv: str, training: Mapping[str, Any], **kw: Any) -> Algorithm:
    return Algorithm(name, VERL, peer_name, _adv(adv), {"loss_agg": "token_mean", **training}, **kw)


_VERL_ROWS: tuple[Algorithm, ...] = (
    _verl(
        "PPO clip + GRPO",
        "policy_loss.loss_mode=vanilla, adv_estimator=grpo",
        "grpo_std",
        _VERL_PPO,
        differs=_VERL_NOTE + ' norm_adv_by_std_in_grpo=False is advantage_mode = "grpo".',
    ),
    _verl("GSPO", "policy_loss.loss_mode=gspo", "grpo_std", {"policy_loss": "gspo"}),
    _verl("SAPO", "policy_loss.loss_mode=sapo", "grpo_std", {"policy_loss": "sapo"}),
    _verl(
        "CISPO",
        "policy_loss.loss_mode=cispo",
        "grpo_std",
        {"policy_loss": "cispo", "clip_eps": 1.0, "clip_eps_high": 4.0},
    ),
    *(
        _verl(
            name,
            f"policy_loss.loss_mode={mode}",
            adv,
            dict(peer_loss(VERL, f"policy_loss.loss_mode={mode}").settings),
            status=DIFFERS,
            differs=peer_loss(VERL, f"policy_loss.loss_mode={mode}").notes,
            loss=peer_loss(VERL, f"policy_loss.loss_mode={mode}"),
        )
        for name, mode, adv in (
            ("GPG", "gpg", "grpo"),
            ("GMPO", "geo_mean", "grpo_std"),
            ("DPPO", "dppo_tv", "grpo_std"),
        )
    ),
    Algorithm(
        "Clip-Cov",
        VERL,
        "policy_loss.loss_mode=clip_cov",
        _adv("grpo_std"),
        {**peer_loss("verl", "policy_loss.loss_mode=clip_cov").settings, "loss_agg": "token_mean"},
        DIFFERS,
        "verl selects the tokens within each micro-batch; retrain once over the step.",
        loss=peer_loss("verl", "policy_loss.loss_mode=clip_cov"),
    ),
    Algorithm(
        "KL-Cov",
        VERL,
        "policy_loss.loss_mode=kl_cov",
        _adv("grpo_std"),
        {**peer_loss("verl", "policy_loss.loss_mode=kl_cov").settings, "loss_agg": "token_mean"},
        DIFFERS,
        "verl selects the tokens within each micro-batch; retrain once over the step.",
        loss=peer_loss("verl", "policy_loss.loss_mode=kl_cov"),
    ),
    _verl("RLOO", "adv_estimator=rloo", "rloo", _VERL_PPO, differs=_VERL_NOTE),
    _verl(
        "REINFORCE++",
        "adv_estimator=reinforce_plus_plus",
        "reinforce_pp",
        _VERL_PPO,
        status=DIFFERS,
        differs=_WHITEN + " verl also puts a KL penalty in the reward when use_kl_in_reward.",
    ),
    _verl(
        "REINFORCE++-baseline",
        "adv_estimator=reinforce_plus_plus_baseline",
        "reinforce_pp_baseline",
        _VERL_PPO,
        status=DIFFERS,
        differs=_WHITEN,
    ),
    Algorithm(
        "ReMax",
        VERL,
        "adv_estimator=remax",
        {},
        {},
        status=NOT_REPRODUCED,
        differs="Not built: its baseline is the reward of an extra greedy completion per "
        "prompt, a second rollout at other sampling settings that the step does not draw.",
    ),
    _verl(
        "OPO",
        "adv_estimator=opo",
        "opo",
        _VERL_PPO,
        differs='Needs [algorithm] advantage_mode = "opo" (the length-weighted group baseline).',
    ),
    _verl(
        "DAPO",
        "recipe/dapo: filter_groups, overlong_buffer, clip_ratio_high=0.28",
        "grpo_std",
        {
            "policy_loss": "ppo_clip",
            "clip_eps": 0.2,
            "clip_eps_high": 0.28,
            "dynamic_sampling": True,
            "max_tokens": 20480,  # the recipe's max_response_length
            "overlong_buffer": 4096,
            "overlong_penalty": 1.0,
        },
        differs="Dynamic sampling keeps sampling until the step has batch_size informative "
        "groups (bounded by dynamic_sampling_max_rounds); overlong_buffer is in tokens.",
    ),
)

_PRIME_ROWS: tuple[Algorithm, ...] = (
    Algorithm(
        "prime-rl default (DPPO + KL)",
        PRIME,
        "trainer.loss (type = default)",
        _adv("grpo"),
        {
            **peer_loss(PRIME_LOSS, "trainer.loss (type = default)").settings,
            "loss_agg": "token_mean",
        },
        DIFFERS,
        peer_loss(PRIME_LOSS, "trainer.loss (type = default)").notes,
        ALGORITHM,
        peer_loss(PRIME_LOSS, "trainer.loss (type = default)"),
    ),
    Algorithm(
        "GRPO advantage",
        PRIME,
        "advantage=grpo",
        _adv("grpo"),
        {},
        differs="prime-rl subtracts the group mean without a std scale.",
    ),
    Algorithm("MaxRL advantage", PRIME, "advantage=max_rl", _adv("maxrl"), {}),
    Algorithm(
        "mismatch_kl",
        PRIME,
        "metric mismatch_kl",
        {},
        {},
        SAME,
        "A metric, not a setting: every step row of a local run carries mismatch_kl (the k3 "
        "estimate of the sampler-trainer KL over the step's tokens), with log_ratio_mean "
        "and log_ratio_max_abs of the same log ratio.",
        METRIC,
    ),
    Algorithm(
        "difficulty-pool curriculum",
        PRIME,
        "buffer easy/hard pools",
        {},
        {},
        NOT_REPRODUCED,
        "retrain has no curriculum: the data order is a fixed shuffle. Dynamic sampling "
        "(dropping all-equal groups) is the nearest setting.",
    ),
)

_SKYRL_PPO = {"policy_loss": "ppo_clip", "clip_ratio_c": 3.0, "loss_agg": "token_mean"}
_SKYRL_ROWS: tuple[Algorithm, ...] = (
    Algorithm("dual clip", SKYRL, "policy_loss_type=dual_clip", _adv("grpo_std"), _SKYRL_PPO),
    Algorithm(
        "GSPO",
        SKYRL,
        "policy_loss_type=gspo",
        _adv("grpo_std"),
        {"policy_loss": "gspo", "loss_agg": "seq_mean_token_mean"},
    ),
    Algorithm(
        "CISPO",
        SKYRL,
        "policy_loss_type=cispo",
        _adv("grpo_std"),
        {"policy_loss": "cispo", "clip_eps": 1.0, "clip_eps_high": 4.0, "loss_agg": "token_mean"},
    ),
    Algorithm(
        "SAPO",
        SKYRL,
        "policy_loss_type=sapo",
        _adv("grpo_std"),
        {"policy_loss": "sapo", "loss_agg": "seq_mean_token_mean"},
    ),
    Algorithm(
        "Clip-Cov",
        SKYRL,
        "policy_loss_type=clip_cov",
        _adv("grpo_std"),
        {"policy_loss": "clip_cov", "loss_agg": "token_mean"},
        DIFFERS,
        "SkyRL selects within each micro-batch; retrain once over the step.",
    ),
    Algorithm(
        "KL-Cov",
        SKYRL,
        "policy_loss_type=kl_cov",
        _adv("grpo_std"),
        {"policy_loss": "kl_cov", "loss_agg": "token_mean"},
        DIFFERS,
        "SkyRL selects within each micro-batch; retrain once over the step.",
    ),
    Algorithm("RLOO", SKYRL, "advantage_estimator=rloo", _adv("rloo"), _SKYRL_PPO),
    Algorithm(
        "REINFORCE++",
        SKYRL,
        "advantage_estimator=reinforce++",
        _adv("reinforce_pp"),
        _SKYRL_PPO,
        DIFFERS,
        "SkyRL whitens over the batch's tokens; retrain over completions.",
    ),
)

_RETRAIN_IS = {"policy_loss": "is", "loss_agg": "token_mean"}
_RETRAIN_ROWS: tuple[Algorithm, ...] = (
    Algorithm(
        "REINFORCE++",
        ORIGINAL,
        'algorithm_mode = "reinforce_pp_none"',
        _adv("reinforce_pp"),
        _RETRAIN_IS,
    ),
    # The original's defaults: maxrl + gtpo_sepa, the `is` loss, token_mean.
    Algorithm("Clip-Cov", ORIGINAL, 'policy_loss = "clip_cov"', {}, {"policy_loss": "clip_cov"}),
    Algorithm("KL-Cov", ORIGINAL, 'policy_loss = "kl_cov"', {}, {"policy_loss": "kl_cov"}),
    Algorithm(
        "reward-tie diagnostics",
        ORIGINAL,
        "metrics of groups whose rewards tie",
        {},
        {},
        DIFFERS,
        "A metric: retrain logs skipped_all_correct and skipped_all_wrong every step (the "
        "groups whose rewards all tie, which carry no signal).",
        METRIC,
    ),
    Algorithm(
        "MaxRL + GTPO + SEPA",
        RETRAIN,
        "default",
        {"advantage_mode": "maxrl", "transform_mode": "gtpo_sepa"},
        _RETRAIN_IS,
    ),
    Algorithm(
        "MaxRL + GTPO",
        RETRAIN,
        'algorithm_mode = "maxrl_gtpo"',
        {"advantage_mode": "maxrl", "transform_mode": "gtpo"},
        _RETRAIN_IS,
    ),
    Algorithm(
        "MaxRL + GTPO + HICRA",
        RETRAIN,
        'algorithm_mode = "maxrl_gtpo_hicra"',
        {"advantage_mode": "maxrl", "transform_mode": "gtpo_hicra"},
        _RETRAIN_IS,
    ),
)

ALGORITHMS: tuple[Algorithm, ...] = (
    _TRL_ROWS + _VERL_ROWS + _PRIME_ROWS + _SKYRL_ROWS + _RETRAIN_ROWS + _OPTIONS
)

# ----------------------------------------------------------------------------- naming a config

# Features a correction or mask row (kind OPTION) stands for; the others make the recipe.
_OPTION_FEATURES = ("correction", "mask_truncated")


def _modes(config: Config) -> tuple[str, str] | None:
    """(advantage_mode, transform_mode) with aliases resolved; None for a plugin
    algorithm_mode (no row names a user's own pipeline)."""
    a = config.algorithm
    adv, tx = a.advantage_mode, a.transform_mode
    if a.algorithm_mode:
        entry = ALGORITHM_MODES.entry(a.algorithm_mode)
        if entry is None or not entry.alias_of:
            return None
        adv, tx = entry.alias_of
    return ADVANTAGE_MODES.canonical(adv), tx


def _on(section: Any, key: str) -> bool:
    # Keys a build may not have yet (batch shaping) count as off there.
    return bool(getattr(section, key, False))


def _correction(t: Any) -> tuple[str, ...]:
    if t.tis_cap > 0:  # the same as is_correction = "truncate" at the token level
        return ("truncate", "token")
    return ("none",) if t.is_correction == "none" else (t.is_correction, t.is_level)


def features(config: Config) -> dict[str, Any] | None:
    """What makes the config one algorithm or another: the estimator, the objective and
    its aggregation, and which parts are on. Parameter values (clip ranges, temperatures,
    fractions, coefficients) are left out: they tune an algorithm, not change it. None
    for a pipeline no row can name (a plugin algorithm_mode)."""
    modes = _modes(config)
    if modes is None:
        return None
    t = config.training
    return {
        "advantage_mode": modes[0],
        "transform_mode": modes[1],
        "policy_loss": t.policy_loss,
        "loss_agg": t.loss_agg,
        "ratio_level": t.ratio_level if t.policy_loss in ("cispo", "sapo") else "",
        "dual_clip": t.policy_loss in ("ppo_clip", "gspo") and t.clip_ratio_c > 0,
        "kl": t.kl_estimator if t.kl_coef > 0 else "off",
        "adv_clip": t.adv_clip_max > 0,
        "dynamic_sampling": _on(t, "dynamic_sampling"),
        "overlong": _on(t, "overlong_buffer") and _on(t, "overlong_penalty"),
        "correction": _correction(t),
        "mask_truncated": _on(t, "mask_truncated"),
    }


def load_row(row: Algorithm) -> Config:
    """The config a row's settings make (the schema's defaults elsewhere); ConfigError
    when this build does not accept them (a key or name not built here)."""
    return config_from_dict(row.toml())


@functools.cache
def _table() -> tuple[tuple[Algorithm, dict[str, Any] | None], ...]:
    """Each row with its features; None for a row this build cannot load."""
    out = []
    for row in ALGORITHMS:
        found = None
        if row.reproduced:
            try:
                found = features(load_row(row))
            except ConfigError:
                found = None
        out.append((row, found))
    return tuple(out)


@functools.cache
def _default_features() -> dict[str, Any]:
    found = features(config_from_dict({}))
    assert found is not None  # the defaults use built-in modes
    return found


def _option_keys(found: dict[str, Any]) -> list[str]:
    default = _default_features()
    return [k for k in _OPTION_FEATURES if found[k] != default[k]]


def identify(config: Config) -> list[Algorithm]:
    """The rows the config amounts to: the recipes whose features equal its own, then
    the corrections and masks it adds. [] when no recipe matches, or when it turns on a
    correction no row names (a partial name would mislead)."""
    have = features(config)
    if have is None:
        return []
    options = [
        row
        for row, found in _table()
        if row.kind == OPTION and found and all(have[k] == found[k] for k in _option_keys(found))
    ]
    covered = {
        k for row, found in _table() if row in options and found for k in _option_keys(found)
    }
    if any(k not in covered for k in _option_keys(have)):
        return []
    recipe = [k for k in have if k not in _OPTION_FEATURES]
    recipes = [
        row
        for row, found in _table()
        if row.kind == ALGORITHM and found and all(have[k] == found[k] for k in recipe)
    ]
    return recipes + options if recipes else []


def describe(rows: list[Algorithm]) -> str:
    """`DAPO loss (TRL 1.16 loss_type=dapo) = ... + TIS (...)`; "" for no rows."""
    recipes = [r.label for r in rows if r.kind == ALGORITHM]
    options: dict[tuple, list[str]] = {}  # the same correction under several names
    for row in (r for r in rows if r.kind == OPTION):
        found = next(f for r, f in _table() if r is row) or {}
        options.setdefault(tuple(found.get(k) for k in _OPTION_FEATURES), []).append(row.label)
    text = " = ".join(recipes) + "".join(f" + {' = '.join(o)}" for o in options.values())
    if any(r.status == DIFFERS for r in rows):
        text += " (differs in part: retrain man --topic algorithms)"
    return text


# ----------------------------------------------------------------------------- the manual's table


def _value(value: Any) -> str:
    from retrain.config.toml_writer import value_to_toml

    return value_to_toml(value)


def settings_text(row: Algorithm) -> str:
    """The row's settings as `[table] key = value` items, for the table's cells."""
    if not row.reproduced:
        return "-"
    return (
        "; ".join(
            f"`{key} = {_value(value)}`"
            for keys in row.toml().values()
            for key, value in keys.items()
        )
        or "(the defaults)"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _notes(row: Algorithm) -> str:
    text = row.differs
    if row.checked_by:
        text += (" " if text else "") + "Loss checked against the peer's own (`-m trl`)."
    return text


def render_markdown() -> str:
    """The map as one markdown table per peer (the manual's and docs' generated block)."""
    keys = {f.key for f in table_fields("algorithm")} | {f.key for f in table_fields("training")}
    out: list[str] = []
    for peer in dict.fromkeys(row.peer for row in ALGORITHMS):
        out += [
            f"#### {peer}",
            "",
            "| Algorithm | Their name | retrain settings | Status | Notes |",
        ]
        out.append("|---|---|---|---|---|")
        for row in (r for r in ALGORITHMS if r.peer == peer):
            kind = "" if row.kind == ALGORITHM else f" ({row.kind})"
            out.append(
                f"| {_cell(row.name)}{kind} | `{_cell(row.peer_name)}` | "
                f"{_cell(settings_text(row))} | {row.status} | {_cell(_notes(row))} |"
            )
        out.append("")
    unknown = sorted({k for row in ALGORITHMS for t in row.toml().values() for k in t} - keys)
    if unknown:  # keys being added by other changes: say so, never pretend they work
        out.append(
            "Keys not in this build yet (rows that use them load once they are): "
            + ", ".join(f"`{k}`" for k in unknown)
            + "."
        )
    return "\n".join(out).rstrip("\n")
