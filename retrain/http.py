"""The one HTTP client setup shared by everything retrain sends over the network (the
judge reward today, server inference engines later), on httpx.

    client = sync_client(timeout=30, max_connections=8, api_key=key)
    data = request(client, "POST", url, json=payload, retry=RetryPolicy(), source=...)

    aclient = async_client(timeout=30, max_connections=8, api_key=key)   # inside a loop
    data = await arequest(aclient, "POST", url, json=payload, ...)

Both clients pool connections (at most `max_connections`, kept alive), apply `timeout`
to each phase (connect, read, write, waiting for a pooled connection) and send the API key
as a bearer token. `request`/`arequest` retry HTTP 429 and 5xx, timeouts and connection
failures up to `retry.max_retries` times with exponential backoff and jitter, honouring
`Retry-After`, and return the decoded JSON body (`reply="json"`), the text (`"text"`), or
the response whatever its status (`"response"`: for probes that read the status; only
failures to get a response are retried then). Whatever still fails raises the one error
type, `HTTPRequestError`: its message names the method, the URL, what happened and
`source` (the config key the URL came from), never the API key. Requests are retried as
sent: pass `retry=NO_RETRY` for one that is not safe to repeat. Every HTTP request
retrain makes goes through these two functions (the judge reward, the server engines and
their probe, the prime_rl backend).

httpx is an optional dependency: `pip install 'retrain[judge]'`.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass
from typing import Any

from retrain import __version__
from retrain.errors import RetrainError

try:
    import httpx
except ModuleNotFoundError as _exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        "retrain's HTTP client needs httpx: pip install 'retrain[judge]'", name="httpx"
    ) from _exc

__all__ = [
    "NO_RETRY",
    "HTTPRequestError",
    "RetryPolicy",
    "arequest",
    "async_client",
    "request",
    "sync_client",
]

_DETAIL_CHARS = 300  # how much of an error body goes into a message


class HTTPRequestError(RetrainError):
    """A request that failed for good: not retryable, or out of attempts.

    `url`: where it went; `status`: the last HTTP status (None when no response came);
    `timed_out`: the last attempt ran out of time; `attempts`: how many were made."""

    def __init__(
        self,
        message: str,
        *,
        url: str,
        status: int | None = None,
        timed_out: bool = False,
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.timed_out = timed_out
        self.attempts = attempts


@dataclass(frozen=True)
class RetryPolicy:
    """Retry up to `max_retries` times; the wait before retry n (1, 2, ...) is
    `backoff * 2**(n-1)` seconds with jitter (50-100 %), at least a server's Retry-After,
    and at most `max_backoff`."""

    max_retries: int = 4
    backoff: float = 0.5
    max_backoff: float = 20.0

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        wait = self.backoff * 2 ** (retry - 1) * (0.5 + random.random() / 2)
        if retry_after is not None:
            wait = max(wait, retry_after)
        return max(0.0, min(self.max_backoff, wait))


NO_RETRY = RetryPolicy(max_retries=0)  # for a request that is not safe to repeat


def _client_options(
    timeout: float,
    max_connections: int,
    api_key: str,
    headers: dict[str, str] | None,
    transport: Any,
    connect_timeout: float | None,
) -> dict[str, Any]:
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    all_headers = {"Accept": "application/json", "User-Agent": f"retrain/{__version__}"}
    if api_key:
        all_headers["Authorization"] = f"Bearer {api_key}"
    all_headers.update(headers or {})
    n = max(1, int(max_connections))
    return {
        "timeout": httpx.Timeout(float(timeout), connect=connect_timeout or float(timeout)),
        "limits": httpx.Limits(max_connections=n, max_keepalive_connections=n),
        "headers": all_headers,
        "transport": transport,
    }


def sync_client(
    *,
    timeout: float = 30.0,
    max_connections: int = 8,
    api_key: str = "",
    headers: dict[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    connect_timeout: float | None = None,
) -> httpx.Client:
    """A pooled blocking client; close it (or use it as a context manager) when done.
    `transport` replaces the network (tests pass an `httpx.MockTransport`);
    `connect_timeout` (default `timeout`) bounds reaching the server only."""
    options = _client_options(
        timeout, max_connections, api_key, headers, transport, connect_timeout
    )
    return httpx.Client(**options)


def async_client(
    *,
    timeout: float = 30.0,
    max_connections: int = 8,
    api_key: str = "",
    headers: dict[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """A pooled asyncio client; create, use and `aclose()` it on one event loop."""
    options = _client_options(timeout, max_connections, api_key, headers, transport, None)
    return httpx.AsyncClient(**options)


def _retry_after(response: httpx.Response) -> float | None:
    """A Retry-After header in seconds (a number or an HTTP date), else None."""
    value = response.headers.get("Retry-After", "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class _Call:
    """The bookkeeping of one request and its retries, shared by the sync and the async
    helper: each failed attempt either gives the wait before the next one or raises."""

    def __init__(self, client: httpx.Client | httpx.AsyncClient, method, url, retry, source):
        self.method, self.url, self.retry, self.source = method.upper(), url, retry, source
        self.limit = client.timeout.read or client.timeout.connect
        auth = client.headers.get("Authorization", "")
        self.secrets = [s for s in (auth, auth.partition(" ")[2]) if len(s) > 3]
        self.attempts = 0

    def _scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def fail(
        self,
        what: str,
        *,
        status: int | None = None,
        timed_out: bool = False,
        retryable: bool = True,
        retry_after: float | None = None,
        cause: BaseException | None = None,
    ) -> float:
        """The wait before the next attempt; raises HTTPRequestError when there is none."""
        if retryable and self.attempts <= self.retry.max_retries:
            return self.retry.delay(self.attempts, retry_after)
        tries = f" after {self.attempts} attempts" if self.attempts > 1 else ""
        where = f"{self.method} {self.url}" + (f" ({self.source})" if self.source else "")
        raise HTTPRequestError(
            self._scrub(f"{where} failed{tries}: {what}"),
            url=self.url,
            status=status,
            timed_out=timed_out,
            attempts=self.attempts,
        ) from cause

    def transport_error(self, exc: httpx.RequestError) -> float:
        """The wait after a request that got no response (or a raise)."""
        if isinstance(exc, httpx.TimeoutException):
            within = f" within {self.limit:g}s" if self.limit else ""
            return self.fail(f"no answer{within} ({type(exc).__name__})", timed_out=True, cause=exc)
        retryable = isinstance(
            exc, httpx.NetworkError | httpx.RemoteProtocolError | httpx.ProxyError
        )
        reason = str(exc) or type(exc).__name__
        return self.fail(f"connection failed: {reason}", retryable=retryable, cause=exc)

    def check(self, response: httpx.Response) -> float | None:
        """None for a 2xx response, else the wait before the next attempt (or a raise)."""
        status = response.status_code
        if response.is_success:
            return None
        # Scrubbed before it is cut, so no prefix of the key can survive the cut.
        detail = self._scrub(response.text)[:_DETAIL_CHARS].strip()
        return self.fail(
            f"HTTP {status}" + (f": {detail}" if detail else ""),
            status=status,
            retryable=status == 429 or status >= 500,
            retry_after=_retry_after(response),
        )

    def reply(self, response: httpx.Response, reply: str) -> Any:
        """The reply as asked: the response itself, its text, or its decoded JSON."""
        if reply == "response":
            return response
        if reply == "text":
            return response.text
        try:
            return response.json()
        except ValueError as exc:
            body = self._scrub(response.text)[:80]
            self.fail(
                f"HTTP {response.status_code} with a body that is not JSON: {body!r}",
                status=response.status_code,
                retryable=False,
                cause=exc,
            )


REPLIES = ("json", "text", "response")


def _checked_reply(reply: str) -> str:
    if reply not in REPLIES:
        raise ValueError(f"reply must be one of {REPLIES}, got {reply!r}")
    return reply


def request(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    json: Any = None,
    retry: RetryPolicy | None = None,
    source: str = "",
    reply: str = "json",
) -> Any:
    """Send one request with retries (see the module docstring) and return its reply as
    asked: the decoded JSON body, the text, or the response itself. Raises
    HTTPRequestError."""
    call = _Call(client, method, url, retry or RetryPolicy(), source)
    reply = _checked_reply(reply)
    while True:
        call.attempts += 1
        try:
            response = client.request(call.method, url, json=json)
        except httpx.InvalidURL as exc:
            call.fail(f"invalid URL: {exc}", retryable=False, cause=exc)
        except httpx.RequestError as exc:
            time.sleep(call.transport_error(exc))
            continue
        wait = None if reply == "response" else call.check(response)
        if wait is None:
            return call.reply(response, reply)
        time.sleep(wait)


async def arequest(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    json: Any = None,
    retry: RetryPolicy | None = None,
    source: str = "",
    reply: str = "json",
) -> Any:
    """The asyncio twin of `request`."""
    call = _Call(client, method, url, retry or RetryPolicy(), source)
    reply = _checked_reply(reply)
    while True:
        call.attempts += 1
        try:
            response = await client.request(call.method, url, json=json)
        except httpx.InvalidURL as exc:
            call.fail(f"invalid URL: {exc}", retryable=False, cause=exc)
        except httpx.RequestError as exc:
            await asyncio.sleep(call.transport_error(exc))
            continue
        wait = None if reply == "response" else call.check(response)
        if wait is None:
            return call.reply(response, reply)
        await asyncio.sleep(wait)
