"""The advantage pipeline: rewards, logprobs and planning masks in, token advantages out.

:class:`AdvantagePipeline` is built once from the configured names (at trainer set-up):
it resolves the advantage mode, the transform, the algorithm plugin and the uncertainty
kind there, once, so a bad name or a plugin that is not callable is a PluginError
before any step runs. It is then called with each step's groups
(:class:`~retrain.types.TokenGroup` records) and returns :class:`BatchAdvantages`
(advantages per group, plus the step's :class:`AdvantageStats`).
:func:`compute_token_advantages` is the one-group convenience plugin authors call and
test with.

Steps of a call, in order:

1. **Skip** uninformative groups: a group whose rewards are all equal carries no
   signal. It is counted as *all-correct* when the common reward is > 0, otherwise as
   *all-wrong*, and gets ``None`` instead of advantages. (``skip_uninformative=False``
   keeps them.) A group of one completion is therefore always skipped.
2. **Episode advantages** of each kept group (``advantage_mode``), in one call over
   all kept groups (a built-in's batched form). Most modes look at one group at a
   time; ``reinforce_pp`` and ``reinforce_pp_baseline`` also normalise with the mean
   and variance of every completion of the kept groups (the step's batch). Skipped
   groups are not in that call, so they do not enter those statistics either
   (formulas in :mod:`retrain.advantages.episode`).
3. **Uncertainty** h_t of every token of the kept groups (``uncertainty_kind``),
   computed once over all their tokens concatenated.
4. **Statistics** over the same tokens: mean and population variance (ddof = 0) of h on
   execution tokens and on planning tokens, pooled over every token of every kept
   group (not averaged per completion), plus token and group counts. Skipped groups
   are not trained on, so they do not enter the statistics. NaN where there is no
   such token.
5. **SEPA lambda**: ``sepa_lambda`` is either a number or a callable
   ``fn(stats) -> float``. The callable is invoked exactly once, after step 4 and
   before step 6, so the trainer can feed this step's execution variance into the
   scheduler and use the lambda it returns for this same step::

       batch = pipeline(
           groups,
           sepa_lambda=lambda stats: sepa.update(step, correct_rate, stats.exec_var),
           step=step,
       )

6. **Token transform** (``transform_mode``). A built-in transform runs as one
   vectorised kernel (its registry entry's ``kernel``) over every token of the batch;
   a dotted-path transform is called once per kept group with a
   :class:`~retrain.advantages.context.TransformContext`. ``entropy_mask`` then masks
   each kept group with ``surprisal_mask_rho`` (formula in
   :mod:`retrain.advantages.transforms`); its two metrics are averaged over the kept
   groups into ``extra_metrics``. rho is ``[algorithm.transform_params]``
   ``surprisal_mask_rho`` (or ``entropy_mask_rho``) when given there, else the
   constructor's ``surprisal_mask_rho``; only ``entropy_mask`` (and plugins that read
   ``ctx.surprisal_mask_rho``) use it.

Plugins (all resolved through :mod:`retrain.registry`, which serves built-ins and dotted
paths alike):

- ``advantage_mode = "pkg.mod.fn"``: ``fn(rewards)`` or ``fn(rewards, params)`` (chosen by
  the number of positional parameters) with ``rewards`` a list of floats and
  ``params`` the ``[algorithm.advantage_params]`` dict; returns G numbers.
- ``transform_mode = "pkg.mod.fn"``: ``fn(ctx: TransformContext) -> TransformOutput``
  (a plain list of arrays is accepted too). ``extra_metrics`` are averaged over groups.
- ``algorithm_mode = "pkg.mod.fn"``: replaces steps 2 and 6:
  ``fn(ctx: AlgorithmContext) -> TransformOutput | list[array]``, once per kept group.
  The skip rule, the uncertainties and the statistics still apply. The built-in
  algorithm names (``grpo_none``, ``maxrl_none``, ``maxrl_gtpo``, ``maxrl_gtpo_hicra``,
  ``maxrl_gtpo_sepa``, ``grpo_std_none``, ``rloo_none``, ``reinforce_pp_none``,
  ``reinforce_pp_baseline_none``) are registry aliases of advantage/transform pairs and
  run exactly as those pairs.

- ``uncertainty_kind = "pkg.mod.fn"``: ``fn(logprobs)`` or ``fn(logprobs, entropies)`` over
  a flat token array, or a
  :class:`~retrain.advantages.uncertainty.PerCompletionUncertainty`, called once per
  completion with its planning mask.

A plugin is resolved through its kind's registry adapters, so other conventions work
too: retrain.compat installs those of the original retrain API (spec objects,
zero-argument factories, context forms, ``register_*`` names).

Every plugin output is checked: the right number of completions, each array as long
as its completion, every value finite; otherwise a PluginError names the plugin and the
problem. An exception inside a plugin is re-raised as a PluginError naming it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from retrain import registry
from retrain.advantages.context import AlgorithmContext, TransformContext
from retrain.advantages.episode import check_params
from retrain.advantages.plugins import (
    builtin_entry,
    call_plugin,
    check_token_output,
    episode_fn,
    resolve_callable,
)
from retrain.advantages.transforms import (
    Segments,
    Workspace,
    check_mask_rho,
    check_sepa_lambda,
    surprisal_mask,
    token_advantages_flat,
)
from retrain.advantages.uncertainty import (
    PerCompletionUncertainty,
    requires_entropies,
    resolve_uncertainty,
    surprisal,
)
from retrain.types import TokenGroup

ArrayLike = Sequence[float] | np.ndarray
LambdaSource = float | Callable[["AdvantageStats"], float]


@dataclass
class AdvantageStats:
    """Statistics of one step's advantage computation (see the module docstring)."""

    exec_mean: float = math.nan
    exec_var: float = math.nan
    plan_mean: float = math.nan
    plan_var: float = math.nan
    num_planning_tokens: int = 0
    num_exec_tokens: int = 0
    skipped_all_correct: int = 0
    skipped_all_wrong: int = 0
    kept_groups: int = 0
    num_groups: int = 0
    sepa_lambda: float = 0.0
    extra_metrics: dict[str, float] = field(default_factory=dict)

    def to_metrics(self) -> dict[str, float]:
        """Flat metric names as logged (exec_entropy_mean, ..., plugin extras)."""
        out: dict[str, Any] = {
            "exec_entropy_mean": self.exec_mean,
            "exec_entropy_var": self.exec_var,
            "plan_entropy_mean": self.plan_mean,
            "plan_entropy_var": self.plan_var,
            "num_planning_tokens": self.num_planning_tokens,
            "num_exec_tokens": self.num_exec_tokens,
            "skipped_all_correct": self.skipped_all_correct,
            "skipped_all_wrong": self.skipped_all_wrong,
            "kept_groups": self.kept_groups,
            "sepa_lambda": self.sepa_lambda,
        }
        out.update(self.extra_metrics)
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BatchAdvantages:
    """Result of an :class:`AdvantagePipeline` call: per group, a list with one float64
    array per completion, or None for a skipped group."""

    advantages: list[list[np.ndarray] | None]
    stats: AdvantageStats
    # None (kept), "all_correct" or "all_wrong"; the trainer adds "all_failed" for a
    # group whose every conversation failed, which the pipeline never sees
    skipped: list[str | None]

    @property
    def kept(self) -> list[bool]:
        return [a is not None for a in self.advantages]


