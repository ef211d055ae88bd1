"""How many CPU threads torch uses: chosen from the cores that are actually free.

Why: torch parallelises each operator with OpenMP, and a decoded token runs hundreds of
small operators. Every parallel region ends at a barrier that waits for all its threads.
On an idle 2-core box two threads are ~1.5x faster than one; when other jobs hold the
cores, one of our threads is often descheduled and the other waits for it at every
barrier (spinning, by default, for ~300k iterations before it sleeps), so sampling with
2 threads on a busy box ran ~5x *slower* than with 1 (../shared/CALIBRATION.md).
`OMP_WAIT_POLICY=PASSIVE` stops the spinning but makes every barrier a sleep/wake-up,
which costs ~1.7x on an idle box, so retrain does not set it: it picks the thread count
instead.

The policy: the cores this process may use (`os.sched_getaffinity`) minus the cores other
processes kept busy since the last decision (from `/proc/stat`, less our own CPU time
from `/proc/self/stat`), rounded, at least 1. It is applied at start-up and again before
each sampling and training phase, so a job that starts or stops beside a run changes the
count within a step; a phase that starts within 0.2 s of the last reading keeps the last
count (`CpuMeter.others`: waiting there would pad every short phase, as a GPU's are). A
fixed `[backend.options] threads` turns the policy off.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def allowed_cpus() -> int:
    """Cores this process may run on (a taskset or cgroup cpuset narrows it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _busy_seconds(cpus: set[int] | None) -> float | None:
    """CPU-seconds spent busy (not idle or iowait) on `cpus` (all when None), or None
    where /proc/stat is unavailable."""
    try:
        with open("/proc/stat") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu"):
            break
        per_cpu = name != "cpu"
        if per_cpu != (cpus is not None) or (per_cpu and int(name[3:]) not in cpus):
            continue
        values = [int(v) for v in fields[:8]]
        busy += sum(values) - values[3] - values[4]  # total - idle - iowait
    return busy / _TICK


def _own_seconds() -> float:
    """CPU-seconds used by this process so far (all its threads)."""
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """Cores used by *other* processes between two readings."""

    def __init__(self):
        try:
            self.cpus: set[int] | None = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = None
        self._last = self._read()
        self._figure: float | None = None
        self._measured = False

    def _read(self) -> tuple[float, float | None, float]:
        return time.monotonic(), _busy_seconds(self.cpus), _own_seconds()

    def others(self, min_interval: float = 0.2) -> float | None:
        """Average cores busy with other work since the previous reading. A reading needs
        `min_interval` seconds (a shorter one is a tick or two of noise): the first call
        waits for them; a later one that comes sooner gives the last figure and reads
        nothing, since waiting there would stretch every phase shorter than
        `min_interval` to it (on a GPU a quickstart step's sampling and training phases
        take a fraction of a second each)."""
        wait = self._last[0] + min_interval - time.monotonic()
        if wait > 0 and self._measured:
            return self._figure
        if wait > 0:
            time.sleep(wait)
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last, self._measured = now, True
        if busy0 is None or busy1 is None or t1 <= t0:
            self._figure = None
        else:
            self._figure = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))
        return self._figure


def choose_threads(cpus: int, others: float | None) -> int:
    """Free cores, rounded, at least 1 (all allowed cores when the load is unknown)."""
    if others is None:
        return max(1, cpus)
    return max(1, min(cpus, round(cpus - others)))


class ThreadPolicy:
    """Sets torch's intra-op thread count from the free cores before each phase.

    `fixed` > 0 pins the count (the `[backend.options] threads` option) and disables the
    measurement. `decisions` keeps (phase, others, threads) for the metrics and tests."""

    def __init__(self, fixed: int = 0, *, meter: CpuMeter | None = None):
        self.fixed = fixed
        self.cpus = allowed_cpus()
        self.meter = meter if meter is not None or fixed else CpuMeter()
        self.threads = 0
        self.decisions: list[tuple[str, float | None, int]] = []

    def apply(self, phase: str = "start") -> int:
        import torch

        others = None if self.fixed else self.meter.others()
        n = self.fixed or choose_threads(self.cpus, others)
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
        self.decisions.append((phase, others, n))
        del self.decisions[:-64]  # a bounded history
        return n

    def describe(self, threads: int) -> str:
        """The start-up line: the count, why, and the OMP_WAIT_POLICY note."""
        if self.fixed:
            text = f"CPU threads: {threads} ([backend.options] threads)"
        else:
            others = self.decisions[-1][1] if self.decisions else None
            busy = "unknown" if others is None else f"{others:.1f}"
            text = (
                f"CPU threads: {threads} of {self.cpus} cores (other work busy on {busy}; "
                "chosen again before each sampling and training phase)"
            )
        if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
            text += "; OMP_WAIT_POLICY=PASSIVE is set: it helps a busy box but slows an idle one"
        return text

    def metrics(self) -> dict[str, float]:
        """The last sampling and training decisions, for the step's metrics row."""
        out: dict[str, float] = {}
        last = {phase: (others, n) for phase, others, n in self.decisions if phase != "start"}
        for phase, (others, n) in last.items():
            out[f"threads_{phase}"] = n
            if others is not None:
                out[f"cpu_busy_others_{phase}"] = round(others, 2)
        return out


class Overran(TimeoutError):
    """`call_within`'s call did not return in time (not a TimeoutError of the call's own)."""


def call_within(fn: Callable[[], T], timeout_s: float, name: str) -> T:
    """`fn()` in a daemon thread of its own (`name`), waited on for `timeout_s`: for a call
    that may block without end (a server that never answers, an import that waits on a
    download). Its result, or its exception re-raised here; Overran when it overruns,
    left behind, its result unused (a daemon thread: the process still exits)."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=call, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise Overran(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
