"""`[reward] type = "judge"`: an LLM judge over an OpenAI-compatible chat endpoint.

For each (response, reference) pair the judge model is asked one question: is the
response's final answer equivalent to the reference? It must answer "yes" or "no";
yes scores 1.0, no 0.0. The question itself is sent too when the example has one.

Transport: the standard library (`urllib.request`) on a thread pool of
`max_concurrency` threads, so the base install needs no HTTP package. Each request has a
`timeout`; HTTP 429 and 5xx (and connection failures) are retried up to `max_retries`
times with exponential backoff and jitter, honouring a numeric `Retry-After`. A judgement
that still fails (or an unreadable verdict) scores 0.0 and is counted in
`BatchScore.errors` (`timeouts` when the last attempt timed out); the run goes on.

Endpoint and key: `judge_base_url`, else `$OPENAI_BASE_URL`, else the OpenAI API;
`judge_api_key`, else `$OPENAI_API_KEY` (may be empty for a local server). The key is sent
as a bearer token and never logged or shown in a repr or error message.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from retrain.errors import RewardError
from retrain.rewards.base import BatchScore, Reward
from retrain.rewards.boxed import extract_boxed
from retrain.types import Example

logger = logging.getLogger("retrain.rewards")

DEFAULT_MODEL = "gpt-4o-mini"
DEFAULT_BASE_URL = "https://api.openai.com/v1"
MAX_RESPONSE_CHARS = 6000  # the tail of a long response is what holds its answer

SYSTEM_PROMPT = (
    "You grade answers to problems. You are given a reference answer and a candidate "
    "response. Decide whether the final answer in the response is equivalent to the "
    "reference answer (same value or meaning; formatting differences do not matter). "
    "Reply with exactly one word: yes or no."
)

_VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class _Timeout(Exception):
    pass


def parse_verdict(text: str) -> float | None:
    """1.0 for yes, 0.0 for no, None when the reply holds neither."""
    m = _VERDICT.search(text or "")
    if m is None:
        return None
    return 1.0 if m.group(1).lower() == "yes" else 0.0


class JudgeReward(Reward):
    name = "judge"

    def __init__(
        self,
        *,
        judge_model: str = "",
        judge_base_url: str = "",
        judge_api_key: str = "",
        timeout: float = 30.0,
        max_concurrency: int = 8,
        max_retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 20.0,
        **_options,
    ) -> None:
        super().__init__()
        self.model = judge_model or DEFAULT_MODEL
        base = judge_base_url or os.environ.get("OPENAI_BASE_URL", "") or DEFAULT_BASE_URL
        self.base_url = base.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise RewardError(
                f"[reward] judge base URL must start with http:// or https://, got {self.base_url!r}"
            )
        self.url = self.base_url + "/chat/completions"
        # Private: never logged, never part of repr().
        self.__api_key = judge_api_key or os.environ.get("OPENAI_API_KEY", "")
        if timeout is None or timeout <= 0:
            raise RewardError(f"[reward] timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.max_concurrency = max(1, int(max_concurrency))
        self.max_retries = max(0, int(max_retries))
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self._pool: ThreadPoolExecutor | None = None

    def _scrub(self, text: str) -> str:
        """`text` with the API key blanked out (error bodies may echo it)."""
        return text.replace(self.__api_key, "***") if self.__api_key else text

    def __repr__(self) -> str:
        return f"JudgeReward(model={self.model!r}, base_url={self.base_url!r})"

    # -- one request -----------------------------------------------------------------
    def build_messages(self, response: str, example: Example) -> list[dict[str, str]]:
        if len(response) > MAX_RESPONSE_CHARS:
            response = "[...]" + response[-MAX_RESPONSE_CHARS:]
        parts = []
        if example.prompt:
            parts.append(f"Problem:\n{example.prompt}")
        parts.append(f"Reference answer:\n{example.reference}")
        parts.append(f"Candidate response:\n{response}")
        parts.append("Is the candidate's final answer equivalent to the reference? yes or no.")
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    def _post(self, payload: bytes) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.__api_key:
            headers["Authorization"] = "Bearer " + self.__api_key
        req = urllib.request.Request(self.url, data=payload, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            status = exc.code
            retry_after = None
            ra = exc.headers.get("Retry-After") if exc.headers else None
            if ra:
                try:
                    retry_after = float(ra)
                except ValueError:
                    retry_after = None
            try:
                detail = exc.read(400).decode("utf-8", "replace").strip()
            except Exception:
                detail = ""
            exc.close()
            if status == 429 or status >= 500:
                raise _Retryable(f"HTTP {status}", retry_after) from None
            raise RuntimeError(
                self._scrub(f"judge endpoint answered HTTP {status}: {detail}")
            ) from None
        except TimeoutError as exc:
            raise _Timeout(f"no answer within {self.timeout:g}s") from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise _Timeout(f"no answer within {self.timeout:g}s") from exc
            raise _Retryable(f"connection failed: {exc.reason}") from exc
        except (ConnectionError, OSError) as exc:
            raise _Retryable(f"connection failed: {exc}") from exc
        return json.loads(body)

    def judge(self, response: str, example: Example) -> tuple[float, str]:
        """(score, status) for one pair; status is "ok", "timeout" or "error"."""
        payload = json.dumps(
            {
                "model": self.model,
                "messages": self.build_messages(response, example),
                "temperature": 0.0,
            }
        ).encode()
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
                if isinstance(last, _Retryable) and last.retry_after is not None:
                    delay = min(self.max_backoff, max(delay, last.retry_after))
                time.sleep(delay * (0.5 + random.random() / 2))
            try:
                data = self._post(payload)
            except (_Retryable, _Timeout) as exc:
                last = exc
                continue
            except Exception as exc:
                self._log_first_failure(f"judge request to {self.url}", exc)
                return 0.0, "error"
            try:
                text = data["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError) as exc:
                self._log_first_failure(f"judge reply from {self.url} (no choices)", exc)
                return 0.0, "error"
            verdict = parse_verdict(text)
            if verdict is None:
                self._log_first_failure(
                    f"judge reply from {self.url}", ValueError(f"no yes/no verdict in {text!r}")
                )
                return 0.0, "error"
            return verdict, "ok"
        assert last is not None
        self._log_first_failure(
            f"judge request to {self.url} ({self.max_retries + 1} attempts)", last
        )
        return 0.0, "timeout" if isinstance(last, _Timeout) else "error"

    # -- batches ---------------------------------------------------------------------
    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        out = BatchScore()
        for response in responses:
            answer = extract_boxed(response)
            out.answers.append(answer)
            out.no_answer += answer is None
        if not responses:
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="judge")
        verdicts = list(self._pool.map(self.judge, responses, examples))
        for score, status in verdicts:
            out.rewards.append(score)
            if status == "timeout":
                out.timeouts += 1
            elif status == "error":
                out.errors += 1
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
