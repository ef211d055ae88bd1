"""The KV cache keyword: `cache` where the model's forward takes it (transformers 5.24
on), else `past_key_values`; never the deprecated one where the new one exists (it warns
on every decode step)."""

from __future__ import annotations

import inspect

from transformers import LlamaForCausalLM

from retrain.kernels.cache_arg import cache_kwargs


class New:
    def forward(self, input_ids=None, cache=None, use_cache=None): ...


class Old:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...


class Wrapper:  # PEFT's PeftModel: forward(*args, **kwargs) around the model
    def __init__(self, model):
        self.model = model

    def forward(self, *args, **kwargs): ...

    def get_base_model(self):
        return self.model


def test_the_keyword_follows_the_forward_signature():
    marker = object()
    assert cache_kwargs(New(), marker) == {"cache": marker}
    assert cache_kwargs(Old(), marker) == {"past_key_values": marker}
    assert cache_kwargs(Wrapper(New()), marker) == {"cache": marker}
    assert cache_kwargs(Wrapper(Old()), marker) == {"past_key_values": marker}


def test_the_installed_transformers_gets_its_own_name():
    params = inspect.signature(LlamaForCausalLM.forward).parameters
    (name,) = cache_kwargs(Wrapper(LlamaForCausalLM.__new__(LlamaForCausalLM)), None)
    assert name in params
    assert name == ("cache" if "cache" in params else "past_key_values")
