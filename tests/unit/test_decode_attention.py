"""Decode steps through retrain's attention (retrain/kernels/flex.py `grouped_decode`): one
query position per row with grouped-query heads, SDPA over each key/value head's group of
query heads instead of transformers' copy of the cache per query head. Checked against
that copy-then-SDPA reference on random inputs (bool and additive masks), then through a
model: the static and dynamic decoders draw the same tokens with the same float32
logprobs on an SDPA model and on the same model switched to retrain's attention."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_static_decode import PROMPTS, assert_same, engines, tiny_model  # noqa: E402

from retrain.kernels import flex  # noqa: E402
from retrain.types import SamplingParams  # noqa: E402


def reference(query, key, value, mask, scaling):
    """transformers' SDPA path with a mask: keys and values repeated per query head."""
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, mask, scale=scaling)
    return out.transpose(1, 2)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    group=st.integers(2, 4),
    keys=st.integers(1, 40),
    extra=st.integers(0, 9),  # mask columns past the keys (a cache longer than the keys)
    additive=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_decode_is_sdpa_over_the_repeated_cache(
    rows, kv_heads, group, keys, extra, additive, seed
):
    g = torch.Generator().manual_seed(seed)
    dim = 8
    query = torch.randn(rows, kv_heads * group, 1, dim, generator=g)
    key = torch.randn(rows, kv_heads, keys, dim, generator=g)
    value = torch.randn(rows, kv_heads, keys, dim, generator=g)
    allowed = torch.rand(rows, 1, 1, keys + extra, generator=g) < 0.6
    allowed[:, :, :, 0] = True  # no row attends to nothing
    mask = allowed
    if additive:
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    scaling = dim**-0.5
    assert flex.one_query(query, key, mask, 0.0, {})
    got = flex.grouped_decode(query, key, value, mask, scaling)
    want = reference(query, key, value, mask[..., :keys], scaling)
    assert got.shape == (rows, 1, kv_heads * group, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_what_is_not_a_grouped_decode_step_goes_to_sdpa():
    q1 = torch.zeros(2, 4, 1, 8)
    k = torch.zeros(2, 2, 5, 8)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    assert flex.one_query(q1, k, mask, 0.0, {})
    assert not flex.one_query(torch.zeros(2, 4, 3, 8), k, mask, 0.0, {})  # a prefill
    assert not flex.one_query(q1, k, None, 0.0, {})  # no mask: SDPA's own GQA
    assert not flex.one_query(q1, torch.zeros(2, 4, 5, 8), mask, 0.0, {})  # no groups
    assert not flex.one_query(q1, k, mask, 0.1, {})  # dropout
    assert not flex.one_query(q1, k, mask, 0.0, {"softcap": 30.0})
    assert not flex.one_query(q1, k, mask, 0.0, {"s_aux": torch.zeros(4)})
    assert not flex.one_query(q1, k, torch.ones(2, 4, 1, 5, dtype=torch.bool), 0.0, {})


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_decoding_through_retrains_attention_draws_what_sdpa_draws(decode):
    """The tiny Llama has 4 query heads over 2 key/value heads: every decode step of
    either decoder goes through `grouped_decode` once switched."""
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=4, return_entropy=True)
    plain = engines(tiny_model(seed=6), decode).sample(PROMPTS, 4, params)
    switched_model = tiny_model(seed=6)
    flex.use_flex(switched_model)
    calls = []
    original = flex.grouped_decode

    def counted(*args):
        calls.append(1)
        return original(*args)

    flex.grouped_decode = counted
    try:
        switched = engines(switched_model, decode).sample(PROMPTS, 4, params)
    finally:
        flex.grouped_decode = original
    lengths = assert_same(plain, switched, entropies=True)
    assert calls and min(lengths) < 12  # really decoded through it, rows stopping early
