"""Token-level transforms: from one advantage per completion to one per token.

Per completion i with episode advantage A_i, uncertainties h_t and planning mask plan_t:

- ``none``: A_t = A_i.
- ``gtpo``: m = mean(h) over the completion; w_t = max(0, 1 + beta (h_t / m - 1));
  A_t = A_i w_t. With beta = 0, or m < 1e-7, every token gets A_i.
- ``gtpo_hicra``: GTPO, then A_t += alpha |A_t| plan_t; execution tokens are
  untouched. alpha must lie in [-1, 1]: a planning token's advantage becomes
  A_t (1 + alpha) or A_t (1 - alpha) by sign, so a larger alpha would flip negative
  advantages positive (alpha = 1 zeroes them; alpha < 1 never changes a sign).
- ``gtpo_sepa``: SEPA pools the execution tokens' uncertainty towards their mean,
  h'_t = lambda mean_exec(h) + (1 - lambda) h_t where plan_t = 0 (planning tokens keep
  h_t), then GTPO runs on h'.
- ``gtpo_sepa_amp``: SEPA amplification, the opposite push: execution tokens move away
  from their mean, h'_t = h_t + lambda (h_t - mean_exec(h)) = (1 + lambda) h_t -
  lambda mean_exec(h) (planning tokens keep h_t), then GTPO on h'. Like pooling it keeps
  each completion's sum of h, hence GTPO's mean; h' may be negative (GTPO's weight is
  clipped at 0 anyway).
- ``gtpo_sepa_amp_c``: the same with h'_t floored at 0 on execution tokens,
  h'_t = max(0, (1 + lambda) h_t - lambda mean_exec(h)); the floor raises the
  completion's mean, which GTPO then uses. lambda = 0 is plain GTPO for all three.
- ``entropy_mask``: GTPO, then the surprisal mask (Yue et al.'s top-rho tokens) over
  each prompt group, rho = ``[algorithm] surprisal_mask_rho``: with n the group's
  token count and k = max(1, int(n rho)), the threshold tau is the k-th largest h of
  the group (h before any SEPA change), tokens with h >= tau keep their advantage
  (ties included, so more than k may stay) and the others get exactly 0. Logged per
  step, averaged over groups: ``entropy_mask_threshold`` (tau; 0 for a group without
  tokens) and ``entropy_mask_fraction`` (the share of the group's tokens zeroed).
  rho = 0 disables the mask (plain GTPO, no metrics); rho = 1 keeps every token.

The work is done by *flat kernels* that see every token of many completions at once,
concatenated into one array and described by :class:`Segments` (each completion's start
and length); per-completion sums use ``np.add.reduceat`` / ``np.bincount`` and
per-completion values are broadcast back to the tokens (``np.repeat``, or one slice
fill per completion into a reused buffer), so there is no per-token Python loop. Within a completion GTPO's weight is affine in h, so it is computed as
max(0, (beta / m_i) h_t + 1 - beta); planning tokens are handled through their flat
indices (they are few), and large temporaries live in a reused :class:`Workspace`. The
``transform_*`` functions are the registry targets: they take a
:class:`~retrain.advantages.context.TransformContext` like any plugin. The pipeline does
not call them: each registry entry names its kernel mode (``Entry.kernel``), which the
pipeline runs on a whole batch at once through :func:`token_advantages_flat`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from retrain.advantages.context import TransformContext, TransformOutput

GTPO_MIN_MEAN = 1e-7
_FILL_MIN_AVG_LENGTH = 64  # see Segments.repeat
BUILTIN_TRANSFORMS = (
    "none",
    "gtpo",
    "gtpo_hicra",
    "gtpo_sepa",
    "gtpo_sepa_amp",
    "gtpo_sepa_amp_c",
    "entropy_mask",
)
# The sign of lambda in the affine fold of each SEPA variant (see token_advantages_flat).
_SEPA_SIGN = {"gtpo_sepa": 1.0, "gtpo_sepa_amp": -1.0}


class Workspace:
    """Scratch buffers reused from call to call (one set per thread).

    A step's token arrays are megabytes; allocating fresh temporaries for each of them
    on every call makes the allocator hand memory back to the OS and fault it in
    again, which costs more than the arithmetic. Buffers only grow; nothing in them
    outlives a call or is ever returned to the caller.
    """

    _local = threading.local()

    @classmethod
    def get(cls, name: str, size: int, dtype: type = np.float64) -> np.ndarray:
        pool = getattr(cls._local, "pool", None)
        if pool is None:
            pool = cls._local.pool = {}
        buf = pool.get(name)
        if buf is None or buf.size < size or buf.dtype != np.dtype(dtype):
            buf = np.empty(max(size, 1024), dtype=dtype)
            pool[name] = buf
        return buf[:size]


@dataclass(frozen=True)
class Segments:
    """The layout of completions concatenated into one flat token array."""

    lengths: np.ndarray  # (C,) int64, tokens per completion
    starts: np.ndarray  # (C,) int64, index of each completion's first token
    total: int

    @classmethod
    def from_lengths(cls, lengths: Sequence[int] | np.ndarray) -> Segments:
        lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if lens.size and lens.min() < 0:
            raise ValueError("completion lengths must be >= 0")
        starts = np.zeros(lens.size, dtype=np.int64)
        if lens.size > 1:
            np.cumsum(lens[:-1], out=starts[1:])
        return cls(lens, starts, int(lens.sum()))

    @property
    def count(self) -> int:
        return int(self.lengths.size)

    def sum(self, x: np.ndarray) -> np.ndarray:
        """Per-completion sums of a flat array (0 for empty completions)."""
        out = np.zeros(self.count, dtype=np.float64)
        if self.total == 0:
            return out
        nonempty = self.lengths > 0
        if nonempty.all():
            out[:] = np.add.reduceat(x, self.starts)
        else:
            # Dropping empty completions leaves each kept start at the previous kept
            # completion's end, which is exactly what reduceat needs.
            out[nonempty] = np.add.reduceat(x, self.starts[nonempty])
        return out

    def segment_of(self, token_index: np.ndarray) -> np.ndarray:
        """The completion each flat token index belongs to."""
        return np.searchsorted(self.starts, token_index, side="right") - 1

    def sum_at(self, token_index: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Per-completion sums of `values`, given at the flat positions `token_index`."""
        if token_index.size == 0:
            return np.zeros(self.count, dtype=np.float64)
        return np.bincount(self.segment_of(token_index), weights=values, minlength=self.count)

    def repeat(self, per_completion: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Broadcast one value per completion to each of its tokens, into `out` if given.

        With long completions (the usual case) `out` is filled one slice per completion,
        which costs a few hundred nanoseconds per completion and needs no temporary; with
        many short ones a single np.repeat is cheaper."""
        if out is None:
            return np.repeat(per_completion, self.lengths)
        if self.count * _FILL_MIN_AVG_LENGTH <= self.total:
            for start, length, value in zip(
                self.starts.tolist(), self.lengths.tolist(), np.asarray(per_completion).tolist()
            ):
                out[start : start + length] = value
        else:
            out[:] = np.repeat(per_completion, self.lengths)
        return out

    def split(self, x: np.ndarray) -> list[np.ndarray]:
        """Cut a flat array back into one array per completion (views of `x`)."""
        starts = self.starts.tolist()
        ends = (self.starts + self.lengths).tolist()
        return [x[s:e] for s, e in zip(starts, ends)]


def _check_finite(name: str, value: float) -> float:
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def check_sepa_lambda(sepa_lambda: float) -> float:
    lam = _check_finite("sepa_lambda", sepa_lambda)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"sepa_lambda must be in [0, 1], got {lam}")
    return lam


def check_hicra_alpha(hicra_alpha: float) -> float:
    alpha = _check_finite("hicra_alpha", hicra_alpha)
    if not -1.0 <= alpha <= 1.0:
        raise ValueError(
            f"hicra_alpha must be in [-1, 1], got {alpha}: a larger alpha would flip the sign "
            "of negative advantages on planning tokens"
        )
    return alpha


def _plan_index(planning: np.ndarray | None, plan_index: np.ndarray | None) -> np.ndarray:
    if plan_index is not None:
        return plan_index
    if planning is None:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(planning)


def _gtpo_coefficients(
    seg: Segments, beta: float, segment_sums: np.ndarray
) -> tuple[np.ndarray, float, np.ndarray]:
    """GTPO's weight is affine in h within a completion: w = slope_i h + (1 - beta).
    Returns (slope per completion, intercept, uniform flag per completion)."""
    mean = segment_sums / np.maximum(seg.lengths, 1)
    uniform = (mean < GTPO_MIN_MEAN) | (seg.lengths == 0)
    slope = beta / np.where(uniform, 1.0, mean)
    slope[uniform] = 0.0
    return slope, 1.0 - beta, uniform


def _fix_uniform(w: np.ndarray, seg: Segments, uniform: np.ndarray, value: np.ndarray) -> None:
    """Set every token of the `uniform` completions to value[i] (rare: tiny mean h)."""
    for i in np.flatnonzero(uniform & (seg.lengths > 0)):
        s = seg.starts[i]
        w[s : s + seg.lengths[i]] = value[i]


def gtpo_weights(h: np.ndarray, seg: Segments, beta: float) -> np.ndarray:
    """w_t = max(0, 1 + beta (h_t / m_i - 1)), m_i the mean of h over completion i;
    w = 1 for every token of a completion whose m_i < 1e-7, and everywhere when beta = 0."""
    beta = _check_finite("gtpo_beta", beta)
    if beta == 0.0 or seg.total == 0:
        return np.ones(seg.total, dtype=np.float64)
    slope, intercept, uniform = _gtpo_coefficients(seg, beta, seg.sum(h))
    w = seg.repeat(slope)
    w *= h
    w += intercept
    np.maximum(w, 0.0, out=w)
    if uniform.any():
        _fix_uniform(w, seg, uniform, np.ones(seg.count))
    return w


def _exec_means(h: np.ndarray, idx: np.ndarray, seg: Segments, sums: np.ndarray) -> np.ndarray:
    """Mean h over the execution tokens of each completion (0 where there are none);
    `idx` are the planning tokens' flat indices, `sums` the sum of h per completion."""
    exec_count = seg.lengths - np.bincount(seg.segment_of(idx), minlength=seg.count)
    return (sums - seg.sum_at(idx, h[idx])) / np.maximum(exec_count, 1)


def _sepa_gtpo_weights(
    h: np.ndarray, idx: np.ndarray, seg: Segments, sums: np.ndarray, beta: float, lam: float
) -> np.ndarray:
    """GTPO weights after SEPA pooling with strength `lam` (0: plain GTPO; a negative
    `lam` is amplification by -lam), in a reused buffer; `idx` are the planning tokens'
    flat indices, `sums` the sum of h per completion. See :func:`token_advantages_flat`
    for how pooling folds into the weight."""
    slope, intercept, uniform = _gtpo_coefficients(seg, beta, sums)
    w = Workspace.get("weights", seg.total)
    if lam == 0.0:
        seg.repeat(slope, out=w)
        w *= h
        w += intercept
    else:
        exec_mean = _exec_means(h, idx, seg, sums)
        seg.repeat(slope * (1.0 - lam), out=w)
        w *= h
        w += seg.repeat(slope * lam * exec_mean + intercept, out=Workspace.get("shift", seg.total))
        w[idx] = slope[seg.segment_of(idx)] * h[idx] + intercept
    np.maximum(w, 0.0, out=w)
    if uniform.any():
        _fix_uniform(w, seg, uniform, np.ones(seg.count))
    return w


def _amp_clamped_gtpo_weights(
    h: np.ndarray, idx: np.ndarray, seg: Segments, sums: np.ndarray, beta: float, lam: float
) -> np.ndarray:
    """GTPO weights on h' = max(0, (1 + lam) h - lam mean_exec(h)) for execution tokens
    (planning tokens keep h). The floor changes each completion's sum, so h' is built
    (in a reused buffer) and GTPO then runs on it with its own sums."""
    if lam == 0.0:
        return _sepa_gtpo_weights(h, idx, seg, sums, beta, 0.0)
    shifted = Workspace.get("amp", seg.total)
    seg.repeat(lam * _exec_means(h, idx, seg, sums), out=shifted)
    np.subtract((1.0 + lam) * h, shifted, out=shifted)
    np.maximum(shifted, 0.0, out=shifted)
    shifted[idx] = h[idx]
    return _sepa_gtpo_weights(shifted, idx, seg, seg.sum(shifted), beta, 0.0)


def token_advantages_flat(
    mode: str,
    episode_advantages_C: np.ndarray,
    uncertainties_T: np.ndarray,
    planning_T: np.ndarray | None,
    seg: Segments,
    *,
    gtpo_beta: float = 0.1,
    hicra_alpha: float = 0.2,
    sepa_lambda: float = 0.0,
    plan_index: np.ndarray | None = None,
    segment_sums: np.ndarray | None = None,
) -> np.ndarray:
    """Apply a built-in transform to many completions at once; returns a new flat array.

    `episode_advantages_C` holds one A_i per completion (of any number of groups: the
    transforms are per completion); the token arrays are the completions' tokens
    concatenated in the same order, laid out by `seg`. Planning tokens are given as a
    bool mask `planning_T` or as flat indices `plan_index`. `segment_sums` (the sum of
    h over each completion) may be passed in when the caller already has it.

    SEPA is folded into GTPO's affine weight rather than materialised: pooling moves
    execution values towards their own mean, so it keeps each completion's sum and
    hence m_i, and for an execution token
    w = slope_i (lambda mu_i + (1 - lambda) h_t) + 1 - beta
      = slope_i (1 - lambda) h_t + (slope_i lambda mu_i + 1 - beta),
    which is still affine in h_t; planning tokens keep slope_i h_t + 1 - beta.
    Amplification, (1 + lambda) h_t - lambda mu_i, is the same formula with -lambda.
    The floored amplification (``gtpo_sepa_amp_c``) changes the sums, so it is built.
    ``entropy_mask`` is GTPO here: its mask needs the group boundaries, see
    :func:`surprisal_mask`.
    """
    if mode not in BUILTIN_TRANSFORMS:
        raise ValueError(f"unknown built-in transform {mode!r}; valid: {BUILTIN_TRANSFORMS}")
    adv_C = np.asarray(episode_advantages_C, dtype=np.float64)
    beta = _check_finite("gtpo_beta", gtpo_beta)
    sepa = mode in ("gtpo_sepa", "gtpo_sepa_amp", "gtpo_sepa_amp_c")
    lam = check_sepa_lambda(sepa_lambda) if sepa else 0.0
    if mode == "none" or beta == 0.0 or seg.total == 0:
        out = seg.repeat(adv_C)
    else:
        h = uncertainties_T
        sums = seg.sum(h) if segment_sums is None else segment_sums
        idx = _plan_index(planning_T, plan_index)
        out = seg.repeat(adv_C)  # a new array: this becomes the result
        if mode == "gtpo_sepa_amp_c":
            out *= _amp_clamped_gtpo_weights(h, idx, seg, sums, beta, lam)
        else:
            out *= _sepa_gtpo_weights(h, idx, seg, sums, beta, _SEPA_SIGN.get(mode, 0.0) * lam)
    if mode == "gtpo_hicra":
        alpha = check_hicra_alpha(hicra_alpha)
        idx = _plan_index(planning_T, plan_index)
        if alpha != 0.0 and idx.size:
            a = out[idx]
            out[idx] = a + alpha * np.abs(a)
    return out


def check_mask_rho(rho: float) -> float:
    value = _check_finite("surprisal_mask_rho", rho)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"surprisal_mask_rho must be in [0, 1], got {value}")
    return value


