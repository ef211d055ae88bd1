"""How the token losses l_it of a step (N tokens, G completions of lengths |o_i|) become
one number, as a per-completion weight w_i over a step-wide denominator:

    token_mean           (1/N) sum_i sum_t l_it              (DAPO's token-level loss)
    seq_mean_token_sum   (1/G) sum_i sum_t l_it              (Dr. GRPO, Liu et al. 2025:
                                                               no per-length division)
    seq_mean_token_mean  (1/G) sum_i (1/|o_i|) sum_t l_it    (GRPO, Shao et al. 2024)

so a step split into micro-batches sums to exactly the same loss and gradient. numpy
only: a backend whose service sums token losses scales the advantages instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def sequence_weights(lengths: Sequence[int], loss_agg: str) -> tuple[np.ndarray, float]:
    """(w_i per completion, denominator) of an aggregation over a whole step: the loss is
    sum_i w_i sum_t l_it / denominator."""
    lengths_arr = np.asarray(lengths, dtype=np.float64)
    ones = np.ones_like(lengths_arr)
    if loss_agg == "token_mean":
        return ones, float(lengths_arr.sum())
    if loss_agg == "seq_mean_token_sum":
        return ones, float(len(lengths_arr))
    if loss_agg == "seq_mean_token_mean":
        return 1.0 / lengths_arr, float(len(lengths_arr))
    raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")


def token_scales(lengths: Sequence[int], loss_agg: str) -> np.ndarray:
    """w_i / denominator per completion: the factor each completion's token losses get
    (a backend whose service sums token losses multiplies the advantages by it)."""
    weights, denom = sequence_weights(lengths, loss_agg)
    return weights / denom
