"""`[reward] type = "math"`: symbolic equivalence of the boxed answer and the reference,
decided by math-verify (parse + verify).

Time limits. math-verify's built-in timeout uses `signal.alarm`, which only works on the
main thread and cannot interrupt a computation stuck in C code (a huge integer power,
for one). So verification runs in a small pool of worker processes:
- inside a worker, an interval timer (SIGALRM, the worker's main thread) stops the pair
  after `timeout` seconds; the worker survives and stays warm;
- if a worker still has not answered at `timeout * 1.5 + 1` seconds (C-level hang), the
  parent kills it and starts a fresh one.
Either way the pair scores 0.0 and is counted in `BatchScore.timeouts`. Workers are plain
`python -m retrain.rewards._mathverify_worker` subprocesses speaking JSON lines (no
multiprocessing: the caller's `__main__` is never re-imported). They start on first use,
say "ready" once math-verify is imported (about a second; the time limit starts then),
and stop at `close()` or interpreter exit. A worker that cannot start at all raises
RewardError with its error output.

`workers = 0` verifies inline in the calling process: no IPC, but time-limited only when
called from the main thread and with no protection against C-level hangs. The default is
min(4, CPUs) workers (POSIX; inline elsewhere). On the 2-core development box, busy with
other jobs, both ran at 40-75 rewards/s on cold, all-distinct MATH-style answers (sympy
parsing dominates: ~2 ms for an integer, ~40 ms for a set or an interval); see
`benchmarks/rewards.py`.

Caching: reference parses are cached per reference string in each worker; whole
(answer, reference) verdicts are cached in the parent (a group of completions often
repeats an answer). Plain numbers (integers, decimals, integer fractions) are decided
without sympy when the verdict is clear (`quick_verdict`), which is most MATH answers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from fractions import Fraction
from multiprocessing.connection import wait

from retrain.errors import RewardError
from retrain.rewards.base import BatchScore, Reward
from retrain.rewards.boxed import extract_boxed
from retrain.types import Example

logger = logging.getLogger("retrain.rewards")

_WORKER_MODULE = "retrain.rewards._mathverify_worker"
OK, TIMEOUT, ERROR = "ok", "timeout", "error"


def _require_math_verify() -> None:
    import importlib.util

    if importlib.util.find_spec("math_verify") is None:
        raise RewardError("the `math` reward needs math-verify: pip install 'retrain[math]'")


_INT = r"[+-]?\d+"
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{\s*(" + _INT + r")\s*\}\{\s*(" + _INT + r")\s*\}")
_SLASH = re.compile(r"(" + _INT + r")\s*/\s*(" + _INT + r")")


def _simple_rational(text: str) -> tuple[Fraction, bool] | None:
    """(value, is_integer_literal) for an integer, decimal or integer fraction
    (`\\frac{a}{b}`, `a/b`), else None."""
    t = text.strip().strip("$").strip()
    try:
        if _NUMBER.fullmatch(t):
            return Fraction(t), "." not in t
        m = _FRAC.fullmatch(t)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return (-value if m.group(1) == "-" else value), False
        m = _SLASH.fullmatch(t)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2))), False
    except (ValueError, ZeroDivisionError):
        return None
    return None


def quick_verdict(answer: str, reference: str) -> float | None:
    """Decide plain-number pairs without sympy: 1.0 when exactly equal, 0.0 when both are
    integers that differ or the values are clearly apart (relative gap > 1e-3, far beyond
    math-verify's rounding), None (ask math-verify) otherwise."""
    a, r = _simple_rational(answer), _simple_rational(reference)
    if a is None or r is None:
        return None
    (av, a_int), (rv, r_int) = a, r
    if av == rv:
        return 1.0
    if a_int and r_int:
        return 0.0
    if abs(av - rv) > Fraction(1, 1000) * max(1, abs(rv)):
        return 0.0
    return None


class _Worker:
    """One verifier process: `python -m retrain.rewards._mathverify_worker`, speaking
    JSON lines over its stdin/stdout. A plain subprocess (not multiprocessing) so that it
    never re-imports the caller's __main__ and behaves the same under any launcher."""

    def __init__(self, module: str = _WORKER_MODULE) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        # A file, not a pipe: a chatty worker can never block on a full pipe, and a worker
        # that dies at start-up leaves its error here.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            bufsize=0,  # unbuffered: no line can hide in a Python buffer from wait()
        )
        self.job: tuple[int, float] | None = None  # (item index, hard deadline)
        self.ready = False  # set by the worker's first line, once math-verify imported

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._stderr.seek(0)
            return self._stderr.read().decode("utf-8", "replace")[-2000:].strip()
        return ""

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, msg) -> None:
        data = memoryview(json.dumps(msg).encode() + b"\n")
        while data:
            n = self.proc.stdin.write(data)
            data = data[n:]

    def recv(self):
        """One message, or None for the worker's start-up "ready" line."""
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("math-verify worker exited")
        msg = json.loads(line)
        if msg == ["ready"]:
            self.ready = True
            return None
        return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2.0)
        with contextlib.suppress(OSError):
            self._stderr.close()

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the worker loop returns
            self.proc.wait(timeout=1.0)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


