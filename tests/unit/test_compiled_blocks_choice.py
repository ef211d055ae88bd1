"""Which modules `compile = true` compiles (retrain/kernels/blocks.py, the blocks that
`shard = true` also shards; retrain/kernels/compiled_blocks.py): a transformers model's
blocks, by the classes it names, under PEFT too; none where it names none. And a failure
of torch.compile becomes an error naming the option, while any other error passes as it
is."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from retrain.errors import BackendError  # noqa: E402
from retrain.kernels.blocks import transformer_blocks as blocks  # noqa: E402
from retrain.kernels.compiled_blocks import compile_errors  # noqa: E402


def _llama(layers: int = 3):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def test_the_blocks_are_the_decoder_layers_under_peft_too():
    from peft import LoraConfig, get_peft_model

    model = _llama()
    assert blocks(model) == list(model.model.layers)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert blocks(wrapped) == list(model.model.layers)
    assert blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_only_a_compile_failure_becomes_the_options_error():
    from torch._dynamo.exc import Unsupported

    message = r"compile = true.*Unsupported.*Fix: compile = false"
    with pytest.raises(BackendError, match=message), compile_errors(True):
        raise Unsupported("graph break in the block")
    with pytest.raises(Unsupported), compile_errors(False):  # not compiling: not ours
        raise Unsupported("graph break in the block")
    with pytest.raises(ValueError), compile_errors(True):  # anything else passes as it is
        raise ValueError("a bad datum")
