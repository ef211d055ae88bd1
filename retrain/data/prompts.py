"""Turn an Example into the prompt the model sees: chat messages, then the tokenizer's
chat template, then token ids. Done once per distinct prompt and cached.

Messages for an ordinary example:
    [system: system_prompt]                       (only when system_prompt is non-empty)
    user: few_shot[0]["user"]  / assistant: few_shot[0]["assistant"]  ...
    user: <question>\\n\\n<instruction>             (instruction only when non-empty)

With an empty system_prompt no system message is sent; some templates then insert their
own default (SmolLM2's adds "You are a helpful AI assistant named SmolLM..."), which is
accepted. A short system prompt of your own keeps prompts short.

Examples from a verifiers environment carry their own chat messages (`meta["messages"]`,
and/or `meta["system_prompt"]`): those are used as they are (the environment decides the
answer format), with `system_prompt` added only when the environment gives none; no
instruction and no few-shot exchange are added.

A tokenizer without a chat template gets a plain format (warning logged once):
    <system>\\n\\nQuestion: <few-shot user>\\nAnswer: <few-shot assistant>\\n\\nQuestion: <q>\\nAnswer:
Rendered chat-template text is tokenized with `add_special_tokens=False` (the template
already holds the special tokens); the plain format is tokenized with the tokenizer's
specials (a BOS where the model uses one).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from retrain.errors import DataError
from retrain.types import Example

logger = logging.getLogger("retrain.data")

DEFAULT_INSTRUCTION = "Put your final answer in \\boxed{}."


def resolve_instruction(instruction: str, source: str) -> str:
    """`[data] instruction = "auto"`: MATH problems go alone, as one user message (the
    original retrain's prompt, so results stay comparable); other sources get the
    boxed-answer line. Any other value is used as it is."""
    if instruction != "auto":
        return instruction
    return "" if source == "math" else DEFAULT_INSTRUCTION


def _check_few_shot(few_shot: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    out = []
    for i, pair in enumerate(few_shot or ()):
        if not isinstance(pair, Mapping) or not {"user", "assistant"} <= set(pair):
            raise DataError(
                f"[data] few_shot[{i}] must be a table with 'user' and 'assistant' strings, "
                f"got {pair!r}"
            )
        out.append({"user": str(pair["user"]), "assistant": str(pair["assistant"])})
    return out


class PromptRenderer:
    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str = "",
        instruction: str = DEFAULT_INSTRUCTION,
        few_shot: Sequence[Mapping[str, str]] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt or ""
        self.instruction = instruction or ""
        self.few_shot = _check_few_shot(few_shot)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._warned = False
        self._text_cache: dict[str, str] = {}
        self._ids_cache: dict[str, list[int]] = {}

    # -- messages --------------------------------------------------------------------
    def user_text(self, question: str) -> str:
        return f"{question}\n\n{self.instruction}" if self.instruction else question

    def messages(self, example: Example) -> list[dict[str, str]]:
        meta = example.meta or {}
        if meta.get("source") == "verifiers":
            env_messages = [dict(m) for m in (meta.get("messages") or [])]
            if not env_messages:
                env_messages = [{"role": "user", "content": example.prompt}]
            if not any(m["role"] == "system" for m in env_messages):
                system = meta.get("system_prompt") or self.system_prompt
                if system:
                    env_messages.insert(0, {"role": "system", "content": system})
            return env_messages
        msgs: list[dict[str, str]] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        for pair in self.few_shot:
            msgs.append({"role": "user", "content": pair["user"]})
            msgs.append({"role": "assistant", "content": pair["assistant"]})
        msgs.append({"role": "user", "content": self.user_text(example.prompt)})
        return msgs

    # -- text ------------------------------------------------------------------------
    def _plain(self, messages: list[dict[str, str]]) -> str:
        if not self._warned:
            self._warned = True
            logger.warning(
                "the tokenizer has no chat template: prompts use a plain "
                "'Question: ...\\nAnswer:' format"
            )
        parts = []
        pending_user = None
        for m in messages:
            if m["role"] == "system":
                parts.append(m["content"] + "\n\n")
            elif m["role"] == "user":
                pending_user = m["content"]
            elif m["role"] == "assistant":
                parts.append(f"Question: {pending_user or ''}\nAnswer: {m['content']}\n\n")
                pending_user = None
        parts.append(f"Question: {pending_user or ''}\nAnswer:")
        return "".join(parts)

    def _render_messages(self, messages: list[dict[str, str]]) -> str:
        if not self.has_chat_template:
            return self._plain(messages)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise DataError(f"the tokenizer's chat template failed on a prompt: {exc}") from exc
        if not isinstance(text, str):  # some versions hand back a list for batched input
            text = text[0]
        return text

    @staticmethod
    def _key(messages: list[dict[str, str]]) -> str:
        return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))

    def render(self, example: Example) -> str:
        """The full prompt text (chat template applied, generation prompt added)."""
        messages = self.messages(example)
        key = self._key(messages)
        text = self._text_cache.get(key)
        if text is None:
            text = self._render_messages(messages)
            self._text_cache[key] = text
        return text

    def encode(self, example: Example) -> list[int]:
        """Token ids of `render(example)`, cached per prompt."""
        messages = self.messages(example)
        key = self._key(messages)
        ids = self._ids_cache.get(key)
        if ids is None:
            text = self.render(example)
            encoded = self.tokenizer(text, add_special_tokens=not self.has_chat_template)
            ids = list(encoded["input_ids"])
            self._ids_cache[key] = ids
        return ids

    def cache_size(self) -> int:
        return len(self._ids_cache)
