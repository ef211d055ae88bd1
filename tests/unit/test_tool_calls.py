"""Native tool calls (retrain/tool_calls.py): the format is detected from the chat
template, the model's calls are parsed back from its text, and a model whose template has
no tool support gets an error naming it and the supported formats.

No tool-capable model is cached offline here, so the templates are small ones written for
these tests in each format's own call syntax (the Hermes one is tests/tiny_model.py's);
the round trips render a call through the template and parse it back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_model import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, build_tokenizer  # noqa: E402

from retrain.errors import ConfigError  # noqa: E402
from retrain.tool_calls import (  # noqa: E402
    FORMATS,
    ParsedReply,
    ToolCall,
    detect,
    require_format,
)

LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m['content'] }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]</s>'
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
TEMPLATES = {"hermes": TOOL_CHAT_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        (
            "hermes",
            'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
            '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
            ParsedReply("Let me add.", [ToolCall("add", {"a": 2, "b": 3}), ToolCall("now", {})]),
        ),
        ("hermes", "The answer is 5.", ParsedReply("The answer is 5.")),
        # a call that is not JSON is no call: left in the text (the environment sees the
        # attempt) and counted
        (
            "hermes",
            "Adding. <tool_call>{add(2, 3)}</tool_call>",
            ParsedReply("Adding. <tool_call>{add(2, 3)}</tool_call>", [], 1),
        ),
        # a mention of the tag in prose starts no call, and takes none away
        (
            "hermes",
            'I will emit a <tool_call> block.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}'
            "\n</tool_call>",
            ParsedReply("I will emit a <tool_call> block.", [ToolCall("f", {"a": 1})]),
        ),
        # the closing tag inside an argument does not end the call
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
            ParsedReply("", [ToolCall("f", {"s": "</tool_call>"})]),
        ),
        # a tool without parameters, its arguments written null: a call with none
        (
            "hermes",
            '<tool_call>{"name": "now", "arguments": null}</tool_call>',
            ParsedReply("", [ToolCall("now", {})]),
        ),
        (
            "llama3",
            '<|python_tag|>{"name": "add", "parameters": {"a": 2}}; {"name": "now", "parameters": {}}',
            ParsedReply("", [ToolCall("add", {"a": 2}), ToolCall("now", {})]),
        ),
        (
            "llama3",
            '{"name": "add", "parameters": {"a": 2}} and more',
            ParsedReply('{"name": "add", "parameters": {"a": 2}} and more'),
        ),
        ("llama3", "The answer is 5.", ParsedReply("The answer is 5.")),
        (
            "llama3",
            'I think <|python_tag|>{"name": "add", "parameters": {"a": 2}}',
            ParsedReply("I think", [ToolCall("add", {"a": 2})]),
        ),
        (
            "mistral",
            '[TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]{"a": 2}',
            ParsedReply("", [ToolCall("add", {"a": 2}, "abc123XYZ")]),
        ),
        (
            "mistral",
            'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}, "id": "abc123xyz"}]',
            ParsedReply("Sure.", [ToolCall("add", {"a": 2}, "abc123xyz")]),
        ),
        (
            "mistral",
            '[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]now[ARGS]{}',
            ParsedReply("", [ToolCall("add", {"a": 2}), ToolCall("now", {})]),
        ),
        # the stop token decoded after the last call's arguments (v11+): read past
        (
            "mistral",
            '[TOOL_CALLS]add[ARGS]{"a": 2}</s>',
            ParsedReply("", [ToolCall("add", {"a": 2})]),
        ),
        (
            "mistral",
            "[TOOL_CALLS]add[ARGS]{a: 2}",
            ParsedReply("", [], 1),
        ),
        # an array cut short by max_tokens: the text as written, counted
        (
            "mistral",
            'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}, {"name": "no',
            ParsedReply(
                'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}, {"name": "no', [], 1
            ),
        ),
        # arguments written as a JSON string (some models do) are decoded
        (
            "mistral",
            '[TOOL_CALLS][{"name": "add", "arguments": "{\\"a\\": 2}"}]',
            ParsedReply("", [ToolCall("add", {"a": 2})]),
        ),
    ],
)
def test_parse_by_hand(fmt, text, expected):
    (row,) = [f for f in FORMATS if f.name == fmt]
    assert row.parse(text) == expected


def test_the_format_is_detected_from_the_template():
    assert {name: detect(t).name for name, t in TEMPLATES.items()} == {
        "hermes": "hermes",
        "llama3": "llama3",
        "mistral": "mistral",
    }
    assert detect(CHAT_TEMPLATE) is None  # never reads `tools`
    assert detect("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}") is None
    # Qwen3-Coder writes XML inside <tool_call>, which the hermes parser cannot read:
    # refused as unsupported, rather than every call silently lost
    coder = "{{ tools }}<tool_call>\n<function={{ name }}>\n<parameter=a>1</parameter></tool_call>"
    assert detect(coder) is None


def test_a_template_without_tools_names_the_model_and_the_formats():
    with pytest.raises(ConfigError) as err:
        require_format(build_tokenizer(CHAT_TEMPLATE), "acme/tiny-chat")
    msg = str(err.value)
    assert "[model] model = 'acme/tiny-chat'" in msg and "no tool-call format" in msg
    for f in FORMATS:
        assert f.name in msg
    assert require_format(build_tokenizer(TOOL_CHAT_TEMPLATE), "t").name == "hermes"


NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
SCALARS = st.one_of(
    st.integers(-(10**6), 10**6),
    st.booleans(),
    st.none(),
    st.text(st.characters(codec="ascii", exclude_characters="<>[]"), max_size=12),
)
ARGS = st.dictionaries(NAMES, st.one_of(SCALARS, st.lists(SCALARS, max_size=3)), max_size=4)


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
@settings(max_examples=40, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3))
def test_a_call_rendered_by_the_template_parses_back(fmt, calls):
    if fmt == "llama3":
        calls = calls[:1]  # a Llama 3 turn holds one call in these templates
    tok = build_tokenizer(TEMPLATES[fmt])
    wanted = [ToolCall(n, a, f"call{i}abcd") for i, (n, a) in enumerate(calls)]
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n, _ in calls]
    user = [{"role": "user", "content": "go"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [c.openai() for c in wanted]}
    before = tok.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    after = tok.apply_chat_template(user + [turn], tools=tools, tokenize=False)
    assert after.startswith(before)
    parsed = require_format(tok, fmt).parse(after[len(before) :])
    ids = [c.id for c in parsed.calls] if fmt == "mistral" else [""] * len(wanted)
    assert parsed.calls == [ToolCall(c.name, c.arguments, i) for c, i in zip(wanted, ids)]
