"""The zero-signal guard's causes and its stop rule (the run-level behaviour, exit code
and message: tests/integration/test_zero_signal_run.py)."""

from __future__ import annotations

import pytest

from retrain.errors import TrainingError
from retrain.types import Example, GroupRollout, RunPosition, Sample, StepResult, TrainResult
from retrain.zero_signal import ALL_EQUAL, ENV_ERRORS, NO_ANSWERS, ZeroSignalGuard, step_cause


def result(datums: int, **counters: float) -> StepResult:
    samples = [Sample([1, 2], [0.0, 0.0], "eos") for _ in range(4)]
    group = GroupRollout(
        Example("q", "a"), [0], samples, ["x"] * 4, [0.0] * 4, [None] * 4, [False] * 4
    )
    return StepResult(
        step=0,
        groups=[group],
        reward_counters=dict(counters),
        planning=[],
        advantages=None,
        num_datums=datums,
        train=TrainResult(loss=0.0, num_tokens=0),
        seconds={},
        batch_size=1,
        group_size=4,
        position=RunPosition(0, 0, False),
        off_policy_steps=0,
    )


def test_causes_in_order_of_precedence():
    assert step_cause(result(2, env_errors=4)) == ""  # a step with datums has signal
    assert step_cause(result(0, env_errors=3, reward_errors=1)) == ENV_ERRORS
    assert step_cause(result(0, env_errors=3, no_answer_rate=1.0)) == NO_ANSWERS
    assert step_cause(result(0, env_errors=1)) == ALL_EQUAL
    # without a \boxed{} extraction (no no_answer_rate) the cause is the rewards
    assert step_cause(result(0)) == ALL_EQUAL


def test_stops_after_limit_consecutive_steps_and_a_signal_resets_the_count():
    guard = ZeroSignalGuard(3)
    for r in (result(0), result(0), result(1), result(0), result(0)):
        guard.observe(r)
        guard.check()
    assert guard.run == 2
    guard.observe(result(0, no_answer_rate=1.0))
    with pytest.raises(TrainingError, match=r"3 consecutive steps .*cause: rewards all equal"):
        guard.check()
    off = ZeroSignalGuard(0)
    for _ in range(10):
        off.observe(result(0))
        off.check()