# --------------------------------------------------------------------------- input


def _vectors(
    seqs: Sequence[ArrayLike], dtype: type, where: str, what: str, n: int
) -> list[np.ndarray]:
    if len(seqs) != n:
        raise ValueError(f"{where}{n} rewards but {len(seqs)} {what}")
    out = []
    for x in seqs:
        if type(x) is not np.ndarray or x.dtype != dtype or x.ndim != 1:
            x = np.asarray(x, dtype=dtype).reshape(-1)
        out.append(x)
    return out


def _matching(
    seqs: Sequence[ArrayLike] | None, dtype: type, where: str, what: tuple[str, str], logprobs: list
) -> list[np.ndarray] | None:
    """Optional per-token sequences, one per completion, each as long as its logprobs.
    `what` names a sequence and a token ("planning masks", "planning flags")."""
    if seqs is None:
        return None
    out = _vectors(seqs, dtype, where, what[0], len(logprobs))
    for i, (a, b) in enumerate(zip(logprobs, out)):
        if a.size != b.size:
            raise ValueError(f"{where}completion {i} has {a.size} logprobs but {b.size} {what[1]}")
    return out


_PLANNING = ("planning masks", "planning flags")
_ENTROPIES = ("entropy sequences", "entropies")


def _checked_group(gi: int, group: TokenGroup) -> TokenGroup:
    """`group` with every field a 1-D numpy array of the right dtype and length."""
    where = f"group {gi}: "
    if not isinstance(group, TokenGroup):
        raise TypeError(f"{where}expected a retrain.types.TokenGroup, got {type(group).__name__}")
    rewards = np.asarray(group.rewards_G, dtype=np.float64)
    if rewards.ndim != 1 or rewards.size == 0:
        raise ValueError(f"{where}rewards must be a non-empty 1-D sequence")
    if not np.isfinite(rewards).all():
        raise ValueError(f"{where}rewards must be finite, got {rewards.tolist()}")
    if group.logprobs_G_T is None:
        raise ValueError(f"{where}logprobs are missing")
    logprobs = _vectors(group.logprobs_G_T, np.float64, where, "logprob sequences", rewards.size)
    return TokenGroup(
        rewards,
        logprobs,
        _matching(group.planning_G_T, np.bool_, where, _PLANNING, logprobs),
        _matching(group.entropies_G_T, np.float64, where, _ENTROPIES, logprobs),
    )