def surprisal_mask(
    advantages_T: np.ndarray, uncertainties_T: np.ndarray, bounds: Sequence[int], rho: float
) -> tuple[list[float], list[float]]:
    """Zero, in place, the advantage of every token below its group's top-rho threshold.

    Group j holds the flat tokens ``bounds[j]:bounds[j + 1]``. For a group of n tokens,
    k = max(1, int(n rho)) and tau = the k-th largest h; tokens with h < tau get 0.
    Returns (tau per group, masked fraction per group); a group without tokens reports
    tau = 0 and fraction 0. rho = 0 changes nothing (and should not be called)."""
    rho = check_mask_rho(rho)
    thresholds, fractions = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        if n == 0:
            thresholds.append(0.0)
            fractions.append(0.0)
            continue
        h = uncertainties_T[start:end]
        k = min(n, max(1, int(n * rho)))
        tau = float(np.partition(h, n - k)[n - k])
        below = h < tau
        advantages_T[start:end][below] = 0.0
        thresholds.append(tau)
        fractions.append(float(np.count_nonzero(below)) / n)
    return thresholds, fractions


def _run_on_context(mode: str, ctx: TransformContext) -> TransformOutput:
    seg = Segments.from_lengths([len(x) for x in ctx.uncertainties_G_T])
    if seg.count == 0:
        return TransformOutput([])
    h = np.concatenate([np.asarray(x, dtype=np.float64) for x in ctx.uncertainties_G_T])
    plan = np.concatenate([np.asarray(x, dtype=bool) for x in ctx.planning_G_T])
    flat = token_advantages_flat(
        mode,
        np.asarray(ctx.episode_advantages_G, dtype=np.float64),
        h,
        plan,
        seg,
        gtpo_beta=ctx.gtpo_beta,
        hicra_alpha=ctx.hicra_alpha,
        sepa_lambda=ctx.sepa_lambda,
    )
    metrics: dict[str, float] = {}
    if mode == "entropy_mask" and ctx.surprisal_mask_rho > 0.0:
        (tau,), (fraction,) = surprisal_mask(flat, h, [0, seg.total], ctx.surprisal_mask_rho)
        metrics = {"entropy_mask_threshold": tau, "entropy_mask_fraction": fraction}
    return TransformOutput(seg.split(flat), metrics)


