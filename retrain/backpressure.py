"""Back pressure: fit the Universal Scalability Law to step throughput and steer the batch size.

Pure module: plain Python and numpy, no torch, no config. The trainer builds a
`BackPressureController` from the `[backpressure]` table, calls `observe()` after every step
with the batch size it used and the throughput it measured, and uses the returned
`Decision.batch_size` for the next step.

Model
-----
Universal Scalability Law, with concurrency ``p = batch_size * group_size``::

    X(p) = lam * p / (1 + sigma * (p - 1) + kappa * p * (p - 1))

peaks at ``p* = sqrt((1 - sigma) / kappa)``.

Linearisation (the choice made here)
------------------------------------
``p / X(p)`` is a quadratic in ``p``::

    p / X = a + b p + c p^2,  a = (1 - sigma) / lam,  b = (sigma - kappa) / lam,  c = kappa / lam

so a three-parameter least-squares fit of ``y = p / X`` gives all of lam, sigma and kappa
without needing an observation at p = 1: ``lam = 1 / (a + b + c)``, ``kappa = c * lam``,
``sigma = (b + c) * lam`` and ``p* = sqrt(a / c)``. Throughput noise is multiplicative
(a few percent of X), so ``y`` has noise proportional to itself; the fit is weighted by
``1 / y^2`` and thus minimises the *relative* residuals. All the fit needs are eight running
sums (``sum X^2 p^(k-2)`` for k = 0..4 and ``sum X p^(k-1)`` for k = 0..2) plus the count,
which `USLEstimator` updates in O(1) when an observation enters or leaves its sliding window.

Fit validity
------------
A fit is marked invalid (``USLFit.valid`` False, with a ``reason``) when there are fewer than
3 distinct concurrencies, the normal equations are singular or non-finite, lam <= 0,
kappa <= 0 (no contention seen: no finite optimum) or sigma >= 1. Rounding is not taken for
signal: a kappa whose term stays below 1e-9 over the observed range counts as 0, and a sigma
within 1e-9 of 1 counts as 1. Nothing raises and no NaN
escapes. A slightly negative sigma (superlinear start, or noise around sigma = 0) is accepted.
Each fit also reports ``p_star_rel_se``, a deliberately conservative bound on the relative
standard error of p*: ``(se(a)/a + se(c)/c) / 2`` from the weighted least-squares covariance
(the bound for log p* = (log a - log c) / 2 when a and c are perfectly anti-correlated).
The plain delta method is not used because it can report a tiny error when all observations
sit in a narrow band around the optimum, where the curvature (c) is unknown. None when
there are no spare degrees of freedom (3 observations).

Controller
----------
* Warmup (the first ``warmup_steps`` observations): batch sizes follow the geometric ladder
  min, 2*min, 4*min, ... up to max (the last rung is max itself), restarting from the bottom
  when the ladder is shorter than the warmup. Action ``hold``, regime ``warmup``.
  ``initial_batch_size`` (clamped into range) is the first step's batch size when
  ``warmup_steps`` is 0; with no warmup there is nothing to fit, so the controller holds it.
  (With back pressure enabled, the config refuses warmup_steps < 2 and ladders of fewer
  than 3 rungs, which never fit: retrain/config/validate.py.)
* Afterwards, each step refits. A fit is *trusted* when it is valid, its ``p_star_rel_se``
  is at most ``max_p_star_rel_se`` (0.15; an exact fit with no spare degrees of freedom is
  trusted too) and, once a model has been adopted, its window holds at least as many
  observations at every concurrency as the model's own fit had. The controller decides
  with the most recent trusted fit (the model). While the window fills, each fit only adds
  data and may refine the model; once the window slides and drops the warmup's
  exploration points (which pin the curve's shape) no later fit qualifies, and the model
  is kept for the rest of the run instead of chasing noise: the controller does not
  explore again (`_holds_model_data` says why).
* Invalid or untrusted fit after warmup: while no model has been adopted the ladder walk
  continues for at most ``warmup_steps`` more steps (regime ``warmup``, action ``hold``).
  If there is still no trusted fit at step ``2 * warmup_steps``, a valid but untrusted fit
  is adopted; if no valid fit exists either (e.g. kappa <= 0: throughput still scaling over
  the whole range), the controller moves once to the batch size with the best mean observed
  throughput in the window and then holds it, regime ``warmup``, until a valid fit appears.
* Decision with p = batch_size * group_size and target = throttle_margin * p*:
  - ``p > target`` -> regime ``retrograde``, throttle to target;
  - ``p < increase_margin * target`` -> increase to target;
  - otherwise hold (hysteresis: anywhere in [increase_margin, 1] * target stays put, so a
    batch size that the warmup left in that band is kept).
  The regime of the increase/hold cases comes from the ratio r of the EMA throughput to
  the USL prediction at p: r > 1.1 -> ``memory_bound``; 0.8 <= r <= 1.1 -> ``optimal``;
  r < 0.8 -> ``compute_bound``. When a roofline hint is available (below) it names the
  regime instead whenever r is outside the optimal band.
  The target batch size is ``floor(target / group_size)`` (so the new concurrency never
  exceeds the target), clamped to [min_batch_size, max_batch_size] and at least 1, and
  rounded down to a multiple of ``multiple`` (the ranks under torchrun, which take whole
  prompts each; min and max must be multiples, so every ladder rung is one). The action
  reported is the direction the batch size actually moves (``hold`` when a clamp
  keeps it where it is).
* EMA: ``ema = ema_decay * ema + (1 - ema_decay) * throughput``, restarted from the raw
  value whenever the concurrency changes, so it always describes the current batch size.
  The USL fit uses the raw observations; the EMA feeds the regime and ``bp_throughput``.
* Roofline hint: with ``peak_gflops > 0`` and ``peak_bw_gb_s > 0``, an ``observe`` call that
  passes ``flops`` and ``bytes_moved`` for the step (the trainer counts them from the
  model's shape and the step's tokens: retrain/roofline.py) gets its arithmetic intensity
  ``flops / bytes_moved`` compared with the ridge point ``peak_gflops / peak_bw_gb_s``
  (FLOP per byte): below -> ``memory_bound``, at or above -> ``compute_bound``.
  The hint only labels the regime; it never moves the batch size.
* Utilization: EMA throughput divided by the fitted peak throughput X(p*)
  (can exceed 1 slightly under noise); None while no model has been adopted.
* Unusable throughputs (NaN, inf, negative) are ignored by the fit and the EMA; a zero
  throughput enters the EMA but not the fit (p / X is undefined). Decisions stay in bounds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "ACTIONS",
    "REGIMES",
    "BackPressureController",
    "Decision",
    "USLEstimator",
    "USLFit",
    "batch_ladder",
    "fit_usl",
    "usl_throughput",
]

REGIMES = ("warmup", "retrograde", "memory_bound", "compute_bound", "optimal")
ACTIONS = ("hold", "throttle", "increase")

WINDOW = 100
_NSUMS = 8  # S0..S4 (sum w p^k) and T0..T2 (sum w y p^k), w = 1 / y^2, y = p / X
_MAX_TERM = 1e150  # observations whose sum terms exceed this are dropped (overflow guard)
_MAX_COND = 1e12
_OPTIMAL_LOW, _OPTIMAL_HIGH = 0.8, 1.1


def usl_throughput(p: float, lam: float, sigma: float, kappa: float) -> float:
    """X(p) = lam * p / (1 + sigma (p - 1) + kappa p (p - 1))."""
    return lam * p / (1.0 + sigma * (p - 1.0) + kappa * p * (p - 1.0))


def batch_ladder(min_batch_size: int, max_batch_size: int) -> list[int]:
    """The warmup's batch sizes: min, 2 min, 4 min, ... below max, then max itself.
    The fit needs three distinct sizes, so a ladder of fewer than 3 rungs (max <= 2 min)
    never gives the controller a model (config/validate.py refuses it)."""
    rungs, b = [], min_batch_size
    while b < max_batch_size:
        rungs.append(b)
        b *= 2
    rungs.append(max_batch_size)
    return rungs


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class USLFit:
    """Result of a USL fit. When ``valid`` is False, ``reason`` says why; the numeric fields
    are then whatever could be computed (finite) or None."""

    sigma: float | None
    kappa: float | None
    lam: float | None
    p_star: float | None
    valid: bool
    reason: str
    n: int = 0
    distinct: int = 0
    p_star_rel_se: float | None = None

    def predict(self, p: float) -> float | None:
        """Fitted throughput at concurrency p (None for an invalid fit)."""
        if not self.valid:
            return None
        return _finite(usl_throughput(p, self.lam, self.sigma, self.kappa))


def _invalid(reason: str, n: int, distinct: int, **fields: float | None) -> USLFit:
    vals = {k: _finite(fields.get(k)) for k in ("sigma", "kappa", "lam", "p_star")}
    return USLFit(**vals, valid=False, reason=reason, n=n, distinct=distinct)


def _terms(p: float, x: float) -> list[float] | None:
    """The eight sum terms of one observation, or None when it cannot enter the fit."""
    if not (math.isfinite(p) and math.isfinite(x)) or p <= 0 or x <= 0:
        return None
    try:
        x2 = x * x
        t = [x2 / (p * p), x2 / p, x2, x2 * p, x2 * p * p, x / p, x, x * p]
    except OverflowError:  # pragma: no cover - floats overflow to inf, not raise
        return None
    if not all(math.isfinite(v) and abs(v) < _MAX_TERM for v in t):
        return None
    if t[0] == 0.0:  # weight underflowed: carries no information
        return None
    return t


def _normal_equations(sums: list[float]) -> tuple[np.ndarray, np.ndarray, float]:
    """The weighted normal equations (matrix, right-hand side) with p rescaled by its
    weighted RMS `sc`, so the matrix is well conditioned."""
    s0, s1, s2, s3, s4, t0, t1, t2 = sums
    sc = math.sqrt(s2 / s0)
    m = (
        np.array(
            [
                [s0, s1 / sc, s2 / sc**2],
                [s1 / sc, s2 / sc**2, s3 / sc**3],
                [s2 / sc**2, s3 / sc**3, s4 / sc**4],
            ]
        )
        / s0
    )
    return m, np.array([t0, t1 / sc, t2 / sc**2]) / s0, sc


def _rel_se(beta, r, minv, s0: float, n: int, sc: float, a: float, c: float) -> float | None:
    """Conservative relative standard error of p* (see the module docstring)."""
    if n <= 3:
        return None
    # Weighted residual sum of squares; sum w y^2 == n because w = 1 / y^2.
    rss = max(float(n) - float(beta @ r) * s0, 0.0)
    cov = minv * (rss / (n - 3) / s0)
    va, vc = float(cov[0, 0]), float(cov[2, 2]) / sc**4
    return _finite(0.5 * (math.sqrt(max(va, 0.0)) / abs(a) + math.sqrt(max(vc, 0.0)) / c))


def _solve(sums: list[float], n: int, distinct: int) -> USLFit:
    """Weighted least squares of p/X = a + b p + c p^2 from the running sums."""
    if n < 3 or distinct < 3:
        return _invalid(
            f"need observations at >= 3 distinct concurrencies (have {distinct})", n, distinct
        )
    if not all(math.isfinite(v) for v in sums) or sums[0] <= 0 or sums[2] <= 0:
        return _invalid("non-finite running sums", n, distinct)
    m, r, sc = _normal_equations(sums)
    if not np.all(np.isfinite(m)) or not np.all(np.isfinite(r)):
        return _invalid("non-finite normal equations", n, distinct)
    with np.errstate(all="ignore"):
        cond = np.linalg.cond(m)
        if not math.isfinite(cond) or cond > _MAX_COND:
            return _invalid("ill-conditioned normal equations", n, distinct)
        try:
            minv = np.linalg.inv(m)
        except np.linalg.LinAlgError:
            return _invalid("singular normal equations", n, distinct)
        beta = minv @ r
    a, b, c = float(beta[0]), float(beta[1]) / sc, float(beta[2]) / sc**2
    if not all(math.isfinite(v) for v in (a, b, c)):
        return _invalid("non-finite coefficients", n, distinct)
    denom = a + b + c
    if denom <= 0:
        return _invalid("fitted throughput at p=1 is not positive (lam <= 0)", n, distinct)
    lam = 1.0 / denom
    kappa = c * lam
    sigma = (b + c) * lam
    fitted = {"sigma": sigma, "kappa": kappa, "lam": lam}
    if not all(math.isfinite(v) for v in (lam, kappa, sigma)):
        return _invalid("non-finite parameters", n, distinct)
    # kappa that adds less than 1e-9 to the denominator over the observed range is rounding.
    if kappa * sc * sc <= 1e-9:
        return _invalid("kappa <= 0: no contention seen, no finite optimum", n, distinct, **fitted)
    if sigma >= 1.0 - 1e-9:
        return _invalid("sigma >= 1: throughput does not scale", n, distinct, **fitted)
    p_star = math.sqrt((1.0 - sigma) / kappa)
    if not math.isfinite(p_star) or p_star <= 0:
        return _invalid("non-finite p*", n, distinct, **fitted)
    return USLFit(
        sigma=sigma,
        kappa=kappa,
        lam=lam,
        p_star=p_star,
        valid=True,
        reason="ok",
        n=n,
        distinct=distinct,
        p_star_rel_se=_rel_se(beta, r, minv, sums[0], n, sc, a, c),
    )


def fit_usl(concurrency: Iterable[float], throughput: Iterable[float]) -> USLFit:
    """Fit the USL to paired (concurrency, throughput) observations (all of them, no window).
    Observations that cannot enter the fit (non-positive or non-finite) are skipped."""
    ps = np.asarray(list(concurrency), dtype=float).ravel()
    xs = np.asarray(list(throughput), dtype=float).ravel()
    if ps.shape != xs.shape:
        raise ValueError(f"concurrency and throughput differ in length ({ps.size} vs {xs.size})")
    rows, kept = [], set()
    for p, x in zip(ps.tolist(), xs.tolist()):
        t = _terms(p, x)
        if t is not None:
            rows.append(t)
            kept.add(p)
    sums = [math.fsum(col) for col in zip(*rows)] if rows else [0.0] * _NSUMS
    return _solve(sums, len(rows), len(kept))


class USLEstimator:
    """USL fit over a sliding window of the most recent `window` usable observations.

    Adding an observation (and evicting the oldest) updates eight running sums in O(1);
    `fit()` solves a 3x3 system. To stop floating-point drift the sums are recomputed from
    the window every `window` evictions (amortised O(1)), and at once when an evicted
    observation dwarfs what remains."""

    def __init__(self, window: int = WINDOW):
        if not isinstance(window, int) or isinstance(window, bool) or window < 3:
            raise ValueError(f"window must be an int >= 3, got {window!r}")
        self.window = window
        self._obs: deque[tuple[float, float]] = deque()
        self._sums = [0.0] * _NSUMS
        self._counts: dict[float, int] = {}
        self._evictions = 0

    def __len__(self) -> int:
        return len(self._obs)

    @property
    def distinct(self) -> int:
        return len(self._counts)

    @property
    def observations(self) -> list[tuple[float, float]]:
        return list(self._obs)

    @property
    def counts(self) -> dict[float, int]:
        """How many observations the window holds at each concurrency."""
        return dict(self._counts)

    def add(self, concurrency: float, throughput: float) -> bool:
        """Add one observation; returns False (and changes nothing) when it is unusable."""
        p, x = float(concurrency), float(throughput)
        t = _terms(p, x)
        if t is None:
            return False
        self._obs.append((p, x))
        self._counts[p] = self._counts.get(p, 0) + 1
        for i in range(_NSUMS):
            self._sums[i] += t[i]
        if len(self._obs) > self.window:
            self._evict()
        return True

    def _evict(self) -> None:
        p, x = self._obs.popleft()
        left = self._counts[p] - 1
        if left:
            self._counts[p] = left
        else:
            del self._counts[p]
        t = _terms(p, x)
        assert t is not None
        for i in range(_NSUMS):
            self._sums[i] -= t[i]
        self._evictions += 1
        dwarfed = any(abs(t[i]) > 1e8 * abs(self._sums[i]) for i in range(_NSUMS))
        if self._evictions >= self.window or dwarfed:
            self._resync()

    def _resync(self) -> None:
        rows = [_terms(p, x) for p, x in self._obs]
        self._sums = [math.fsum(col) for col in zip(*rows)] if rows else [0.0] * _NSUMS
        self._evictions = 0

    def fit(self) -> USLFit:
        return _solve(list(self._sums), len(self._obs), len(self._counts))

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "observations": [[p, x] for p, x in self._obs],
            "sums": list(self._sums),
            "evictions": self._evictions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        window = int(state["window"])
        obs = [(float(p), float(x)) for p, x in state["observations"]]
        sums = [float(v) for v in state["sums"]]
        if len(sums) != _NSUMS or len(obs) > window:
            raise ValueError("malformed USLEstimator state")
        self.window = window
        self._obs = deque(obs)
        self._sums = sums
        self._counts = {}
        for p, _ in obs:
            self._counts[p] = self._counts.get(p, 0) + 1
        self._evictions = int(state["evictions"])


@dataclass(frozen=True)
class Decision:
    """What the controller decided after one observation. ``batch_size`` is the batch size
    for the next step."""

    batch_size: int
    action: str
    regime: str
    p_star: float | None
    sigma: float | None
    kappa: float | None
    utilization: float | None
    throughput: float | None
    roofline: str | None = None
    step: int = 0

    def as_metrics(self) -> dict[str, Any]:
        return {
            "bp_action": self.action,
            "bp_regime": self.regime,
            "bp_p_star": _finite(self.p_star),
            "bp_sigma": _finite(self.sigma),
            "bp_kappa": _finite(self.kappa),
            "bp_utilization": _finite(self.utilization),
            "bp_throughput": _finite(self.throughput),
            # the step's own side of the ridge point, where peaks were given (roofline.py)
            **({"bp_roofline": self.roofline} if self.roofline is not None else {}),
        }


def _direction(current: int, nxt: int) -> str:
    return "increase" if nxt > current else "throttle" if nxt < current else "hold"


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _check_float(
    name: str, value: Any, low: float, high: float | None, *, open_low=False, open_high=False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    bad = (
        not math.isfinite(v)
        or (v <= low if open_low else v < low)
        or (high is not None and (v >= high if open_high else v > high))
    )
    if bad:
        lo = "(" if open_low else "["
        hi = ")" if open_high else "]"
        rng = f"{lo}{low}, {high if high is not None else 'inf'}{hi}"
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    return v


class BackPressureController:
    """USL-based adaptive batch sizing (see the module docstring for the rules)."""

    def __init__(
        self,
        warmup_steps: int = 10,
        ema_decay: float = 0.9,
        throttle_margin: float = 0.85,
        increase_margin: float = 0.5,
        min_batch_size: int = 1,
        max_batch_size: int = 64,
        peak_gflops: float = 0.0,
        peak_bw_gb_s: float = 0.0,
        group_size: int = 1,
        initial_batch_size: int | None = None,
        *,
        multiple: int = 1,
        window: int = WINDOW,
        max_p_star_rel_se: float = 0.15,
    ):
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.ema_decay = _check_float("ema_decay", ema_decay, 0.0, 1.0, open_high=True)
        self.throttle_margin = _check_float(
            "throttle_margin", throttle_margin, 0.0, 1.0, open_low=True
        )
        self.increase_margin = _check_float(
            "increase_margin", increase_margin, 0.0, 1.0, open_low=True
        )
        self.min_batch_size = _check_int("min_batch_size", min_batch_size, 1)
        self.max_batch_size = _check_int("max_batch_size", max_batch_size, 1)
        if self.max_batch_size < self.min_batch_size:
            raise ValueError(
                f"max_batch_size ({max_batch_size}) must be >= min_batch_size ({min_batch_size})"
            )
        # Under torchrun every rank samples whole prompts of the same number, so every batch
        # size is a multiple of the ranks; with min and max multiples, so is every ladder rung.
        self.multiple = _check_int("multiple", multiple, 1)
        for name, value in (("min_batch_size", min_batch_size), ("max_batch_size", max_batch_size)):
            if value % self.multiple:
                raise ValueError(f"{name} ({value}) must be a multiple of {self.multiple}")
        self.peak_gflops = _check_float("peak_gflops", peak_gflops, 0.0, None)
        self.peak_bw_gb_s = _check_float("peak_bw_gb_s", peak_bw_gb_s, 0.0, None)
        self.group_size = _check_int("group_size", group_size, 1)
        if initial_batch_size is not None:
            # e.g. [training] batch_size; clamped into [min_batch_size, max_batch_size]
            initial_batch_size = _check_int("initial_batch_size", initial_batch_size, 1)
            initial_batch_size = self._clamp(initial_batch_size)
        self.initial_batch_size = initial_batch_size
        self.max_p_star_rel_se = _check_float(
            "max_p_star_rel_se", max_p_star_rel_se, 0.0, None, open_low=True
        )
        self.estimator = USLEstimator(window)
        self._ladder = batch_ladder(self.min_batch_size, self.max_batch_size)
        self._step = 0
        self._ema: float | None = None
        self._ema_p: float | None = None
        self._model: dict[str, float] | None = None  # last trusted fit
        # observations per concurrency in the window the model was fitted on
        self._model_counts: dict[float, int] | None = None
        self._batch_size = self._first_batch_size()
        self._last: Decision | None = None

    # -- schedule ---------------------------------------------------------------------------
    def _first_batch_size(self) -> int:
        if self.warmup_steps > 0:
            return self._ladder[0]
        if self.initial_batch_size is not None:
            return self.initial_batch_size
        return self.min_batch_size

    def warmup_batch_size(self, step: int) -> int:
        """The batch size the warmup schedule uses at (0-based) step `step`."""
        return self._ladder[step % len(self._ladder)]

    def _clamp(self, b: int) -> int:
        """Into [min_batch_size, max_batch_size], rounded down to a multiple of `multiple`
        (never below min_batch_size, itself a multiple)."""
        b = min(self.max_batch_size, max(1, int(b)))
        return max(self.min_batch_size, b - b % self.multiple)

    @property
    def batch_size(self) -> int:
        """The batch size to use for the next step."""
        return self._batch_size

    @property
    def roofline_enabled(self) -> bool:
        return self.peak_gflops > 0 and self.peak_bw_gb_s > 0

    @property
    def ridge_point(self) -> float | None:
        """FLOP per byte at which the roofline turns from memory- to compute-bound."""
        return self.peak_gflops / self.peak_bw_gb_s if self.roofline_enabled else None

    def roofline_hint(self, flops: float | None, bytes_moved: float | None) -> str | None:
        """``memory_bound`` / ``compute_bound`` from the step's arithmetic intensity, or None."""
        if not self.roofline_enabled or flops is None or bytes_moved is None:
            return None
        f, by = float(flops), float(bytes_moved)
        if not (math.isfinite(f) and math.isfinite(by)) or f < 0 or by <= 0:
            return None
        return "memory_bound" if f / by < self.ridge_point else "compute_bound"

    # -- main entry -------------------------------------------------------------------------
    def observe(
        self,
        batch_size: int,
        throughput: float,
        *,
        flops: float | None = None,
        bytes_moved: float | None = None,
    ) -> Decision:
        """Record the step just run (its batch size and measured throughput) and decide the
        next step's batch size."""
        b = _check_int("batch_size", batch_size, 1)
        p = float(b * self.group_size)
        try:
            x = float(throughput)
        except (TypeError, ValueError, OverflowError):
            x = math.nan
        usable = math.isfinite(x) and x >= 0
        if usable:
            if self._ema is None or self._ema_p != p:
                self._ema, self._ema_p = x, p
            else:
                self._ema = self.ema_decay * self._ema + (1.0 - self.ema_decay) * x
            self.estimator.add(p, x)
        self._step += 1
        hint = self.roofline_hint(flops, bytes_moved)

        if self._step < self.warmup_steps:
            decision = self._decision(self.warmup_batch_size(self._step), "hold", "warmup", p, hint)
        else:
            fit = self.estimator.fit()
            counts = self.estimator.counts
            trusted = (
                fit.valid
                and (fit.p_star_rel_se is None or fit.p_star_rel_se <= self.max_p_star_rel_se)
                and self._holds_model_data(counts)  # never trade the model's data away
            )
            explore_end = 2 * self.warmup_steps
            if trusted or (fit.valid and self._model is None and self._step >= explore_end):
                self._model = {
                    "sigma": fit.sigma,
                    "kappa": fit.kappa,
                    "lam": fit.lam,
                    "p_star": fit.p_star,
                }
                self._model_counts = counts
            if self._model is None and self._step < explore_end:
                # No trustworthy curve yet: keep walking the ladder (at most warmup_steps more).
                nxt = self.warmup_batch_size(self._step)
                decision = self._decision(nxt, "hold", "warmup", p, hint)
            elif self._model is None:
                nxt = self._best_observed(b) if self._step == explore_end else b
                decision = self._decision(nxt, _direction(b, nxt), "warmup", p, hint)
            else:
                decision = self._decide(b, p, hint)
        self._batch_size = decision.batch_size
        self._last = decision
        return decision

    def _holds_model_data(self, counts: dict[float, int]) -> bool:
        """Whether a window with these counts per concurrency has at least as many
        observations at every concurrency as the adopted model's fit had (True while no
        model is adopted).

        Only such a fit may replace the model, so a new model only ever adds information.
        Once the window slides past the warmup's ladder, each fit trades exploration
        points for more at the settled size; what remains (a few low rungs beside ~97
        points at one size) barely determines the curvature c, and with it
        p* = sqrt(a / c). Such a fit passes the p_star_rel_se test mostly when noise made
        the curve look too sharp (p* far too small), and the fits after it have fewer
        than 3 sizes, so nothing would correct it. A run that follows the controller thus
        keeps the model fitted just before its window began to drop exploration points;
        the controller does not explore again.

        Rejected: requiring only that the window still reach the model's smallest and
        largest concurrency (fits over the full span with one point per rung still moved
        9 of 200 simulated runs at 10% noise by 2 or 3 batch sizes), and keeping the sums
        of evicted observations (that fits throughput measured long ago together with
        today's, which drifts as training changes the completions)."""
        if self._model is None or self._model_counts is None:
            return True
        return all(counts.get(p, 0) >= n for p, n in self._model_counts.items())

    def _best_observed(self, current: int) -> int:
        """The batch size whose observations in the window have the highest mean throughput."""
        total: dict[float, list[float]] = {}
        for p, x in self.estimator.observations:
            acc = total.setdefault(p, [0.0, 0])
            acc[0] += x
            acc[1] += 1
        if not total:
            return self._clamp(current)
        best_p = max(sorted(total), key=lambda q: total[q][0] / total[q][1])
        return self._clamp(round(best_p / self.group_size))

    def _decide(self, b: int, p: float, hint: str | None) -> Decision:
        cur = self._clamp(b)
        m = self._model
        if m is None:
            return self._decision(cur, "hold", "warmup", p, hint)
        target = self.throttle_margin * m["p_star"]
        to_target = self._clamp(math.floor(target / self.group_size + 1e-9))
        if p > target:
            regime, nxt = "retrograde", to_target
        else:
            regime = self._classify(p, hint)
            nxt = to_target if p < self.increase_margin * target else cur
        return self._decision(nxt, _direction(b, nxt), regime, p, hint)

    def _classify(self, p: float, hint: str | None) -> str:
        m = self._model
        pred = usl_throughput(p, m["lam"], m["sigma"], m["kappa"])
        if self._ema is None or self._ema_p != p or not (math.isfinite(pred) and pred > 0):
            return hint or "optimal"
        ratio = self._ema / pred
        if _OPTIMAL_LOW <= ratio <= _OPTIMAL_HIGH:
            return "optimal"
        if hint is not None:
            return hint
        return "memory_bound" if ratio > _OPTIMAL_HIGH else "compute_bound"

    def _decision(self, nxt: int, action: str, regime: str, p: float, hint: str | None) -> Decision:
        m = self._model
        util = None
        if m is not None and self._ema is not None:
            peak = usl_throughput(m["p_star"], m["lam"], m["sigma"], m["kappa"])
            if math.isfinite(peak) and peak > 0:
                util = _finite(self._ema / peak)
        return Decision(
            batch_size=self._clamp(nxt),
            action=action,
            regime=regime,
            p_star=_finite(m["p_star"]) if m else None,
            sigma=_finite(m["sigma"]) if m else None,
            kappa=_finite(m["kappa"]) if m else None,
            utilization=util,
            throughput=_finite(self._ema),
            roofline=hint,
            step=self._step,
        )

    # -- reporting ----------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """The latest decision as ``bp_*`` metrics (all None before the first observation)."""
        if self._last is None:
            return {
                "bp_action": "hold",
                "bp_regime": "warmup",
                "bp_p_star": None,
                "bp_sigma": None,
                "bp_kappa": None,
                "bp_utilization": None,
                "bp_throughput": None,
            }
        return self._last.as_metrics()

    # -- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; `load_state_dict` restores it exactly."""
        return {
            "version": 1,
            "step": self._step,
            "batch_size": self._batch_size,
            "ema": self._ema,
            "ema_p": self._ema_p,
            "model": dict(self._model) if self._model else None,
            "model_counts": (
                [[p, n] for p, n in sorted(self._model_counts.items())]
                if self._model_counts is not None
                else None
            ),
            "last": asdict(self._last) if self._last else None,
            "estimator": self.estimator.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("version", 0)) != 1:
            raise ValueError(f"unsupported back-pressure state version {state.get('version')!r}")
        self._step = int(state["step"])
        self._batch_size = self._clamp(int(state["batch_size"]))
        self._ema = None if state["ema"] is None else float(state["ema"])
        self._ema_p = None if state["ema_p"] is None else float(state["ema_p"])
        model = state["model"]
        self._model = {k: float(v) for k, v in model.items()} if model else None
        self._last = Decision(**state["last"]) if state["last"] else None
        self.estimator.load_state_dict(state["estimator"])
        counts = state.get("model_counts")
        if counts is not None:
            self._model_counts = {float(p): int(n) for p, n in counts}
        else:  # a state saved before the counts were kept: the window's own, as the best guess
            self._model_counts = self.estimator.counts if self._model else None
