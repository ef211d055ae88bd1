"""The `gym` reward: reasoning-gym's own score_answer on the boxed answer."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from builders import (
    data_source,  # noqa: E402
    reward,  # noqa: E402
)

from retrain.errors import RewardError  # noqa: E402
from retrain.types import Example  # noqa: E402


@pytest.fixture(scope="module")
def chain_sum():
    return data_source(
        "reasoning_gym", task="chain_sum", args={"min_terms": 2, "max_terms": 2}, size=8, seed=3
    )


def test_gym_reward_uses_the_task_scorer(chain_sum):
    r = reward("gym")
    exs = chain_sum.examples[:3]
    responses = [
        f"the sum is \\boxed{{{exs[0].reference}}}",
        f"\\boxed{{{int(exs[1].reference) + 1}}}",
        "I don't know",
    ]
    out = r.score_batch(responses, exs)
    assert out.rewards == [1.0, 0.0, 0.0]
    assert out.answers[0] == exs[0].reference
    assert out.no_answer == 1


def test_gym_reward_partial_credit():
    # spell_backward gives partial credit for a nearly right spelling.
    src = data_source("reasoning_gym", task="spell_backward", size=4, seed=0)
    r = reward("gym")
    ex = src.examples[0]
    assert len(ex.reference) > 3
    out = r.score_batch([f"\\boxed{{{ex.reference}}}", f"\\boxed{{{ex.reference[:-1]}}}"], [ex, ex])
    assert out.rewards[0] == 1.0
    assert 0.0 < out.rewards[1] < 1.0


def test_gym_reward_rejects_non_gym_examples():
    r = reward("gym")
    with pytest.raises(RewardError, match="reasoning-gym examples only"):
        r.score_batch(
            ["\\boxed{1}"], [Example(prompt="q", reference="1", meta={"source": "jsonl"})]
        )


def test_score_answer_exception_is_counted(chain_sum, monkeypatch):
    r = reward("gym")
    ex = chain_sum.examples[0]
    ds = r._dataset(ex.meta["task"], ex.meta["args"])

    def broken(answer, entry):
        raise RuntimeError("scorer bug")

    monkeypatch.setattr(ds, "score_answer", broken)
    out = r.score_batch(["\\boxed{1}", "\\boxed{2}"], [ex, ex])
    assert out.rewards == [0.0, 0.0] and out.errors == 2
