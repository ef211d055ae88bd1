"""A counting semaphore shared by processes through lock files (the Tinker throttle).

Parallel campaign workers that all talk to the Tinker service share a limit on concurrent
API calls, `[backend] max_concurrent`. The semaphore is a directory holding one file per
slot, `slot_0.lock` ... `slot_{n-1}.lock`. Holding a slot means holding an exclusive
`fcntl.flock` on its file. The kernel drops a flock when the process that holds it dies,
however it dies (SIGKILL included), so a crashed worker never leaks a slot: there is no
counter to repair.

Each `slot()` opens its own file description, so threads of one process also exclude each
other correctly. flock is reliable on local filesystems; over NFS it may not be, so with a
multi-machine Ray cluster keep the throttle directory on a local disk of one host or use a
single worker machine for Tinker campaigns.

Use from a backend::

    throttle = throttle_for(config.backend)   # None when no throttle is configured
    with maybe_slot(throttle):
        result = client.forward_backward(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from retrain.errors import RetrainError

ENV_DIR = "RETRAIN_TINKER_THROTTLE_DIR"
ENV_MAX = "RETRAIN_TINKER_MAX_CONCURRENT"
DEFAULT_MAX_CONCURRENT = 4


class ThrottleTimeout(RetrainError):
    """No slot became free within the requested time."""


class Throttle:
    """`max_concurrent` slots shared by every process that uses the same `directory`."""

    def __init__(self, directory: str | Path, max_concurrent: int = DEFAULT_MAX_CONCURRENT):
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int):
            raise RetrainError(
                f"throttle max_concurrent must be an integer, got {max_concurrent!r}"
            )
        if max_concurrent < 1:
            raise RetrainError(f"throttle max_concurrent must be >= 1, got {max_concurrent}")
        self.directory = Path(directory)
        self.max_concurrent = max_concurrent
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RetrainError(
                f"cannot create the throttle directory {self.directory}: {exc.strerror or exc}"
            ) from exc

    def __repr__(self) -> str:
        return f"Throttle({str(self.directory)!r}, max_concurrent={self.max_concurrent})"

    # ------------------------------------------------------------ construction

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Throttle | None:
        """The throttle named by RETRAIN_TINKER_THROTTLE_DIR (and
        RETRAIN_TINKER_MAX_CONCURRENT, default 4), or None when the directory is unset."""
        env = os.environ if environ is None else environ
        directory = env.get(ENV_DIR, "").strip()
        if not directory:
            return None
        raw = env.get(ENV_MAX, "").strip()
        try:
            limit = int(raw) if raw else DEFAULT_MAX_CONCURRENT
        except ValueError:
            raise RetrainError(f"{ENV_MAX}={raw!r} is not an integer") from None
        return cls(directory, limit)

    @classmethod
    def from_config(cls, backend_config: Any) -> Throttle | None:
        """From `[backend] throttle_dir` + `max_concurrent`; None when throttle_dir is empty."""
        directory = str(getattr(backend_config, "throttle_dir", "") or "").strip()
        if not directory:
            return None
        return cls(
            directory, int(getattr(backend_config, "max_concurrent", DEFAULT_MAX_CONCURRENT))
        )

    # ------------------------------------------------------------ slots

    def _slot_path(self, index: int) -> Path:
        return self.directory / f"slot_{index}.lock"

    def try_acquire(self) -> _Held | None:
        """Take a free slot without waiting, or return None when all are held."""
        start = random.randrange(self.max_concurrent)  # spread contenders over the files
        for offset in range(self.max_concurrent):
            index = (start + offset) % self.max_concurrent
            path = self._slot_path(index)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise RetrainError(
                    f"cannot open throttle slot {path}: {exc.strerror or exc}"
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            except OSError:
                os.close(fd)
                raise
            try:  # who holds it, for people looking at the directory; not used for locking
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            except OSError:
                pass
            return _Held(fd, index)
        return None

    def acquire(self, timeout: float | None = None, poll: float = 0.05) -> _Held:
        """Wait for a slot (forever when `timeout` is None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = poll
        while True:
            held = self.try_acquire()
            if held is not None:
                return held
            if deadline is not None and time.monotonic() >= deadline:
                raise ThrottleTimeout(
                    f"no Tinker throttle slot free in {self.directory} after {timeout:.1f}s "
                    f"({self.max_concurrent} slots)"
                )
            wait = delay * (0.5 + random.random())
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            time.sleep(wait)
            delay = min(delay * 1.5, 0.5)

    @contextlib.contextmanager
    def slot(self, timeout: float | None = None) -> Iterator[int]:
        """Hold one slot for the duration of the block; yields the slot index."""
        held = self.acquire(timeout)
        try:
            yield held.index
        finally:
            held.release()

    @contextlib.asynccontextmanager
    async def async_slot(self, timeout: float | None = None) -> AsyncIterator[int]:
        """Like `slot()` for coroutines: waits with asyncio.sleep, never blocks the loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.05
        while True:
            held = self.try_acquire()
            if held is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise ThrottleTimeout(
                    f"no Tinker throttle slot free in {self.directory} after {timeout:.1f}s"
                )
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 1.5, 0.5)
        try:
            yield held.index
        finally:
            held.release()

    def in_use(self) -> int:
        """How many slots are held right now (probes each file; for status and tests)."""
        busy = 0
        for index in range(self.max_concurrent):
            path = self._slot_path(index)
            if not path.exists():
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy += 1
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        return busy


class _Held:
    """One acquired slot; `release()` is idempotent."""

    def __init__(self, fd: int, index: int):
        self.fd: int | None = fd
        self.index = index

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def throttle_for(backend_config: Any = None) -> Throttle | None:
    """The throttle a backend should use: `[backend] throttle_dir` when set, else the
    environment variables a campaign sets for its workers, else None (no limit)."""
    if backend_config is not None:
        throttle = Throttle.from_config(backend_config)
        if throttle is not None:
            return throttle
    return Throttle.from_env()


def maybe_slot(throttle: Throttle | None, timeout: float | None = None):
    """`throttle.slot()` or a no-op context when there is no throttle."""
    return contextlib.nullcontext() if throttle is None else throttle.slot(timeout)
