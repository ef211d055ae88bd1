"""Native tool calls: which format a model's chat template writes tool calls in, and
parsing the model's calls back out of its completion.

A tool environment's tools go into the prompt through the chat template
(`apply_chat_template(..., tools=[...])`); the model answers in the template's own
tool-call format; this module reads the calls back so the environment gets them as
tool calls (an assistant message with `tool_calls`). The format is detected from the
template text (the marker each format's templates contain), one row per format in
FORMATS, so adding a format is adding a row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from retrain.errors import ConfigError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def openai(self) -> dict[str, Any]:
        """The OpenAI chat form chat templates and environments read (`arguments` is a
        dict: templates serialise it themselves)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the reply's text without the tool calls it parsed
    calls: list[ToolCall] = field(default_factory=list)
    # calls the model began in the format but wrote wrong (bad JSON, no name): left in
    # the content, so the environment sees the attempt, and counted (tool_calls_malformed)
    malformed: int = 0


def _call_of(obj: Any) -> ToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} as a ToolCall; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:  # a tool without parameters, written `"arguments": null`
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args, str(obj.get("id") or ""))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# A call's JSON object between the tags: a bare mention of "<tool_call>" in prose (no
# object after it) starts no match, so it cannot swallow the real call that follows.
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _parse_hermes(text: str) -> ParsedReply:
    calls: list[ToolCall] = []
    malformed = 0

    def take(m: re.Match) -> str:
        nonlocal malformed
        call = _call_of(_json(m.group(1)))
        if call is None:
            malformed += 1
            return m.group(0)  # left as written
        calls.append(call)
        return ""

    content = _HERMES.sub(take, text)
    return ParsedReply(content.strip(), calls, malformed)


def _parse_mistral(text: str) -> ParsedReply:
    # [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...] (v3 tokenizers) or
    # [TOOL_CALLS]name[ARGS]{...} one per call (v11+ tokenizers)
    head, _, rest = text.partition("[TOOL_CALLS]")
    if not _:
        return ParsedReply(text.strip())
    rest = rest.strip()
    if rest.startswith("["):
        decoded, end = _raw_json(rest)
        items = decoded if isinstance(decoded, list) else []
        calls = [c for c in map(_call_of, items) if c]
        if not isinstance(decoded, list):  # cut short or not JSON: the text as written
            return ParsedReply(text.strip(), [], 1)
        after = rest[end:].strip()
        return ParsedReply(f"{head.strip()} {after}".strip(), calls, len(items) - len(calls))
    calls, malformed = [], 0
    for chunk in rest.split("[TOOL_CALLS]"):
        name, sep, args = chunk.partition("[ARGS]")
        name, _, call_id = name.partition("[CALL_ID]")  # name[CALL_ID]id[ARGS]{...}
        decoded, end = _raw_json(args.strip())
        call = (
            _call_of({"name": name.strip(), "arguments": decoded, "id": call_id.strip()})
            if sep and end  # end 0: the arguments are not JSON
            else None
        )
        if call:
            calls.append(call)
        else:
            malformed += 1
    return ParsedReply(head.strip(), calls, malformed)


def _raw_json(text: str) -> tuple[Any, int]:
    try:
        return json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None, 0


def _parse_llama3(text: str) -> ParsedReply:
    # The whole reply is the call: {"name": ..., "parameters": {...}}, optionally after
    # <|python_tag|>, several separated by ";"
    before, tag, body = text.partition("<|python_tag|>")
    if not tag:
        before, body = "", text
    body = body.strip()
    for end in ("<|eot_id|>", "<|eom_id|>"):  # the turn's end token, when decoded with it
        body = body.removesuffix(end).rstrip()
    calls: list[ToolCall] = []
    while body.startswith("{"):
        obj, end = _raw_json(body)
        call = _call_of(obj)
        if call is None:
            break
        calls.append(call)
        body = body[end:].lstrip().removeprefix(";").lstrip()
    if not calls or body:  # plain text, or text after the calls: not a tool-call reply
        return ParsedReply(text.strip())
    return ParsedReply(before.strip(), calls)  # any text before <|python_tag|> kept


@dataclass(frozen=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]  # text a chat template of this format contains
    example: str  # how a call looks, for messages
    models: str
    parse: Callable[[str], ParsedReply]


FORMATS: tuple[ToolFormat, ...] = (
    # Mistral first: its templates may mention other formats' words, never the reverse.
    ToolFormat(
        "mistral",
        ("[TOOL_CALLS]",),
        '[TOOL_CALLS][{"name": ..., "arguments": {...}}]',
        "Mistral / Mixtral instruct",
        _parse_mistral,
    ),
    ToolFormat(
        "hermes",
        ("<tool_call>",),
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        "Qwen2.5 / Qwen3, Hermes, SmolLM3",
        _parse_hermes,
    ),
    ToolFormat(
        "llama3",
        ("<|python_tag|>", '"parameters": dictionary'),
        '{"name": ..., "parameters": {...}}',
        "Llama 3.1 / 3.2 / 3.3",
        _parse_llama3,
    ),
)


def supported() -> str:
    return "; ".join(f"{f.name} ({f.example}: {f.models})" for f in FORMATS)


def detect(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes, or None when it has no tool support
    (it never reads `tools`, or writes calls in a format not in FORMATS)."""
    if not template or "tools" not in template:
        return None
    if "<function=" in template:  # Qwen3-Coder's XML calls inside <tool_call>: not hermes
        return None
    return next((f for f in FORMATS if any(m in template for m in f.markers)), None)


def format_of(tokenizer: Any) -> ToolFormat | None:
    """The tool-call format of a tokenizer's chat template (see detect)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the tool-use one counts
        template = template.get("tool_use") or template.get("default")
    return detect(template)


def require_format(tokenizer: Any, model: str) -> ToolFormat:
    """The model's tool-call format; a ConfigError naming the model and the supported
    formats when its chat template has none."""
    found = format_of(tokenizer)
    if found is None:
        raise ConfigError(
            f"[model] model = {model!r}: the environment needs tool calls ([environment] "
            "probe: needs tools), but this model's chat template has no tool-call format "
            f"retrain can parse. Supported formats: {supported()}. Fix: pick a model whose "
            "chat template supports tools (e.g. a Qwen2.5/Qwen3 instruct model), or an "
            "environment without tools"
        )
    return found


def tool_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """One tool as the OpenAI function schema chat templates take in `tools=`."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }
