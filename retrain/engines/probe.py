"""Probing a server engine's server before anything loads (`retrain explain`, `retrain
doctor`, and the engine's own `connect`): it answers, serves a model, and can hot-swap
LoRA adapters when the weights must be synced; and (`temperature_problems`, run by the
startup checks) whether its logprobs follow a sampling temperature the config asks for.
Loads nothing; every request goes through retrain/http.py's one client helper, without
retries (a probe reports, it does not wait).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from retrain.engines.dialects import DIALECTS, Dialect, recognised, server_url
from retrain.engines.wire import top_logprobs
from retrain.settings import EngineSettings

Problems = list[tuple[str, str]]
KEY = "[inference] url"


def api_key(dialect: Dialect, given: str) -> str:
    """`[inference] api_key`, else the dialect's environment variable ($OPENAI_API_KEY
    for the openai engine), else none."""
    if given or not dialect.api_key_env:
        return given
    return os.environ.get(dialect.api_key_env, "")


def base_model(models: Any) -> str:
    """The served base model: the /v1/models entry that is not a LoRA (no parent)."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data:
        return ""
    bases = [m for m in data if isinstance(m, dict) and not m.get("parent")]
    return str((bases or data)[0].get("id", ""))


def _address_problems(dialect: Dialect, base: str) -> Problems:
    if not base:
        fix = 'Fix: url = "http://HOST:PORT"'
        return [(KEY, f'is empty; engine = "{dialect.name}" has no default URL. {fix}')]
    if not urlsplit(base).scheme.startswith("http"):
        return [(KEY, f'{base!r} is not an http(s) URL. Fix: url = "http://HOST:PORT"')]
    return []


def _lora_problems(client: Any, dialect: Dialect, base: str, models: Any) -> Problems:
    """Whether the server can take a new adapter each step: a variant recognised from
    its model list may not (llama.cpp), else its load endpoint must exist with LoRA on."""
    from retrain.http import NO_RETRY, request

    speaks = recognised(dialect, models)
    if not speaks.lora.hot_swap:
        return [
            (
                "[inference] engine",
                f"the server at {base} is {speaks.name}, which cannot hot-swap LoRA adapters, "
                f"so every step would sample from stale weights: {speaks.lora_note}",
            )
        ]
    if not speaks.lora.load:  # the adapter folder travels with every request
        return []
    url = f"{base}{speaks.lora.load}"
    # An empty body is refused by a server that has the endpoint (400/422) and changes
    # nothing; 404/405 means the server cannot hot-swap adapters.
    lora = request(client, "POST", url, json={}, retry=NO_RETRY, reply="response")
    if lora.status_code in (400, 422):
        # The route exists; a well-formed request for a folder that does not exist tells
        # whether LoRA is on (MAX without --enable-lora answers 501).
        missing = {"lora_name": "retrain-probe", "lora_path": "/nonexistent/retrain-probe"}
        lora = request(client, "POST", url, json=missing, retry=NO_RETRY, reply="response")
    if lora.status_code in (405, 501) or (lora.status_code == 404 and "adapter" not in lora.text):
        return [
            (
                "[inference] engine",
                f"{dialect.name} server at {base} cannot hot-swap LoRA adapters "
                f"({speaks.lora.load}: HTTP {lora.status_code}), so every step would sample "
                f"from stale weights. Fix: {speaks.lora_note}",
            )
        ]
    return []


def _answers(client: Any, dialect: Dialect, base: str) -> tuple[Problems, Any, str]:
    """(problems, the /v1/models reply, the base model) of a server that is reached."""
    from retrain.http import NO_RETRY, request

    start = f"Fix: start it ({dialect.start}), or point [inference] url at it"
    health_url = f"{base}{dialect.health}"
    health = request(client, "GET", health_url, retry=NO_RETRY, reply="response")
    if health.status_code >= 500:
        return (
            [(KEY, f"{health_url} answers HTTP {health.status_code} (not ready). {start}")],
            {},
            "",
        )
    reply = request(client, "GET", f"{base}/v1/models", retry=NO_RETRY, reply="response")
    models = reply.json() if reply.is_success else {}
    model = base_model(models)
    if not model:
        problem = f"{base}/v1/models lists no model (HTTP {reply.status_code}). {start}"
        return [(KEY, problem)], models, ""
    return [], models, model


def server_problems(
    dialect: Dialect,
    url: str,
    *,
    needs_lora: bool,
    api_key: str = "",
    timeout: float = 5.0,
    read_timeout: float | None = None,
) -> tuple[Problems, str]:
    """(problems with a fix, base model name) of the server at `url`. Each request may
    take `timeout` seconds to connect and `read_timeout` (default the same) to answer."""
    import httpx

    from retrain.http import HTTPRequestError, sync_client

    base = server_url(dialect, url)
    problems = _address_problems(dialect, base)
    if problems:
        return problems, ""
    answer_within = read_timeout or timeout
    try:
        with sync_client(
            timeout=answer_within, connect_timeout=timeout, max_connections=1, api_key=api_key
        ) as client:
            problems, models, model = _answers(client, dialect, base)
            if problems or not needs_lora:
                return problems, model
            return _lora_problems(client, dialect, base, models), model
    except HTTPRequestError as exc:
        if isinstance(exc.__cause__, httpx.ReadTimeout | httpx.WriteTimeout):
            return [
                (
                    KEY,
                    f"{base} accepted the connection but did not answer within "
                    f"{answer_within:g} s ({type(exc.__cause__).__name__}). Fix: wait until the "
                    "server is idle (still loading, or busy with another run's requests?), or "
                    "raise [inference] timeout",
                )
            ], ""
        cause = exc.__cause__ or exc
        start = f"Fix: start it ({dialect.start}), or point [inference] url at it"
        what = f"{type(cause).__name__}: {cause}"
        return [(KEY, f"nothing answers at {base} ({what}). {start}")], ""


