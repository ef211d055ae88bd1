"""The `/v1/completions` wire format: the request body of one prompt's group, and the
samples read back from a reply (the server's token ids and logprobs, never re-tokenised).
Every server difference comes from the `Dialect` record (retrain/engines/dialects.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from retrain.engines.dialects import AdapterRef, Dialect
from retrain.errors import BackendError
from retrain.types import Sample, SamplingParams


def build_request(
    dialect: Dialect,
    model: str,
    prompt: list[int] | str,
    n: int,
    params: SamplingParams,
    *,
    seed: int | None,
    adapter: AdapterRef,
    stop_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The `/v1/completions` JSON body of one prompt's group."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": max(params.temperature, 0.0),
        "top_p": params.top_p,
        "logprobs": dialect.logprobs,
        "stream": False,
    }
    if seed is not None:
        body["seed"] = int(seed)
    if dialect.ask_token_ids:
        body["return_token_ids"] = True
    if stop_ids and dialect.stop_token_ids:
        # The trainer's eos set (tokenizer + generation config) ends a completion here too.
        body["stop_token_ids"] = sorted(int(i) for i in stop_ids)
    if dialect.keep_special_tokens:
        body["skip_special_tokens"] = False
    body.update(dialect.extra)
    if adapter.version > 0:
        body.update(dialect.lora.names(adapter))
    return body


def _token_id(token: Any) -> int | None:
    """An id from a `tokens` entry: an int, or vLLM's "token_id:N" string."""
    if isinstance(token, int):
        return token
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token[len("token_id:") :])
    return None


def _content_logprob(entry: dict[str, Any]) -> float:
    """A `logprobs.content[]` entry's logprob; llama.cpp with `post_sampling_probs` gives
    the probability (`prob`) instead."""
    if "logprob" in entry:
        return float(entry["logprob"])
    prob = float(entry.get("prob", 1.0))
    return math.log(prob) if prob > 0 else -math.inf


def parse_choice(choice: dict[str, Any], greedy: bool = False) -> Sample:
    """One completion from a `/v1/completions` choice: the sampled ids and their logprobs.

    Ids come from `choice.token_ids` (vLLM, MAX with return_token_ids), the chat-style
    `logprobs.content[].id` (llama.cpp), or integer `logprobs.tokens` (MLX); logprobs from
    `logprobs.token_logprobs` or `logprobs.content[].logprob`. A reply with neither raises:
    re-tokenising the text could give other ids than those sampled."""
    lp = choice.get("logprobs") or {}
    content = lp.get("content") if isinstance(lp, dict) else None
    ids: list[int] | None = None
    logprobs: list[float] | None = None
    if isinstance(content, list) and content:
        if all(isinstance(c, dict) and "id" in c for c in content):
            ids = [int(c["id"]) for c in content]
        logprobs = [_content_logprob(c) for c in content]
    if isinstance(lp, dict) and lp.get("token_logprobs") is not None:
        logprobs = [float(x) if x is not None else 0.0 for x in lp["token_logprobs"]]
    raw = choice.get("token_ids") or choice.get("completion_ids")
    if raw is None and isinstance(lp, dict) and lp.get("tokens"):
        parsed = [_token_id(t) for t in lp["tokens"]]
        raw = parsed if all(p is not None for p in parsed) else None
    if raw is not None:
        ids = [int(t) for t in raw]
    if ids is None:
        raise BackendError(
            "the server's reply has no sampled token ids (choices[].token_ids or "
            "logprobs.content[].id); retrain does not re-tokenise completions. Fix: use a "
            "server that returns them (vLLM >= 0.10, MAX, llama.cpp, MLX-LM)"
        )
    if logprobs is None or len(logprobs) != len(ids):
        got = "no" if logprobs is None else f"{len(logprobs)}"
        raise BackendError(
            f"the server returned {len(ids)} token ids but {got} logprobs; retrain needs "
            "one logprob per sampled token (request field `logprobs`)"
        )
    if greedy:  # argmax decoding: each token was chosen with probability 1
        logprobs = [0.0] * len(ids)
    finish = choice.get("finish_reason")
    return Sample(ids, logprobs, "length" if finish == "length" else "eos")


def parse_reply(data: Any, n: int, greedy: bool = False) -> list[Sample]:
    """The samples of one `/v1/completions` reply, in choice order."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise BackendError(f"the server's reply has no choices: {str(data)[:200]}")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    return [parse_choice(c, greedy) for c in choices[:n]]


def top_logprobs(logprobs: dict[str, Any]) -> dict[Any, float]:
    """The first token's top alternatives {token: logprob}: the completions shape
    (`top_logprobs: [{token: logprob}]`) or the chat shape llama.cpp uses
    (`content[0].top_logprobs` / `top_probs`: [{id, logprob | prob}])."""
    content = logprobs.get("content")
    if isinstance(content, list) and content:
        first = content[0]
        alts = first.get("top_logprobs") or first.get("top_probs") or []
        return {a.get("id", a.get("token")): _content_logprob(a) for a in alts}
    return dict(logprobs["top_logprobs"][0])
