"""Packed rows through FlexAttention (retrain/kernels/flex.py, `[backend.options]
attention`). torch 2.13 runs FlexAttention's backward on CUDA only, so on a CPU the rule
and the forward pass are checked against the dense mask (torch's eager FlexAttention, no
gradient); `tests/integration/test_gpu.py` checks the gradients on CUDA."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from option_config import option_config  # noqa: E402
from test_packing import _tiny_llama  # noqa: E402

from retrain.config import load_config  # noqa: E402
from retrain.errors import BackendError, ConfigError  # noqa: E402
from retrain.kernels import flex  # noqa: E402
from retrain.kernels.logprobs import linear_head  # noqa: E402
from retrain.kernels.packing import completion_logprobs, mask_style, pack  # noqa: E402
from retrain.registry import BACKENDS  # noqa: E402

LAYOUTS = st.lists(
    st.tuples(st.integers(1, 6), st.lists(st.integers(1, 7), min_size=1, max_size=4)),
    min_size=1,
    max_size=3,
)


def _groups(shape, seed):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 40, p).tolist(), [rng.integers(0, 40, k) for k in lengths])
        for p, lengths in shape
    ]


@settings(max_examples=40)
@given(shape=LAYOUTS, seed=st.integers(0, 2**16))
def test_the_block_rule_is_the_dense_mask_on_every_real_position(shape, seed):
    groups = _groups(shape, seed)
    dense = pack(groups, "bool").mask[:, 0]  # (B, L, L)
    segments = pack(groups, "flex").segments
    rows, width = segments.shape
    i = torch.arange(width)
    rule = flex.block_mask(segments, pack(groups, "flex").positions).mask_mod(
        torch.arange(rows)[:, None, None], 0, i[None, :, None], i[None, None, :]
    )
    real = segments != flex.PAD  # a pad's own row is never used (see block_mask)
    assert torch.equal(rule[real], dense[real])
    pad_key = (~real)[:, None, :].expand(rows, width, width)
    assert not rule[real[:, :, None].expand(rows, width, width) & pad_key].any()


def test_segments_worked_by_hand():
    # prompt [1, 2] with completions [7, 8, 9] and [5]; prompt [3] with completion [6, 4]
    packed = pack(
        [([1, 2], [np.array([7, 8, 9]), np.array([5])]), ([3], [np.array([6, 4])])], "flex"
    )
    assert packed.segments.tolist() == [[0, 0, 1, 1], [0, 1, -1, -1]]
    assert packed.mask is None  # no L x L mask is built for FlexAttention
    # a real token never sees a pad; the second completion (5 is fed nothing) is empty
    rule = flex.block_mask(packed.segments, packed.positions).mask_mod
    assert not rule(torch.tensor(1), 0, torch.tensor(1), torch.tensor(2))


_FLEX_MODEL = []


def _flex_llama():
    if not _FLEX_MODEL:
        model = _tiny_llama("sdpa")
        flex.use_flex(model)
        _FLEX_MODEL.append(model)
    return _FLEX_MODEL[0]


@settings(max_examples=20, deadline=None)
@given(
    shape=LAYOUTS,
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([1.0, 0.7]),
    split_head=st.booleans(),
)
def test_flex_logprobs_equal_the_dense_masks(shape, seed, temperature, split_head):
    """The same model, switched to retrain's implementation: a BlockMask goes through
    FlexAttention, a bool mask through SDPA, and both give the same logprobs."""
    model = _flex_llama()
    head = linear_head(model) if split_head else None
    groups = _groups(shape, seed)
    cpu = torch.device("cpu")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        got = completion_logprobs(model, groups, temperature, "flex", cpu, head)
        dense = completion_logprobs(model, groups, temperature, "bool", cpu, head)
    torch.testing.assert_close(got, dense, atol=2e-5, rtol=0)


def test_the_sampler_computes_what_it_did_under_the_flex_implementation():
    """Tensor masks (2-D padding masks from the sampler, 4-D custom ones) still go to
    SDPA: the same logits to the bit as the plain SDPA model."""
    plain, switched = _tiny_llama("sdpa"), _flex_llama()
    assert switched.config._attn_implementation == flex.NAME
    ids = torch.randint(0, 40, (3, 9))
    padding = torch.ones(3, 9, dtype=torch.long)
    padding[1, :4] = 0  # left padding
    with torch.no_grad():
        for mask in (padding, None):
            a = plain(ids, attention_mask=mask).logits
            b = switched(ids, attention_mask=mask).logits
            assert torch.equal(a[padding.bool()], b[padding.bool()])


def test_mask_style_picks_flex_from_the_row_length():
    groups = [([1] * 10, [np.array([2] * 6), np.array([3] * 5)])]  # a row of 10 + 5 + 4
    assert mask_style(groups, "bool", None) == "bool"
    assert mask_style(groups, "bool", 0) == "flex"
    assert mask_style(groups, "bool", 19) == "flex"
    assert mask_style(groups, "bool", 20) == "bool"


@pytest.mark.parametrize(
    "option, device, attention, want",
    [
        ("auto", "cpu", "sdpa", None),
        ("auto", "cuda", "sdpa", flex.AUTO_FROM),
        ("auto", "cuda", "eager", None),  # auto keeps a model that is not on SDPA dense
        ("flex", "cuda", "sdpa", 0),
        ("dense", "cuda", "sdpa", None),
        ("dense", "cpu", "eager", None),
    ],
)
def test_flex_from(option, device, attention, want):
    assert flex.flex_from(option, device, attention, "m") == want


def test_flex_where_it_cannot_run_is_a_backend_error():
    with pytest.raises(BackendError, match='attention = "flex" trains on cpu.*CUDA only'):
        flex.flex_from("flex", "cpu", "sdpa", "m")
    with pytest.raises(BackendError, match="m uses 'eager'.*Fix: attention = \"dense\""):
        flex.flex_from("flex", "cuda", "eager", "m")


def test_the_options_text_names_the_auto_threshold():
    spec = BACKENDS.entry("local").options["attention"]
    assert spec.default == "auto" and str(flex.AUTO_FROM) in spec.help


def test_flex_training_on_a_cpu_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            option_config(tmp_path, "gpu:0,cpu", attention="flex")
        )  # trains on the last: the CPU
    text = str(err.value)
    assert "[backend.options] attention" in text and "'cpu'" in text and "Fix:" in text


@pytest.mark.parametrize(
    "devices, attention",
    [
        ("gpu:0", "flex"),
        ("cuda:0", "flex"),
        ("cpu", "auto"),
        ("cpu", "dense"),
        ("cpu,gpu:1", "flex"),
    ],
)
def test_accepted_attention_settings(tmp_path, monkeypatch, devices, attention):
    monkeypatch.setattr("retrain.config.validate.compiler_missing", lambda kind: None)  # triton
    config = load_config(option_config(tmp_path, devices, attention=attention))
    assert config.backend.options["attention"] == attention


def test_flex_without_triton_is_refused_and_auto_keeps_the_dense_mask(tmp_path, monkeypatch):
    """torch compiles FlexAttention with triton: without it (a CUDA torch on a platform
    triton does not ship for) `attention = "flex"` on a GPU is a config error naming the
    key and the fix, and `auto` keeps the dense mask there (`device_blockers`)."""
    import retrain.hardware as hardware

    missing = lambda kind: "triton is not installed"  # noqa: E731
    monkeypatch.setattr("retrain.config.validate.compiler_missing", missing)
    monkeypatch.setattr(hardware, "compiler_missing", missing)
    with pytest.raises(ConfigError) as caught:
        load_config(option_config(tmp_path, "gpu:0", attention="flex"))
    text = str(caught.value)
    assert "[backend.options] attention" in text and "but triton is not installed" in text
    assert 'Fix: install it, or attention = "auto" (the dense mask without triton)' in text
    load_config(option_config(tmp_path, "gpu:0", attention="auto"))  # accepted
    blocked = flex.device_blockers("bf16", "cuda")
    assert blocked == ["triton is not installed (it compiles FlexAttention)"]
    assert flex.flex_from("auto", "cuda", "sdpa", "m", blocked) is None
    assert flex.describe("auto", "cuda", blocked) == (
        "dense mask (not FlexAttention: triton is not installed (it compiles FlexAttention)), "
        "on SDPA's memory-efficient kernel"
    )
    assert flex.device_blockers("bf16", "cpu") == []  # a CPU needs no triton for the dense mask


def test_an_unknown_attention_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="attention"):
        load_config(option_config(tmp_path, "cpu", attention="sparse"))


@pytest.mark.parametrize(
    "option, kind, text",
    [
        ("auto", "cpu", "dense mask"),
        (
            "auto",
            "cuda",
            f"FlexAttention for rows of {flex.AUTO_FROM}+ positions, dense mask below, "
            "on SDPA's memory-efficient kernel",
        ),
        ("flex", "cuda", "FlexAttention"),
        ("dense", "cuda", "dense mask, on SDPA's memory-efficient kernel"),
        ("dense", "cpu", "dense mask"),
    ],
)
def test_describe(option, kind, text):
    assert flex.describe(option, kind) == text


def test_explain_shows_the_attention_and_refuses_flex_on_a_cpu(tmp_path, capsys, monkeypatch):
    from retrain.cli.main import main

    monkeypatch.setattr("retrain.hardware.compiler_missing", lambda kind: None)  # triton there
    main(["explain", str(option_config(tmp_path, "gpu:0", attention="auto"))])
    out = capsys.readouterr().out
    assert "attention: FlexAttention for rows of" in out
    assert main(["explain", str(option_config(tmp_path, "cpu", attention="flex"))]) == 2
    err = capsys.readouterr().err
    assert "[backend.options] attention (" in err and "retrain.toml:4)" in err
    assert "Traceback" not in err
