"""The training objective, as pure functions of per-token tensors (`retrain man --topic
loss`). torch is imported by the functions that take tensors, so the constants, the
records and the numpy helpers stay light.

    records.py      LossInputs -> objective -> TokenLoss; LossOutputs, LossStats
    objectives.py   the built-in policy losses `is` and `ppo_clip` (the targets of
                    retrain.registry.OBJECTIVES, `[training] policy_loss`)
    compose.py      LossFn: an objective resolved once, composed with advantage
                    clipping, truncated IS, the KL penalty and the aggregation
    aggregation.py  the per-completion weights of `[training] loss_agg`

The composition root (retrain/build.py) resolves the configured objective once
(`resolve_objective(policy_loss)`, into LocalSettings.loss) and the backend calls the
LossFn on every micro-batch:

    loss_fn = resolve_objective(policy_loss, search_paths)
    out = loss_fn(LossInputs(logp, sampler_logp, advantages, mask, denominator, ...), hyper)
    out.loss.backward(); stats.add(out.stats)

A dotted-path `policy_loss` is a user objective with the built-ins' signature,
`fn(inputs: LossInputs, hyper: TrainHyper) -> TokenLoss`.
"""

from __future__ import annotations

from retrain.loss.aggregation import LOSS_AGGS, sequence_weights, token_scales
from retrain.loss.compose import KL_ESTIMATORS, LossFn, compose, kl_estimate, resolve_objective
from retrain.loss.objectives import ppo_clipped
from retrain.loss.records import LossInputs, LossOutputs, LossStats, Objective, TokenLoss

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "LossFn",
    "LossInputs",
    "LossOutputs",
    "LossStats",
    "Objective",
    "TokenLoss",
    "compose",
    "kl_estimate",
    "ppo_clipped",
    "resolve_objective",
    "sequence_weights",
    "token_scales",
]
