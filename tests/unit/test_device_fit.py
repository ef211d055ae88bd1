"""The back-off after an out-of-memory training micro-batch (retrain/backends/device_fit.py),
on hand-worked cases; the integration tests in test_memory_sizing.py drive it through the
local backend with injected errors."""

from __future__ import annotations

import pytest

from retrain.backends.device_fit import BackOff, back_off
from retrain.errors import TrainingError

CASE = dict(longest=300, before=4096, where="cuda:0", shard=False)


def test_several_completions_halve_the_budget_down_to_one():
    on = dict(auto_checkpointing=True, checkpointing=False)
    assert back_off(5, budget=4096, **CASE, **on) == BackOff(2048)
    assert back_off(2, budget=3, **CASE, **on) == BackOff(1)
    assert back_off(2, budget=1, **CASE, **on) == BackOff(1)


def test_one_completion_turns_auto_checkpointing_on_at_the_first_budget():
    plan = back_off(1, budget=256, auto_checkpointing=True, checkpointing=False, **CASE)
    assert plan.checkpoint and plan.micro_batch_tokens == 4096  # `before`, not 256 // 2
    assert plan.notice.startswith("out of memory on cuda:0 training one completion (up to 300 ")


@pytest.mark.parametrize("auto", [True, False])
def test_one_completion_that_still_cannot_fit_names_what_to_lower(auto):
    with pytest.raises(TrainingError) as err:  # checkpointing already on (auto turned it)
        back_off(1, budget=256, auto_checkpointing=auto, checkpointing=True, **CASE)
    message = str(err.value)
    assert "micro_batch_tokens is down to 256" in message and "up to 300 positions" in message
    assert "[training] max_tokens" in message and "checkpointing = true" not in message
    with pytest.raises(TrainingError, match=r"Fix: \[backend.options\] checkpointing = true"):
        back_off(1, budget=256, auto_checkpointing=False, checkpointing=False, **CASE)


def test_a_sharded_base_cannot_redo_a_step_on_one_rank():
    with pytest.raises(
        TrainingError, match=r"shard = true \(3 completions, micro_batch_tokens = 512\)"
    ):
        back_off(
            3, budget=512, auto_checkpointing=True, checkpointing=False, **{**CASE, "shard": True}
        )
