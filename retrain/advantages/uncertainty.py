"""Per-token uncertainty h_t, the signal GTPO weights tokens by.

Every kind is an element-wise function over a flat array holding the tokens of many
completions: ``fn(logprobs_T, entropies_T=None) -> h_T`` (float64, same length).

- ``surprisal`` (default): h = -logprob of the sampled token, capped at 50.
- ``predictive_variance`` (aliases ``pred_var``, ``bernoulli_variance``): h = p (1 - p)
  with p = exp(logprob), the Bernoulli variance of "the sampled token is drawn".
- ``shannon_entropy``: -sum_v p_v log p_v over the whole vocabulary at each position.
  It cannot be rebuilt from the sampled token's logprob, so it is taken from the
  per-token entropies the backend returned (today only the local backend with the
  pytorch engine does). Asking for it without them raises
  :class:`UncertaintyUnavailableError`; there is never a silent fallback.
- a dotted path ``pkg.mod.fn``: ``fn(logprobs)`` or ``fn(logprobs, entropies)``; its
  output is checked (length, finiteness) and a malformed one is a PluginError.
- a :class:`PerCompletionUncertainty`, computed one completion at a time with its
  planning mask and the transform params. A registry adapter returns one for plugin
  forms that need this (retrain.compat: the original API's ``UncertaintySpec``,
  factories and ``compute(ctx: UncertaintyContext)`` plugins).

Aliases: ``token_surprisal``, ``neg_logprob``, ``negative_logprob``, ``nll`` name
``surprisal``; ``shannon``, ``entropy``, ``token_entropy`` name ``shannon_entropy``;
``pred_var``, ``bernoulli_variance`` name ``predictive_variance``.

Names are resolved through ``retrain.registry.UNCERTAINTY_KINDS``, the same registry
that config validation and ``retrain plugins`` use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from retrain.advantages.plugins import positional_arity
from retrain.errors import PluginError, RetrainError

SURPRISAL_CAP = 50.0

UncertaintyFn = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


class UncertaintyUnavailableError(RetrainError, ValueError):
    """The configured uncertainty kind needs data the backend did not return."""


@runtime_checkable
class PerCompletionUncertainty(Protocol):
    """An uncertainty computed one completion at a time: it may read each completion's
    planning mask and the transform params, which the flat form never sees. The pipeline
    calls :meth:`per_completion` instead of the flat ``fn(logprobs_T, entropies_T)``; an
    attribute ``needs_entropies = True`` asks for the backend's entropies."""

    def per_completion(
        self,
        logprobs: Sequence[np.ndarray],
        entropies: Sequence[np.ndarray] | None,
        planning: Sequence[np.ndarray],
        params: Mapping[str, Any],
    ) -> np.ndarray:
        """h of every token, the completions concatenated (float64, checked)."""
        ...


def surprisal(
    logprobs_T: np.ndarray, entropies_T: np.ndarray | None = None, *, out: np.ndarray | None = None
) -> np.ndarray:
    """-logprob of each sampled token, capped at 50 (so -inf logprobs stay finite).
    `out` (built-ins only) receives the result and may be `logprobs_T` itself."""
    lp = np.asarray(logprobs_T, dtype=np.float64)
    h = np.negative(lp, out=out)
    return np.minimum(h, SURPRISAL_CAP, out=h)


def predictive_variance(
    logprobs_T: np.ndarray, entropies_T: np.ndarray | None = None, *, out: np.ndarray | None = None
) -> np.ndarray:
    """p (1 - p) with p = exp(logprob) of each sampled token; in [0, 0.25]."""
    p = np.exp(np.asarray(logprobs_T, dtype=np.float64), out=out)
    return np.multiply(p, 1.0 - p, out=p)


