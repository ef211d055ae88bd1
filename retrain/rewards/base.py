"""What every reward returns, and the small base class they share.

A reward scores a batch of `(response, example)` pairs and reports, besides the rewards,
how the batch went: how many scorings failed (`errors`), ran out of time (`timeouts`) and
how many responses had no extractable answer (`no_answer`). A failure never stops the
run: the pair scores 0.0 and is counted. Only misconfiguration raises (RewardError).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from retrain.types import Example

if TYPE_CHECKING:
    from retrain.config.schema import RewardConfig

logger = logging.getLogger("retrain.rewards")


class LoopThread:
    """A private asyncio event loop on a daemon thread, kept for the reward's lifetime.

    Async scorers (custom async functions, verifiers rubrics) often cache clients bound to
    the loop they first ran on, so every batch runs on this same loop. Works whether or
    not the caller is itself inside a running event loop."""

    def __init__(self, name: str = "retrain-reward-loop") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def gather(self, coros: Sequence[Any]) -> list[Any]:
        """Results of `coros` run concurrently; an exception comes back as the value."""

        async def _all():
            return await asyncio.gather(*coros, return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(_all(), self._ensure()).result()

    def close(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(timeout=5.0)
            if not loop.is_running():
                loop.close()


@dataclass
class BatchScore:
    """Rewards for one batch plus its counters. `answers[i]` is the answer extracted from
    response i (the boxed content), None when there was none; it is there for logging."""

    rewards: list[float] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)
    errors: int = 0
    timeouts: int = 0
    no_answer: int = 0
    # False for scorers that read their own format (verifiers rubrics, environments):
    # `no_answer` (a \boxed{} extraction) says nothing about them, so it is not reported.
    extracts_answers: bool = True

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def no_answer_rate(self) -> float:
        return self.no_answer / len(self.rewards) if self.rewards else 0.0

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    def counters(self) -> dict[str, float]:
        """The counters as a flat dict, ready for a metrics row."""
        out = {"reward_errors": self.errors, "reward_timeouts": self.timeouts}
        if self.extracts_answers:
            out["no_answer_rate"] = self.no_answer_rate
        return out


class Reward:
    """Base class: subclasses implement `score_batch`; `score` is one pair of it."""

    name = "reward"

    def __init__(self) -> None:
        self._traceback_logged = False

    @classmethod
    def from_config(cls, reward: RewardConfig, search_paths: tuple[str, ...] = ()) -> Reward:
        """The reward for a `[reward]` table; each type reads the keys it uses."""
        return cls()

    def score(self, response: str, reference: str, example: Example | None = None) -> float:
        ex = example if example is not None else Example(prompt="", reference=reference)
        if example is not None and example.reference != reference:
            ex = Example(prompt=example.prompt, reference=reference, meta=example.meta)
        return self.score_batch([response], [ex]).rewards[0]

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        raise NotImplementedError

    def close(self) -> None:
        """Release workers or connections (no-op for most rewards)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers for subclasses ------------------------------------------------------
    @staticmethod
    def _check_lengths(responses: Sequence[str], examples: Sequence[Example]) -> None:
        if len(responses) != len(examples):
            from retrain.errors import RewardError

            raise RewardError(
                f"score_batch got {len(responses)} responses but {len(examples)} examples"
            )

    def _log_first_failure(self, what: str, exc: BaseException) -> None:
        """Log the first failure's traceback once per reward object; later ones are only
        counted (the batch counters carry them)."""
        if self._traceback_logged:
            return
        self._traceback_logged = True
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        logger.warning(
            "%s raised %s; scoring it 0.0 and counting it as a reward error "
            "(further failures are counted, not logged):\n%s",
            what,
            type(exc).__name__,
            tb.rstrip(),
        )