def transform_none(ctx: TransformContext) -> TransformOutput:
    """Every token gets its completion's episode advantage."""
    return _run_on_context("none", ctx)


def transform_gtpo(ctx: TransformContext) -> TransformOutput:
    """Uncertainty-weighted token credit (GTPO)."""
    return _run_on_context("gtpo", ctx)


def transform_gtpo_hicra(ctx: TransformContext) -> TransformOutput:
    """GTPO, then planning tokens amplified by alpha |A_t| (HICRA)."""
    return _run_on_context("gtpo_hicra", ctx)


def transform_gtpo_sepa(ctx: TransformContext) -> TransformOutput:
    """SEPA pooling of execution-token uncertainty, then GTPO."""
    return _run_on_context("gtpo_sepa", ctx)


def transform_gtpo_sepa_amp(ctx: TransformContext) -> TransformOutput:
    """SEPA amplification h' = h + lambda (h - mean_exec) on execution tokens, then GTPO."""
    return _run_on_context("gtpo_sepa_amp", ctx)


def transform_gtpo_sepa_amp_c(ctx: TransformContext) -> TransformOutput:
    """SEPA amplification floored at 0, h' = max(0, h + lambda (h - mean_exec)), then GTPO."""
    return _run_on_context("gtpo_sepa_amp_c", ctx)


def transform_entropy_mask(ctx: TransformContext) -> TransformOutput:
    """GTPO, then every token below the group's top-rho uncertainty threshold zeroed
    (rho = ``ctx.surprisal_mask_rho``)."""
    return _run_on_context("entropy_mask", ctx)
