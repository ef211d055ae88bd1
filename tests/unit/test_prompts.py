"""Prompt rendering through a chat template, with a tiny tokenizer built here (no hub)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from retrain.data.prompts import DEFAULT_INSTRUCTION, PromptRenderer  # noqa: E402
from retrain.errors import DataError  # noqa: E402
from retrain.types import Example  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "<unk>",
    "<s>",
    "<|im_start|>",
    "<|im_end|>",
    "system",
    "user",
    "assistant",
    "what",
    "is",
    "2",
    "+",
    "3",
    "?",
    "put",
    "your",
    "final",
    "answer",
    "in",
    "\\boxed{}",
    ".",
    "calculate",
    "4",
    "=",
    "\\boxed{7}",
    "you",
    "are",
    "a",
    "calculator",
    "question:",
    "answer:",
]


def make_tokenizer(chat_template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # With add_special_tokens=True a BOS <s> is prepended: lets us see which mode ran.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = chat_template
    return fast


Q = Example(prompt="what is 2 + 3 ?", reference="5")


def test_render_with_system_and_instruction():
    r = PromptRenderer(make_tokenizer(), system_prompt="you are a calculator")
    text = r.render(Q)
    assert text == (
        "<|im_start|>system\nyou are a calculator<|im_end|>\n"
        f"<|im_start|>user\nwhat is 2 + 3 ?\n\n{DEFAULT_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_no_system_message_when_system_prompt_is_empty():
    r = PromptRenderer(make_tokenizer(), instruction="")
    assert r.messages(Q) == [{"role": "user", "content": "what is 2 + 3 ?"}]
    assert "system" not in r.render(Q)


def test_few_shot_exchange_comes_before_the_question():
    shots = [{"user": "calculate 3 + 4 .", "assistant": "3 + 4 = \\boxed{7}"}]
    r = PromptRenderer(make_tokenizer(), system_prompt="you are a calculator", few_shot=shots)
    roles = [m["role"] for m in r.messages(Q)]
    assert roles == ["system", "user", "assistant", "user"]
    assert r.messages(Q)[2]["content"] == "3 + 4 = \\boxed{7}"
    assert r.render(Q).index("\\boxed{7}") < r.render(Q).index("what is 2 + 3")


def test_encode_adds_no_extra_specials_and_is_cached():
    tok = make_tokenizer()
    r = PromptRenderer(tok, system_prompt="you are a calculator")
    ids = r.encode(Q)
    assert ids == tok(r.render(Q), add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # no BOS before the template
    calls = []
    real = tok.apply_chat_template

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    tok.apply_chat_template = counting
    for _ in range(3):
        assert r.encode(Example(prompt=Q.prompt, reference="other")) == ids
    assert calls == []  # same prompt text: served from the cache
    r.encode(Example(prompt="calculate 4 + 4 ?", reference="8"))
    assert calls == [1] and r.cache_size() == 2


def test_plain_fallback_without_chat_template(caplog):
    tok = make_tokenizer(chat_template=None)
    shots = [{"user": "calculate 3 + 4 .", "assistant": "\\boxed{7}"}]
    r = PromptRenderer(tok, system_prompt="you are a calculator", few_shot=shots, instruction="")
    with caplog.at_level(logging.WARNING, logger="retrain.data"):
        text = r.render(Q)
        r.render(Example(prompt="what is 3 + 3 ?", reference="6"))
    assert text == (
        "you are a calculator\n\n"
        "Question: calculate 3 + 4 .\nAnswer: \\boxed{7}\n\n"
        "Question: what is 2 + 3 ?\nAnswer:"
    )
    assert len([rec for rec in caplog.records if "no chat template" in rec.getMessage()]) == 1
    ids = r.encode(Q)
    assert ids[0] == tok.bos_token_id  # plain text: the tokenizer's own specials are added


def test_verifiers_examples_keep_their_messages():
    r = PromptRenderer(make_tokenizer(), system_prompt="you are a calculator")
    ex = Example(
        prompt="what is 2 + 3 ?",
        reference="5",
        meta={"source": "verifiers", "messages": [{"role": "user", "content": "what is 2 + 3 ?"}]},
    )
    # The config system prompt fills in for the missing one; no instruction is appended.
    assert r.messages(ex) == [
        {"role": "system", "content": "you are a calculator"},
        {"role": "user", "content": "what is 2 + 3 ?"},
    ]


def test_bad_few_shot_is_rejected():
    with pytest.raises(DataError, match="few_shot"):
        PromptRenderer(make_tokenizer(), few_shot=[{"user": "only a question"}])


def test_auto_instruction_is_the_original_prompt_for_math_only():
    from retrain.data.prompts import resolve_instruction

    assert resolve_instruction("auto", "math") == ""  # the problem alone, as the original sent it
    assert resolve_instruction("auto", "reasoning_gym") == DEFAULT_INSTRUCTION
    assert resolve_instruction("auto", "jsonl") == DEFAULT_INSTRUCTION
    assert resolve_instruction("", "jsonl") == ""
    assert resolve_instruction("Answer briefly.", "math") == "Answer briefly."
