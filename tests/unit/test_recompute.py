"""Norms and gated MLPs recomputed in the backward (retrain/kernels/recompute.py): what
the backward keeps (counted exactly against the formula), the gradients those of the
model as it was, with and without activation checkpointing, the same parameters under
the same names, and the parts a probe rejects left as they are."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tiny_qwen3 import HEAD_DIM, HEADS, HIDDEN, INTER, KV, LAYERS, per_position, qwen3_lora  # noqa: E402

import retrain.kernels.norms as norms  # noqa: E402
from retrain.kernels.norms import RmsNorm, fuse_rms_norms  # noqa: E402
from retrain.kernels.recompute import (  # noqa: E402
    GatedMlp,
    RecomputedRmsNorm,
    recompute_elementwise,
    recomputed,
)


def _grads(model, ids, probe):
    out = model.get_base_model().model(input_ids=ids).last_hidden_state
    (out.float() * probe).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_the_backward_keeps_the_inputs_of_norms_and_gated_products_only():
    before = per_position(qwen3_lora(bf16=True, switch=True))
    model = qwen3_lora(bf16=True, switch=True, recompute=True)
    after = per_position(model)
    # a norm kept a float32 copy of its bf16 input (4 bytes a value) and the float32
    # reciprocal of each normalised vector's RMS (4 bytes a vector), and now keeps the
    # input (2 bytes a value); the gated product kept act(gate) besides gate and up
    # (2 bytes a value). Norms over the hidden state: two per block and the final one,
    # less the first, whose input (the frozen embeddings) needs no gradient
    hidden_norms = 2 * LAYERS
    head_norms = LAYERS * (HEADS + KV)  # one vector per query and key head
    norms = (4 - 2) * (hidden_norms * HIDDEN + head_norms * HEAD_DIM)
    norms += 4 * (hidden_norms + head_norms)
    assert before - after == norms + LAYERS * 2 * INTER
    assert sum(isinstance(m, RecomputedRmsNorm) for m in model.modules()) == 4 * LAYERS + 1
    assert sum(isinstance(m, GatedMlp) for m in model.modules()) == LAYERS


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_are_the_models_own(checkpointing):
    ids = torch.arange(24)[None] % 97
    probe = torch.randn(1, 24, HIDDEN, generator=torch.Generator().manual_seed(1))
    results = []
    for recompute in (False, True):
        model = qwen3_lora(bf16=True, switch=True, recompute=recompute)
        if checkpointing:  # each block recomputed too: the parts' recompute nests in it
            model.gradient_checkpointing_enable({"use_reentrant": False})
            model.train()
        results.append(_grads(model, ids, probe))
    (out0, g0), (out1, g1) = results
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    assert list(g0) == list(g1)
    for name in g0:  # the same operators on a CPU: the same numbers
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, msg=name)
    assert any(g.abs().sum() > 0 for g in g1.values())


def test_where_the_norm_is_one_kernel_it_is_not_recomputed(monkeypatch):
    # where torch's rms_norm is one kernel keeping its input and reciprocal RMS (CUDA),
    # the norm is that kernel: nothing to recompute. It rounds once where transformers
    # rounds twice: against the same model in float32, its output and gradients are as
    # close as transformers' bf16 ones (a wrong weight or a dropped gradient is not)
    ids = torch.arange(24)[None] % 97
    probe = torch.randn(1, 24, HIDDEN, generator=torch.Generator().manual_seed(1))
    exact, g_exact = _grads(qwen3_lora(bf16=False, switch=True), ids, probe)
    theirs, g_theirs = _grads(qwen3_lora(bf16=True, switch=True), ids, probe)
    monkeypatch.setattr(norms, "FUSED_NORM_DEVICES", frozenset({"cpu"}))
    model = qwen3_lora(bf16=True, switch=True, recompute=True)
    kinds = [type(m) for m in model.modules() if isinstance(m, RmsNorm)]
    assert kinds == [RmsNorm] * (4 * LAYERS + 1)
    assert sum(isinstance(m, GatedMlp) for m in model.modules()) == LAYERS
    ours, g_ours = _grads(model, ids, probe)

    def error(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert 0 < error(ours, exact) < 1.5 * error(theirs, exact)
    assert list(g_ours) == list(g_exact)
    for name in g_exact:
        assert (
            error(g_ours[name], g_exact[name]) < 1.5 * error(g_theirs[name], g_exact[name]) + 1e-3
        ), name


def test_a_part_gets_the_gradients_of_its_forward():
    gate = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)

    def fn(g, u):
        return torch.nn.functional.silu(g) * u

    assert torch.autograd.gradcheck(lambda g, u: recomputed(fn, g, u), (gate, up))
    frozen = up.detach()  # an input without a gradient gets none
    recomputed(fn, gate, frozen).sum().backward()
    assert frozen.grad is None and gate.grad is not None


def test_the_same_parameters_under_the_same_names():
    plain = qwen3_lora(bf16=True, switch=True)
    ours = qwen3_lora(bf16=True, switch=True, recompute=True)
    assert list(plain.state_dict()) == list(ours.state_dict())
    for (name, a), b in zip(plain.state_dict().items(), ours.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert recompute_elementwise(ours) == (0, 0)  # nothing left to replace


def test_the_sampling_copy_takes_plain_fused_norms(monkeypatch):
    import retrain.engines.sampling_copy as sampling_copy

    monkeypatch.setattr(norms, "FUSED_NORM_DEVICES", frozenset({"cpu"}))
    model = qwen3_lora(bf16=True, switch=True, recompute=True)
    copy = sampling_copy.SamplingCopy.build(model, None)
    copy.refresh()
    fused = [m for m in copy.model.modules() if isinstance(m, RmsNorm)]
    assert fused and all(type(m) is RmsNorm for m in fused)
    ids = torch.arange(12)[None] % 97
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        got = copy.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)  # bf16 rounding, as before


def test_a_gated_mlp_computing_otherwise_and_gemmas_norms_are_kept():
    class Swapped(torch.nn.Module):  # a gated MLP's parts, gate and up the other way
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(8, 12, bias=False)
            self.up_proj = torch.nn.Linear(8, 12, bias=False)
            self.down_proj = torch.nn.Linear(12, 8, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    assert recompute_elementwise(torch.nn.Sequential(Swapped())) == (0, 0)
    cfg = transformers.GemmaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    gemma = transformers.GemmaForCausalLM(cfg)
    # Gemma's (1 + weight) norms keep their own; its gelu-gated MLP qualifies
    assert recompute_elementwise(gemma) == (0, 1)
    assert fuse_rms_norms(gemma) == 0
