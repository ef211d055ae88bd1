"""The adapter computed in the model's dtype on a wholly bf16 model
(retrain/kernels/lora_layers.py `adapter_in_input_dtype`): what the backward keeps (one
bf16 input per set of siblings instead of a float32 copy per adapted layer, counted
exactly), gradients against a float32 reference, the adapter's tensors and saved names
unchanged, a float32 model unchanged, and non-plain adapters left to PEFT. The lean
forward (`lean_lora_forward`): PEFT's values and gradients, the adapter switched off as
PEFT switches it off, and the same modules and names."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tiny_qwen3 import HEAD_DIM, HEADS, HIDDEN, INTER, LAYERS, RANK, per_position, qwen3_lora  # noqa: E402

from retrain.kernels.lora_layers import (  # noqa: E402
    InputDtypeLinear,
    adapter_dtype,
    adapter_in_input_dtype,
    lean_lora_forward,
    plain_lora_layers,
)


def _per_position(model) -> int:
    return per_position(model) // LAYERS


def test_the_backward_keeps_one_bf16_input_per_set_of_siblings():
    before = _per_position(qwen3_lora(bf16=True, switch=False))
    after = _per_position(qwen3_lora(bf16=True, switch=True))
    q = HEADS * HEAD_DIM
    inputs = {  # each adapted linear's input width
        "q": HIDDEN,
        "k": HIDDEN,
        "v": HIDDEN,
        "o": q,
        "gate": HIDDEN,
        "up": HIDDEN,
        "down": INTER,
    }
    # q/k/v read one tensor, gate/up another; o's input is the attention's output, which
    # the attention keeps for its own backward anyway
    new_inputs = HIDDEN + HIDDEN + INTER
    # PEFT: per adapted linear a float32 copy of its input and float32 x @ A^T; now the
    # bf16 inputs and a bf16 x @ A^T per linear
    peft = sum(4 * w + 4 * RANK for w in inputs.values())
    ours = 2 * new_inputs + 2 * RANK * len(inputs)
    assert before - after == peft - ours


def test_gradients_equal_a_float32_reference_to_bf16_rounding():
    ids = torch.arange(24)[None] % 97
    probe = torch.randn(1, 24, HIDDEN, generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, bf16, switch in (("ref", False, False), ("peft", True, False), ("ours", True, True)):
        model = qwen3_lora(bf16=bf16, switch=switch)
        out = model.get_base_model().model(input_ids=ids).last_hidden_state
        (out.float() * probe).sum().backward()
        grads[name] = torch.cat(
            [p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad]
        )
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    ref = grads["ref"]
    for name in ("peft", "ours"):
        cos = torch.nn.functional.cosine_similarity(grads[name], ref, dim=0)
        rel = (grads[name] - ref).norm() / ref.norm()
        assert cos > 0.999 and rel < 0.03, (name, cos, rel)
    # ours is as close to the reference as PEFT's float32 adapter on the same model
    assert (grads["ours"] - ref).norm() < 2 * (grads["peft"] - ref).norm()


def test_the_adapter_stays_float32_under_the_same_names():
    plain = qwen3_lora(bf16=True, switch=False)
    ours = qwen3_lora(bf16=True, switch=True)
    assert list(plain.state_dict()) == list(ours.state_dict())
    layers = plain_lora_layers(ours)
    assert layers and all(adapter_dtype(m, torch.bfloat16) == torch.bfloat16 for _, m in layers)
    assert all(
        adapter_dtype(m, torch.bfloat16) == torch.float32 for _, m in plain_lora_layers(plain)
    )
    factors = [m for m in ours.modules() if isinstance(m, InputDtypeLinear)]
    assert len(factors) == 2 * 7 * LAYERS
    assert all(f.weight.dtype == torch.float32 for f in factors)


def test_a_float32_model_computes_exactly_as_before():
    ids = torch.arange(20)[None] % 97
    outs = []
    for switch in (False, True):
        model = qwen3_lora(bf16=False, switch=switch)
        out = model.get_base_model().model(input_ids=ids).last_hidden_state
        out.sum().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        outs.append((out.detach(), grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_dora_adapter_is_left_to_peft():
    model = qwen3_lora(bf16=True, switch=False, use_dora=True)
    assert adapter_in_input_dtype(model) == 0
    assert not any(isinstance(m, InputDtypeLinear) for m in model.modules())


def _forward_backward(model, ids, probe):
    out = model.get_base_model().model(input_ids=ids).last_hidden_state
    (out.float() * probe).sum().backward()
    grads = [p.grad.float() for p in model.parameters() if p.requires_grad]
    return out.detach().float(), torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("alpha", [2 * RANK, 12])  # scaling 2 (exact) and 1.5
def test_the_lean_forward_gives_peft_lora_in_float32(alpha):
    ids = torch.arange(30)[None] % 97
    probe = torch.randn(1, 30, HIDDEN, generator=torch.Generator().manual_seed(2))
    peft = _forward_backward(qwen3_lora(bf16=False, lora_alpha=alpha), ids, probe)
    lean = _forward_backward(qwen3_lora(bf16=False, lean=True, lora_alpha=alpha), ids, probe)
    for a, b in zip(peft, lean, strict=True):  # float32 sums in another order
        assert a.norm() > 0 and (b - a).norm() < 1e-5 * a.norm()


def test_the_lean_forward_rounds_bf16_no_worse_than_peft():
    """One rounding (the matmul's sum) where PEFT rounds the product, the scaled product
    and the sum: against the float32 reference, at least as close as PEFT."""
    ids = torch.arange(40)[None] % 97
    probe = torch.randn(1, 40, HIDDEN, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grad = _forward_backward(qwen3_lora(bf16=False), ids, probe)
    errors = {}
    for lean in (False, True):
        out, grad = _forward_backward(qwen3_lora(bf16=True, switch=True, lean=lean), ids, probe)
        errors[lean] = (
            (out - ref_out).norm() / ref_out.norm(),
            (grad - ref_grad).norm() / ref_grad.norm(),
        )
    assert errors[True][0] <= errors[False][0] and errors[True][1] <= errors[False][1], errors
    assert errors[True][1] < 0.03


def test_the_lean_forward_keeps_the_modules_and_switches_off_like_peft():
    peft, lean = qwen3_lora(bf16=False), qwen3_lora(bf16=False, lean=True)
    assert list(peft.state_dict()) == list(lean.state_dict())
    assert len(plain_lora_layers(lean)) == 7 * LAYERS  # still plain: the sampler copies them
    assert lean_lora_forward(lean) == 7 * LAYERS  # again: nothing changes
    ids = torch.arange(12)[None] % 97
    with torch.no_grad(), peft.disable_adapter(), lean.disable_adapter():
        off = peft(input_ids=ids).logits
        torch.testing.assert_close(lean(input_ids=ids).logits, off, rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.allclose(lean(input_ids=ids).logits, off)  # on again: B is not zero


def test_a_dora_adapter_keeps_peft_forward():
    model = qwen3_lora(bf16=False, use_dora=True)
    assert lean_lora_forward(model) == 0
    assert all(type(m).__name__ != "LeanLoraLinear" for m in model.modules())


def test_the_lean_forward_drops_what_peft_drops():
    """With LoRA dropout in training mode, the same draws in the same order: PEFT's output."""
    ids = torch.arange(16)[None] % 97
    outs = []
    for lean in (False, True):
        model = qwen3_lora(bf16=False, lean=lean, lora_dropout=0.3).train()
        torch.manual_seed(5)
        outs.append(model(input_ids=ids).logits.detach())
    off = qwen3_lora(bf16=False).eval()(input_ids=ids).logits.detach()
    assert not torch.allclose(outs[0], off, atol=1e-3)  # dropout changed something
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_the_lean_forward_rounds_as_the_sampling_copy_does():
    """The trainer's lean LoRA linear and the sampler's copy of it (`LoraBeside`, a bf16 A
    and a float32 B) run the same float32 sum on the same operands, rounded once: the
    same output to the bit, so rounding adds nothing to the sampler/trainer gap.
    Scaling 1.5, so a scaling applied anywhere else would round differently. (In float32
    the copy merges the adapter into the weight instead.)"""
    from retrain.engines.sampling_copy import LoraBeside, SamplingCopy

    model = qwen3_lora(bf16=True, switch=True, lean=True, lora_alpha=12)
    copy = SamplingCopy.build(model, None)
    copy.refresh()
    alone = [(layer, inner) for layer, inner in copy.pairs if isinstance(inner, LoraBeside)]
    assert {type(layer).__name__ for layer, _ in alone} == {"LeanLoraLinear"} and alone
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer, inner in alone:  # o_proj and down_proj: no siblings to stack with
            x = torch.randn(2, 7, layer.in_features, generator=gen).bfloat16()
            assert torch.equal(layer(x), inner(x))


def one_layer(lean: bool, b_std: float, rank: int = 8, alpha: int = 12, width: int = 96):
    """One wholly bf16 linear (width -> width) with a plain LoRA adapter computed in bf16:
    A ~ N(0, 1/width), B ~ N(0, b_std); lean or PEFT's forward."""
    from peft import LoraConfig, get_peft_model

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(width, width, bias=False)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    model = One().bfloat16()
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=["proj"]))
    adapter_in_input_dtype(peft)
    if lean:
        lean_lora_forward(peft)
    layer = plain_lora_layers(peft)[0][1]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.lora_A["default"].weight.normal_(0, width**-0.5, generator=gen)
        layer.lora_B["default"].weight.normal_(0, b_std, generator=gen)
    return layer


