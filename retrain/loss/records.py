"""The typed boundary of the objective: what an objective reads (LossInputs), what it
returns (TokenLoss), and what the composed loss hands back to a backend (LossOutputs,
LossStats).

A micro-batch holds n completions right-padded to T tokens. torch is imported by the
methods that build tensors, so importing the records stays cheap (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from retrain.types import TrainHyper


@dataclass(frozen=True, eq=False)  # tensors: == would compare elementwise
class LossInputs:
    """One micro-batch of per-token tensors, as an objective sees it.

    Pads and a multi-turn environment's tokens are False in `mask`: their values are
    arbitrary (0 where the backend padded) and the composed loss multiplies them out.
    The advantages an objective receives are already clipped when adv_clip_max > 0."""

    logp: Tensor  # (n, T) float32 with grad (float64 in tests): trainer logprobs
    sampler_logp: Tensor  # (n, T), no grad: the sampler's logprobs (behaviour policy)
    advantages: Tensor  # (n, T): token advantages A_it
    mask: Tensor  # (n, T) bool: True = trained on
    # The step-wide divisor of the aggregation (N tokens or G completions; see
    # retrain.loss.aggregation.sequence_weights): the same in every micro-batch, so
    # micro-batch losses add up to the step's.
    denominator: float
    seq_weights: Tensor | None = None  # (n,): w_i per completion; None = 1 (token_mean)
    ref_logp: Tensor | None = None  # (n, T), no grad: reference logprobs; kl_coef > 0 only

    def log_ratio(self) -> Tensor:
        """(n, T) log r = logp - sampler_logp on trained tokens, 0 elsewhere (so a pad's
        ratio is 1 and never overflows)."""
        import torch

        return torch.where(self.mask, self.logp - self.sampler_logp, torch.zeros_like(self.logp))

    def ratio(self) -> Tensor:
        """(n, T) importance ratio r = exp(logp - sampler_logp), 1 off the mask."""
        return self.log_ratio().exp()


@dataclass(frozen=True, eq=False)  # tensors: == would compare elementwise
class TokenLoss:
    """What an objective returns: the loss of every token before truncated importance
    sampling, the KL penalty, the per-completion weights and the aggregation, which the
    composition (retrain.loss.compose) applies the same way to every objective."""

    per_token: Tensor  # (n, T), differentiable in inputs.logp; off-mask values ignored
    # (n, T) bool: tokens whose loss took a clipped branch (no gradient), counted as
    # the metric clip_fraction; None = the objective never clips (clip_fraction 0).
    clipped: Tensor | None = None


# The one calling convention of a policy loss, built-in or a dotted-path plugin:
# objective(inputs, hyper) -> TokenLoss, `hyper` a retrain.types.TrainHyper.
Objective = Callable[[LossInputs, "TrainHyper"], TokenLoss]


@dataclass
class LossStats:
    """Sums over the trained tokens of one call (add them up across micro-batches)."""

    tokens: int = 0
    clipped: float = 0.0  # tokens whose loss took a clipped branch (no gradient)
    kl_sum: float | None = None  # sum of the KL estimator; None when kl_coef = 0
    truncated: float | None = None  # tokens whose ratio exceeded tis_cap; None when off

    def add(self, other: LossStats) -> None:
        self.tokens += other.tokens
        self.clipped += other.clipped
        if other.kl_sum is not None:
            self.kl_sum = (self.kl_sum or 0.0) + other.kl_sum
        if other.truncated is not None:
            self.truncated = (self.truncated or 0.0) + other.truncated

    def metrics(self) -> dict[str, float]:
        out = {"clip_fraction": self.clipped / self.tokens if self.tokens else 0.0}
        if self.kl_sum is not None:
            out["kl_mean"] = self.kl_sum / self.tokens if self.tokens else 0.0
        if self.truncated is not None:
            out["tis_truncated_fraction"] = self.truncated / self.tokens if self.tokens else 0.0
        return out


@dataclass(frozen=True, eq=False)  # tensors: == would compare elementwise
class LossOutputs:
    """The composed loss of one micro-batch."""

    loss: Tensor  # () scalar with grad: this micro-batch's share of the step's loss
    stats: LossStats  # its token counts (add across micro-batches)
