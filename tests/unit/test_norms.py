"""The fused RMS norms (retrain/kernels/norms.py): which norms are replaced
(Llama-family ones, Qwen3's per-head ones; not Gemma's 1 + weight, not a LayerNorm),
the model's logits unchanged in float32 and to bf16's rounding in bf16, the weight
applied before the one rounding (closer to the exact norm than transformers' two), and
the sampling copy taking them where torch fuses them while the trained model keeps its
own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import retrain.kernels.norms as norms  # noqa: E402
from retrain.kernels.norms import RmsNorm, fuse_rms_norms  # noqa: E402
from retrain.kernels.precision import bf16_weights  # noqa: E402

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def _model(arch: str, bf16: bool):
    cfg = getattr(transformers, f"{arch}Config")(**SIZES)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # trained norms: weights away from their init
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    if bf16:
        bf16_weights(model)
    return model


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize(("arch", "norms"), [("Llama", 5), ("Qwen3", 9), ("Mistral", 5)])
def test_llama_family_norms_are_replaced_and_the_logits_stay(arch, norms, bf16):
    model = _model(arch, bf16)
    ids = torch.arange(1, 12)[None]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    # two per block and the final one; Qwen3 adds its per-head query and key norms
    assert fuse_rms_norms(model) == norms
    assert sum(isinstance(m, RmsNorm) for m in model.modules()) == norms
    with torch.no_grad():
        after = model(input_ids=ids).logits
    if bf16:  # one rounding where transformers has two: a rounding step of bf16 apart
        torch.testing.assert_close(after, before, rtol=0.02, atol=0.02)
        assert not torch.equal(after, before)
    else:  # a CPU: the same operators in float32, the weight's product commuted
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert fuse_rms_norms(model) == 0  # nothing left to replace


def test_the_weight_is_applied_before_the_one_rounding():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    theirs = LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.3 * torch.randn(48, generator=gen))
    theirs.to(torch.bfloat16)
    ours = RmsNorm(theirs.weight, 1e-6)
    x = (3 * torch.randn(256, 48, generator=gen)).to(torch.bfloat16)
    xd, wd = x.double(), theirs.weight.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    with torch.no_grad():
        got, want = ours(x).double(), theirs(x).double()
    step = torch.finfo(torch.bfloat16).eps * exact.abs()  # one bf16 step of the value
    assert ((got - exact).abs() <= 0.5 * step + 1e-12).float().mean() > 0.99  # rounded once
    assert ((got - want).abs() <= step + 1e-12).all()  # a step from transformers' at most
    assert (got - exact).abs().mean() < (want - exact).abs().mean()


def test_gemmas_one_plus_weight_norm_and_a_layer_norm_are_kept():
    model = _model("Gemma", bf16=True)
    assert fuse_rms_norms(model) == 0
    layer_norm = torch.nn.Sequential(torch.nn.LayerNorm(16, bias=False))
    with torch.no_grad():
        layer_norm[0].weight.normal_()
    assert fuse_rms_norms(layer_norm) == 0


def test_a_norm_that_computes_otherwise_is_kept():
    class ScaledNorm(torch.nn.Module):  # an RMS norm's shape, another formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(16))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return 2 * self.weight * torch.nn.functional.rms_norm(x, (16,), eps=1e-6)

    assert fuse_rms_norms(torch.nn.Sequential(ScaledNorm())) == 0


def test_the_sampling_copy_takes_them_where_torch_fuses_them(monkeypatch):
    from peft import LoraConfig, get_peft_model

    from retrain.engines.sampling_copy import SamplingCopy

    model = get_peft_model(_model("Qwen3", bf16=True), LoraConfig(r=4, target_modules="all-linear"))
    ids = torch.arange(1, 12)[None]
    plain = SamplingCopy.build(model, None)  # a CPU: torch's rms_norm is not one kernel here
    assert not any(isinstance(m, RmsNorm) for m in plain.model.modules())
    monkeypatch.setattr(norms, "FUSED_NORM_DEVICES", frozenset({"cpu"}))
    fused = SamplingCopy.build(model, None)
    assert sum(isinstance(m, RmsNorm) for m in fused.model.modules()) == 9
    assert not any(isinstance(m, RmsNorm) for m in model.modules())  # the trainer's own
    with torch.no_grad():
        for copy_ in (plain, fused):
            copy_.refresh()
        torch.testing.assert_close(
            fused.model(input_ids=ids).logits, plain.model(input_ids=ids).logits, rtol=0, atol=0.05
        )
