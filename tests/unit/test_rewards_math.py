"""The `math` reward: math-verify equivalence, caching and time limits."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("math_verify")

from builders import reward as make_reward  # noqa: E402

from retrain.rewards.math import MathReward, _VerifyPool, quick_verdict  # noqa: E402
from retrain.types import Example  # noqa: E402

# Expands 9^(9^(9^9)): sympy never finishes it.
PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"


@pytest.fixture(scope="module")
def reward():
    # Generous: a symbolic check that takes 0.1 s on an idle box can take seconds on a
    # loaded one, and a timeout would score an equivalent answer 0.
    r = make_reward("math", timeout=30.0)
    yield r
    r.close()


def _ex(ref: str) -> Example:
    return Example(prompt="q", reference=ref)


EQUIVALENT = [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\sqrt{4}}", "2"),
    ("\\boxed{2}", "\\sqrt{4}"),
    ("\\boxed{[1, 2)}", "[1,2)"),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]"),
    ("\\boxed{\\{3, 2, 1\\}}", "\\{1,2,3\\}"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\frac{1}{2}\\sqrt{3}}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{10.0}", "10"),
]
NOT_EQUIVALENT = [
    ("\\boxed{3}", "4"),
    ("\\boxed{[1,2]}", "(1,2)"),
    ("\\boxed{\\{1,3\\}}", "\\{1,2\\}"),
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
]


def test_equivalences_and_non_equivalences(reward):
    pairs = EQUIVALENT + NOT_EQUIVALENT
    out = reward.score_batch([r for r, _ in pairs], [_ex(ref) for _, ref in pairs])
    expected = [1.0] * len(EQUIVALENT) + [0.0] * len(NOT_EQUIVALENT)
    assert list(zip(pairs, out.rewards)) == list(zip(pairs, expected))
    assert out.errors == 0 and out.timeouts == 0 and out.no_answer == 0


def test_no_answer_and_truncation_score_zero(reward):
    out = reward.score_batch(["the answer is 0.5", "\\boxed{\\frac{1}{2}"], [_ex("0.5")] * 2)
    assert out.rewards == [0.0, 0.0]
    assert out.answers == [None, None]
    assert out.no_answer == 2


def test_single_score(reward):
    assert reward.score("so \\boxed{\\frac{6}{12}}", "0.5") == 1.0
    assert reward.score("so \\boxed{7}", "0.5") == 0.0


def test_pathological_expression_times_out_and_is_counted():
    r = MathReward(timeout=1.0, workers=1)
    try:
        r.score("\\boxed{1}", "1")  # start the worker before timing
        t0 = time.monotonic()
        out = r.score_batch([PATHOLOGICAL, "\\boxed{5}"], [_ex("5"), _ex("5")])
        elapsed = time.monotonic() - t0
        assert out.rewards == [0.0, 1.0]
        assert out.timeouts == 1 and out.errors == 0
        # Unbounded, 9^9^9^9 never finishes; the bound is loose because a loaded box
        # may stretch the 1 s limit, and only "it came back at all" is the behaviour.
        assert elapsed < 30
        # The worker survived the in-process timeout and keeps scoring.
        assert r.score("\\boxed{\\sqrt{9}}", "3") == 1.0
        # A repeated pathological answer is served from the cache, still counted.
        t0 = time.monotonic()
        again = r.score_batch([PATHOLOGICAL], [_ex("5")])
        # Scoring it again would take at least the 1 s timeout; the cache answers at once.
        assert again.timeouts == 1 and time.monotonic() - t0 < 1.0
    finally:
        r.close()


def test_hung_worker_is_killed_and_replaced():
    # A worker that stops responding entirely (stuck in C code, where no signal gets
    # through) is killed at the hard limit; SIGSTOP makes one really stop.
    pool = _VerifyPool(size=1, limit=0.5)
    try:
        assert pool.run([("1/2", "0.5")]) == [(1.0, "ok")]
        stuck = pool._workers[0].proc
        os.kill(stuck.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert pool.run([("3", "3.0")]) == [(0.0, "timeout")]
        assert time.monotonic() - t0 < pool.hard_limit + 1.0
        assert stuck.poll() is not None  # killed
        assert pool._workers[0].proc.pid != stuck.pid
        assert pool.run([("3", "3.0")]) == [(1.0, "ok")]  # the replacement works
    finally:
        pool.close()


def test_crashed_worker_counts_as_error():
    pool = _VerifyPool(size=1, limit=2.0)
    try:
        pool.run([("1", "1.0")])
        os.kill(pool._workers[0].proc.pid, signal.SIGKILL)
        pool._workers[0].proc.wait()
        # The dead worker's pipe fails on send or recv: the item is retried or scored as
        # an error, and a fresh worker takes over.
        first = pool.run([("2", "2.0")])
        assert first in ([(1.0, "ok")], [(0.0, "error")])
        assert pool.run([("2", "2.0")]) == [(1.0, "ok")]
    finally:
        pool.close()


def test_inline_mode_enforces_limit_on_main_thread():
    r = MathReward(timeout=1.0, workers=0)
    t0 = time.monotonic()
    out = r.score_batch([PATHOLOGICAL, "\\boxed{\\frac{2}{4}}"], [_ex("5"), _ex("0.5")])
    assert out.rewards == [0.0, 1.0]
    assert out.timeouts == 1
    assert time.monotonic() - t0 < 4.0


def test_pool_mode_works_off_the_main_thread(reward):
    # The trainer may score from a worker thread: math-verify's own signal-based timeout
    # would raise there; the process pool does not care.
    box = {}

    def work():
        box["out"] = reward.score_batch(["\\boxed{\\sqrt{4}}"], [_ex("2")])

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert box["out"].rewards == [1.0]


def test_timeout_must_be_positive():
    from retrain.errors import RewardError

    with pytest.raises(RewardError, match="timeout"):
        MathReward(timeout=0)


_numbers = st.one_of(
    st.integers(-50, 50).map(str),
    st.tuples(st.integers(-50, 50), st.integers(0, 99)).map(lambda t: f"{t[0]}.{t[1]:02d}"),
    st.tuples(st.integers(-20, 20), st.integers(1, 12)).map(
        lambda t: f"\\frac{{{t[0]}}}{{{t[1]}}}"
    ),
    st.tuples(st.integers(0, 20), st.integers(1, 12)).map(lambda t: f"{t[0]}/{t[1]}"),
)


@settings(max_examples=60, deadline=None)
@given(answer=_numbers, reference=_numbers)
def test_quick_verdict_agrees_with_math_verify(answer, reference):
    # The sympy-free shortcut may abstain (None) but must never disagree.
    from retrain.rewards._mathverify_worker import verify_pair

    quick = quick_verdict(answer, reference)
    if quick is not None:
        assert quick == verify_pair(answer, reference, 0)[0]


def test_quick_verdict_cases():
    assert quick_verdict("42", "42.0") == 1.0
    assert quick_verdict("\\dfrac{2}{4}", "0.5") == 1.0
    assert quick_verdict("-\\frac{1}{2}", "-0.5") == 1.0
    assert quick_verdict("41", "42") == 0.0
    assert quick_verdict("0.3333", "\\frac{1}{3}") is None  # close: math-verify decides
    assert quick_verdict("x", "1") is None


def test_worker_that_cannot_start_is_a_clear_error():
    from retrain.errors import RewardError

    pool = _VerifyPool(size=1, limit=1.0)
    pool.worker_module = "retrain.rewards.no_such_worker_module"
    try:
        with pytest.raises(
            RewardError, match="(?s)failed to start.*No module named.*no_such_worker_module"
        ):
            pool.run([("1", "2")])
    finally:
        pool.close()
