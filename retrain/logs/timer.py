"""Wall time per phase of a step, measured by one helper instead of timestamp variables."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PhaseTimer:
    """`with timer.phase("sampling"): ...` adds the block's wall time to
    `timer.seconds["sampling"]`; `on_enter(label)` is told when a phase starts (the
    console's live status line)."""

    def __init__(self, on_enter: Callable[[str], None] | None = None):
        self.seconds: dict[str, float] = {}
        self._on_enter = on_enter

    @contextmanager
    def phase(self, name: str, label: str = "") -> Iterator[None]:
        if self._on_enter is not None:
            self._on_enter(label or name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Count time measured elsewhere (phases that interleave, as in a multi-turn
        rollout) under phase `name`."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
