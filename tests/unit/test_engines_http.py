"""Server engines: request bodies built from SamplingParams, parsing of recorded real
replies (vLLM 0.32 on CPU; tests/fixtures/engines/), the text fallback and retries
replayed from those recordings, and the live-adapter folder. The engines against a
running server: tests/integration/test_vllm_engine.py (-m vllm) and the max/llamacpp ones."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from retrain.engines.dialects import (
    DIALECTS,
    LLAMACPP,
    LORA_NAME,
    AdapterRef,
    recognised,
    server_url,
)
from retrain.engines.http import HTTPEngine
from retrain.engines.probe import server_problems
from retrain.engines.sync import LiveAdapterDir
from retrain.engines.wire import build_request, parse_choice, parse_reply, top_logprobs
from retrain.errors import BackendError
from retrain.registry import ENGINES
from retrain.settings import EngineSettings
from retrain.types import SamplingParams

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
PARAMS = SamplingParams(max_tokens=24, temperature=0.7, seed=5, top_p=0.9)


def _fixture(name: str):
    return json.loads((FIX / name).read_text())


# ---------------------------------------------------------------- request bodies


def test_vllm_request_carries_ids_n_seed_logprobs_and_eos():
    body = build_request(
        DIALECTS["vllm"], "base", [1, 2, 3], 8, PARAMS, seed=13, adapter=AdapterRef(), stop_ids=[2]
    )
    assert body == {
        "model": "base",
        "prompt": [1, 2, 3],
        "n": 8,
        "max_tokens": 24,
        "temperature": 0.7,
        "top_p": 0.9,
        "logprobs": 0,
        "stream": False,
        "seed": 13,
        "return_token_ids": True,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
    }
    assert "prompt_logprobs" not in body  # crashes vLLM 0.32 with LoRA and n > 1


@pytest.mark.parametrize(
    ("engine", "key", "value"),
    [
        ("vllm", "model", "n"),
        ("max", "model", "n"),
        ("sglang", "lora_path", "n"),
        ("mlx", "adapters", "/a/v000003"),
        (
            "trtllm",
            "lora_request",
            {"lora_name": "n-3", "lora_int_id": 3, "lora_path": "/a/v000003"},
        ),
    ],
)
def test_each_engine_names_the_live_adapter_its_own_way(engine, key, value):
    adapter = AdapterRef(3, "/a/v000003", "n")
    body = build_request(DIALECTS[engine], "base", [1], 2, PARAMS, seed=None, adapter=adapter)
    assert body[key] == value
    assert "seed" not in body
    base = build_request(DIALECTS[engine], "base", [1], 2, PARAMS, seed=None, adapter=AdapterRef())
    assert base["model"] == "base" and key not in base or base[key] == "base"


def test_llamacpp_requests_turn_truncation_off_and_ask_for_post_sampling_probs():
    body = build_request(LLAMACPP, "m", [1, 2], 1, PARAMS, seed=7, adapter=AdapterRef())
    assert body["top_k"] == 0 and body["min_p"] == 0.0 and body["post_sampling_probs"] is True
    assert body["prompt"] == [1, 2] and body["seed"] == 7 and body["logprobs"] == 1
    assert "return_token_ids" not in body and "stop_token_ids" not in body
    assert not LLAMACPP.honours_n  # one request per completion, seed + i each
    assert LLAMACPP.name not in DIALECTS  # reached through engine = "openai"


def test_default_urls_and_openai_needs_one():
    assert server_url(DIALECTS["vllm"], "") == "http://127.0.0.1:8000"
    assert server_url(DIALECTS["sglang"], "") == "http://127.0.0.1:30000"
    assert server_url(DIALECTS["trtllm"], "") == "http://127.0.0.1:31000"
    assert server_url(DIALECTS["mlx"], "") == "http://127.0.0.1:8080"
    assert server_url(DIALECTS["max"], "") == ""  # no url: retrain starts max serve (max_serve.py)
    assert server_url(DIALECTS["openai"], "") == ""
    assert server_url(DIALECTS["openai"], "http://h:1/v1/") == "http://h:1"
    with pytest.raises(BackendError, match=r"\[inference\] url is empty"):
        HTTPEngine(EngineSettings("openai"), None, {2})


def test_every_server_engine_is_a_built_registry_entry():
    for name, dialect in DIALECTS.items():
        entry = ENGINES.entry(name)
        assert entry.available and entry.target == "retrain.engines.http:build"
        traits = entry.engine_traits
        assert not traits.in_process and "entropy" not in traits.token_data  # logprobs only
        assert entry.probe == "retrain.engines.probe:probe"
        # config validation reads the trait, the engine the dialect: they must agree
        assert traits.needs_url == (not dialect.default_url and not dialect.starts_own_server)


def test_the_in_process_engine_is_the_only_one_that_returns_entropies():
    in_process = [e.name for e in ENGINES.entries if e.engine_traits.in_process]
    entropies = [e.name for e in ENGINES.entries if "entropy" in e.engine_traits.token_data]
    assert in_process == entropies == ["pytorch"]


# ---------------------------------------------------------------- recorded replies


def test_parse_recorded_vllm_reply_keeps_the_servers_ids_and_logprobs():
    recorded = _fixture("vllm_completion_chat.json")
    samples = parse_reply(recorded["response"], 2)
    for sample, choice in zip(samples, recorded["response"]["choices"], strict=True):
        assert sample.token_ids.tolist() == choice["token_ids"]
        np.testing.assert_allclose(sample.logprobs, choice["logprobs"]["token_logprobs"])
    stopped, cut = samples
    assert stopped.stop_reason == "eos" and stopped.token_ids[-1] == 2  # eos included
    assert cut.stop_reason == "length" and len(cut) == 32


def test_parse_other_reply_shapes():
    # llama.cpp: chat-style logprobs.content[] with ids
    llama = {
        "finish_reason": "stop",
        "logprobs": {
            "content": [{"id": 5, "token": "a", "logprob": -0.5}, {"id": 2, "logprob": -0.1}]
        },
    }
    s = parse_choice(llama)
    assert s.token_ids.tolist() == [5, 2] and s.logprobs.tolist() == [-0.5, -0.1]
    # MLX-LM: integer tokens
    mlx = {
        "finish_reason": "length",
        "logprobs": {"tokens": [7, 8], "token_logprobs": [-1.0, -2.0]},
    }
    assert parse_choice(mlx).token_ids.tolist() == [7, 8]
    # vLLM with return_tokens_as_token_ids
    ids = {"logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.3]}}
    assert parse_choice(ids).token_ids.tolist() == [9]
    # greedy decoding: each token had probability 1
    assert parse_choice(mlx, greedy=True).logprobs.tolist() == [0.0, 0.0]


def test_parse_recorded_llamacpp_reply_reads_ids_and_post_sampling_probs():
    import math

    recorded = _fixture("llamacpp_completion.json")
    (sample,) = parse_reply(recorded["response"], 1)
    content = recorded["response"]["choices"][0]["logprobs"]["content"]
    assert sample.token_ids.tolist() == [c["id"] for c in content]
    assert np.allclose(sample.logprobs, [math.log(c["prob"]) for c in content])
    assert sample.stop_reason == "length"
    top = top_logprobs(recorded["response"]["choices"][0]["logprobs"])
    assert top == {content[0]["top_probs"][0]["id"]: math.log(content[0]["top_probs"][0]["prob"])}
    openai = DIALECTS["openai"]
    assert recognised(openai, recorded["models"]) is LLAMACPP
    assert recognised(openai, _fixture("vllm_models.json")) is openai


def test_a_reply_without_ids_is_refused_rather_than_retokenised():
    with pytest.raises(BackendError, match="re-tokenise"):
        parse_choice({"text": "hi", "logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}})
    with pytest.raises(BackendError, match="logprobs"):
        parse_choice({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}})


# ---------------------------------------------------------------- replayed exchanges


class _Tok:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=False):
        return "decoded:" + ",".join(map(str, ids))


def _engine(handler, engine="vllm", **options) -> HTTPEngine:
    """An engine whose sync calls (reloads) are answered by `handler` (recorded replies)."""
    e = HTTPEngine(EngineSettings(engine, url="http://server", **options), _Tok(), {2})
    e.model = "base"
    e._client = httpx.Client(transport=httpx.MockTransport(handler))
    e._client.event_hooks = {"request": [e._count_send]}
    return e


@pytest.fixture
def patched_async(monkeypatch):
    """Route retrain.http.async_client through the engine's replay transport."""
    import retrain.http as http_mod

    holder = {}
    original = http_mod.async_client

    def async_client(**kw):
        return original(transport=holder["transport"], **kw)

    monkeypatch.setattr(http_mod, "async_client", async_client)
    return holder


