"""The list-based helpers the original retrain API's transforms were written with, and
its masking hook, following that API's formulas exactly (values capped at 50 first):

- :func:`gtpo_list`: w_t = max(0, 1 + beta (h_t / (mean(h) + 1e-8) - 1)),
  A_t = A w_t; A for every token when beta = 0 or mean(h) < 1e-7.
- :func:`hicra_list`: A_t + alpha |A_t| on planning tokens.
- :func:`sepa_pool_list`: execution tokens h'_t = lambda mu + (1 - lambda) h_t.
- :func:`sepa_amp_list`: execution tokens h'_t = (1 + lambda) h_t - lambda mu,
  floored at 0 when ``clamp``; mu = mean h over execution tokens, lambda clipped to
  [0, 1]; unchanged when lambda = 0 or there is no execution token.
- :func:`surprisal_mask_post_process`: the ``entropy_mask`` masking as a
  ``TransformSpec.post_process`` hook.

retrain's own vectorised kernels (:mod:`retrain.advantages.transforms`) compute the
same up to the 1e-8 in GTPO's denominator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from retrain.advantages.uncertainty import SURPRISAL_CAP as CAP


def _capped(values: Sequence[float]) -> np.ndarray:
    return np.minimum(np.asarray(values, dtype=np.float64).reshape(-1), CAP)


def _same_length(a: Sequence[Any], b: Sequence[Any], what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"Length mismatch: {what} ({len(a)}) vs planning_mask ({len(b)})")


def gtpo_list(advantage: float, surprisals: Sequence[float], beta: float = 0.1) -> list[float]:
    """Token advantages of one completion under GTPO (formula in the module docstring)."""
    h = _capped(surprisals)
    if h.size == 0:
        return []
    mean = float(h.mean())
    if beta == 0.0 or mean < 1e-7:
        return [float(advantage)] * h.size
    w = np.maximum(0.0, 1.0 + beta * (h / (mean + 1e-8) - 1.0))
    return (advantage * w).tolist()


def hicra_list(
    token_advs: Sequence[float], planning_mask: Sequence[int], alpha: float = 0.2
) -> list[float]:
    """A_t + alpha |A_t| on planning tokens, A_t elsewhere."""
    _same_length(token_advs, planning_mask, "token_advs")
    a = np.asarray(token_advs, dtype=np.float64).reshape(-1)
    if alpha == 0.0:
        return a.tolist()
    plan = np.asarray(planning_mask, dtype=bool).reshape(-1)
    return np.where(plan, a + alpha * np.abs(a), a).tolist()


def _sepa_list(
    surprisals: Sequence[float], planning_mask: Sequence[int], lambda_t: float, sign: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(capped h, exec mask, h' before any floor), or None when nothing changes."""
    _same_length(surprisals, planning_mask, "surprisals")
    lam = max(0.0, min(1.0, float(lambda_t)))
    if lam == 0.0:
        return None
    h = _capped(surprisals)
    execs = ~np.asarray(planning_mask, dtype=bool).reshape(-1)
    if not execs.any():
        return None
    mu = float(h[execs].mean())
    moved = np.where(execs, h + sign * lam * (mu - h), h)
    return h, execs, moved


def sepa_pool_list(
    surprisals: Sequence[float], planning_mask: Sequence[int], lambda_t: float
) -> list[float]:
    """Execution tokens pulled towards their mean: lambda mu + (1 - lambda) h_t."""
    out = _sepa_list(surprisals, planning_mask, lambda_t, 1.0)
    if out is None:
        return _unchanged(surprisals, lambda_t)
    return out[2].tolist()


def sepa_amp_list(
    surprisals: Sequence[float],
    planning_mask: Sequence[int],
    lambda_t: float,
    clamp: bool = False,
) -> list[float]:
    """Execution tokens pushed away from their mean: (1 + lambda) h_t - lambda mu,
    floored at 0 when `clamp`."""
    out = _sepa_list(surprisals, planning_mask, lambda_t, -1.0)
    if out is None:
        return _unchanged(surprisals, lambda_t)
    h, execs, moved = out
    if clamp:
        moved = np.where(execs, np.maximum(moved, 0.0), h)
    return moved.tolist()


def _unchanged(surprisals: Sequence[float], lambda_t: float) -> list[float]:
    # the original returns its input untouched when lambda is 0, capped otherwise
    if max(0.0, min(1.0, float(lambda_t))) == 0.0:
        return [float(x) for x in surprisals]
    return _capped(surprisals).tolist()


def mask_rho(params: Mapping[str, object], default: float = 0.0) -> float:
    """The masking fraction a hook reads: ``surprisal_mask_rho``, else the older
    ``entropy_mask_rho``, else `default`; a value that is not a number counts as 0."""
    raw = params.get("surprisal_mask_rho", params.get("entropy_mask_rho", default))
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return 0.0
    return float(raw)


def surprisal_mask_post_process(
    all_token_advs: list[list[float]],
    all_raw_surprisals: list[list[float]],
    params: Mapping[str, object],
) -> tuple[list[list[float]], dict[str, float]]:
    """Post-process hook: zero every token of the group below its top-rho threshold
    (k = max(1, int(n rho)) of the n tokens, ties kept; rho from `params`, see
    :func:`mask_rho`). Returns the advantages and ``entropy_mask_threshold`` /
    ``entropy_mask_fraction``; with rho <= 0, the input unchanged and no metrics."""
    rho = mask_rho(params)
    if rho <= 0.0:
        return all_token_advs, {}
    h = np.concatenate([np.asarray(x, dtype=np.float64) for x in all_raw_surprisals] or [[]])
    n = h.size
    if n == 0:
        return all_token_advs, {"entropy_mask_threshold": 0.0, "entropy_mask_fraction": 0.0}
    k = min(n, max(1, int(n * rho)))
    tau = float(np.partition(h, n - k)[n - k])
    out = [
        np.where(np.asarray(s, dtype=np.float64) < tau, 0.0, np.asarray(a, dtype=np.float64))
        .reshape(-1)
        .tolist()
        for a, s in zip(all_token_advs, all_raw_surprisals)
    ]
    fraction = float(np.count_nonzero(h < tau)) / n
    return out, {"entropy_mask_threshold": tau, "entropy_mask_fraction": fraction}


entropy_mask_post_process = surprisal_mask_post_process  # the original's older name