class _VerifyPool:
    """Worker processes that verify (answer, reference) pairs with a hard time limit."""

    def __init__(self, size: int, limit: float) -> None:
        self.size = max(1, size)
        self.limit = limit
        self.hard_limit = limit * 1.5 + 1.0
        self.startup_grace = 120.0
        self.worker_module = _WORKER_MODULE
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def _spawn(self) -> _Worker:
        return _Worker(self.worker_module)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = self._spawn()

    def run(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, str]]:
        with self._lock:
            while len(self._workers) < min(self.size, len(pairs)):
                self._workers.append(self._spawn())
            results: list[tuple[float, str] | None] = [None] * len(pairs)
            todo = deque(range(len(pairs)))
            while todo or any(w.job for w in self._workers):
                for w in list(self._workers):
                    if w.job is None and todo:
                        i = todo.popleft()
                        try:
                            w.send([i, pairs[i][0], pairs[i][1], self.limit])
                        except (OSError, ValueError):
                            self._replace(w)  # a dead worker: retry the item on a fresh one
                            todo.appendleft(i)
                            continue
                        # A fresh worker first imports math-verify (seconds on a busy
                        # machine): its clock starts when it says ready.
                        grace = 0.0 if w.ready else self.startup_grace
                        w.job = (i, time.monotonic() + self.hard_limit + grace)
                busy = [w for w in self._workers if w.job]
                if not busy:
                    continue
                nearest = min(w.job[1] for w in busy)
                ready = wait(busy, timeout=max(0.0, nearest - time.monotonic()))
                for w in busy:
                    if w not in ready:
                        continue
                    i = w.job[0]
                    try:
                        msg = w.recv()
                    except (EOFError, OSError, ValueError):
                        if not w.ready:
                            # Died before saying ready: it cannot start at all.
                            with contextlib.suppress(subprocess.TimeoutExpired):
                                w.proc.wait(timeout=2.0)
                            detail = w.stderr_tail()
                            w.kill()
                            self._workers.remove(w)
                            raise RewardError(
                                "the math reward's math-verify worker "
                                f"(`{sys.executable} -m {self.worker_module}`) failed to start:\n"
                                f"{detail or '(no output)'}"
                            ) from None
                        # The worker died on this item (memory blow-up, segfault): 0.0.
                        results[i] = (0.0, ERROR)
                        w.job = None
                        self._replace(w)
                        continue
                    if msg is None:  # the ready line; the answer is still to come
                        w.job = (i, time.monotonic() + self.hard_limit)
                        continue
                    key, score, status = msg
                    results[key] = (float(score), status)
                    w.job = None
                now = time.monotonic()
                for w in list(self._workers):
                    if w.job and w.job[1] <= now:
                        results[w.job[0]] = (0.0, TIMEOUT)  # stuck in C code: kill it
                        w.job = None
                        self._replace(w)
            return [r if r is not None else (0.0, ERROR) for r in results]

    def close(self) -> None:
        with self._lock:
            _shutdown(self._workers)


class MathReward(Reward):
    """1.0 when math-verify finds the boxed answer equivalent to the reference."""

    name = "math"

    @classmethod
    def from_config(cls, reward, search_paths=()) -> MathReward:
        return cls(timeout=reward.timeout)

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        workers: int | None = None,
        cache_size: int = 65536,
    ) -> None:
        super().__init__()
        _require_math_verify()
        if timeout is None or timeout <= 0:
            raise RewardError(f"[reward] timeout must be > 0 seconds for `math`, got {timeout!r}")
        self.timeout = float(timeout)
        if workers is None:
            workers = min(4, os.cpu_count() or 1) if os.name == "posix" else 0
        self.workers = int(workers)
        self._pool = _VerifyPool(self.workers, self.timeout) if self.workers > 0 else None
        self._cache: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self._cache_size = cache_size
        self._inline_warned = False

    def _verify_inline(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, str]]:
        from retrain.rewards import _mathverify_worker as mv

        if threading.current_thread() is not threading.main_thread() and not self._inline_warned:
            self._inline_warned = True
            logger.warning(
                "math reward with workers = 0 called off the main thread: no time limit "
                "can be enforced; use workers >= 1"
            )
        out = []
        for answer, reference in pairs:
            try:
                out.append(mv.verify_pair(answer, reference, self.timeout))
            except BaseException as exc:  # a stray timer tick outside verify_pair
                if type(exc).__name__ != "_Deadline":
                    raise
                mv.disarm()
                out.append((0.0, TIMEOUT))
        return out

    def verify_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, str]]:
        """(score, status) per (answer, reference) pair, through the caches."""
        results: list[tuple[float, str] | None] = [None] * len(pairs)
        todo: dict[tuple[str, str], list[int]] = {}
        for i, (answer, reference) in enumerate(pairs):
            key = (answer, reference)
            quick = 1.0 if answer == reference else quick_verdict(answer, reference)
            if quick is not None:
                results[i] = (quick, OK)
            elif key in self._cache:
                self._cache.move_to_end(key)
                results[i] = self._cache[key]
            else:
                todo.setdefault(key, []).append(i)
        if todo:
            keys = list(todo)
            verdicts = self._pool.run(keys) if self._pool else self._verify_inline(keys)
            for key, verdict in zip(keys, verdicts):
                for i in todo[key]:
                    results[i] = verdict
                if verdict[1] != ERROR:
                    self._cache[key] = verdict
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return results  # type: ignore[return-value]

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        out = BatchScore(rewards=[0.0] * len(responses))
        pairs, where = [], []
        for i, (response, example) in enumerate(zip(responses, examples)):
            answer = extract_boxed(response)
            out.answers.append(answer)
            if answer is None:
                out.no_answer += 1
                continue
            pairs.append((answer, str(example.reference).strip()))
            where.append(i)
        for i, (score, status) in zip(where, self.verify_pairs(pairs)):
            out.rewards[i] = score
            if status == TIMEOUT:
                out.timeouts += 1
            elif status == ERROR:
                out.errors += 1
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