def _planning_masks(group: TokenGroup) -> list[np.ndarray]:
    if group.planning_G_T is not None:
        return group.planning_G_T
    return [np.zeros(x.size, dtype=bool) for x in group.logprobs_G_T]


# ------------------------------------------------------------------ steps 1, 3, 4


def _skip_reasons(groups: list[TokenGroup], stats: AdvantageStats) -> list[str | None]:
    """Step 1: per group None (kept), "all_correct" or "all_wrong"; counts into stats."""
    sizes = np.array([g.rewards_G.size for g in groups], dtype=np.int64)
    rewards = np.concatenate([g.rewards_G for g in groups])
    starts = np.zeros(len(groups), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    lo = np.minimum.reduceat(rewards, starts)
    equal = lo == np.maximum.reduceat(rewards, starts)
    positive = lo > 0
    stats.skipped_all_correct = int(np.count_nonzero(equal & positive))
    stats.skipped_all_wrong = int(np.count_nonzero(equal & ~positive))
    return [
        ("all_correct" if p else "all_wrong") if e else None
        for e, p in zip(equal.tolist(), positive.tolist())
    ]


@dataclass
class _Tokens:
    """Every token of the kept groups, concatenated (steps 3 and 4)."""

    seg: Segments
    h: np.ndarray  # uncertainty per token (may live in a reused Workspace buffer)
    plan_index: np.ndarray  # flat indices of the planning tokens
    segment_sums: np.ndarray  # sum of h per completion
    total: float  # sum of h


def _entropies(kept: list[TokenGroup]) -> np.ndarray | None:
    have = [g.entropies_G_T is not None for g in kept]
    if kept and all(have):
        return np.concatenate([x for g in kept for x in g.entropies_G_T])
    if any(have):
        raise ValueError("entropies were given for some groups but not for others")
    return None


def _plan_index(kept: list[TokenGroup], n_tokens: int) -> np.ndarray:
    if not n_tokens or all(g.planning_G_T is None for g in kept):
        return np.zeros(0, dtype=np.int64)
    plan = Workspace.get("planning", n_tokens, np.bool_)
    np.concatenate([x for g in kept for x in _planning_masks(g)], out=plan)
    return np.flatnonzero(plan)


def _mean_var(x: np.ndarray) -> tuple[float, float]:
    if x.size == 0:
        return math.nan, math.nan
    mean = float(x.mean())
    return mean, float(np.mean(np.square(x - mean)))


def _fill_stats(t: _Tokens, stats: AdvantageStats) -> None:
    """Step 4. Planning tokens are few, so they are gathered; the execution statistics
    are the totals minus the planning part, with the variance taken about the execution
    mean (two passes, no large temporaries beyond one reused scratch buffer)."""
    n = t.h.size
    n_plan = int(t.plan_index.size)
    n_exec = n - n_plan
    stats.num_planning_tokens = n_plan
    stats.num_exec_tokens = n_exec
    plan_h = t.h[t.plan_index]
    stats.plan_mean, stats.plan_var = _mean_var(plan_h)
    if n_exec:
        mean = (t.total - float(plan_h.sum())) / n_exec
        dev = np.subtract(t.h, mean, out=Workspace.get("stats", n))
        # (not np.dot: a BLAS call may wake a thread pool that then spins on a busy CPU)
        sq = float(np.multiply(dev, dev, out=dev).sum())
        if n_plan:
            sq -= float(np.sum(np.square(plan_h - mean)))
        stats.exec_mean, stats.exec_var = mean, max(sq / n_exec, 0.0)


def _by_group(pieces: list[np.ndarray], kept: list[TokenGroup]) -> list[list[np.ndarray]]:
    out, k = [], 0
    for g in kept:
        n = g.rewards_G.size
        out.append(pieces[k : k + n])
        k += n
    return out


def _group_token_bounds(seg: Segments, kept: list[TokenGroup]) -> list[int]:
    """Flat token offsets where each kept group starts, plus the total at the end."""
    ends = np.cumsum(seg.lengths)
    completions = np.cumsum([g.rewards_G.size for g in kept])
    return [0, *(int(ends[c - 1]) if c else 0 for c in completions.tolist())]


def _effective_rho(transform_params: Mapping[str, Any], configured: Any) -> float:
    """The mask fraction: ``surprisal_mask_rho`` (else ``entropy_mask_rho``) from the
    transform params when given there, else the configured one; a number in [0, 1]."""
    raw = transform_params.get("surprisal_mask_rho", transform_params.get("entropy_mask_rho"))
    if raw is None:
        raw = configured
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError(f"surprisal_mask_rho must be a number in [0, 1], got {raw!r}")
    return check_mask_rho(raw)


# ---------------------------------------------------------------------- pipeline


class AdvantagePipeline:
    """The configured advantage flow, resolved once; call it with each step's groups.

    ``algorithm_mode`` names a built-in alias (replaced by its advantage/transform pair)
    or an algorithm plugin (which then replaces the advantage and transform steps, and
    those two names are not resolved). Unknown names and plugins that are not callable
    raise PluginError here. ``search_paths`` (``[plugins] search_paths``) are put on
    sys.path while the plugins are resolved, here and never again.

    ``needs_entropies`` is True when the uncertainty kind needs the full-vocabulary
    entropies, which then must be in every group's ``entropies_G_T``.
    ``surprisal_mask_rho`` (``[algorithm] surprisal_mask_rho``, in [0, 1]) is the
    fraction of each group's tokens ``entropy_mask`` keeps (see step 6).
    """

    def __init__(
        self,
        *,
        advantage_mode: str = "maxrl",
        transform_mode: str = "gtpo_sepa",
        algorithm_mode: str | None = "",
        gtpo_beta: float = 0.1,
        hicra_alpha: float = 0.2,
        uncertainty_kind: str = "surprisal",
        advantage_params: Mapping[str, Any] | None = None,
        transform_params: Mapping[str, Any] | None = None,
        skip_uninformative: bool = True,
        search_paths: Iterable[str] = (),
        surprisal_mask_rho: float = 0.0,
    ):
        paths = tuple(search_paths)
        self.algorithm_mode = algorithm_mode or ""
        self.gtpo_beta = gtpo_beta
        self.hicra_alpha = hicra_alpha
        self.uncertainty_kind = uncertainty_kind
        self.advantage_params = dict(advantage_params or {})
        self.transform_params = dict(transform_params or {})
        self.skip_uninformative = skip_uninformative
        self.surprisal_mask_rho = _effective_rho(self.transform_params, surprisal_mask_rho)
        self._algorithm: Callable | None = None  # an algorithm plugin
        self._episode: Callable | None = None  # see plugins.EpisodeFn
        self._transform: Callable | None = None  # a transform plugin
        self._kernel = ""  # a built-in transform's vectorised kernel
        self._token_varying = False  # the kernel's registry entry says so
        self._varies: bool | None = None  # varies_per_token(), once known
        if self.algorithm_mode:
            entry = builtin_entry(registry.ALGORITHM_MODES, self.algorithm_mode)
            if entry is not None and entry.alias_of:
                advantage_mode, transform_mode = entry.alias_of
            else:
                self._algorithm = resolve_callable(
                    registry.ALGORITHM_MODES, self.algorithm_mode, paths
                )
        self.advantage_mode, self.transform_mode = advantage_mode, transform_mode
        if self._algorithm is None:
            self._resolve_transform(paths)
            self._episode = episode_fn(advantage_mode, paths)
            entry = registry.ADVANTAGE_MODES.entry(advantage_mode)
            if entry is not None and not entry.plugin:  # a bad param fails here, not at step 0
                check_params(entry.name, self.advantage_params)
        self._uncertainty = resolve_uncertainty(uncertainty_kind, paths)
        self._uncertainty_builtin = registry.UNCERTAINTY_KINDS.is_builtin(uncertainty_kind)
        self.needs_entropies = requires_entropies(uncertainty_kind) or bool(
            getattr(self._uncertainty, "needs_entropies", False)
        )

    def _resolve_transform(self, paths: tuple[str, ...]) -> None:
        entry = builtin_entry(registry.TRANSFORM_MODES, self.transform_mode)
        if entry is not None and entry.kernel:
            self._kernel, self._token_varying = entry.kernel, entry.token_varying
        else:
            self._transform = resolve_callable(registry.TRANSFORM_MODES, self.transform_mode, paths)

    def __repr__(self) -> str:
        flow = self.algorithm_mode or f"{self.advantage_mode}+{self.transform_mode}"
        return f"AdvantagePipeline({flow}, uncertainty={self.uncertainty_kind})"

    # ------------------------------------------------------------------ a call

    def __call__(
        self, groups: Sequence[TokenGroup], *, sepa_lambda: LambdaSource = 0.0, step: int = 0
    ) -> BatchAdvantages:
        """Token advantages for every group of a step, plus the step's statistics (see
        the module docstring for the steps and for `sepa_lambda` as a callable)."""
        gs = [_checked_group(i, g) for i, g in enumerate(groups)]
        stats = AdvantageStats(num_groups=len(gs))
        if self.skip_uninformative and gs:
            skipped = _skip_reasons(gs, stats)
        else:
            skipped = [None] * len(gs)
        kept = [g for g, s in zip(gs, skipped) if s is None]
        stats.kept_groups = len(kept)
        episode = self._episode_advantages(kept)
        tokens = self._tokens(kept)
        _fill_stats(tokens, stats)
        lam = sepa_lambda(stats) if callable(sepa_lambda) else sepa_lambda
        stats.sepa_lambda = lam = check_sepa_lambda(lam)
        if self._kernel:
            per_group, stats.extra_metrics = self._run_kernel(kept, episode, tokens, lam)
        else:
            per_group, stats.extra_metrics = self._run_plugin(kept, episode, tokens, lam, step)
        it = iter(per_group)
        advantages = [None if s is not None else next(it) for s in skipped]
        return BatchAdvantages(advantages=advantages, stats=stats, skipped=skipped)

    def _episode_advantages(self, kept: list[TokenGroup]) -> np.ndarray:
        """Step 2: one episode advantage per completion of the kept groups."""
        if self._episode is None or not kept:
            return np.zeros(0)
        lengths = [np.array([x.size for x in g.logprobs_G_T], dtype=np.int64) for g in kept]
        return self._episode([g.rewards_G for g in kept], dict(self.advantage_params), lengths)

    def _tokens(self, kept: list[TokenGroup]) -> _Tokens:
        """Step 3: the uncertainty of every kept token, with the planning-token indices."""
        parts = [x for g in kept for x in g.logprobs_G_T]
        seg = Segments.from_lengths([x.size for x in parts])
        entropies = _entropies(kept)
        if isinstance(self._uncertainty, PerCompletionUncertainty):
            ents = None if entropies is None else seg.split(entropies)
            planning = [x for g in kept for x in _planning_masks(g)]
            h = self._uncertainty.per_completion(parts, ents, planning, self.transform_params)
        elif self._uncertainty_builtin:
            # built-ins compute in place, in a reused buffer (see transforms.Workspace)
            logprobs = Workspace.get("logprobs", seg.total)
            if seg.total:
                np.concatenate(parts, out=logprobs)
            h = self._uncertainty(logprobs, entropies, out=logprobs)
        else:
            logprobs = np.concatenate(parts) if parts else np.zeros(0)
            if np.isnan(logprobs).any():
                raise ValueError("logprobs contain NaN")
            h = self._uncertainty(logprobs, entropies)
        plan_index = _plan_index(kept, seg.total)
        sums = seg.sum(h)
        total = float(sums.sum())
        if not math.isfinite(total):
            source = "entropies" if entropies is not None else "logprobs"
            raise ValueError(f"uncertainties are not finite: the {source} contain NaN or +inf")
        return _Tokens(seg, h, plan_index, sums, total)

    def _run_kernel(
        self, kept: list[TokenGroup], episode: np.ndarray, t: _Tokens, lam: float
    ) -> tuple[list[list[np.ndarray]], dict[str, float]]:
        """Step 6 with a built-in transform: one kernel call over every kept token (then
        the per-group mask of ``entropy_mask``); returns the advantages and metrics."""
        flat = token_advantages_flat(
            self._kernel,
            episode,
            t.h,
            None,
            t.seg,
            gtpo_beta=self.gtpo_beta,
            hicra_alpha=self.hicra_alpha,
            sepa_lambda=lam,
            plan_index=t.plan_index,
            segment_sums=t.segment_sums,
        )
        metrics: dict[str, float] = {}
        if self._kernel == "entropy_mask" and self.surprisal_mask_rho > 0.0 and kept:
            taus, fractions = surprisal_mask(
                flat, t.h, _group_token_bounds(t.seg, kept), self.surprisal_mask_rho
            )
            metrics = {
                "entropy_mask_threshold": float(np.mean(taus)),
                "entropy_mask_fraction": float(np.mean(fractions)),
            }
        return _by_group(t.seg.split(flat), kept), metrics

    def _run_plugin(
        self, kept: list[TokenGroup], episode: np.ndarray, t: _Tokens, lam: float, step: int
    ) -> tuple[list[list[np.ndarray]], dict[str, float]]:
        """Steps 2 + 6 with an algorithm plugin, or 6 with a transform plugin: one call
        per kept group; returns the advantages and the averaged extra metrics."""
        h_by_group = _by_group(t.seg.split(t.h.copy()), kept)  # plugins may keep what they get
        advantage_params, params = dict(self.advantage_params), dict(self.transform_params)
        per_group, metrics, k = [], {}, 0
        for g, h in zip(kept, h_by_group):
            common = dict(
                logprobs_G_T=g.logprobs_G_T,
                uncertainties_G_T=h,
                planning_G_T=_planning_masks(g),
                sepa_lambda=lam,
                step=step,
                params=params,
                gtpo_beta=self.gtpo_beta,
                hicra_alpha=self.hicra_alpha,
                entropies_G_T=g.entropies_G_T,
                uncertainty_kind=self.uncertainty_kind,
                surprisal_mask_rho=self.surprisal_mask_rho,
            )
            if self._algorithm is not None:
                kind, name, fn = "algorithm_mode", self.algorithm_mode, self._algorithm
                ctx: Any = AlgorithmContext(
                    rewards_G=g.rewards_G.copy(), advantage_params=advantage_params, **common
                )
            else:
                kind, name, fn = "transform_mode", self.transform_mode, self._transform
                n = g.rewards_G.size
                ctx = TransformContext(episode_advantages_G=episode[k : k + n].copy(), **common)
                k += n
            out = call_plugin(kind, name, fn, ctx)
            arrays, extra = check_token_output(kind, name, out, [x.size for x in g.logprobs_G_T])
            per_group.append(arrays)
            for key, v in extra.items():
                metrics.setdefault(key, []).append(v)
        return per_group, {key: float(np.mean(v)) for key, v in metrics.items()}

    # ------------------------------------------------------------------ flow facts

    def varies_per_token(self) -> bool:
        """True when tokens of one completion can get different advantages. Built-in
        transforms (and algorithm aliases) answer from their registry entry; plugins
        are probed once on a small synthetic group, with surprisal as the uncertainty."""
        if self._kernel:
            return self._token_varying
        if self._varies is None:
            self._varies = self._probe()
        return self._varies

    def _probe(self) -> bool:
        rng = np.random.default_rng(0)
        group = TokenGroup(
            np.array([1.0, 0.0, 0.0, 1.0]),
            [-rng.exponential(1.0, size=12) for _ in range(4)],
            [np.arange(12) < 3 for _ in range(4)],
        )
        probe = copy.copy(self)
        probe.uncertainty_kind = "surprisal"
        probe._uncertainty, probe._uncertainty_builtin = surprisal, True
        advantages = probe([group], sepa_lambda=0.5).advantages[0] or []
        return any(np.ptp(x) > 1e-12 for x in advantages)


def compute_token_advantages(
    rewards_G: ArrayLike,
    logprobs_G_T: Sequence[ArrayLike],
    planning_G_T: Sequence[ArrayLike] | None,
    *,
    advantage_mode: str = "maxrl",
    transform_mode: str = "gtpo_sepa",
    gtpo_beta: float = 0.1,
    hicra_alpha: float = 0.2,
    sepa_lambda: float = 0.0,
    uncertainty_kind: str = "surprisal",
    entropies_G_T: Sequence[ArrayLike] | None = None,
    advantage_params: Mapping[str, Any] | None = None,
    transform_params: Mapping[str, Any] | None = None,
    step: int = 0,
    algorithm_mode: str | None = None,
    search_paths: Iterable[str] = (),
    surprisal_mask_rho: float = 0.0,
) -> list[np.ndarray]:
    """Token advantages of one prompt group: one float64 array per completion.

    `rewards_G` has one reward per completion; `logprobs_G_T` (and `planning_G_T`,
    `entropies_G_T` when given) one sequence per completion, of ragged lengths, as
    lists or numpy arrays. `planning_G_T=None` means no planning tokens. The group is
    never skipped here: equal rewards simply give zero advantages under the built-in
    modes (the group is the whole batch of ``reinforce_pp``).
    Builds an :class:`AdvantagePipeline` on every call: for many calls, build one.
    """
    pipeline = AdvantagePipeline(
        advantage_mode=advantage_mode,
        transform_mode=transform_mode,
        algorithm_mode=algorithm_mode,
        gtpo_beta=gtpo_beta,
        hicra_alpha=hicra_alpha,
        uncertainty_kind=uncertainty_kind,
        advantage_params=advantage_params,
        transform_params=transform_params,
        skip_uninformative=False,
        search_paths=search_paths,
        surprisal_mask_rho=surprisal_mask_rho,
    )
    group = TokenGroup(rewards_G, logprobs_G_T, planning_G_T, entropies_G_T)  # type: ignore[arg-type]
    out = pipeline([group], sepa_lambda=sepa_lambda, step=step).advantages[0]
    assert out is not None
    return out
