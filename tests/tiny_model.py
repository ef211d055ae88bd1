"""A tiny random Llama with a character-level tokenizer and a chat template, saved as an
ordinary Hugging Face model directory, so tests run the real loading code fast."""

from __future__ import annotations

import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]

# The same turns with tool support in the Hermes/Qwen format (written for the tests, not
# a model's own): the tools' JSON schemas in a system turn, each call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, each result as a user turn
# holding <tool_response>...</tool_response>.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}"
    "{% if message['content'] or not message.tool_calls %}{{ '\\n' + message['content'] }}{% endif %}"
    # (trim_blocks: a newline right after a tag is dropped, so it is written as output)
    "{% for call in message.tool_calls or [] %}{{ '\\n' }}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    tok.chat_template = template
    return tok


def make_tiny_model(
    directory: str | Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    template: str = CHAT_TEMPLATE,
    sliding_window: int | None = None,
) -> Path:
    """`sliding_window`: a Qwen2 instead, its first layer full, the others sliding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    tok = build_tokenizer(template)
    torch.manual_seed(seed)
    kind, extra = (LlamaConfig, LlamaForCausalLM), {}
    if sliding_window is not None:
        kind = (Qwen2Config, Qwen2ForCausalLM)
        extra = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
    config = kind[0](
        **extra,
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = kind[1](config)
    # Make eos likely enough that completions end on their own sometimes.
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 0
        model.lm_head.bias = None
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
