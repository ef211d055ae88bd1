"""One step's rollout: sample the groups, score them, and turn them into what the
advantage pipeline and the backend consume (TokenGroup, Datum)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from retrain.logs.timer import PhaseTimer
from retrain.shaping import is_truncated
from retrain.types import Datum, Example, GroupRollout, Sample, SamplingParams, TokenGroup


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


class RolloutFn(Protocol):
    """What the trainer and the held-out evaluator call to sample and score one batch:
    `Rollout` (single-turn) or `multiturn.MultiTurnRollout`."""

    def __call__(
        self,
        examples: Sequence[Example],
        group_size: int,
        params: SamplingParams,
        timer: PhaseTimer,
    ) -> tuple[list[GroupRollout], dict[str, float]]:
        """`group_size` scored completions per example, as one GroupRollout each, and the
        reward counters (reward_errors, reward_timeouts, no_answer_rate, ...) for the
        metrics row; the phases it spends (sampling, scoring, ...) are added to `timer`."""

    def close(self) -> None:
        """Release what the rollout holds of its own (multi-turn: its event loop); the
        backend and the reward it calls are closed by their owner."""


@dataclass(frozen=True)
class Rollout:
    """Sampling and scoring of one step's groups, with everything fixed for the run.
    A completion counts as correct when its reward is above `correct_above`."""

    backend: Any
    reward: Any
    renderer: Any
    correct_above: float

    def __call__(
        self,
        examples: Sequence[Example],
        group_size: int,
        params: SamplingParams,
        timer: PhaseTimer,
    ) -> tuple[list[GroupRollout], dict[str, float]]:
        """`group_size` scored completions per example, and the reward counters (errors,
        timeouts, no-answer rate) for the metrics row."""
        prompts = [self.renderer.encode(e) for e in examples]
        with timer.phase("sampling"):
            samples = self.backend.sample(prompts, group_size, params)
        with timer.phase("scoring"):
            return self._score(examples, prompts, samples)

    def _score(self, examples, prompts, samples) -> tuple[list[GroupRollout], dict[str, float]]:
        decode = self.renderer.tokenizer.decode
        texts = [[decode(s.token_ids, skip_special_tokens=True) for s in g] for g in samples]
        flat_examples = [e for e, g in zip(examples, samples, strict=True) for _ in g]
        scored = self.reward.score_batch([t for g in texts for t in g], flat_examples)
        groups, k = [], 0
        for example, prompt, group, group_texts in zip(
            examples, prompts, samples, texts, strict=True
        ):
            n = len(group)
            rewards = list(scored.rewards[k : k + n])
            answers = list(scored.answers[k : k + n])
            correct = [r > self.correct_above for r in rewards]
            groups.append(
                GroupRollout(example, prompt, group, group_texts, rewards, answers, correct)
            )
            k += n
        return groups, scored.counters()

    def close(self) -> None:
        pass  # nothing of its own: the backend and the reward are closed by their owner


def correct_rate(groups: Sequence[GroupRollout]) -> float:
    total = sum(len(g) for g in groups)
    return sum(g.num_correct for g in groups) / total if total else 0.0


def planning_masks(detector, vocab: VocabTable, samples: Sequence[Sample]) -> list[np.ndarray]:
    """Per completion, which of the MODEL's tokens belong to a planning phrase (a
    multi-turn trajectory's environment tokens are left out: the masks have one entry
    per model token, like the advantage pipeline's arrays)."""
    pieces = [vocab.token_strings(s.model_tokens(s.token_ids).tolist()) for s in samples]
    texts, offsets = [], []
    for p in pieces:
        lengths = np.array([len(x) for x in p], dtype=np.int64)
        ends = np.cumsum(lengths)
        texts.append("".join(p))
        offsets.append(
            np.stack([ends - lengths, ends], axis=1) if p else np.zeros((0, 2), dtype=np.int64)
        )
    return detector.detect_many(texts, offsets)


def scored_members(group: GroupRollout) -> list[int]:
    """The completions that enter the group's advantage statistics: all but the failed
    conversations (their reward 0 says nothing of the policy, and in the baseline it
    would turn a group whose conversations all scored 1.0 into an update)."""
    failed = group.failed or [False] * len(group)
    return [i for i, f in enumerate(failed) if not f]


