"""The training objective, as pure functions of per-token tensors (`retrain man --topic
loss`). torch is imported by the functions that take tensors, so the constants, the
records and the numpy helpers stay light.

    records.py      LossInputs -> objective -> TokenLoss; LossOutputs, LossStats
    objectives.py   the built-in policy losses is, ppo_clip, gspo, cispo, sapo, vespo,
                    clip_cov, kl_cov, gpg, gmpo, dppo (the targets of
                    retrain.registry.OBJECTIVES, `[training] policy_loss`)
    correction.py   the off-policy correction (tis_cap, is_correction, is_level) and the
                    mismatch_kl metric
    selection.py    the step-wide token selection of clip_cov and kl_cov (numpy)
    compose.py      LossFn: an objective resolved once, composed with advantage
                    clipping, the correction, the KL penalty and the aggregation
    aggregation.py  the per-completion weights of `[training] loss_agg`
    peers.py        the map from other trainers' loss settings (TRL, verl, prime-rl, ...)
                    to retrain's

The composition root (retrain/build.py) resolves the configured objective once
(`resolve_objective(policy_loss)`, into LocalSettings.loss) and the backend calls the
LossFn on every micro-batch:

    loss_fn = resolve_objective(policy_loss, search_paths)
    weights, denominator = step_weights(lengths_of_the_step, hyper)
    out = loss_fn(LossInputs(logp, sampler_logp, advantages, mask, denominator, ...), hyper)
    out.loss.backward(); stats.add(out.stats)

A dotted-path `policy_loss` is a user objective with the built-ins' signature,
`fn(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss`.
"""

from __future__ import annotations

from retrain.loss.aggregation import LOSS_AGGS, sequence_weights, step_weights, token_scales
from retrain.loss.compose import KL_ESTIMATORS, LossFn, compose, kl_estimate, resolve_objective
from retrain.loss.correction import IS_CORRECTIONS, IS_LEVELS, Correction
from retrain.loss.objectives import RATIO_LEVELS, cispo_clipped, ppo_clipped
from retrain.loss.records import LossInputs, LossOutputs, LossStats, Objective, TokenLoss
from retrain.loss.selection import StepTokens, covariance_selection, needs_selection

__all__ = [
    "IS_CORRECTIONS",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "LossFn",
    "LossInputs",
    "LossOutputs",
    "LossStats",
    "Objective",
    "RATIO_LEVELS",
    "StepTokens",
    "TokenLoss",
    "Correction",
    "cispo_clipped",
    "compose",
    "covariance_selection",
    "kl_estimate",
    "needs_selection",
    "ppo_clipped",
    "resolve_objective",
    "sequence_weights",
    "step_weights",
    "token_scales",
]
