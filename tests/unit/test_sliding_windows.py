"""Models with sliding-window attention (retrain/kernels/windows.py): packed training
rows and the static decoder hand the model 4-D masks, which transformers takes as they
are for every layer, so the window must be in them. Checked against the model's own
forward on an ordinary row (transformers builds its masks, window included) for a model
whose layers all slide (Mistral) and one that mixes full and sliding layers (Qwen2),
with a window of 4 positions and sequences well past it. Then the probe the local
backend runs on every model at load (`check_packing`): models that pack pass, one that
rebuilds its own mask or lets completions see each other is refused by name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_packing import plain_logprobs  # noqa: E402
from test_static_decode import assert_same  # noqa: E402

from retrain.engines.pytorch import PyTorchEngine  # noqa: E402
from retrain.engines.static_decode import reads_prefix  # noqa: E402
from retrain.errors import BackendError  # noqa: E402
from retrain.kernels import flex  # noqa: E402
from retrain.kernels.logprobs import linear_head  # noqa: E402
from retrain.kernels.packing import (  # noqa: E402
    MASK_STYLES,
    check_packing,
    completion_logprobs,
)
from retrain.kernels.windows import (  # noqa: E402
    FULL,
    NO_WINDOW,
    SLIDING,
    Windows,
    windows_of,
)
from retrain.types import SamplingParams  # noqa: E402

WINDOW = 4
SIZES = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_MODELS: dict = {}


def sliding_model(kind: str, attention: str = "sdpa"):
    """ "mistral": every layer slides; "qwen2": layer 0 full, layer 1 sliding."""
    key = (kind, attention)
    if key not in _MODELS:
        torch.manual_seed(0)
        if kind == "mistral":
            config = transformers.MistralConfig(
                sliding_window=WINDOW, attn_implementation=attention, **SIZES
            )
            model = transformers.MistralForCausalLM(config)
        else:
            config = transformers.Qwen2Config(
                use_sliding_window=True,
                sliding_window=WINDOW,
                max_window_layers=1,
                attn_implementation=attention,
                **SIZES,
            )
            model = transformers.Qwen2ForCausalLM(config)
        model.eval().lm_head.weight.requires_grad_(False)
        _MODELS[key] = model
    return _MODELS[key]


def test_windows_read_from_configs():
    c = transformers
    assert windows_of(c.LlamaConfig()) == NO_WINDOW
    assert windows_of(c.Qwen2Config()) == NO_WINDOW  # use_sliding_window is off by default
    assert windows_of(c.MistralConfig(sliding_window=64)) == Windows(((SLIDING, 64),))
    mixed = windows_of(sliding_model("qwen2").config)
    assert mixed == Windows(((FULL, None), (SLIDING, WINDOW)))
    assert mixed.sliding == WINDOW and NO_WINDOW.sliding is None
    gemma = windows_of(c.Gemma3TextConfig(sliding_window=512))
    assert dict(gemma.by_type) == {SLIDING: 512, FULL: None}


def test_masks_are_one_tensor_when_every_layer_shares_a_window_else_one_per_type():
    built = []

    def build(window):
        built.append(window)
        return f"mask({window})"

    assert NO_WINDOW.masks(build) == "mask(None)"
    assert Windows(((SLIDING, 8),)).masks(build) == "mask(8)"
    both = Windows(((SLIDING, 8), (FULL, None), ("other_sliding", 8)))
    assert both.masks(build) == {SLIDING: "mask(8)", FULL: "mask(None)", "other_sliding": "mask(8)"}
    assert built == [None, 8, 8, None]  # each distinct window built once per call


@pytest.mark.parametrize(
    "types, refused",
    [
        (["full_attention", "linear_attention"], "'linear_attention'"),
        (["sliding_attention", "conv"], "'conv'"),
    ],
)
def test_layers_that_carry_state_along_the_sequence_are_refused_by_name(types, refused):
    config = transformers.Qwen2Config(num_hidden_layers=2)
    config.layer_types = types
    with pytest.raises(BackendError) as err:
        windows_of(config, "org/hybrid")
    assert f"org/hybrid has {refused} layers" in str(err.value)
    assert "Fix:" in str(err.value)
    config.layer_types = ["full_attention", "moe"]  # no attention in that layer: no mask
    assert windows_of(config) == NO_WINDOW


def test_chunked_attention_is_refused():
    config = transformers.LlamaConfig()
    config.attention_chunk_size = 16
    with pytest.raises(BackendError, match="'chunked_attention'"):
        windows_of(config)


def _groups(shape, seed):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 40, p).tolist(), [rng.integers(0, 40, k) for k in lengths])
        for p, lengths in shape
    ]


# prompts and completions long enough that most rows outgrow the window of 4
SHAPES = st.lists(
    st.tuples(st.integers(1, 7), st.lists(st.integers(1, 9), min_size=1, max_size=3)),
    min_size=1,
    max_size=3,
)


@settings(max_examples=25, deadline=None)
@given(
    shape=SHAPES,
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["mistral", "qwen2"]),
    attention=st.sampled_from(["sdpa", "eager"]),
    split_head=st.booleans(),
)
def test_packed_rows_compute_the_models_own_windowed_logprobs(
    shape, seed, kind, attention, split_head
):
    model = sliding_model(kind, attention)
    head = linear_head(model) if split_head else None
    groups = _groups(shape, seed)
    style = {"sdpa": "bool", "eager": "additive"}[attention]
    windows = windows_of(model.config)
    with torch.no_grad():
        got = completion_logprobs(model, groups, 0.8, style, torch.device("cpu"), head, windows)
        i = 0
        for prompt, completions in groups:
            for c in completions:
                plain = plain_logprobs(model, prompt, c, 0.8)
                torch.testing.assert_close(got[i, : len(c)], plain, atol=2e-5, rtol=0)
                i += 1


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_without_the_window_the_packed_logprobs_differ(kind):
    """The check above can fail: past the window, the mask without it computes other
    logprobs than the model (what training did before the window was in the masks)."""
    model = sliding_model(kind)
    groups = _groups([(6, [9, 7])], 1)
    with torch.no_grad():
        ignored = completion_logprobs(model, groups, 1.0, "bool", torch.device("cpu"))
        plain = plain_logprobs(model, groups[0][0], groups[0][1][0])
    assert (ignored[0, : len(plain)] - plain).abs().max() > 1e-3


@settings(max_examples=10, deadline=None)
@given(shape=SHAPES, seed=st.integers(0, 2**16), kind=st.sampled_from(["mistral", "qwen2"]))
def test_flex_block_masks_carry_the_window(shape, seed, kind):
    """FlexAttention (torch's eager CPU reference, forward only) with one block mask per
    layer type: the dense masks' logprobs."""
    model = sliding_model(kind, "sdpa")
    groups = _groups(shape, seed)
    windows, cpu = windows_of(model.config), torch.device("cpu")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        dense = completion_logprobs(model, groups, 1.0, "bool", cpu, None, windows)
        flex.use_flex(model)
        try:
            got = completion_logprobs(model, groups, 1.0, "flex", cpu, None, windows)
        finally:
            model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, dense, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "spans"])