def token_groups(
    groups: Sequence[GroupRollout], planning: Sequence[list[np.ndarray]], with_entropies: bool
) -> list[TokenGroup]:
    """The advantage pipeline's view of each group (every group with a scored member:
    `pipeline_advantages`): its scored members' model tokens only (a multi-turn
    trajectory's environment tokens are gathered out, so GTPO/HICRA/SEPA and the
    planning masks never see them; build_datums scatters the advantages back)."""
    out = []
    for g, plan in zip(groups, planning, strict=True):
        keep = scored_members(g)
        samples = [g.samples[i] for i in keep]
        out.append(
            TokenGroup(
                rewards_G=np.asarray([g.rewards[i] for i in keep], dtype=np.float64),
                logprobs_G_T=[s.model_tokens(s.logprobs) for s in samples],
                planning_G_T=None if plan is None else [plan[i] for i in keep],
                entropies_G_T=[s.model_tokens(s.entropies) for s in samples]
                if with_entropies
                else None,
            )
        )
    return out


def pipeline_advantages(
    pipeline: Any, groups: Sequence[GroupRollout], planning: Sequence[Any], **kwargs: Any
) -> Any:
    """`pipeline`'s BatchAdvantages for `groups`, computed over their scored members
    (`scored_members`) and given back per group and completion; a group whose every
    conversation failed is skipped as "all_failed". `kwargs`: the pipeline call's."""
    seen = [i for i, g in enumerate(groups) if scored_members(g)]  # some to compare
    adv = pipeline(
        token_groups(
            [groups[i] for i in seen], [planning[i] for i in seen], pipeline.needs_entropies
        ),
        **kwargs,
    )
    skipped: list[str | None] = ["all_failed"] * len(groups)
    for i, why in zip(seen, adv.skipped, strict=True):
        skipped[i] = why
    return replace(adv, advantages=every_member(groups, seen, adv.advantages), skipped=skipped)


def every_member(
    groups: Sequence[GroupRollout], seen: Sequence[int], advantages: Sequence[list | None]
) -> list[list[np.ndarray] | None]:
    """The pipeline's advantages (of the groups `seen`, of their scored members) per
    group and completion again: None for a group it did not see, an empty array for a
    failed conversation (which build_datums skips: its loss mask is cleared)."""
    out: list[list[np.ndarray] | None] = [None] * len(groups)
    for gi, adv in zip(seen, advantages, strict=True):
        if adv is not None:
            row = [np.zeros(0)] * len(groups[gi])
            for i, a in zip(scored_members(groups[gi]), adv, strict=True):
                row[i] = a
            out[gi] = row
    return out


def build_datums(
    groups: Sequence[GroupRollout],
    advantages: Sequence[list[np.ndarray] | None],
    *,
    mask_truncated: bool = False,
) -> list[Datum]:
    """One Datum per non-empty completion of every kept group (skipped groups carry None).
    `mask_truncated` ([training] mask_truncated): a completion cut at max_tokens gets a
    zero loss mask, i.e. no datum (shaping.is_truncated says how this matches TRL)."""
    return [
        Datum(
            group.prompt_ids,
            sample.token_ids,
            sample.logprobs,
            scatter_model_tokens(adv, sample.loss_mask),
            sample.loss_mask,
        )
        for group, adv_G in zip(groups, advantages, strict=True)
        if adv_G is not None
        for sample, adv in zip(group.samples, adv_G, strict=True)
        if len(sample)
        and (sample.loss_mask is None or sample.loss_mask.any())
        and not (mask_truncated and is_truncated(sample))
    ]


def scatter_model_tokens(values_M: np.ndarray, mask_T: np.ndarray | None) -> np.ndarray:
    """Per-model-token values placed at the model's positions of the whole trajectory,
    0 at the environment's (the inverse of Sample.model_tokens)."""
    if mask_T is None:
        return values_M
    out_T = np.zeros(mask_T.size, dtype=np.float64)
    out_T[mask_T] = values_M
    return out_T