def probe(settings: EngineSettings) -> Problems:
    """A server engine's probe (its registry entry's `probe`): the server answers,
    serves a model and can hot-swap LoRA; or, when retrain starts the server itself
    (MAX with no url), that it can be started here."""
    dialect = DIALECTS[settings.engine]
    if dialect.starts_own_server and not settings.url.strip():
        from retrain.engines import max_serve

        return max_serve.problems(needs_lora=True)
    problems, _ = server_problems(
        dialect, settings.url, needs_lora=True, api_key=api_key(dialect, settings.api_key)
    )
    return problems


# ---------------------------------------------------------------- logprobs at temperature T

MEASURE_PROMPT = "Once upon a time, there was a"


def raw_logprobs(
    complete: Callable[[dict[str, Any]], Any],
    model: str,
    prompt: list[int] | str,
    extra: Mapping[str, Any],
) -> bool:
    """Whether a server's logprobs ignore the sampling temperature: the same next-token
    logprobs at T = 1 and 0.5 (vLLM's default `--logprobs-mode raw_logprobs`, and MAX 26.7
    always). Two one-token completions; `complete` posts a /v1/completions body and
    returns its JSON."""
    tops = []
    for temperature in (1.0, 0.5):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": temperature,
            "logprobs": 5,
            "seed": 0,
        }
        body.update(extra)
        tops.append(top_logprobs(complete(body)["choices"][0]["logprobs"]))
    shared = [t for t in tops[0] if t in tops[1] and tops[0][t] < -0.05]
    return bool(shared) and all(abs(tops[0][t] - tops[1][t]) < 1e-4 for t in shared)


def needs_processed_logprobs(temperature: float) -> bool:
    """Sampling at `temperature` needs logprobs at that temperature: T = 1 is what a raw
    server returns anyway, and T = 0 (greedy) is never an importance ratio's behaviour."""
    return temperature > 0 and abs(temperature - 1) > 1e-6


def temperature_refusal(name: str, url: str, temperature: float, key: str) -> str:
    """Why a server with temperature-1 logprobs is not sampled at `temperature` (`key`)."""
    return (
        f"the {name} server at {url} returns logprobs at temperature 1 whatever the "
        f"sampling temperature; sampling at T = {temperature:g} would make the importance "
        f"ratio wrong. Fix: {key} = 1.0"
    )


def temperature_problems(
    settings: EngineSettings, temperatures: Mapping[str, float], timeout: float = 5.0
) -> Problems:
    """The engine's `sample` refuses a temperature (key -> T) other than 1 on a server
    whose logprobs are at temperature 1 (MAX, llama.cpp); measured here as `connect`
    measures it, with a text prompt (no tokenizer is loaded yet), so that the run stops
    before any model loads. Asks only a server whose dialect may need it, for a T that
    needs it; a server that does not answer is the probe's (and `connect`'s) to report,
    and one started by retrain itself (MAX, no url) is measured only once it runs."""
    from retrain.http import NO_RETRY, HTTPRequestError, request, sync_client

    dialect = DIALECTS[settings.engine]
    asked = {k: t for k, t in temperatures.items() if needs_processed_logprobs(t)}
    # vLLM's raw mode is refused at connect whatever T (it has a fix): only the others
    maybe = (dialect.checks_logprob_temperature and not dialect.raw_logprobs_fix) or bool(
        dialect.variants
    )
    base = server_url(dialect, settings.url)
    if not asked or not maybe or not base or _address_problems(dialect, base):
        return []
    key = api_key(dialect, settings.api_key)
    try:
        with sync_client(timeout=timeout, max_connections=1, api_key=key) as client:
            models = request(client, "GET", f"{base}/v1/models", retry=NO_RETRY)
            speaks = recognised(dialect, models)  # the openai engine may be llama.cpp
            if not speaks.checks_logprob_temperature or speaks.raw_logprobs_fix:
                return []  # follows T, or refused at connect whatever T (vLLM)

            def complete(body: dict[str, Any]) -> Any:
                url = f"{base}/v1/completions"
                return request(client, "POST", url, json=body, retry=NO_RETRY)

            raw = raw_logprobs(complete, base_model(models), MEASURE_PROMPT, speaks.extra)
    except (HTTPRequestError, KeyError, IndexError, TypeError, ValueError):
        return []
    if not raw:
        return []
    return [(k, temperature_refusal(speaks.name, base, t, k)) for k, t in asked.items()]