def test_the_static_decoder_draws_what_the_dynamic_one_draws(kind, attention):
    """Prompts of 2-9 tokens and 12 new ones against a window of 4: the static decoder
    (full-length cache, a second mask for the sliding layers) against the dynamic one
    (transformers' own sliding caches and masks). "spans": the static decoder on
    retrain's attention, each step reading its key span (here in steps of 4), both
    masks as narrow as the span."""
    model = sliding_model(kind, "sdpa" if attention == "spans" else attention)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13], [20, 21, 22, 23, 24]]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=7)
    out = {}
    for decode in ("dynamic", "static"):
        if decode == "static" and attention == "spans":
            flex.use_flex(model)
        engine = PyTorchEngine(
            model, {3}, 0, torch.device("cpu"), sampling_copy=False, decode=decode
        )
        if engine.static is not None:  # spans of 4 where its steps read by span
            engine.static.length_step = 4
            assert reads_prefix(model) == (attention == "spans")
        out[decode] = engine.sample(prompts, 3, params)
    lengths = assert_same(out["dynamic"], out["static"])
    assert max(lengths) == 12 and min(lengths) < 12  # rows that stopped early too
    # and both are the model's own logprobs on the whole sequence
    for prompt, group in zip(prompts, out["static"], strict=True):
        for sample in group:
            with torch.no_grad():
                plain = plain_logprobs(model, prompt, np.asarray(sample.token_ids), 0.9)
            assert np.abs(sample.logprobs - plain.numpy()).max() < 1e-5


def test_flex_is_refused_for_what_it_cannot_apply():
    """Soft-capped logits (Gemma 2): auto keeps the dense mask; flex is an error."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(attn_logit_softcapping=50.0, **SIZES)
    model = transformers.Gemma2ForCausalLM(config)
    blocked = flex.blockers(model)
    assert blocked == ["attention logit soft-capping"]
    assert flex.flex_from("auto", "cuda", "sdpa", "g", blocked) is None
    with pytest.raises(BackendError, match='soft-capping of g. Fix: attention = "dense"'):
        flex.flex_from("flex", "cuda", "sdpa", "g", blocked)
    assert flex.blockers(sliding_model("qwen2")) == []


# ----------------------------------------------------------------- the packing probe

ARCHITECTURES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=40)
    ),
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            word_embed_proj_dim=32,
            vocab_size=40,
        )
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**{**SIZES, "head_dim": 8}, sliding_window=WINDOW)
    ),
    "mistral": lambda: sliding_model("mistral"),
    "qwen2": lambda: sliding_model("qwen2", "eager"),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_probe_passes_models_that_pack(arch):
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]().eval()
    style = MASK_STYLES[model.config._attn_implementation]
    check_packing(model, style, windows_of(model.config), arch)


def test_the_probe_refuses_a_model_that_rebuilds_its_mask():
    """Bloom computes ALiBi from a 2-D mask: a packed row's 4-D mask breaks it."""
    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=40)
    model = transformers.BloomForCausalLM(config).eval()
    with pytest.raises(BackendError) as err:
        check_packing(model, "bool", NO_WINDOW, "org/bloom")
    text = str(err.value)
    assert text.startswith("org/bloom cannot be trained by the local backend: it packs")
    assert "a packed row fails in it (ValueError" in text and "Fix:" in text


def test_the_probe_refuses_a_model_whose_completions_see_each_other():
    """An attention that ignores the mask (plain causal over the row): the second
    completion attends to the first, and its logprobs move."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, q, k, v, attention_mask, **kwargs):
        return sdpa_attention_forward(module, q, k, v, None, **kwargs)

    AttentionInterface.register("retrain_test_causal_only", causal_only)
    model = sliding_model("mistral", "sdpa")
    try:
        model.set_attn_implementation("retrain_test_causal_only")
        with pytest.raises(BackendError, match=r"logprobs [0-9.e-]+ away from its own row's"):
            check_packing(model, "bool", NO_WINDOW, "leaky")
    finally:
        model.set_attn_implementation("sdpa")
