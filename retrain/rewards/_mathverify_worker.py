"""The worker side of the `math` reward: parse + verify one (answer, reference) pair under
a time limit. Run as `python -m retrain.rewards._mathverify_worker` by the math reward's
worker pool (JSON lines on stdin/stdout), it imports math_verify at module level; the
trainer process imports it only when the reward runs inline (`workers = 0`).

The time limit here is a SIGALRM interval timer, which only works on a process's main
thread; that is exactly where a worker process runs this code. The exception it raises
derives from BaseException so that math_verify's own `except Exception` blocks do not
swallow it. A computation stuck inside C code (a huge integer power) cannot be
interrupted by a signal; the parent process covers that case by killing the worker.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from functools import lru_cache

from math_verify import parse, verify

# math_verify warns (once) that we disabled its own timeouts: we enforce ours instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)

OK, TIMEOUT, ERROR = "ok", "timeout", "error"


class _Deadline(BaseException):
    """Raised by the interval timer when a verification runs past its time limit."""


_armed = False


def _on_alarm(signum, frame):
    if _armed:
        raise _Deadline()


def _arm(limit: float) -> None:
    global _armed
    _armed = True
    # Fire at the limit, then every 50 ms: should some handler swallow the first tick,
    # the next one gets through.
    signal.setitimer(signal.ITIMER_REAL, float(limit), 0.05)


def disarm() -> None:
    """Stop the timer. Safe against a tick landing while we stop it: once `_armed` is
    False, ticks are ignored."""
    global _armed
    while True:
        try:
            _armed = False
            signal.setitimer(signal.ITIMER_REAL, 0.0, 0.0)
            return
        except _Deadline:
            continue


def as_latex(text: str) -> str:
    """Wrap a bare answer so math_verify's LaTeX extraction finds it."""
    return text if "\\boxed" in text else "\\boxed{" + text + "}"


@lru_cache(maxsize=16384)
def parse_reference(reference: str):
    """Reference parses are cached per reference string (a reference is scored once per
    completion in its group, and again every epoch)."""
    return parse(as_latex(reference), parsing_timeout=None)


def _verify(answer: str, reference: str) -> float:
    gold = parse_reference(reference)
    pred = parse(as_latex(answer), parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def verify_pair(answer: str, reference: str, limit: float) -> tuple[float, str]:
    """(score, status) for one pair; status is "ok", "timeout" or "error". The limit is
    enforced only on the main thread (where SIGALRM is delivered)."""
    timed = bool(limit and limit > 0) and threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGALRM, _on_alarm) if timed else None
    try:
        try:
            if timed:
                _arm(limit)
            return _verify(answer, reference), OK
        finally:
            if timed:
                disarm()
    except _Deadline:
        disarm()
        return 0.0, TIMEOUT
    except Exception:
        return 0.0, ERROR
    finally:
        if timed:
            signal.signal(signal.SIGALRM, old)


def serve(stdin=None, stdout=None) -> None:
    """Worker loop over JSON lines: read [key, answer, reference, limit], write
    [key, score, status]. EOF on stdin ends the worker."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    # The parent handles Ctrl-C; a worker just ends when its stdin closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdout.write(b'["ready"]\n')  # math-verify is imported: the parent may count on us
    stdout.flush()
    for line in stdin:
        if not line.strip():
            continue
        key, answer, reference, limit = json.loads(line)
        try:
            score, status = verify_pair(answer, reference, limit)
        except _Deadline:  # a tick landing in the few bytecodes around the try block
            disarm()
            score, status = 0.0, TIMEOUT
        try:
            stdout.write(json.dumps([key, score, status]).encode() + b"\n")
            stdout.flush()
        except (BrokenPipeError, OSError):
            return


if __name__ == "__main__":
    serve()
