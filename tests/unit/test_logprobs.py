"""Chosen-token logprobs from the split-off output layer (retrain/kernels/logprobs.py):
values and gradients against the plain log-softmax of whole logits on random inputs
(several row chunks, a bias, temperatures, positions shared by several tokens), a case
worked by hand, and which models may be split (plain heads only: not soft-capped logits,
not an adapter on the output layer)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from retrain.kernels import logprobs as lp  # noqa: E402
from retrain.kernels.logprobs import LinearHead, chosen_logprobs, linear_head  # noqa: E402


def plain(hidden, weight, bias, row, target, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    return torch.log_softmax(logits, -1)[row, target]


def test_worked_by_hand():
    # two positions, vocabulary of 3; identity-like weights make the logits the hidden state
    weight = torch.eye(3)
    hidden = torch.tensor([[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0]])
    head = LinearHead(decoder=None, weight=weight, bias=None)
    out = chosen_logprobs(hidden, head, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1]), 1.0)
    # position 0: uniform, log 1/3; position 1: logits (log 2, 0, 0): p = (1/2, 1/4, 1/4)
    torch.testing.assert_close(out, torch.tensor([-math.log(3), -math.log(2), -math.log(4)]))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    tokens=st.integers(1, 14),
    vocab=st.integers(2, 30),
    with_bias=st.booleans(),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    chunk=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_values_and_gradients_equal_the_plain_log_softmax(
    rows, tokens, vocab, with_bias, temperature, chunk, seed
):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lp, "LOGIT_ROWS", chunk)  # several chunks, a partial last one
        _compare(rows, tokens, vocab, with_bias, temperature, seed)


def _compare(rows, tokens, vocab, with_bias, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 8, generator=gen, dtype=torch.float64) * 2
    weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64) if with_bias else None
    row = torch.randint(0, rows, (tokens,), generator=gen)  # positions shared by tokens
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    grad_out = torch.randn(tokens, generator=gen, dtype=torch.float64)

    h1 = hidden.clone().requires_grad_(True)
    got = chosen_logprobs(h1, LinearHead(None, weight, bias), row, target, temperature)
    h2 = hidden.clone().requires_grad_(True)
    want = plain(h2, weight, bias, row, target, temperature)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got.backward(grad_out.to(got.dtype))
    want.backward(grad_out)
    torch.testing.assert_close(h1.grad.double(), h2.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_bf16_head_gives_the_float32_logprobs_of_its_values(with_bias):
    # a GPU's bf16 model: bf16 hidden states and output layer, float32 logprobs (there
    # on the tensor cores, here by upcasting: the same float32 products); only the
    # softmax in the gradient is rounded to bf16
    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(40, 32, generator=gen) * 2).bfloat16()
    weight = torch.randn(300, 32, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16() if with_bias else None
    row = torch.randint(0, 40, (60,), generator=gen)
    target = torch.randint(0, 300, (60,), generator=gen)
    grad_out = torch.randn(60, generator=gen)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lp, "LOGIT_ROWS", 16)
        h1 = hidden.clone().requires_grad_(True)
        got = chosen_logprobs(h1, LinearHead(None, weight, bias), row, target, 0.7)
        got.backward(grad_out)
    h2 = hidden.double().requires_grad_(True)
    b64 = None if bias is None else bias.double()
    want = plain(h2, weight.double(), b64, row, target, 0.7)
    want.backward(grad_out.double())
    assert got.dtype == torch.float32 and h1.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    err = (h1.grad.double() - h2.grad).norm() / h2.grad.norm()
    assert err < 5e-3  # bf16's 2^-8 in the softmax and in the gradient itself


def test_no_gradient_state_without_grad():
    hidden = torch.randn(3, 4)
    head = LinearHead(None, torch.randn(5, 4), None)
    with torch.no_grad():
        out = chosen_logprobs(hidden, head, torch.tensor([0, 2]), torch.tensor([1, 4]), 1.0)
    assert not out.requires_grad


def _tiny(arch: str, **extra):
    import transformers

    kwargs = dict(
        vocab_size=30,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        **extra,
    )
    config = getattr(transformers, f"{arch}Config")(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config)
    model.get_output_embeddings().weight.requires_grad_(False)
    return model


def test_a_plain_llama_head_is_split_off_through_peft():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny("Llama"), LoraConfig(r=2, target_modules="all-linear"))
    model.train()
    head = linear_head(model)
    assert head is not None
    assert head.weight is model.get_base_model().lm_head.weight
    assert model.training  # the probe ran in eval mode and gave the mode back


def test_soft_capped_logits_keep_the_whole_logits_path():
    # Gemma 2 caps its logits with tanh: they are not a plain linear of the hidden state
    model = _tiny("Gemma2", final_logit_softcapping=0.5, head_dim=8)
    assert linear_head(model) is None
    uncapped = _tiny("Gemma2", final_logit_softcapping=None, head_dim=8)
    assert linear_head(uncapped) is not None


def test_a_trained_or_adapted_output_layer_is_not_split_off():
    from peft import LoraConfig, get_peft_model

    trained = _tiny("Llama")
    trained.lm_head.weight.requires_grad_(True)
    assert linear_head(trained) is None
    adapted = get_peft_model(_tiny("Llama"), LoraConfig(r=2, target_modules=["lm_head"]))
    assert linear_head(adapted) is None
