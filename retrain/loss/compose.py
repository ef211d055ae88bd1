"""The loss of a micro-batch: a policy loss (an objective) with the parts every objective
shares composed around it once, here:

    A_t   <- clip(A_t, -adv_clip_max, adv_clip_max)       when adv_clip_max > 0
    l_t    = objective(inputs, hyper).per_token             (is, ppo_clip, gspo, cispo, sapo,
                                                             vespo, clip_cov, kl_cov, gpg,
                                                             gmpo, dppo, a dotted path)
    l_t   *= c_t                                            the off-policy correction
            (retrain.loss.correction: the trainer/sampler importance weight truncated or
            masked at the token, sequence or geometric level; `tis_cap` is token-level
            truncation, c_t = min(1, tis_cap / r_t), Yao et al. 2025); c = 1 when off
    l_t   += kl_coef * k(logp_t - logp_ref_t)               when kl_coef > 0
    loss   = sum_i w_i sum_t mask_it l_it / denominator     (the aggregation's weights)

The KL estimators are Schulman's ("Approximating KL Divergence", 2020) of KL(pi || ref)
on tokens sampled from pi, d = logp - logp_ref:

    k1 = d,   k2 = d^2 / 2,   k3 = exp(-d) + d - 1

An objective is resolved once per run (:func:`resolve_objective`, from `[training]
policy_loss`) into a :class:`LossFn`, which a backend calls on every micro-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from retrain.errors import PluginError
from retrain.loss.correction import Correction, apply_correction, mismatch_kl_sum
from retrain.loss.records import LossInputs, LossOutputs, LossStats, Objective, TokenLoss

if TYPE_CHECKING:
    from torch import Tensor

    from retrain.types import TrainHyper

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class LossFn:
    """A policy loss resolved once: `loss_fn(inputs, hyper) -> LossOutputs` composes its
    objective with the shared parts (:func:`compose`)."""

    name: str  # the `[training] policy_loss` it was resolved from
    objective: Objective

    def __call__(self, inputs: LossInputs, hyper: TrainHyper) -> LossOutputs:
        return compose(self.objective, inputs, hyper)


def resolve_objective(name: str, search_paths: Iterable[str] = ()) -> LossFn:
    """The policy loss `name` (a built-in of retrain.registry.OBJECTIVES or a dotted path
    `pkg.mod.fn`, imported from `search_paths` or the working directory), checked to
    take (inputs, hyper)."""
    from retrain.registry import OBJECTIVES

    fn = OBJECTIVES.resolve(name, search_paths)
    if not callable(fn):
        raise PluginError(f"[training] policy_loss {name!r} is not callable: {fn!r}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise PluginError(
            f"[training] policy_loss {name!r} has the signature {inspect.signature(fn)}; an "
            "objective is fn(inputs: retrain.loss.LossInputs, hyper: retrain.types.TrainHyper) "
            "-> retrain.loss.TokenLoss (retrain man --topic loss)"
        ) from None
    except ValueError:  # no signature to read (a builtin): let the call tell
        pass
    return LossFn(name, fn)


def compose(objective: Objective, inputs: LossInputs, hyper: TrainHyper) -> LossOutputs:
    """The loss of one micro-batch and its statistics (formulas: the module docstring).
    `hyper` supplies adv_clip_max, the correction (tis_cap, is_*), kl_coef and
    kl_estimator here; the objective reads what it needs (clip_eps, ...). With the
    defaults and `is` the loss is exactly -(1/N) sum A exp(logp - logp_sampler), in that
    order of operations."""
    if hyper.adv_clip_max > 0:
        bound = hyper.adv_clip_max
        inputs = replace(inputs, advantages=inputs.advantages.clamp(-bound, bound))
    correction = Correction.from_hyper(hyper)
    terms = _checked(objective(inputs, hyper), inputs, objective)
    mask = inputs.mask
    # The statistics stay tensors on the loss's device (LossStats): the backend reads them
    # once per step, so a micro-batch never waits for the device to count them.
    stats = LossStats(tokens=mask.sum(), token_truncation=correction.token_truncation)
    if terms.clipped is not None:
        stats.clipped = (terms.clipped & mask).sum()
    stats.mismatch_kl_sum = mismatch_kl_sum(inputs)
    per_token, stats.truncated, stats.masked = apply_correction(terms.per_token, inputs, correction)
    if hyper.kl_coef > 0:
        per_token, stats.kl_sum = kl_penalty(per_token, inputs, hyper.kl_coef, hyper.kl_estimator)
    if inputs.seq_weights is not None:
        per_token = per_token * inputs.seq_weights[:, None]
    return LossOutputs((per_token * mask).sum() / inputs.denominator, stats)


def kl_penalty(
    per_token: Tensor, inputs: LossInputs, coef: float, estimator: str
) -> tuple[Tensor, Tensor]:
    """(l_t + coef * k(d_t), sum of k over the trained tokens: a 0-d tensor), d = logp -
    logp_ref."""
    import torch

    if inputs.ref_logp is None:
        raise ValueError("kl_coef > 0 needs the reference logprobs (LossInputs.ref_logp)")
    logp, mask = inputs.logp, inputs.mask
    kl = kl_estimate(torch.where(mask, logp - inputs.ref_logp, torch.zeros_like(logp)), estimator)
    return per_token + coef * kl, torch.where(mask, kl.detach(), 0.0).sum()


def kl_estimate(log_ratio_ref: Tensor, estimator: str) -> Tensor:
    """Schulman's k1/k2/k3 estimator of KL(pi || ref) per token, d = logp - logp_ref."""
    d = log_ratio_ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (-d).exp() + d - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def _checked(terms: Any, inputs: LossInputs, objective: Objective) -> TokenLoss:
    """`terms` when it is a TokenLoss of the batch's shape; a dotted-path objective that
    returns anything else fails here, naming itself, instead of broadcasting silently."""
    where = (
        f"{getattr(objective, '__module__', '?')}.{getattr(objective, '__qualname__', objective)}"
    )
    if not isinstance(terms, TokenLoss):
        raise PluginError(
            f"policy loss {where} returned {type(terms).__name__}; an objective returns "
            "retrain.loss.TokenLoss(per_token, clipped=None)"
        )
    shape = tuple(inputs.logp.shape)
    for field, value in (("per_token", terms.per_token), ("clipped", terms.clipped)):
        if value is not None and tuple(getattr(value, "shape", ())) != shape:
            raise PluginError(
                f"policy loss {where} returned {field} of shape "
                f"{tuple(getattr(value, 'shape', ()))}; expected {shape}, the shape of logp"
            )
    return terms