def test_token_prompts_refused_fall_back_to_text_and_are_counted(patched_async):
    bad = _fixture("vllm_bad_prompt.json")
    good = _fixture("vllm_completion_chat.json")["response"]
    prompts = []

    def handler(request):
        body = json.loads(request.content)
        prompts.append(body["prompt"])
        if isinstance(body["prompt"], list):
            return httpx.Response(bad["status"], json=bad["body"])
        return httpx.Response(200, json=good)

    patched_async["transport"] = httpx.MockTransport(handler)
    e = _engine(handler)
    out = e.sample([[1, 5, 9]], 2, PARAMS)
    assert prompts == [[1, 5, 9], "decoded:1,5,9"]
    assert e.metrics()["engine_token_prompt_fallbacks"] == 1
    e.sample([[1, 5, 9]], 2, PARAMS)  # from now on text first
    assert prompts[2] == "decoded:1,5,9" and e.metrics()["engine_token_prompt_fallbacks"] == 2
    assert out[0][0].token_ids.tolist() == good["choices"][0]["token_ids"]


def test_transient_failures_are_retried_and_counted(patched_async):
    good = _fixture("vllm_completion_chat.json")["response"]
    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) <= 2:
            return httpx.Response(503, json={"error": "busy"}, headers={"Retry-After": "0"})
        return httpx.Response(200, json=good)

    patched_async["transport"] = httpx.MockTransport(handler)
    e = _engine(handler)
    e.retry = type(e.retry)(max_retries=3, backoff=0.001)
    samples = e.sample([[1, 2]], 2, PARAMS)
    assert len(samples[0]) == 2 and e.metrics()["engine_request_retries"] == 2


