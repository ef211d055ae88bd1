"""`[lora] target_modules` checked against the model's weights on disk, before any model
loads: the check agrees with what PEFT itself finds on a real (tiny) model."""

from __future__ import annotations

import pytest

from retrain.models import unknown_targets, weight_names

CANDIDATES = [
    "q_proj",
    "k_proj",
    "down_proj",
    "lm_head",
    "embed_tokens",
    "self_attn.q_proj",
    "layers.0.mlp.up_proj",
    "nope_proj",
    "q_porj",
    "query_key_value",
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path, config


def test_weight_names_are_read_from_the_safetensors_headers(tiny_llama):
    path, _ = tiny_llama
    names = weight_names(str(path))
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "lm_head.weight" not in names  # tied: the head has no weight of its own
    assert weight_names(str(path / "nowhere")) is None


def test_hand_worked_cases():
    weights = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    assert unknown_targets(["q_proj", "self_attn.q_proj", "lm_head"], weights) == []
    assert unknown_targets(["q_porj", "proj", "q_proj.weight"], weights) == [
        "q_porj",
        "proj",
        "q_proj.weight",
    ]


@pytest.mark.parametrize("target", CANDIDATES)
def test_unknown_exactly_where_peft_finds_no_module(tiny_llama, target):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    path, config = tiny_llama
    unknown = unknown_targets([target], weight_names(str(path))) == [target]
    try:
        get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=[target]))
        found = True
    except ValueError as exc:
        assert "not found" in str(exc) or "not supported" in str(exc)
        found = "not found" not in str(exc)
    assert unknown == (not found)


def test_the_start_refuses_a_target_no_layer_matches(tiny_llama):
    """Before any model loads (explain, doctor and the run share model_problems): a typo
    beside a valid name, which PEFT would skip without a word."""
    from retrain.config import config_from_dict
    from retrain.startup import model_problems

    path, _ = tiny_llama

    def problems(targets):
        config = config_from_dict(
            {
                "model": {"model": str(path)},
                "backend": {"devices": "cpu"},
                "lora": {"target_modules": targets},
            }
        )
        return dict(model_problems(config, ask=None))

    said = problems(["q_proj", "v_porj"])["[lora] target_modules"]
    assert "'v_porj' (did you mean 'v_proj'?) names no layer of" in said and "q_proj," in said
    assert problems(["q_proj", "self_attn.v_proj", "lm_head"]) == {}
