"""`[reward] type = "match"`: the last boxed answer, stripped, equals the reference."""

from __future__ import annotations

from collections.abc import Sequence

from retrain.rewards.base import BatchScore, Reward
from retrain.rewards.boxed import extract_boxed
from retrain.types import Example


class MatchReward(Reward):
    """1.0 when the content of the last `\\boxed{...}` equals the stripped reference,
    else 0.0. No box, or an unterminated last box, scores 0.0 (counted as no answer)."""

    name = "match"

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        out = BatchScore()
        for response, example in zip(responses, examples):
            answer = extract_boxed(response)
            out.answers.append(answer)
            if answer is None:
                out.no_answer += 1
                out.rewards.append(0.0)
            else:
                out.rewards.append(1.0 if answer == str(example.reference).strip() else 0.0)
        return out
