"""The pytorch engine's token draw: inverse-CDF sampling against a plain loop, never a
zero-probability token (even at u's extremes), and the right frequencies; and how a step
is cut into decoding batches of at most 64 completions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from retrain.engines.draw import draw, inverse_cdf, uniforms  # noqa: E402
from retrain.types import SamplingParams  # noqa: E402


def plain_inverse_cdf(probs: list[float], u: float) -> int:
    total, running = sum(probs), 0.0
    for i, p in enumerate(probs):
        running += p
        if running > u * total:
            return i
    raise AssertionError("u * total reached the total")


@settings(max_examples=200)
@given(
    rows=st.lists(
        st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=1, max_size=12).filter(
            lambda r: sum(r) > 0
        ),
        min_size=1,
        max_size=4,
    ),
    us=st.lists(
        st.one_of(st.just(0.0), st.just(1 - 2**-53), st.floats(0.0, 1.0, exclude_max=True)),
        min_size=4,
        max_size=4,
    ),
)
def test_matches_a_plain_loop_and_never_picks_an_impossible_token(rows, us):
    width = max(len(r) for r in rows)
    probs = torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)
    u = torch.tensor(us[: len(rows)], dtype=torch.float64)[:, None]
    got = inverse_cdf(probs, u).tolist()
    for r, (row, x, token) in enumerate(zip(probs.tolist(), u[:, 0].tolist(), got)):
        assert token == plain_inverse_cdf(row, x)
        assert probs[r, token] > 0


def test_frequencies_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.25, 0.05]])
    logits = probs.log().expand(20_000, 5).contiguous()
    u = uniforms(20_000, 1, torch.Generator().manual_seed(0))
    token, logp, _ = draw(logits, SamplingParams(max_tokens=1, temperature=1.0), u)
    freq = torch.bincount(token, minlength=5).double() / token.numel()
    assert freq[1] == 0
    assert torch.allclose(freq, probs[0].double(), atol=0.01)
    assert torch.allclose(logp, probs[0].log()[token].float(), atol=1e-6)


def test_top_p_and_temperature_are_the_recorded_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(5_000, 4).contiguous()
    params = SamplingParams(max_tokens=1, temperature=0.5, top_p=0.9)
    token, logp, full = draw(logits, params, uniforms(5_000, 1, torch.Generator().manual_seed(1)))
    tempered = torch.log_softmax(logits[0] / 0.5, -1)
    assert torch.allclose(full[0], tempered)
    kept = tempered.exp() >= tempered.exp().sort(descending=True).values[1]  # top two: 0.98
    assert set(token.tolist()) <= set(kept.nonzero().squeeze(-1).tolist())
    renorm = torch.log_softmax(tempered.masked_fill(~kept, float("-inf")), -1)
    assert torch.allclose(logp, renorm[token], atol=1e-6)


def test_greedy_is_the_argmax_with_logprob_zero():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]])
    u = uniforms(2, 1, torch.Generator().manual_seed(0))
    token, logp, _ = draw(logits, SamplingParams(max_tokens=1, temperature=0.0), u)
    assert token.tolist() == [1, 0] and logp.tolist() == [0.0, 0.0]


def _batches(prompts: int, n: int, prompt_batch: int = 0):
    from retrain.memory import decoding_batches

    return decoding_batches(prompts, n, prompt_batch)


def test_decoding_batches_worked_by_hand():
    # (first prompt, prompts, completions each); 0 = at most 64 completions at once
    assert _batches(4, 8) == [(0, 4, 8)]
    assert _batches(5, 24) == [(0, 2, 24), (2, 2, 24), (4, 1, 24)]
    assert _batches(2, 64) == [(0, 1, 64), (1, 1, 64)]
    # a group larger than 64: each prompt in parts of at most 64
    assert _batches(2, 100) == [(0, 1, 64), (0, 1, 36), (1, 1, 64), (1, 1, 36)]
    # an explicit prompt_batch: that many whole prompts, whatever the group
    assert _batches(5, 100, prompt_batch=2) == [(0, 2, 100), (2, 2, 100), (4, 1, 100)]


@given(prompts=st.integers(1, 9), n=st.integers(1, 300))
def test_decoding_batches_cover_every_completion_within_64_rows(prompts, n):
    batches = _batches(prompts, n)
    count = [0] * prompts
    for first, k, rows in batches:
        assert k * rows <= 64
        for i in range(first, first + k):
            count[i] += rows
    assert count == [n] * prompts
