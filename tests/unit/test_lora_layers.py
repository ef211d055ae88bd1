"""The adapter computed in the model's dtype on a wholly bf16 model
(retrain/kernels/lora_layers.py `adapter_in_input_dtype`): what the backward keeps (one
bf16 input per set of siblings instead of a float32 copy per adapted layer, counted
exactly), gradients against a float32 reference, the adapter's tensors and saved names
unchanged, a float32 model unchanged, and non-plain adapters left to PEFT."""

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
