"""Packed rows through flash attention's variable-length kernel (retrain/kernels/varlen.py,
`[backend.options] attention = "varlen"`). The kernel is CUDA's, so on a CPU the layout,
the gather and its backward are checked through `varlen.reference` (one SDPA call per
sequence) against the dense mask, forward and backward; `tests/integration/test_gpu.py`
checks the kernel itself, and the run's start checks it on its device (`varlen.check`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from option_config import option_config  # noqa: E402
from test_flex_attention import LAYOUTS, _flex_llama, _groups  # noqa: E402

from retrain.config import load_config  # noqa: E402
from retrain.config.validate import kernel_problems  # noqa: E402
from retrain.errors import BackendError, ConfigError  # noqa: E402
from retrain.kernels import flex, varlen  # noqa: E402
from retrain.kernels.logprobs import linear_head  # noqa: E402
from retrain.kernels.packing import (  # noqa: E402
    completion_logprobs,
    dense_mask,
    mask_style,
    pack,
)


def test_the_layout_worked_by_hand():
    # row 0: prompt at 0-1, completions at 2-3 and 4, a pad at 5; row 1 (flat 6-11):
    # prompt at 6, a completion at 7-9, pads at 10-11
    lay = varlen.layout(torch.tensor([[0, 0, 1, 1, 2, -1], [0, 1, 1, 1, -1, -1]]))
    assert lay.cu_q.tolist() == [0, 2, 4, 5, 6, 7, 10, 12]  # the row's own order
    assert lay.cu_q.dtype == lay.cu_k.dtype == torch.int32
    assert lay.gather.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 6, 7, 8, 9, 10, 11]
    assert lay.cu_k.tolist() == [0, 2, 6, 9, 10, 11, 15, 17]
    assert (lay.max_q, lay.max_k) == (3, 4)
    # gathered once: completions and pads; the prompts once per sequence of their row
    assert lay.once_src.tolist() == [4, 5, 8, 9, 12, 13, 14, 15, 16]
    assert lay.once_dst.tolist() == [2, 3, 4, 5, 7, 8, 9, 10, 11]
    (copies0, start0, p0), (copies1, start1, p1) = lay.prompts
    assert (copies0.tolist(), start0, p0) == ([0, 1, 2, 3, 6, 7], 0, 2)
    assert (copies1.tolist(), start1, p1) == ([10, 11], 6, 1)


def test_a_row_must_start_with_its_prompt():
    with pytest.raises(ValueError, match="row 0 does not start with its prompt"):
        varlen.layout(torch.tensor([[1, 1, 0]]))


def _qkv(rows, length, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(rows, h, length, dim, generator=g, dtype=torch.float64)  # noqa: E731
    return [t.requires_grad_() for t in (make(heads), make(kv_heads), make(kv_heads))]


def _dense(q, k, v, mask):
    """transformers' SDPA attention for a (B, 1, L, L) bool mask: (B, L, heads, dim)."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    return out.transpose(1, 2)