def test_seeds_differ_per_prompt_and_short_replies_are_topped_up(patched_async):
    one = _fixture("vllm_completion_chat.json")["response"]
    single = {**one, "choices": one["choices"][:1]}  # a server that ignores n
    seeds = []

    def handler(request):
        seeds.append(json.loads(request.content).get("seed"))
        return httpx.Response(200, json=single)

    patched_async["transport"] = httpx.MockTransport(handler)
    e = _engine(handler, engine="openai")
    out = e.sample([[1], [2]], 3, SamplingParams(max_tokens=8, temperature=1.0, seed=100))
    assert [len(g) for g in out] == [3, 3]
    assert sorted(seeds) == [100, 101, 102, 103, 104, 105]


def test_reload_failure_is_counted_retried_and_then_stops(patched_async):
    answers = iter([400, 200, 500, 500])

    def handler(request):
        status = next(answers)
        return httpx.Response(status, text="Success" if status == 200 else "no")

    e = _engine(handler)
    assert e.sync_adapter("/tmp/v000001", 1) is False  # counted and warned
    assert e.metrics()["engine_adapter_reload_failures"] == 1 and e.adapter.version == 0
    e._ensure_adapter()  # retried before the next sample: goes through
    assert e.adapter.version == 1 and e.metrics()["engine_adapter_reloads"] == 1
    assert e.sync_adapter("/tmp/v000002", 2) is False
    with pytest.raises(BackendError, match="stale weights"):
        e._ensure_adapter()


def _lost_lora(name: str) -> httpx.Response:
    """vLLM 0.32's real reply to a request naming a LoRA it does not serve (recorded after
    a restart), with the recorded name replaced by this engine's."""
    lost = _fixture("vllm_lost_lora.json")
    text = json.dumps(lost["body"]).replace(lost["lora_name"], name)
    return httpx.Response(
        lost["status"], content=text.encode(), headers={"content-type": "application/json"}
    )


