"""The zero-signal guard: a run that learns nothing stops, saying why.

A step has no signal when it hands the training no datum: every trajectory failed (the
environment raised, timed out or answered malformed messages, or the scorer failed), or
every group's rewards were equal (GRPO-style advantages are then zero). Such a step is
flagged on its step line; `[training] zero_signal_steps` consecutive ones stop the run
with a TrainingError naming the cause, after the step's row is logged, so the last
checkpoint is kept and the run exits non-zero instead of printing "Done" on nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from retrain.errors import TrainingError
from retrain.types import StepResult

# Per-trajectory failure counters (single-turn rewards and multi-turn environments).
FAILURE_COUNTERS = (
    "env_errors",
    "env_timeouts",
    "env_malformed",
    "reward_errors",
    "reward_timeouts",
)

ENV_ERRORS = "environment errors"
NO_ANSWERS = "no answers extracted"
ALL_EQUAL = "rewards all equal"


def step_cause(result: StepResult) -> str:
    """Why `result` has no signal ('' when it has some): the first that holds of
    environment errors, no answers extracted (only where the reward extracts \\boxed{}:
    `no_answer_rate` is in its counters), rewards all equal."""
    if result.num_datums > 0:
        return ""
    counters = result.reward_counters
    failed = sum(int(counters.get(k, 0)) for k in FAILURE_COUNTERS)
    if result.num_completions and failed >= result.num_completions:
        return ENV_ERRORS
    if counters.get("no_answer_rate", 0.0) >= 1.0:
        return NO_ANSWERS
    return ALL_EQUAL


def _fix(cause: str) -> str:
    if cause == ENV_ERRORS:
        return (
            "every conversation failed: read the first traceback logged above, fix the "
            "environment (or raise [environment] turn_timeout_s if it timed out)"
        )
    if cause == NO_ANSWERS:
        return (
            "no completion had a \\boxed{} answer: raise [training] max_tokens, or tell the "
            "model to box its answer ([data] instruction)"
        )
    return (
        "every group's completions scored the same, so the advantages are zero: raise "
        "[training] group_size or temperature, or use a reward with partial credit"
    )


@dataclass
class ZeroSignalGuard:
    """Counts consecutive steps without a trainable datum; `limit` 0 turns it off."""

    limit: int
    run: int = 0
    causes: list[str] = field(default_factory=list)

    def observe(self, result: StepResult) -> str:
        """This step's cause ('' when it had signal); updates the consecutive count."""
        cause = step_cause(result)
        if cause:
            self.run += 1
            self.causes.append(cause)
        else:
            self.run, self.causes = 0, []
        return cause

    def state_dict(self) -> dict[str, Any]:
        return {"run": self.run, "causes": list(self.causes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run, self.causes = int(state["run"]), [str(c) for c in state["causes"]]

    @staticmethod
    def flag(cause: str) -> str:
        """What the step line gets appended for a step without signal."""
        return f" | NO SIGNAL: {cause}" if cause else ""

    def check(self) -> None:
        """Raise once `limit` consecutive steps had no trainable datum."""
        if self.limit <= 0 or self.run < self.limit:
            return
        cause = max(set(self.causes), key=self.causes.count)
        raise TrainingError(
            f"stopped: no trainable datums for {self.run} consecutive steps "
            f"([training] zero_signal_steps = {self.limit}); cause: {cause}. "
            f"{_fix(cause)}. The last checkpoint is kept; set [training] "
            "zero_signal_steps = 0 to train on regardless"
        )
