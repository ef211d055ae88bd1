"""Turning a step's samples into what the advantage pipeline and the backend consume."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from retrain.backends.base import Datum, Sample

CORRECT_THRESHOLD = 1.0 - 1e-9  # a completion is "correct" when its reward reaches 1


def is_correct(reward: float) -> bool:
    return reward >= CORRECT_THRESHOLD


class VocabTable:
    """The decoded text of every token id, built once, so per-token strings (for
    planning-token detection) cost a list lookup instead of a tokenizer call."""

    def __init__(self, tokenizer):
        size = len(tokenizer)
        self.pieces = tokenizer.batch_decode(
            [[i] for i in range(size)],
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def __len__(self) -> int:
        return len(self.pieces)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        # Special tokens (eos) carry no words: an empty piece keeps offsets aligned.
        return [
            "" if i in self.special else self.pieces[i] if 0 <= i < len(self.pieces) else ""
            for i in ids
        ]


@dataclass
class GroupRollout:
    """One prompt's completions and their scores."""

    prompt_ids: list[int]
    samples: list[Sample]
    texts: list[str]
    rewards: list[float]
    answers: list[str | None]

    @property
    def num_correct(self) -> int:
        return sum(is_correct(r) for r in self.rewards)


def planning_masks(detector, vocab: VocabTable, samples: Sequence[Sample]) -> list[np.ndarray]:
    pieces = [vocab.token_strings(s.token_ids) for s in samples]
    texts, offsets = [], []
    for p in pieces:
        ends = np.cumsum([len(x) for x in p], dtype=np.int64)
        starts = ends - np.array([len(x) for x in p], dtype=np.int64)
        texts.append("".join(p))
        offsets.append(np.stack([starts, ends], axis=1) if p else np.zeros((0, 2), dtype=np.int64))
    return detector.detect_many(texts, offsets)


def build_datums(
    groups: Sequence[GroupRollout], advantages: Sequence[list[np.ndarray] | None]
) -> list[Datum]:
    """One Datum per completion of every kept group (skipped groups carry None)."""
    datums = []
    for group, adv in zip(groups, advantages, strict=True):
        if adv is None:
            continue
        for sample, a in zip(group.samples, adv, strict=True):
            if not sample.token_ids:
                continue
            datums.append(
                Datum(
                    group.prompt_ids,
                    list(sample.token_ids),
                    list(sample.logprobs),
                    [float(x) for x in a],
                )
            )
    return datums
