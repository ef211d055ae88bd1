"""The advantage pipeline: rewards, logprobs and planning masks in, token advantages out.

Two entry points, both pure (numpy only):

- :func:`compute_token_advantages` for one prompt group -> one float64 array of token
  advantages per completion. This is the function plugin authors call and test with.
- :func:`compute_batch_advantages` for all the groups of a training step at once ->
  :class:`BatchAdvantages` (advantages per group, plus the step's
  :class:`AdvantageStats`). The trainer calls this one.

Steps of the batch form, in order:

1. **Skip** uninformative groups: a group whose rewards are all equal carries no
   signal. It is counted as *all-correct* when the common reward is > 0, otherwise as
   *all-wrong*, and gets ``None`` instead of advantages. (``skip_uninformative=False``
   keeps them.) A group of one completion is therefore always skipped.
2. **Episode advantages** of each kept group (``advantage_mode``).
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

       batch = compute_batch_advantages(
           groups, ...,
           sepa_lambda=lambda stats: sepa.update(step, correct_rate, stats.exec_var),
       )

6. **Token transform** (``transform_mode``). Built-in transforms run as one vectorised
   kernel over every token of the batch; a dotted-path transform is called once per
   kept group with a :class:`~retrain.advantages.context.TransformContext`.

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
  algorithm names (``maxrl_gtpo``, ``maxrl_gtpo_hicra``, ``maxrl_gtpo_sepa``) are the
  matching advantage/transform pairs and run on the vectorised path.

Every plugin output is checked: the right number of completions, each array as long
as its completion, every value finite; otherwise a PluginError names the plugin and the
problem. An exception inside a plugin is re-raised as a PluginError naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from retrain.advantages.context import AlgorithmContext, TransformContext, TransformOutput
from retrain.advantages.transforms import (
    Segments,
    Workspace,
    check_sepa_lambda,
    token_advantages_flat,
)
from retrain.advantages.uncertainty import positional_arity, resolve_uncertainty
from retrain.errors import PluginError, RetrainError

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
    """Result of :func:`compute_batch_advantages`: per group, a list with one float64
    array per completion, or None for a skipped group."""

    advantages: list[list[np.ndarray] | None]
    stats: AdvantageStats
    skipped: list[str | None]  # None (kept), "all_correct" or "all_wrong"

    @property
    def kept(self) -> list[bool]:
        return [a is not None for a in self.advantages]


@dataclass
class _Group:
    rewards: np.ndarray
    logprobs: list[np.ndarray]
    planning: list[np.ndarray] | None  # None: no planning tokens
    entropies: list[np.ndarray] | None

    def planning_masks(self) -> list[np.ndarray]:
        if self.planning is not None:
            return self.planning
        return [np.zeros(x.size, dtype=bool) for x in self.logprobs]


# --------------------------------------------------------------------------- input

_FIELDS = (
    ("rewards_G", "rewards"),
    ("logprobs_G_T", "logprobs"),
    ("planning_G_T", "planning"),
    ("entropies_G_T", "entropies"),
)


def _fields(group: Any) -> list[Any]:
    """(rewards, logprobs, planning, entropies) of a tuple, mapping or object."""
    if type(group) in (tuple, list):
        return [group[i] if i < len(group) else None for i in range(4)]
    if isinstance(group, Mapping):
        return [next((group[n] for n in names if n in group), None) for names in _FIELDS]
    out = []
    for names in _FIELDS:
        out.append(next((getattr(group, n) for n in names if hasattr(group, n)), None))
    if out[0] is None and isinstance(group, Sequence) and not isinstance(group, str | bytes):
        return [group[i] if i < len(group) else None for i in range(4)]
    return out


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


def _check_lengths(where: str, logprobs: list[np.ndarray], other: list[np.ndarray], what: str):
    for i, (a, b) in enumerate(zip(logprobs, other)):
        if a.size != b.size:
            raise ValueError(f"{where}completion {i} has {a.size} logprobs but {b.size} {what}")


def _normalise_group(
    gi: int,
    rewards_G: ArrayLike,
    logprobs_G_T: Sequence[ArrayLike],
    planning_G_T: Sequence[ArrayLike] | None,
    entropies_G_T: Sequence[ArrayLike] | None,
) -> _Group:
    where = f"group {gi}: " if gi >= 0 else ""
    rewards = np.asarray(rewards_G, dtype=np.float64)
    if rewards.ndim != 1 or rewards.size == 0:
        raise ValueError(f"{where}rewards must be a non-empty 1-D sequence")
    if logprobs_G_T is None:
        raise ValueError(f"{where}logprobs are missing")
    n = rewards.size
    logprobs = _vectors(logprobs_G_T, np.float64, where, "logprob sequences", n)
    planning = None
    if planning_G_T is not None:
        planning = _vectors(planning_G_T, np.bool_, where, "planning masks", n)
        _check_lengths(where, logprobs, planning, "planning flags")
    entropies = None
    if entropies_G_T is not None:
        entropies = _vectors(entropies_G_T, np.float64, where, "entropy sequences", n)
        _check_lengths(where, logprobs, entropies, "entropies")
    return _Group(rewards, logprobs, planning, entropies)


def _as_group(gi: int, group: Any) -> _Group:
    if isinstance(group, _Group):
        return group
    return _normalise_group(gi, *_fields(group))


# ------------------------------------------------------------------ plugin calling


def _call_plugin(kind: str, name: str, fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except RetrainError:
        raise
    except Exception as exc:
        raise PluginError(f"{kind} plugin {name!r} raised {type(exc).__name__}: {exc}") from exc


def _validate_vector(kind: str, name: str, out: Any, n: int) -> np.ndarray:
    try:
        arr = np.asarray(out, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PluginError(
            f"{kind} plugin {name!r} must return {n} numbers, got {type(out).__name__}"
        ) from exc
    if arr.shape != (n,):
        raise PluginError(
            f"{kind} plugin {name!r} returned {arr.size} value(s) (shape {arr.shape}) for a "
            f"group of {n}; it must return one advantage per completion"
        )
    if not np.all(np.isfinite(arr)):
        raise PluginError(f"{kind} plugin {name!r} returned NaN or infinite advantages")
    return arr


def _validate_token_output(kind: str, name: str, out: Any, lengths: Sequence[int]) -> tuple:
    extra: dict[str, float] = {}
    if isinstance(out, TransformOutput):
        arrays, extra = out.token_advantages, dict(out.extra_metrics or {})
    elif isinstance(out, list | tuple):
        arrays = out
    else:
        raise PluginError(
            f"{kind} plugin {name!r} must return a TransformOutput (or a list of arrays), "
            f"got {type(out).__name__}"
        )
    if len(arrays) != len(lengths):
        raise PluginError(
            f"{kind} plugin {name!r} returned token advantages for {len(arrays)} "
            f"completion(s); the group has {len(lengths)}"
        )
    result = []
    for i, (a, t) in enumerate(zip(arrays, lengths)):
        try:
            arr = np.array(a, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise PluginError(
                f"{kind} plugin {name!r}: completion {i} advantages are not numbers"
            ) from exc
        if arr.size != t:
            raise PluginError(
                f"{kind} plugin {name!r}: completion {i} has {t} tokens but "
                f"{arr.size} token advantages"
            )
        if not np.all(np.isfinite(arr)):
            raise PluginError(
                f"{kind} plugin {name!r}: completion {i} has NaN or infinite token advantages"
            )
        result.append(arr)
    clean_extra: dict[str, float] = {}
    for k, v in extra.items():
        try:
            clean_extra[str(k)] = float(v)
        except (TypeError, ValueError):
            raise PluginError(
                f"{kind} plugin {name!r}: extra_metrics[{k!r}] is not a number"
            ) from None
    return result, clean_extra


def _resolve_advantage(
    name: str, search_paths: Iterable[str]
) -> Callable[[np.ndarray, dict], np.ndarray]:
    from retrain.registry import ADVANTAGE_MODES

    fn = ADVANTAGE_MODES.resolve(name, search_paths)
    if not callable(fn):
        raise PluginError(f"advantage_mode plugin {name!r} is not callable")
    if ADVANTAGE_MODES.is_builtin(name):

        def run_builtin(rewards: np.ndarray, params: dict) -> np.ndarray:
            return np.asarray(fn(rewards, params), dtype=np.float64)

        run_builtin.grouped = getattr(fn, "grouped", None)  # type: ignore[attr-defined]
        return run_builtin
    arity = positional_arity(fn)

    def run(rewards: np.ndarray, params: dict) -> np.ndarray:
        args = (rewards.tolist(), params) if arity >= 2 else (rewards.tolist(),)
        out = _call_plugin("advantage_mode", name, fn, *args)
        return _validate_vector("advantage_mode", name, out, rewards.size)

    return run


# ------------------------------------------------------------------------- stats


def _mean_var(x: np.ndarray) -> tuple[float, float]:
    if x.size == 0:
        return math.nan, math.nan
    mean = float(x.mean())
    return mean, float(np.mean(np.square(x - mean)))


def _compute_stats(
    h: np.ndarray, plan_index: np.ndarray, stats: AdvantageStats, total: float
) -> None:
    """Fill the uncertainty statistics; `total` is sum(h).

    Planning tokens are few, so they are gathered; the execution statistics are the
    totals minus the planning part, with the variance taken about the execution mean
    (two passes, no large temporaries beyond one reused scratch buffer)."""
    n = h.size
    n_plan = int(plan_index.size)
    n_exec = n - n_plan
    stats.num_planning_tokens = n_plan
    stats.num_exec_tokens = n_exec
    plan_h = h[plan_index]
    stats.plan_mean, stats.plan_var = _mean_var(plan_h)
    if n_exec:
        mean = (total - float(plan_h.sum())) / n_exec
        dev = np.subtract(h, mean, out=Workspace.get("stats", n))
        # (not np.dot: a BLAS call may wake a thread pool that then spins on a busy CPU)
        sq = float(np.multiply(dev, dev, out=dev).sum())
        if n_plan:
            sq -= float(np.sum(np.square(plan_h - mean)))
        stats.exec_mean, stats.exec_var = mean, max(sq / n_exec, 0.0)


# ---------------------------------------------------------------------- pipeline


def compute_batch_advantages(
    groups: Sequence[Any],
    *,
    advantage_mode: str = "maxrl",
    transform_mode: str = "gtpo_sepa",
    algorithm_mode: str | None = None,
    gtpo_beta: float = 0.1,
    hicra_alpha: float = 0.2,
    sepa_lambda: LambdaSource = 0.0,
    uncertainty_kind: str = "surprisal",
    advantage_params: Mapping[str, Any] | None = None,
    transform_params: Mapping[str, Any] | None = None,
    step: int = 0,
    skip_uninformative: bool = True,
    search_paths: Iterable[str] = (),
) -> BatchAdvantages:
    """Token advantages for every group of a step, plus the step's statistics.

    Each group is a mapping or object with ``rewards_G``, ``logprobs_G_T`` and
    optionally ``planning_G_T`` / ``entropies_G_T`` (short names ``rewards``,
    ``logprobs``, ``planning``, ``entropies`` work too), or a tuple in that order.
    Per-token sequences may be lists or numpy arrays of any (ragged) lengths; missing
    planning masks mean "no planning tokens". See the module docstring for the steps
    and for ``sepa_lambda`` as a callable.
    """
    from retrain.registry import ALGORITHM_MODES, TRANSFORM_MODES, UNCERTAINTY_KINDS

    search_paths = tuple(search_paths)
    adv_params = dict(advantage_params or {})
    tr_params = dict(transform_params or {})
    gs = [_as_group(i, g) for i, g in enumerate(groups)]
    stats = AdvantageStats(num_groups=len(gs))
    sizes = np.array([g.rewards.size for g in gs], dtype=np.int64)
    rewards = np.concatenate([g.rewards for g in gs]) if gs else np.zeros(0)
    if not np.isfinite(rewards).all():
        bad = next(i for i, g in enumerate(gs) if not np.isfinite(g.rewards).all())
        raise ValueError(f"group {bad}: rewards must be finite, got {gs[bad].rewards.tolist()}")

    # what runs: a built-in algorithm is just an advantage/transform pair
    algorithm_fn: Callable | None = None
    if algorithm_mode:
        fn = ALGORITHM_MODES.resolve(algorithm_mode, search_paths)
        pair = getattr(fn, "pipeline_modes", None)
        if ALGORITHM_MODES.is_builtin(algorithm_mode) and pair:
            advantage_mode, transform_mode = pair
        elif not callable(fn):
            raise PluginError(f"algorithm_mode plugin {algorithm_mode!r} is not callable")
        else:
            algorithm_fn = fn
    transform_fn = None
    flat_mode = None
    grouped_advantage = None
    if algorithm_fn is None:
        transform_fn = TRANSFORM_MODES.resolve(transform_mode, search_paths)
        if TRANSFORM_MODES.is_builtin(transform_mode):
            flat_mode = getattr(transform_fn, "flat_mode", None)
        elif not callable(transform_fn):
            raise PluginError(f"transform_mode plugin {transform_mode!r} is not callable")
        run_advantage = _resolve_advantage(advantage_mode, search_paths)
        grouped_advantage = getattr(run_advantage, "grouped", None)
    uncertainty_fn = resolve_uncertainty(uncertainty_kind, search_paths)
    uncertainty_builtin = UNCERTAINTY_KINDS.is_builtin(uncertainty_kind)

    # 1. skip uninformative groups (all rewards equal)
    if skip_uninformative and gs:
        starts = np.zeros(len(gs), dtype=np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        lo = np.minimum.reduceat(rewards, starts)
        hi = np.maximum.reduceat(rewards, starts)
        equal = lo == hi
        skipped: list[str | None] = [
            ("all_correct" if lo[i] > 0 else "all_wrong") if equal[i] else None
            for i in range(len(gs))
        ]
        stats.skipped_all_correct = int(np.count_nonzero(equal & (lo > 0)))
        stats.skipped_all_wrong = int(np.count_nonzero(equal & ~(lo > 0)))
        keep_mask = ~equal
    else:
        skipped = [None] * len(gs)
        keep_mask = np.ones(len(gs), dtype=bool)
    kept = [g for g, s in zip(gs, skipped) if s is None]
    stats.kept_groups = len(kept)
    kept_sizes = sizes[keep_mask]

    # 2. episode advantages, one per completion of the kept groups
    episode_C = np.zeros(0)
    if algorithm_fn is None and kept:
        if grouped_advantage is not None:
            kept_rewards = np.concatenate([g.rewards for g in kept])
            episode_C = grouped_advantage(kept_rewards, kept_sizes, adv_params)
        else:
            episode_C = np.concatenate([run_advantage(g.rewards, adv_params) for g in kept])

    # 3. uncertainties over every kept token
    lengths = [x.size for g in kept for x in g.logprobs]
    seg = Segments.from_lengths(lengths)
    n_tokens = seg.total
    entropies = None
    if kept:
        have_entropies = [g.entropies is not None for g in kept]
        if all(have_entropies):
            entropies = np.concatenate([x for g in kept for x in g.entropies])
        elif any(have_entropies):
            raise ValueError("entropies were given for some groups but not for others")
    if uncertainty_builtin:
        # built-ins compute in place, in a reused buffer (see transforms.Workspace)
        logprobs = Workspace.get("logprobs", n_tokens)
        if n_tokens:
            np.concatenate([x for g in kept for x in g.logprobs], out=logprobs)
        h = uncertainty_fn(logprobs, entropies, out=logprobs)
    else:
        parts = [x for g in kept for x in g.logprobs]
        logprobs = np.concatenate(parts) if parts else np.zeros(0)
        if np.isnan(logprobs).any():
            raise ValueError("logprobs contain NaN")
        h = uncertainty_fn(logprobs, entropies)
    if any(g.planning is not None for g in kept) and n_tokens:
        plan = Workspace.get("planning", n_tokens, np.bool_)
        np.concatenate([x for g in kept for x in g.planning_masks()], out=plan)
        plan_index = np.flatnonzero(plan)
    else:
        plan_index = np.zeros(0, dtype=np.int64)

    # 4. statistics (the per-completion sums of h are reused by the transforms)
    segment_sums = seg.sum(h)
    total = float(segment_sums.sum())
    if not math.isfinite(total):
        source = "entropies" if entropies is not None else "logprobs"
        raise ValueError(f"uncertainties are not finite: the {source} contain NaN or +inf")
    _compute_stats(h, plan_index, stats, total)

    # 5. this step's SEPA lambda
    lam = sepa_lambda(stats) if callable(sepa_lambda) else sepa_lambda
    lam = check_sepa_lambda(lam)
    stats.sepa_lambda = lam

    # 6. token advantages
    per_group: list[list[np.ndarray]] = []
    if flat_mode is not None:
        flat = token_advantages_flat(
            flat_mode,
            episode_C,
            h,
            None,
            seg,
            gtpo_beta=gtpo_beta,
            hicra_alpha=hicra_alpha,
            sepa_lambda=lam,
            plan_index=plan_index,
            segment_sums=segment_sums,
        )
        pieces = seg.split(flat)
        k = 0
        for n in kept_sizes.tolist():
            per_group.append(pieces[k : k + n])
            k += n
    else:
        h_pieces = seg.split(h.copy())  # plugins may keep what they are given
        metrics: dict[str, list[float]] = {}
        k = 0
        for g in kept:
            n = g.rewards.size
            common = dict(
                logprobs_G_T=g.logprobs,
                uncertainties_G_T=h_pieces[k : k + n],
                planning_G_T=g.planning_masks(),
                sepa_lambda=lam,
                step=step,
                params=tr_params,
                gtpo_beta=gtpo_beta,
                hicra_alpha=hicra_alpha,
                entropies_G_T=g.entropies,
                uncertainty_kind=uncertainty_kind,
            )
            if algorithm_fn is not None:
                kind, name, fn = "algorithm_mode", algorithm_mode, algorithm_fn
                ctx: Any = AlgorithmContext(
                    rewards_G=g.rewards.copy(), advantage_params=adv_params, **common
                )
            else:
                kind, name, fn = "transform_mode", transform_mode, transform_fn
                ctx = TransformContext(episode_advantages_G=episode_C[k : k + n].copy(), **common)
            out = _call_plugin(kind, str(name), fn, ctx)
            arrays, extra = _validate_token_output(
                kind, str(name), out, [x.size for x in g.logprobs]
            )
            per_group.append(arrays)
            for key, v in extra.items():
                metrics.setdefault(key, []).append(v)
            k += n
        stats.extra_metrics = {key: float(np.mean(v)) for key, v in metrics.items()}

    advantages: list[list[np.ndarray] | None] = []
    it = iter(per_group)
    for s in skipped:
        advantages.append(None if s is not None else next(it))
    return BatchAdvantages(advantages=advantages, stats=stats, skipped=skipped)


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
) -> list[np.ndarray]:
    """Token advantages of one prompt group: one float64 array per completion.

    `rewards_G` has one reward per completion; `logprobs_G_T` (and `planning_G_T`,
    `entropies_G_T` when given) one sequence per completion, of ragged lengths, as
    lists or numpy arrays. `planning_G_T=None` means no planning tokens. The group is
    never skipped here: equal rewards simply give zero advantages under grpo/maxrl.
    """
    group = _normalise_group(-1, rewards_G, logprobs_G_T, planning_G_T, entropies_G_T)
    result = compute_batch_advantages(
        [group],
        advantage_mode=advantage_mode,
        transform_mode=transform_mode,
        algorithm_mode=algorithm_mode,
        gtpo_beta=gtpo_beta,
        hicra_alpha=hicra_alpha,
        sepa_lambda=sepa_lambda,
        uncertainty_kind=uncertainty_kind,
        advantage_params=advantage_params,
        transform_params=transform_params,
        step=step,
        skip_uninformative=False,
        search_paths=search_paths,
    )
    out = result.advantages[0]
    assert out is not None
    return out


# ------------------------------------------------- built-in algorithm_mode entries


def _builtin_algorithm(advantage_mode: str, transform_mode: str) -> Callable:
    def algorithm(ctx: AlgorithmContext) -> TransformOutput:
        adv = compute_token_advantages(
            ctx.rewards_G,
            ctx.logprobs_G_T,
            ctx.planning_G_T,
            advantage_mode=advantage_mode,
            transform_mode=transform_mode,
            gtpo_beta=ctx.gtpo_beta,
            hicra_alpha=ctx.hicra_alpha,
            sepa_lambda=ctx.sepa_lambda,
            uncertainty_kind=ctx.uncertainty_kind,
            entropies_G_T=ctx.entropies_G_T,
            advantage_params=ctx.advantage_params,
            transform_params=ctx.params,
            step=ctx.step,
        )
        return TransformOutput(adv)

    algorithm.pipeline_modes = (advantage_mode, transform_mode)  # type: ignore[attr-defined]
    algorithm.__name__ = f"algorithm_{advantage_mode}_{transform_mode}"
    algorithm.__doc__ = f"{advantage_mode} episode advantages, then the {transform_mode} transform."
    return algorithm


algorithm_maxrl_gtpo = _builtin_algorithm("maxrl", "gtpo")
algorithm_maxrl_gtpo_hicra = _builtin_algorithm("maxrl", "gtpo_hicra")
algorithm_maxrl_gtpo_sepa = _builtin_algorithm("maxrl", "gtpo_sepa")