def shannon_entropy(
    logprobs_T: np.ndarray, entropies_T: np.ndarray | None = None, *, out: np.ndarray | None = None
) -> np.ndarray:
    """The full-vocabulary entropy at each position, as supplied by the backend."""
    if entropies_T is None:
        raise UncertaintyUnavailableError(
            "uncertainty_kind 'shannon_entropy' needs the full-vocabulary entropy of every "
            "sampled position, and the backend returned none. Only the local backend with "
            'the pytorch inference engine provides it ([backend] backend = "local", '
            '[inference] engine = "pytorch"); otherwise use uncertainty_kind = '
            '"surprisal" or "predictive_variance".'
        )
    ent = np.asarray(entropies_T, dtype=np.float64)
    lp = np.asarray(logprobs_T)
    if ent.shape != lp.shape:
        raise ValueError(
            f"entropies have shape {ent.shape} but logprobs have shape {lp.shape}; "
            "the backend must return one entropy per sampled token"
        )
    if out is not None:
        np.copyto(out, ent)
        return out
    return ent


def requires_entropies(kind: str) -> bool:
    """True when `kind` can only be computed from backend-supplied entropies (a plugin
    may ask for them too: see ``AdvantagePipeline.needs_entropies``)."""
    from retrain.registry import UNCERTAINTY_KINDS

    return UNCERTAINTY_KINDS.canonical(kind) == "shannon_entropy"


def resolve_uncertainty(
    kind: str, search_paths: Iterable[str] = ()
) -> UncertaintyFn | PerCompletionUncertainty:
    """The function behind an uncertainty kind: a built-in name or alias, or a dotted path.

    The returned callable has the signature ``(logprobs_T, entropies_T) -> h_T``
    (built-ins also take ``out=``), unless a registry adapter made the plugin a
    :class:`PerCompletionUncertainty`, returned as it is. A plugin's output is validated,
    and problems raise PluginError naming the plugin.
    """
    from retrain.registry import UNCERTAINTY_KINDS

    if not UNCERTAINTY_KINDS.is_plugin(kind):
        return UNCERTAINTY_KINDS.resolve(kind)
    fn = UNCERTAINTY_KINDS.resolve_plugin(kind, search_paths)
    if isinstance(fn, PerCompletionUncertainty):
        return fn  # called per completion by the pipeline
    if not callable(fn):
        raise PluginError(
            f"uncertainty_kind plugin {kind!r} is not callable (got {type(fn).__name__})"
        )
    return _checked_flat(kind, fn)


def _checked_flat(kind: str, fn: Callable) -> UncertaintyFn:
    """A flat ``fn(logprobs[, entropies])`` plugin, its exceptions and output checked."""
    arity = positional_arity(fn)

    def plugin(logprobs_T: np.ndarray, entropies_T: np.ndarray | None = None) -> np.ndarray:
        try:
            out = fn(logprobs_T, entropies_T) if arity >= 2 else fn(logprobs_T)
        except RetrainError:
            raise
        except Exception as exc:
            raise PluginError(
                f"uncertainty_kind plugin {kind!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        try:
            h = np.asarray(out, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise PluginError(
                f"uncertainty_kind plugin {kind!r} must return numbers, got {type(out).__name__}"
            ) from exc
        n = len(logprobs_T)
        if h.shape != (n,):
            raise PluginError(
                f"uncertainty_kind plugin {kind!r} returned shape {h.shape}, expected ({n},): "
                "one value per token"
            )
        if not np.all(np.isfinite(h)):
            raise PluginError(f"uncertainty_kind plugin {kind!r} returned NaN or infinite values")
        return h

    plugin.__name__ = f"uncertainty_plugin[{kind}]"
    return plugin


def compute_uncertainty(
    kind: str,
    logprobs_T: np.ndarray,
    entropies_T: np.ndarray | None = None,
    search_paths: Iterable[str] = (),
) -> np.ndarray:
    """Resolve `kind` and apply it to a flat token array (a per-completion kind sees it
    as one completion without planning tokens)."""
    fn = resolve_uncertainty(kind, search_paths)
    if isinstance(fn, PerCompletionUncertainty):
        lp = np.asarray(logprobs_T, dtype=np.float64).reshape(-1)
        ent = None if entropies_T is None else [np.asarray(entropies_T, dtype=np.float64)]
        return fn.per_completion([lp], ent, [np.zeros(lp.size, dtype=bool)], {})
    return fn(logprobs_T, entropies_T)
