"""retrain.http: client setup, retries with backoff, and the one error type.

The network is replaced by `httpx.MockTransport` handlers; the judge tests run the same
code against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time

import httpx
import pytest

from retrain.errors import RetrainError
from retrain.http import (
    HTTPRequestError,
    RetryPolicy,
    arequest,
    async_client,
    request,
    sync_client,
)

URL = "http://judge.test/v1/chat/completions"
KEY = "sk-http-SECRET-42"
FAST = RetryPolicy(max_retries=2, backoff=0.001, max_backoff=0.01)


class Script:
    """A MockTransport handler answering from a list, one entry per request: a
    response, or an exception to raise."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, type) and issubclass(answer, Exception):
            raise answer("scripted failure", request=request)
        return answer


def _client(script: Script, **kw) -> httpx.Client:
    return sync_client(api_key=KEY, timeout=2.0, transport=httpx.MockTransport(script), **kw)


def _post(script: Script, **kw):
    with _client(script) as client:
        return request(client, "post", URL, json={"q": 1}, retry=FAST, **kw)


def test_success_sends_json_and_the_bearer_key():
    script = Script(httpx.Response(200, json={"ok": True}))
    assert _post(script) == {"ok": True}
    (req,) = script.requests
    assert req.method == "POST" and str(req.url) == URL
    assert req.headers["Authorization"] == f"Bearer {KEY}"
    assert req.headers["Content-Type"] == "application/json" and json.loads(req.read()) == {"q": 1}
    assert req.headers["User-Agent"].startswith("retrain/")


def test_client_settings():
    with sync_client(timeout=3.0, headers={"X-Extra": "1"}) as client:
        assert client.timeout.read == 3.0 and client.timeout.connect == 3.0
        assert "Authorization" not in client.headers  # no key: no header (local servers)
        assert client.headers["X-Extra"] == "1"
    with pytest.raises(ValueError, match="timeout"):
        sync_client(timeout=0)


def test_429_and_5xx_are_retried():
    script = Script(
        httpx.Response(429, headers={"Retry-After": "0"}),
        httpx.Response(503, text="busy"),
        httpx.Response(200, json=[1, 2]),
    )
    assert _post(script) == [1, 2]
    assert len(script.requests) == 3


def test_out_of_retries_raises_one_clear_error():
    script = Script(httpx.Response(500, text="boom"))
    with pytest.raises(HTTPRequestError) as info:
        _post(script, source="[reward] judge_base_url")
    err = info.value
    assert isinstance(err, RetrainError)
    assert len(script.requests) == 3 and err.attempts == 3
    assert err.status == 500 and not err.timed_out and err.url == URL
    assert (
        str(err) == f"POST {URL} ([reward] judge_base_url) failed after 3 attempts: HTTP 500: boom"
    )


def test_client_errors_are_not_retried_and_the_key_is_scrubbed():
    script = Script(httpx.Response(401, text=f"bad key Bearer {KEY} / {KEY}"))
    with pytest.raises(HTTPRequestError) as info:
        _post(script)
    assert len(script.requests) == 1 and info.value.status == 401
    assert KEY not in str(info.value) and "bad key *** / ***" in str(info.value)
    assert " after " not in str(info.value)  # one attempt
    # A key cut by the length limit on the quoted body does not leak a prefix either.
    script = Script(httpx.Response(400, text="x" * 290 + KEY))
    with pytest.raises(HTTPRequestError) as info:
        _post(script)
    assert KEY[:8] not in str(info.value)


def test_timeouts_and_connection_failures():
    script = Script(httpx.ReadTimeout)
    with pytest.raises(HTTPRequestError, match=r"no answer within 2s \(ReadTimeout\)") as info:
        _post(script)
    assert info.value.timed_out and info.value.status is None and len(script.requests) == 3

    script = Script(httpx.ConnectError, httpx.Response(200, json={}))
    assert _post(script) == {}  # retried

    script = Script(httpx.ConnectError)
    with pytest.raises(HTTPRequestError, match="connection failed: scripted failure") as info:
        _post(script)
    assert not info.value.timed_out and isinstance(info.value.__cause__, httpx.ConnectError)

    script = Script(httpx.UnsupportedProtocol)
    with pytest.raises(HTTPRequestError):
        _post(script)
    assert len(script.requests) == 1  # a misconfiguration, not retried


def test_a_body_that_is_not_json_is_an_error():
    script = Script(httpx.Response(200, text="<html>"))
    with pytest.raises(HTTPRequestError, match="not JSON: '<html>'"):
        _post(script)
    assert len(script.requests) == 1


def test_unreachable_real_port():
    with sync_client(timeout=0.5) as client, pytest.raises(HTTPRequestError, match="connection"):
        request(client, "GET", "http://127.0.0.1:9/", retry=RetryPolicy(0))


def test_retry_policy_delay():
    policy = RetryPolicy(max_retries=5, backoff=1.0, max_backoff=5.0)
    for _ in range(50):
        assert 0.5 <= policy.delay(1) <= 1.0
        assert 2.0 <= policy.delay(3) <= 4.0
        assert policy.delay(10) == 5.0  # capped
        assert policy.delay(1, retry_after=3.0) == 3.0  # the server's wait wins
        assert policy.delay(1, retry_after=60.0) == 5.0  # but stays capped


def test_retry_after_as_an_http_date_is_honoured():
    soon = email.utils.formatdate(time.time() + 2, usegmt=True)
    script = Script(httpx.Response(429, headers={"Retry-After": soon}), httpx.Response(200, json=1))
    policy = RetryPolicy(max_retries=1, backoff=0.001, max_backoff=0.3)
    t0 = time.monotonic()
    with _client(script) as client:
        assert request(client, "GET", URL, retry=policy) == 1
    assert time.monotonic() - t0 >= 0.25  # waited (up to max_backoff) as told


def test_async_twin():
    async def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(502) if len(calls) == 1 else httpx.Response(200, json=len(calls))

    async def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text=request.headers["Authorization"])

    async def main():
        async with async_client(api_key=KEY, transport=httpx.MockTransport(flaky)) as client:
            assert await arequest(client, "POST", URL, json={}, retry=FAST) == 2
        async with async_client(api_key=KEY, transport=httpx.MockTransport(down)) as client:
            with pytest.raises(HTTPRequestError, match=r"\(x\) failed: HTTP 503: \*\*\*$"):
                await arequest(client, "GET", URL, retry=RetryPolicy(0), source="x")

    calls: list = []
    asyncio.run(main())
