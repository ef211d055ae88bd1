"""How the token losses l_it of a step (N tokens, G completions of lengths |o_i|) become
one number, as a per-completion weight w_i over a step-wide denominator:

    token_mean               (1/N) sum_i sum_t l_it           (DAPO's token-level loss;
                                                                TRL's dapo)
    seq_mean_token_sum       (1/G) sum_i sum_t l_it           (Dr. GRPO, Liu et al. 2025:
                                                                no per-length division)
    seq_mean_token_mean      (1/G) sum_i (1/|o_i|) sum_t l_it (GRPO, Shao et al. 2024)
    seq_mean_token_sum_norm  (1/(G L)) sum_i sum_t l_it       (Dr. GRPO with its constant
                                                                L = [training] max_tokens, the
                                                                generation budget: TRL's dr_grpo)
    bnpo                     (1/K) sum_b (1/N_b) sum_{i in b} sum_t l_it
                                                              (TRL's bnpo: a token mean per
                                                                local batch, averaged)

For bnpo the step is cut into K local batches b of `bnpo_batch_size` consecutive
completions (N_b trained tokens each; the last may be shorter): TRL normalises each
device's batch of `per_device_train_batch_size` completions by its own tokens and averages
those means over gradient accumulation (and devices). In retrain the local batches are
this fixed partition of the step, never the memory-driven micro-batches, so the loss does
not depend on the split; `bnpo_batch_size = 0` makes the step one batch (then bnpo is
token_mean) and 1 makes it GRPO's per-completion mean.

Every form is sum_i w_i sum_t l_it / denominator, so a step split into micro-batches sums
to exactly the same loss and gradient. numpy only: a backend whose service sums token
losses scales the advantages instead (token_scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from retrain.types import TrainHyper

LOSS_AGGS = (
    "token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "bnpo",
)


def sequence_weights(
    lengths: Sequence[int], loss_agg: str, *, max_tokens: int = 0, batch_size: int = 0
) -> tuple[np.ndarray, float]:
    """(w_i per completion, denominator) of an aggregation over a whole step: the loss is
    sum_i w_i sum_t l_it / denominator. `max_tokens` is seq_mean_token_sum_norm's constant
    L, `batch_size` bnpo's completions per local batch (0 = the whole step)."""
    lengths_arr = np.asarray(lengths, dtype=np.float64)
    ones = np.ones_like(lengths_arr)
    if loss_agg == "token_mean":
        return ones, float(lengths_arr.sum())
    if loss_agg == "seq_mean_token_sum":
        return ones, float(len(lengths_arr))
    if loss_agg == "seq_mean_token_mean":
        return 1.0 / lengths_arr, float(len(lengths_arr))
    if loss_agg == "seq_mean_token_sum_norm":
        if max_tokens <= 0:
            raise ValueError("loss_agg 'seq_mean_token_sum_norm' needs max_tokens > 0 (its L)")
        return ones, float(len(lengths_arr)) * max_tokens
    if loss_agg == "bnpo":
        return _bnpo_weights(lengths_arr, batch_size)
    raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")


def _bnpo_weights(lengths: np.ndarray, batch_size: int) -> tuple[np.ndarray, float]:
    """w_i = 1 / N_b(i) over K local batches of `batch_size` consecutive completions,
    denominator K (N_b at least 1, as TRL clamps it); one batch: token_mean's exact form."""
    size = len(lengths)
    if batch_size <= 0 or batch_size >= size:
        return np.ones_like(lengths), float(lengths.sum())
    starts = np.arange(0, size, batch_size)
    tokens = np.maximum(np.add.reduceat(lengths, starts), 1.0)
    return 1.0 / np.repeat(tokens, batch_size)[:size], float(len(starts))


def step_weights(lengths: Sequence[int], hyper: TrainHyper) -> tuple[np.ndarray, float]:
    """sequence_weights with the settings of `hyper` (loss_agg, max_tokens,
    bnpo_batch_size)."""
    return sequence_weights(
        lengths, hyper.loss_agg, max_tokens=hyper.max_tokens, batch_size=hyper.bnpo_batch_size
    )


def token_scales(
    lengths: Sequence[int], loss_agg: str, *, max_tokens: int = 0, batch_size: int = 0
) -> np.ndarray:
    """w_i / denominator per completion: the factor each completion's token losses get
    (a backend whose service sums token losses multiplies the advantages by it)."""
    weights, denom = sequence_weights(
        lengths, loss_agg, max_tokens=max_tokens, batch_size=batch_size
    )
    return weights / denom
