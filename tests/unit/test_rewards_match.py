"""The boxed-answer extractor and the `match` reward."""

from __future__ import annotations

import pytest
from builders import reward
from hypothesis import given
from hypothesis import strategies as st

from retrain.rewards import BatchScore
from retrain.rewards.boxed import extract_all_boxed, extract_boxed
from retrain.rewards.match import MatchReward
from retrain.types import Example


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces kept whole
        ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last box wins
        ("\\boxed{  7 }", "7"),  # content is stripped
        ("\\boxed {7}", "7"),  # space before the brace
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the group
        ("\\fbox{x}", "x"),
        ("MATH style: \\boxed 5$.", "5"),
        ("$\\boxed{a}$ and \\boxed{b}", "b"),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        None,
        "no box here: 42",
        "\\boxed{42",  # truncated output
        "\\boxed{\\frac{1}{2}",  # truncated inside a nested group
        "\\boxed{1} then changed to \\boxed{2",  # the last box decides, and it is unfinished
        "\\boxedx{3}",  # not a box command
        "\\boxed",
    ],
)
def test_extract_boxed_none(text):
    assert extract_boxed(text) is None


def test_extract_all_boxed_in_order():
    assert extract_all_boxed("\\boxed{1} x \\boxed{\\frac{a}{b}} \\boxed{3") == [
        "1",
        "\\frac{a}{b}",
    ]


_atom = st.text(alphabet="abcxyz0123456789+-=^_ ", min_size=0, max_size=6)


@st.composite
def balanced(draw, depth=0):
    parts = draw(st.lists(_atom, min_size=1, max_size=3))
    out = parts[0]
    for p in parts[1:]:
        inner = draw(balanced(depth + 1)) if depth < 3 and draw(st.booleans()) else ""
        out += "{" + inner + "}" + p
    return out


@given(prefix=st.text(alphabet="abc .,\n0123456789", max_size=20), content=balanced())
def test_extract_boxed_roundtrip(prefix, content):
    # Any brace-balanced content comes back whole (stripped) from the last box.
    text = f"{prefix}\\boxed{{0}} and finally \\boxed{{{content}}} end"
    assert extract_boxed(text) == content.strip()
    # Cut anywhere inside the last box: no answer.
    cut = text[: text.rindex("\\boxed{") + len("\\boxed{") + len(content)]
    assert extract_boxed(cut) is None


def _ex(ref):
    return Example(prompt="q", reference=ref)


def test_match_reward_scores_and_counters():
    r = reward("match")
    assert isinstance(r, MatchReward)
    responses = [
        "\\boxed{42}",
        "\\boxed{ 42 }",
        "\\boxed{41}",
        "I think 42",
        "\\boxed{42",
        "\\boxed{\\frac{1}{2}}",
    ]
    refs = ["42", " 42 ", "42", "42", "42", "\\frac{1}{2}"]
    out = r.score_batch(responses, [_ex(x) for x in refs])
    assert isinstance(out, BatchScore)
    assert out.rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert out.answers == ["42", "42", "41", None, None, "\\frac{1}{2}"]
    assert out.no_answer == 2
    assert out.no_answer_rate == pytest.approx(2 / 6)
    assert out.errors == 0 and out.timeouts == 0
    assert out.counters()["no_answer_rate"] == pytest.approx(2 / 6)


def test_match_reward_is_exact_not_symbolic():
    r = MatchReward()
    assert r.score("\\boxed{0.5}", "\\frac{1}{2}") == 0.0
    assert r.score("\\boxed{0.5}", "0.5") == 1.0


def test_score_batch_length_mismatch_is_an_error():
    from retrain.errors import RewardError

    with pytest.raises(RewardError, match="2 responses but 1 examples"):
        MatchReward().score_batch(["a", "b"], [_ex("a")])


def test_unknown_reward_type_lists_valid_ones():
    from retrain.errors import RewardError

    with pytest.raises(RewardError, match="valid: match, math, judge, custom, gym"):
        reward("mtach")
