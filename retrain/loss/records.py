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
    # (n, T) bool, no grad: the tokens a step-wide selection picked before the first
    # micro-batch (retrain.loss.selection: clip_cov, kl_cov); None when none ran.
    selected: Tensor | None = None

    def log_ratio(self) -> Tensor:
        """(n, T) log r = logp - sampler_logp on trained tokens, 0 elsewhere (so a pad's
        ratio is 1 and never overflows)."""
        import torch

        return torch.where(self.mask, self.logp - self.sampler_logp, torch.zeros_like(self.logp))

    def ratio(self) -> Tensor:
        """(n, T) importance ratio r = exp(logp - sampler_logp), 1 off the mask."""
        return self.log_ratio().exp()

    def lengths(self) -> Tensor:
        """(n, 1) trained tokens per completion, at least 1 (a completion is never split
        across micro-batches, so this is its whole length)."""
        return self.mask.sum(-1, keepdim=True).clamp(min=1).to(self.logp.dtype)

    def sequence_log_ratio(self) -> Tensor:
        """(n, 1) log s_i = (1/|o_i|) sum_t log r_it: the length-normalised sequence log
        ratio of GSPO (Zheng et al. 2025), with its gradient (d/dlogp_t = 1/|o_i|)."""
        return self.log_ratio().sum(-1, keepdim=True) / self.lengths()

    def sequence_ratio(self) -> Tensor:
        """(n, T) GSPO-token's ratio s_it = sg(s_i) * exp(logp_t - sg(logp_t)): the value
        s_i on every token of completion i, the gradient s_i d logp_t (GSPO-token, Zheng et
        al. 2025). With an advantage constant over the completion and equal weights for
        its tokens, the aggregated loss and its gradient are GSPO's sequence-level ones;
        with token advantages each token keeps its own. 1 off the mask."""
        import torch

        log_s = self.logp - self.logp.detach() + self.sequence_log_ratio().detach()
        return torch.where(self.mask, log_s, torch.zeros_like(log_s)).exp()


@dataclass(frozen=True, eq=False)  # tensors: == would compare elementwise
class TokenLoss:
    """What an objective returns: the loss of every token before truncated importance
    sampling, the KL penalty, the per-completion weights and the aggregation, which the
    composition (retrain.loss.compose) applies the same way to every objective."""

    per_token: Tensor  # (n, T), differentiable in inputs.logp; off-mask values ignored
    # (n, T) bool: tokens the objective clipped, counted as the metric clip_fraction
    # (a PPO-style loss: the clipped branch, no gradient; cispo: a clamped weight, the
    # token keeps a gradient; clip_cov: also the covariance-selected tokens); None = the
    # objective never clips (clip_fraction 0).
    clipped: Tensor | None = None


# The one calling convention of a policy loss, built-in or a dotted-path plugin:
# objective(inputs, hyper) -> TokenLoss, `hyper` a retrain.types.TrainHyper.
Objective = Callable[[LossInputs, "TrainHyper"], TokenLoss]


def read_numbers(values: list) -> list:
    """`values` with its 0-d tensors read as Python floats, in one transfer from their
    device (one wait, where each `float(t)` would wait again); numbers and None as given."""
    tensors = [v for v in values if hasattr(v, "detach")]
    if not tensors:
        return list(values)
    import torch

    read = iter(torch.stack([t.detach().double() for t in tensors]).tolist())
    return [next(read) if hasattr(v, "detach") else v for v in values]


@dataclass
class LossStats:
    """Sums over the trained tokens of one call (add them up across micro-batches).

    The loss leaves its sums as 0-d tensors on its device, so that a micro-batch never
    waits for the device to count them; `settled` turns them into numbers, once per step
    (`metrics` settles first)."""

    tokens: int | Tensor = 0
    clipped: float | Tensor = 0.0  # tokens the objective clipped (TokenLoss.clipped)
    kl_sum: float | Tensor | None = None  # sum of the KL estimator; None when kl_coef = 0
    # The off-policy correction (retrain.loss.correction), on every call, off included:
    # sum of k3(rho) = rho - 1 - log rho, rho = trainer/sampler
    mismatch_kl_sum: float | Tensor = 0.0
    truncated: float | Tensor = 0.0  # tokens whose importance weight was truncated
    masked: float | Tensor = 0.0  # tokens whose importance weight was masked out (their sequence's)
    # Token-level truncation (`tis_cap`, or is_correction = "truncate" at the token level)
    # is also reported under its older name; False = not on.
    token_truncation: bool = False

    def add(self, other: LossStats) -> None:
        self.tokens = self.tokens + other.tokens
        self.clipped = self.clipped + other.clipped
        if other.kl_sum is not None:
            self.kl_sum = (0.0 if self.kl_sum is None else self.kl_sum) + other.kl_sum
        self.mismatch_kl_sum = self.mismatch_kl_sum + other.mismatch_kl_sum
        self.truncated = self.truncated + other.truncated
        self.masked = self.masked + other.masked
        self.token_truncation = self.token_truncation or other.token_truncation

    def settled(self) -> LossStats:
        """These sums as Python numbers: the tensors among them read in one transfer."""
        names = ("tokens", "clipped", "kl_sum", "mismatch_kl_sum", "truncated", "masked")
        values = read_numbers([getattr(self, n) for n in names])
        fields = {n: (None if v is None else float(v)) for n, v in zip(names, values, strict=True)}
        fields["tokens"] = int(fields["tokens"])
        return LossStats(**fields, token_truncation=self.token_truncation)

    def metrics(self) -> dict[str, float]:
        """clip_fraction, mismatch_kl (k3 estimate of KL(sampler || trainer) per trained
        token), is_truncated_fraction and is_masked_fraction always; kl_mean with the KL
        penalty; tis_truncated_fraction with token-level truncation."""
        sums = self.settled()
        n = sums.tokens

        def share(x: float) -> float:
            return x / n if n else 0.0

        out = {
            "clip_fraction": share(sums.clipped),
            "mismatch_kl": share(sums.mismatch_kl_sum),
            "is_truncated_fraction": share(sums.truncated),
            "is_masked_fraction": share(sums.masked),
        }
        if sums.kl_sum is not None:
            out["kl_mean"] = share(sums.kl_sum)
        if sums.token_truncation:
            out["tis_truncated_fraction"] = share(sums.truncated)
        return out


@dataclass(frozen=True, eq=False)  # tensors: == would compare elementwise
class LossOutputs:
    """The composed loss of one micro-batch."""

    loss: Tensor  # () scalar with grad: this micro-batch's share of the step's loss
    stats: LossStats  # its token counts (add across micro-batches)