@settings(max_examples=40, deadline=None)
@given(shape=LAYOUTS, seed=st.integers(0, 2**16), window=st.sampled_from([None, 1, 2, 5]))
def test_the_sequences_give_the_dense_masks_attention_and_gradients(shape, seed, window):
    groups = _groups(shape, seed)
    packed = pack(groups, "varlen")
    allowed = pack(groups, "bool").mask
    rows, length = packed.segments.shape
    real = (packed.segments != flex.PAD)[:, :, None, None]  # a pad's output is never used
    grad = torch.randn(rows, length, 4, 8, dtype=torch.float64) * real
    results = []
    for run in ("varlen", "dense"):
        q, k, v = _qkv(rows, length, seed=seed)
        if run == "varlen":
            out = varlen.attend(q, k, v, varlen.Mask(varlen.layout(packed.segments), window))
        else:
            out = _dense(q, k, v, dense_mask(allowed, packed.positions, window, "bool"))
        out.backward(grad)
        results.append([out * real, q.grad, k.grad, v.grad])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_the_gathers_backward_sums_the_prompts_copies_the_same_every_time():
    lay = varlen.layout(pack(_groups([(3, [4, 2, 5]), (2, [1, 6])], 0), "varlen").segments)
    flat = torch.randn(lay.rows * lay.length, 2, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(len(lay.gather), 2, 4, dtype=torch.float64)
    varlen._Gathered.apply(flat, lay).backward(grad)
    want = torch.zeros_like(flat).index_add_(0, lay.gather, grad)  # index_select's backward
    torch.testing.assert_close(flat.grad, want, atol=1e-12, rtol=0)
    # in bf16: float32 sums in a fixed order, the same bits on every call
    bf = flat.detach().bfloat16().requires_grad_()
    seen = []
    for _ in range(2):
        bf.grad = None
        varlen._Gathered.apply(bf, lay).backward(grad.bfloat16())
        seen.append(bf.grad.clone())
    assert torch.equal(*seen)


@settings(max_examples=15, deadline=None)
@given(shape=LAYOUTS, seed=st.integers(0, 2**16), split_head=st.booleans())
def test_varlen_logprobs_and_gradients_equal_the_dense_masks(shape, seed, split_head):
    """The tiny Llama on retrain's attention: its packed rows as the kernel's sequences
    (through the reference on this CPU) give the dense mask's logprobs and parameter
    gradients."""
    model = _flex_llama()
    head = linear_head(model) if split_head else None
    groups = _groups(shape, seed)
    cpu = torch.device("cpu")
    rng = np.random.default_rng(seed)
    results = []
    for style in ("varlen", "bool"):
        model.zero_grad()
        logp = completion_logprobs(model, groups, 0.7, style, cpu, head)
        weights = torch.from_numpy(rng.normal(size=logp.shape)).float()
        rng = np.random.default_rng(seed)  # the same weights for both styles
        (logp * weights).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logp.detach(), grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def test_the_start_check_passes_the_rule_and_stops_a_kernel_that_breaks_it(monkeypatch):
    varlen.check(torch.device("cpu"), 4, 2, 8, torch.bfloat16)  # the reference: the rule

    def top_left(query, key, value, mask, scaling=None):
        """Causal from the top left (torch's `is_causal` for fewer queries than keys):
        a completion would not see the end of its prompt."""
        rows, heads, length, dim = query.shape
        flat = lambda t: t.transpose(1, 2).reshape(rows * length, t.shape[1], dim)  # noqa: E731
        q, k, v = flat(query), flat(key), flat(value)
        k, v = k.index_select(0, mask.layout.gather), v.index_select(0, mask.layout.gather)
        out = torch.empty_like(q)
        for q0, q1, k0, k1 in mask.layout.bounds():
            seq = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                is_causal=True,
                enable_gqa=True,
            )
            out[q0:q1] = seq.transpose(0, 1)
        return out.view(rows, length, heads, dim)

    monkeypatch.setattr(varlen, "attend", top_left)
    with pytest.raises(BackendError, match=r'attention = "varlen".*away from the rule.*Fix:'):
        varlen.check(torch.device("cpu"), 4, 2, 8, torch.bfloat16)

    def unsupported(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(varlen, "attend", unsupported)
    with pytest.raises(BackendError, match=r"kernel fails on cpu \(RuntimeError: Flash.*Fix:"):
        varlen.check(torch.device("cpu"), 4, 2, 8, torch.bfloat16)


def test_varlen_chosen_and_its_refusals():
    assert flex.varlen_chosen("varlen", "cuda", "sdpa", "m", [], "bf16")
    assert not flex.varlen_chosen("auto", "cuda", "sdpa", "m", [], "bf16")
    assert flex.flex_from("varlen", "cuda", "sdpa", "m") is None  # no FlexAttention then
    groups = [([1] * 10, [np.array([2] * 6)])]
    assert mask_style(groups, "bool", None, varlen=True) == "varlen"
    refusals = [
        (("cpu", "sdpa", [], "bf16"), "trains on cpu.*CUDA only"),
        (("cuda", "eager", [], "bf16"), "m uses 'eager'"),
        (("cuda", "sdpa", ["attention sinks"], "bf16"), "cannot apply the attention sinks"),
        (("cuda", "sdpa", [], "fp32"), 'no float32 kernel.*dtype = "bf16"'),
    ]
    for (device, attention, blocked, dtype), text in refusals:
        with pytest.raises(BackendError, match=text):
            flex.varlen_chosen("varlen", device, attention, "m", blocked, dtype)


def test_describe_and_label_say_varlen():
    assert flex.describe("varlen", "cuda") == flex.VARLEN_LABEL
    assert flex.label(None, varlen=True) == flex.VARLEN_LABEL
    assert "variable-length" in flex.VARLEN_LABEL


@pytest.mark.parametrize(
    "devices, options, refused",
    [
        ("gpu:0", {}, None),
        ("cuda:0", {"dtype": "bf16"}, None),
        ("cpu", {}, "'cpu'"),
        ("gpu:0,cpu", {}, "'cpu'"),  # trains on the last
        ("gpu:0", {"dtype": "fp32"}, 'dtype = "fp32"'),
    ],
)
def test_varlen_in_the_config(tmp_path, devices, options, refused):
    path = option_config(tmp_path, devices, attention="varlen", **options)
    if refused is None:
        assert load_config(path).backend.options["attention"] == "varlen"
        return
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert "[backend.options] attention" in text and refused in text and "Fix:" in text


def test_varlen_on_a_gpu_without_native_bf16_is_a_startup_problem(tmp_path):
    config = load_config(option_config(tmp_path, "gpu:0", attention="varlen"))
    problems = kernel_problems(config, lambda dtype, kind, index: "compute capability 7.5")
    assert [key for key, _ in problems] == ["[backend.options] attention"]
    assert "needs native bf16" in problems[0][1] and "7.5" in problems[0][1]
    assert kernel_problems(config, lambda dtype, kind, index: None) == []


def test_explain_says_varlen(tmp_path, capsys):
    from retrain.cli.main import main

    main(["explain", str(option_config(tmp_path, "gpu:0", attention="varlen"))])
    assert f"attention: {flex.VARLEN_LABEL}" in capsys.readouterr().out
    assert main(["explain", str(option_config(tmp_path, "cpu", attention="varlen"))]) == 2
    err = capsys.readouterr().err
    assert "[backend.options] attention (" in err and "CUDA" in err and "Traceback" not in err