def test_a_server_that_lost_the_adapter_gets_it_back_once_and_the_requests_are_retried(
    patched_async,
):
    good = _fixture("vllm_completion_chat.json")["response"]
    state = {"served": False}
    loads, models = [], []

    def handler(request):
        body = json.loads(request.content)
        if request.url.path == "/v1/load_lora_adapter":
            loads.append(body)
            state["served"] = True
            return httpx.Response(200, text="Success")
        models.append(body["model"])
        if body["model"] != "base" and not state["served"]:
            return _lost_lora(body["model"])
        return httpx.Response(200, json=good)

    patched_async["transport"] = httpx.MockTransport(handler)
    e = _engine(handler)
    e.sync_adapter("/tmp/v000003", 3)
    state["served"] = False  # the server restarts: it forgets the adapter
    loads.clear()
    out = e.sample([[1, 2], [3, 4], [5, 6]], 2, PARAMS)  # three requests see it missing
    assert [len(g) for g in out] == [2, 2, 2]
    # one plain (not in-place) load of the latest folder for all three, then each retried
    assert loads == [{"lora_name": e.lora_name, "lora_path": "/tmp/v000003"}]
    # 3 replies + 1 to 3 refusals (how many were sent before the re-load depends on the
    # event loop's order); never the base model
    assert set(models) == {e.lora_name} and 4 <= len(models) <= 6
    m = e.metrics()
    assert m["engine_adapter_resyncs"] == 1 and m["engine_adapter_version"] == 3
    assert m["engine_token_prompt_fallbacks"] == 0  # a lost adapter is not a prompt problem


def test_a_lost_adapter_that_cannot_be_reloaded_stops_the_run(patched_async):
    def handler(request):
        if request.url.path == "/v1/load_lora_adapter":
            if json.loads(request.content)["lora_path"] == "/tmp/v000001":
                return httpx.Response(200, text="Success")
            return httpx.Response(404, json={"error": {"message": "No adapter found"}})
        return _lost_lora(json.loads(request.content)["model"])

    patched_async["transport"] = httpx.MockTransport(handler)
    e = _engine(handler)
    e.sync_adapter("/tmp/v000001", 1)
    e.adapter = AdapterRef(1, "/tmp/gone", e.lora_name)  # the folder the server cannot read
    with pytest.raises(BackendError, match="lost adapter version 1.*base model"):
        e.sample([[1, 2]], 2, PARAMS)
    assert e.metrics()["engine_adapter_resyncs"] == 0


def test_the_base_model_missing_is_not_a_lost_adapter(patched_async):
    """Before any adapter (version 0) a 404 is the server's answer, not a restart."""

    def handler(request):
        return _lost_lora(json.loads(request.content)["model"])

    patched_async["transport"] = httpx.MockTransport(handler)
    e = _engine(handler)
    with pytest.raises(BackendError, match="404"):
        e.sample([[1, 2]], 2, PARAMS)
    assert e.metrics()["engine_adapter_resyncs"] == 0


def test_reload_bodies_vllm_in_place_after_the_first_and_sglang_unload_load():
    seen = []

    def handler(request):
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, text="ok")

    e = _engine(handler)
    e.sync_adapter("/tmp/v000001", 1)
    e.sync_adapter("/tmp/v000002", 2)
    assert seen == [
        ("/v1/load_lora_adapter", {"lora_name": e.lora_name, "lora_path": "/tmp/v000001"}),
        (
            "/v1/load_lora_adapter",
            {"lora_name": e.lora_name, "lora_path": "/tmp/v000002", "load_inplace": True},
        ),
    ]
    assert e.lora_name.startswith(LORA_NAME)  # per process: runs sharing a server never clash
    seen.clear()
    s = _engine(handler, engine="sglang")
    s.sync_adapter("/tmp/v000001", 1)
    s.sync_adapter("/tmp/v000002", 2)
    assert [p for p, _ in seen] == [
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/load_lora_adapter",
    ]
    seen.clear()
    t = _engine(handler, engine="trtllm")
    assert t.sync_adapter("/tmp/v000001", 1) and seen == []  # per request, nothing to send