def test_a_young_adapters_update_reaches_the_bf16_output():
    """An update far under half a bf16 step of the base output (a median ~1/50 of one):
    added to the rounded base output, as PEFT does, it rounds away almost everywhere (not
    at the few values near zero, whose steps are small); added in float32
    before the one rounding (the lean forward on a wholly bf16 model), it comes through
    on average, the base output's own rounding error dithering it: the output moves by
    the update, in the mean over many values."""
    x = torch.randn(512, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = {}
    for lean in (False, True):
        layer = one_layer(lean, b_std=1e-5)
        with torch.no_grad():
            base = layer.base_layer(x).float()
            outs[lean] = layer(x).float() - base
            a, b = (f.weight.double() for f in (layer.lora_A["default"], layer.lora_B["default"]))
            update = (x.double() @ a.t() @ b.t() * layer.scaling["default"]).float()
    step = base.abs() * 2.0**-8  # a bf16 step at each value, within a factor of 2
    assert (update.abs() / step).median() < 1 / 20  # the update: tiny

    def slope(moved):  # how much of the update the output moved by, fitted over all values
        return float((moved * update).sum() / (update * update).sum())

    assert slope(outs[False]) < 0.1  # PEFT's order: 0.04 (at 1/5 of a step: 0.44)
    assert 0.9 < slope(outs[True]) < 1.1  # rounded once: 0.98, the whole update on average


def test_rounded_once_the_output_is_the_float32_sum_rounded():
    """The lean forward's output on a wholly bf16 model is the float32 (here float64) sum
    of the base output and the adapter's product of bf16 operands (x A^T rounded to bf16,
    B read in bf16: the tensor cores' operands), rounded to bf16 once: within half a
    bf16 step of the exact value, and the same bf16 number wherever the exact value is
    not within float32 noise of a rounding boundary. The adapter's term with float32
    operands differs from it by ~2^-8 of itself: for an adapter whose term is a few per
    cent of the base output (here it is as large as it), a fraction of a bf16 step."""
    layer = one_layer(True, b_std=0.05)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        out = layer(x).double()
        w = layer.base_layer.weight.double()
        a = layer.lora_A["default"].weight.bfloat16().double()  # A is read in bf16
        h = (x.double() @ a.t()).float()  # x A^T, a float32 result
        b = layer.lora_B["default"].weight
        term = h.bfloat16().double() @ b.bfloat16().double().t() * 1.5
        exact = x.double() @ w.t() + term
        wide = h.double() @ b.double().t() * 1.5  # float32 operands: the term before
    assert torch.all((out - exact).abs() <= exact.abs() * 2.0**-8)  # half a step at most
    agree = (out == exact.bfloat16().double()).float().mean()
    assert agree > 0.99, agree
    assert (term - wide).norm() < 2.0**-7 * wide.norm()  # bf16 operands: ~2^-8 of the term


def test_rounded_once_the_gradients_are_the_plain_lora_gradients():
    """The rounding counts as the identity in the backward: x's, A's and B's gradients
    are those of x W^T + s (x A^T) B^T in float32 on the same bf16 values, to the bf16
    rounding of the backward's operands; A's and B's come out float32."""
    gen = torch.Generator().manual_seed(4)
    layer = one_layer(True, b_std=0.05)
    x = torch.randn(40, 96, generator=gen).bfloat16().requires_grad_()
    probe = torch.randn(40, 96, generator=gen)
    (layer(x).float() * probe).sum().backward()
    a32 = layer.lora_A["default"].weight.detach().bfloat16().float().requires_grad_()
    b32 = layer.lora_B["default"].weight.detach().clone().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    w32 = layer.base_layer.weight.float()
    ((x32 @ w32.t() + (x32 @ a32.t()) @ b32.t() * 1.5) * probe).sum().backward()
    pairs = (
        (x.grad, x32.grad),
        (layer.lora_A["default"].weight.grad, a32.grad),
        (layer.lora_B["default"].weight.grad, b32.grad),
    )
    for got, want in pairs:
        assert want.norm() > 0
        assert (got.float() - want).norm() < 1e-2 * want.norm(), (got.shape, want.shape)
    assert layer.lora_A["default"].weight.grad.dtype == torch.float32
    assert layer.lora_B["default"].weight.grad.dtype == torch.float32


def test_rounded_once_the_backward_keeps_what_it_kept():
    """The bf16 input, one per set of siblings, and a bf16 x A^T per adapted linear, as
    the lean forward kept rounding twice: no more bytes per position."""
    assert _per_position(qwen3_lora(bf16=True, switch=True, lean=True)) == _per_position(
        qwen3_lora(bf16=True, switch=True)
    )


def test_rounded_once_on_cuda_the_products_take_the_float32_result_path(monkeypatch, meta_addmm):
    """The CUDA branch (bf16 operands into a float32 result, `torch.mm(..., out_dtype=)`),
    which this CPU cannot run, traced on the meta device: the forward gives bf16 rows, the
    backward x's gradient in bf16 and A's and B's in float32 of their shapes, and the
    sampler's sum the same rows."""
    import retrain.kernels.precision as precision
    from retrain.kernels.lora_layers import _RoundOnce, lora_sum_f32

    calls, added = [], []
    real_mm, real_addmm = torch.mm, torch.addmm

    def mm(a, b, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real_mm(a, b, **kwargs)

    def addmm(c, a, b, **kwargs):
        added.append((c.dtype, a.dtype, b.dtype, kwargs.get("out_dtype"), kwargs.get("out") is c))
        return real_addmm(c, a, b, **kwargs)

    monkeypatch.setattr(precision, "f32_out_matmul", lambda device_type: True)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    meta = {"device": "meta"}
    x = torch.empty(40, 96, dtype=torch.bfloat16, **meta).requires_grad_()
    w = torch.empty(64, 96, dtype=torch.bfloat16, **meta)
    a = torch.empty(8, 96, **meta).requires_grad_()
    b = torch.empty(64, 8, **meta).requires_grad_()
    out = _RoundOnce.apply(x, w, None, 1.5, None, a, b)
    assert (out.dtype, out.shape) == (torch.bfloat16, (40, 64))
    # x A^T and x W^T with float32 results, no float32 copies; then B's product of bf16
    # operands added into the float32 sum, on the tensor cores (not float32 operands,
    # which went to the CUDA cores' float32 GEMM), into that sum itself: an addmm into a
    # new tensor first copies its input there (aten's addmm_out), a pass over the sum
    assert calls[:2] == [torch.float32, torch.float32]
    bf16, f32 = torch.bfloat16, torch.float32
    assert added == [(f32, bf16, bf16, f32, True)]
    out.float().sum().backward()
    assert len(added) == 1  # x's gradient: A's term added into x W's product in place
    assert (x.grad.dtype, x.grad.shape) == (torch.bfloat16, x.shape)
    assert (a.grad.dtype, a.grad.shape) == (torch.float32, a.shape)
    assert (b.grad.dtype, b.grad.shape) == (torch.float32, b.shape)
    y = lora_sum_f32(x.detach(), w, None, a.detach().bfloat16(), b.detach(), 1.5)
    assert (y.dtype, y.shape) == (torch.float32, (40, 64))


def test_compiled_the_adapters_product_is_added_apart(monkeypatch):
    """Inside torch.compile (the compiled decode step) B's product of bf16 operands is a
    float32-result mm and one add, not addmm's out_dtype overload, whose fake-tensor
    rule in torch 2.11 takes out_dtype for beta and failed the whole step's compile; it
    is the same sum. Traced on the meta device as the CUDA branch is above; the value
    on this CPU's float32 path."""
    import retrain.kernels.precision as precision

    calls = []
    real_mm, real_addmm = torch.mm, torch.addmm
    monkeypatch.setattr(precision, "f32_out_matmul", lambda device_type: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(
        torch, "mm", lambda a, b, **k: calls.append(("mm", k)) or real_mm(a, b, **k)
    )
    monkeypatch.setattr(
        torch, "addmm", lambda *a, **k: calls.append(("addmm", k)) or real_addmm(*a, **k)
    )
    meta = {"device": "meta"}
    c = torch.empty(5, 7, **meta)
    a = torch.empty(5, 3, dtype=torch.bfloat16, **meta)
    b = torch.empty(3, 7, dtype=torch.bfloat16, **meta)
    out = precision.addmm_f32_(c, a, b, 1.5)
    assert (out.dtype, out.shape) == (torch.float32, (5, 7))
    assert calls == [("mm", {"out_dtype": torch.float32})]
    monkeypatch.setattr(precision, "f32_out_matmul", lambda device_type: False)
    gen = torch.Generator().manual_seed(5)
    c = torch.randn(5, 7, generator=gen)
    a, b = (torch.randn(*s, generator=gen).bfloat16() for s in ((5, 3), (3, 7)))
    want = c.double() + 1.5 * (a.double() @ b.double())
    out = precision.addmm_f32_(c, a, b, 1.5)
    assert out is c  # eager: into c itself
    torch.testing.assert_close(out.double(), want)


def test_the_device_query_is_a_constant_to_torch_compile(monkeypatch):
    """The products ask `hardware.f32_out_matmul` about the device, which reads torch's
    version from the package's metadata: torch 2.11's Dynamo cannot trace that (the
    compiled decode step failed on the H200 of 2026-11-27 with "does not know how to trace
    method `update` of class `<unknown type>`"; reproduced on this CPU with torch 2.11).
    torch.compile runs the query instead of tracing it: one whose body Dynamo cannot trace
    (here a graph break) still compiles whole (`fullgraph`), giving eager's values."""
    import retrain.kernels.precision as precision

    asked = []

    def untraceable(device_type: str) -> bool:
        torch._dynamo.graph_break()
        asked.append(device_type)
        return False

    monkeypatch.setattr(precision, "f32_out_matmul", untraceable)

    def products(c, a, b):
        return precision.mm_f32(a, b) + precision.addmm_f32_(c.clone(), a, b, 1.5)

    gen = torch.Generator().manual_seed(6)
    a, b = (torch.randn(4, 4, generator=gen).bfloat16() for _ in range(2))
    c = torch.randn(4, 4, generator=gen)
    compiled = torch.compile(products, fullgraph=True, backend="eager")
    assert torch.equal(compiled(c, a, b), products(c, a, b))
    assert asked and set(asked) == {"cpu"}
