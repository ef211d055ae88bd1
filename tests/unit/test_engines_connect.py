"""A server whose logprobs are at temperature 1 whatever the sampling temperature (MAX
26.7, llama.cpp) is refused a run at T != 1 by the startup checks, before any model loads
(the engine's own refusal at its first sample came after the policy model loaded). The
server is a stand-in on 127.0.0.1 speaking the OpenAI completions API: its next-token
logprobs either ignore the temperature (as MAX's do) or follow it (as vLLM's
processed_logprobs do)."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from retrain.cli.main import main
from retrain.config import config_from_dict
from retrain.engines.http import HTTPEngine
from retrain.errors import BackendError, ConfigError
from retrain.settings import EngineSettings
from retrain.startup import check_startup, engine_temperature_problems
from retrain.types import SamplingParams

LOGITS = {"a": 2.0, "b": 1.0, "c": 0.5, "d": 0.0, "e": -1.0}


def next_token_logprobs(temperature: float) -> dict[str, float]:
    scaled = {t: v / temperature for t, v in LOGITS.items()}
    norm = math.log(sum(math.exp(v) for v in scaled.values()))
    return {t: v - norm for t, v in scaled.items()}


class Server:
    """/health, /v1/models (one model), /v1/completions (one token, top logprobs) and a
    LoRA load route that refuses an empty body (it exists)."""

    def __init__(self, follows_temperature: bool) -> None:
        self.completions: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server API)
                self._answer(200, {"data": [{"id": "base"}]} if "models" in self.path else {})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/v1/completions":
                    self._answer(400, {"error": "bad adapter request"})
                    return
                server.completions.append(body)
                t = body["temperature"] if follows_temperature else 1.0
                tops = next_token_logprobs(t)
                logprobs = {"tokens": ["a"], "token_logprobs": [tops["a"]], "top_logprobs": [tops]}
                self._answer(200, {"choices": [{"text": "a", "logprobs": logprobs}]})

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def raw_server():
    server = Server(follows_temperature=False)
    yield server
    server.close()


@pytest.fixture
def processed_server():
    server = Server(follows_temperature=True)
    yield server
    server.close()


def max_run(url: str, temperature: float, **raw) -> object:
    return config_from_dict(
        {
            "backend": {"devices": "cpu"},
            "inference": {"engine": "max", "url": url},
            "data": {"source": "reasoning_gym", "task": "basic_arithmetic"},
            "training": {"temperature": temperature},
            **raw,
        }
    )


MESSAGE = (
    "the max server at {url} returns logprobs at temperature 1 whatever the sampling "
    "temperature; sampling at T = 0.7 would make the importance ratio wrong. "
    "Fix: [training] temperature = 1.0"
)


def test_a_temperature_the_server_ignores_stops_the_run_before_any_model_loads(raw_server):
    config = max_run(raw_server.url, 0.7)
    assert engine_temperature_problems(config) == [
        ("[training] temperature", MESSAGE.format(url=raw_server.url))
    ]
    with pytest.raises(ConfigError, match=r"\[training\] temperature: the max server at"):
        check_startup(config)
    assert [b["temperature"] for b in raw_server.completions][-2:] == [1.0, 0.5]
    # at T = 1 (and at greedy T = 0, never an importance ratio) nothing is asked
    asked = len(raw_server.completions)
    assert engine_temperature_problems(max_run(raw_server.url, 1.0)) == []
    assert len(raw_server.completions) == asked
    # the evaluation samples through the same engine
    evals = max_run(raw_server.url, 1.0, eval={"every": 5, "temperature": 0.5})
    ((key, problem),) = engine_temperature_problems(evals)
    assert key == "[eval] temperature" and problem.endswith("Fix: [eval] temperature = 1.0")


def test_explain_names_the_temperature(raw_server, capsys):
    Path("c.toml").write_text(
        f'[backend]\ndevices = "cpu"\n[inference]\nengine = "max"\nurl = "{raw_server.url}"\n'
        '[data]\nsource = "reasoning_gym"\ntask = "basic_arithmetic"\n'
        "[training]\ntemperature = 0.7\n"
    )
    assert main(["explain", "c.toml"]) == 2
    out = capsys.readouterr().out
    assert f"ERROR: [training] temperature (c.toml:10): {MESSAGE.format(url=raw_server.url)}" in out


def test_a_server_whose_logprobs_follow_the_temperature_passes(processed_server):
    assert engine_temperature_problems(max_run(processed_server.url, 0.7)) == []
    assert len(processed_server.completions) == 2  # measured, and found to follow T


def test_a_server_that_does_not_answer_is_left_to_the_probe():
    assert engine_temperature_problems(max_run("http://127.0.0.1:9", 0.7)) == []


class _Tok:
    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_the_engine_measures_the_same_way_and_still_refuses_at_sample(raw_server):
    """A MAX server retrain starts itself has no url before the run: connect measures it,
    and sample keeps the same refusal."""
    engine = HTTPEngine(EngineSettings("max", url=raw_server.url), _Tok(), {2})
    engine.connect(needs_lora=False)
    assert engine.raw_logprobs
    with pytest.raises(BackendError) as exc:
        engine.sample([[1, 2]], 2, SamplingParams(max_tokens=4, temperature=0.7, seed=1))
    assert str(exc.value) == MESSAGE.format(url=raw_server.url)