def test_a_server_that_is_down_names_the_url_and_the_start_command():
    problems, model = server_problems(
        DIALECTS["vllm"], "http://127.0.0.1:9", needs_lora=True, timeout=1
    )
    assert model == "" and problems[0][0] == "[inference] url"
    assert (
        "http://127.0.0.1:9" in problems[0][1] and "scripts/vllm_server/start.sh" in problems[0][1]
    )
    problems, _ = server_problems(DIALECTS["openai"], "", needs_lora=True)
    assert "no default URL" in problems[0][1]


def test_a_server_that_accepts_but_does_not_answer_is_told_apart_from_a_down_one():
    """A real HTTP server on 127.0.0.1 that holds every request until the test lets go:
    the probe waits `read_timeout` for the answer and says the server is up but busy."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    release = threading.Event()

    class Held(BaseHTTPRequestHandler):
        def do_GET(self):
            release.wait(30)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Held)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        problems, model = server_problems(
            DIALECTS["vllm"], url, needs_lora=True, timeout=30, read_timeout=0.2
        )
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    assert model == "" and problems[0][0] == "[inference] url"
    text = problems[0][1]
    assert "accepted the connection but did not answer within 0.2 s" in text
    assert "raise [inference] timeout" in text and "nothing answers" not in text


# ---------------------------------------------------------------- live adapter folder


def test_live_adapter_folders_rotate_keeping_two(tmp_path):
    live = LiveAdapterDir(tmp_path / "_live_adapter", keep=2)

    def save(d: Path):
        (d / "adapter_model.safetensors").write_bytes(b"w")

    paths = [live.publish(save) for _ in range(4)]
    assert [v for v, _ in paths] == [1, 2, 3, 4]
    assert live.versions() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "_live_adapter").iterdir()) == ["v000003", "v000004"]
    assert (paths[-1][1] / "adapter_model.safetensors").exists()
    # a resumed run continues after the highest folder: the server never sees a name twice
    again = LiveAdapterDir(tmp_path / "_live_adapter")
    assert again.publish(save)[0] == 5


def test_a_failed_save_leaves_no_folder(tmp_path):
    live = LiveAdapterDir(tmp_path / "live")

    def broken(d: Path):
        raise OSError("disk full")

    with pytest.raises(OSError):
        live.publish(broken)
    assert live.versions() == [] and list((tmp_path / "live").iterdir()) == []


# ---------------------------------------------------------------- max without a url


def test_max_without_url_and_without_the_max_package_names_both_fixes():
    from retrain.engines import max_serve

    if max_serve.max_entry_point() is not None:
        pytest.skip("the max package is installed here (tests/integration/test_max_engine.py)")
    (problem,) = max_serve.problems(needs_lora=True)
    assert problem[0] == "[inference] engine" and "pip install modular" in problem[1]
    assert 'url = "http://127.0.0.1:8000"' in problem[1]
    with pytest.raises(BackendError, match="pip install modular"):
        max_serve.ManagedMax("/model")


def test_retrains_own_max_serve_command():
    from retrain.engines.max_serve import ManagedMax

    m = ManagedMax("/model", lora_rank=16, python="/py", entry="max._entrypoints.pipelines:main")
    try:
        cpu = m.command(gpu=False)
        assert cpu[:2] == ["/py", "-c"] and cpu[3:5] == ["max._entrypoints.pipelines:main", "serve"]
        flags = " ".join(cpu[5:])
        assert f"--host 127.0.0.1 --port {m.port}" in flags and "--model /model" in flags
        assert "--devices cpu --quantization-encoding float32" in flags
        assert "--enable-lora" not in flags  # MAX's LoRA is GPU-only
        gpu = " ".join(m.command(gpu=True))
        assert "--devices gpu --enable-lora --max-lora-rank 16 --max-num-loras 2" in gpu
        assert m.url == f"http://127.0.0.1:{m.port}"
        m.close()  # never started: nothing to stop
    finally:
        m.log.unlink(missing_ok=True)
