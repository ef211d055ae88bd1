"""The SEPA scheduler: how strongly execution-token uncertainty is pooled at each step.

SEPA (in the ``gtpo_sepa`` transform) blends each execution token's uncertainty with
the mean over its completion's execution tokens, by a weight lambda in [0, 1] that this
scheduler supplies once per training step.

Schedules (``[sepa] schedule``):

- ``linear``: lambda(step) = clamp((step - delay_steps) / steps, 0, 1). With
  ``steps = 0`` the ramp is a jump: 0 before ``delay_steps``, 1 from it on.
- ``auto``: an exponential moving average of the batch's execution-token uncertainty
  variance is kept (the first observation initialises it; then
  ema <- decay * ema + (1 - decay) * var). The EMA value right after the ``warmup``-th
  observation is frozen as the baseline var_0. From then on
  auto_lambda = 1 - min(var_ema / var_0 / var_threshold, 1), and
  lambda = max(auto_lambda, linear lambda). Before var_0 exists auto_lambda is 0; a
  baseline of 0 (no variance to decay) also gives auto_lambda = 0, leaving the linear
  ramp in charge.

Correctness gate (``correct_rate_gate``): lambda stays 0 until some step's batch
correct rate reaches the gate; once open it never closes (it is saved in checkpoints).
A gate of 0 disables it (open from the start). The variance EMA is tracked from the
first step whatever the gate, so var_0 measures the start of training.

Order within a step: the trainer samples and scores (so it knows the correct rate),
computes the uncertainties and their statistics (so it knows the execution variance),
then calls ``update(step, correct_rate, exec_var)`` once and uses the returned lambda
for this same step's advantages (see ``AdvantagePipeline.__call__(sepa_lambda=...)``).
An exec_var of None or NaN (no execution tokens this step) is ignored.

Pure: numbers in, numbers out; the state is a plain JSON-serialisable dict.
"""

from __future__ import annotations

import math
from typing import Any

SCHEDULES = ("linear", "auto")
_STATE_VERSION = 1


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"[sepa] {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"[sepa] {name} must be finite, got {value}")
    return value


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"[sepa] {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"[sepa] {name} must be >= {minimum}, got {value}")
    return int(value)


class SEPAScheduler:
    """Supplies SEPA's lambda, one ``update`` per training step.

    Arguments (validated; a bad one raises ValueError naming the ``[sepa]`` key):
    ``steps`` (ramp length, >= 0), ``schedule`` ("linear" or "auto"), ``delay_steps``
    (>= 0), ``correct_rate_gate`` (in [0, 1], 0 = no gate), ``ema_decay`` (in [0, 1)),
    ``var_threshold`` (> 0), ``warmup`` (observations that fix var_0, >= 1).
    """

    def __init__(
        self,
        steps: int = 500,
        schedule: str = "linear",
        delay_steps: int = 50,
        correct_rate_gate: float = 0.1,
        ema_decay: float = 0.99,
        var_threshold: float = 0.2,
        warmup: int = 50,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"[sepa] schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.steps = _integer("steps", steps, 0)
        self.schedule = schedule
        self.delay_steps = _integer("delay_steps", delay_steps, 0)
        self.correct_rate_gate = _number("correct_rate_gate", correct_rate_gate)
        if not 0.0 <= self.correct_rate_gate <= 1.0:
            raise ValueError(
                f"[sepa] correct_rate_gate must be in [0, 1], got {self.correct_rate_gate}"
            )
        self.ema_decay = _number("ema_decay", ema_decay)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"[sepa] ema_decay must be in [0, 1), got {self.ema_decay}")
        self.var_threshold = _number("var_threshold", var_threshold)
        if self.var_threshold <= 0.0:
            raise ValueError(f"[sepa] var_threshold must be > 0, got {self.var_threshold}")
        self.warmup = _integer("warmup", warmup, 1)
        self.reset()

    def reset(self) -> None:
        """Back to the state before the first step."""
        self.var_ema: float | None = None
        self.var_0: float | None = None
        self.observations = 0
        self.gate_open = self.correct_rate_gate <= 0.0
        self.last_step: int | None = None
        self._lam = 0.0

    # -- pieces of the schedule ---------------------------------------------------
    def linear_lambda(self, step: int) -> float:
        """clamp((step - delay_steps) / steps, 0, 1); a step function when steps = 0."""
        if self.steps == 0:
            return 1.0 if step >= self.delay_steps else 0.0
        return min(max((step - self.delay_steps) / self.steps, 0.0), 1.0)

    def auto_lambda(self) -> float:
        """1 - min(var_ema / var_0 / var_threshold, 1); 0 until var_0 is fixed or if it is 0."""
        if self.var_0 is None or self.var_ema is None or self.var_0 <= 0.0:
            return 0.0
        ratio = self.var_ema / self.var_0 / self.var_threshold
        return 1.0 - min(ratio, 1.0)

    def lambda_at(self, step: int) -> float:
        """The lambda the current state gives at `step`, without updating anything."""
        if not self.gate_open:
            return 0.0
        lam = self.linear_lambda(step)
        if self.schedule == "auto":
            lam = max(lam, self.auto_lambda())
        return min(max(lam, 0.0), 1.0)

    # -- the per-step update ------------------------------------------------------
    def observe_variance(self, exec_var: float | None) -> None:
        """Feed one step's execution-token uncertainty variance into the EMA."""
        if exec_var is None:
            return
        v = float(exec_var)
        if math.isnan(v):
            return
        if v < 0.0 or math.isinf(v):
            raise ValueError(f"exec_var must be a finite variance >= 0, got {v}")
        if self.var_ema is None:
            self.var_ema = v
        else:
            self.var_ema = self.ema_decay * self.var_ema + (1.0 - self.ema_decay) * v
        self.observations += 1
        if self.var_0 is None and self.observations >= self.warmup:
            self.var_0 = self.var_ema

    def update(self, step: int, correct_rate: float | None, exec_var: float | None) -> float:
        """Record this step's batch correct rate and execution variance; return the
        lambda to use for this step (also available afterwards as ``lam``)."""
        if (
            not self.gate_open
            and correct_rate is not None
            and not math.isnan(float(correct_rate))
            and float(correct_rate) >= self.correct_rate_gate
        ):
            self.gate_open = True
        self.observe_variance(exec_var)
        self.last_step = int(step)
        self._lam = self.lambda_at(int(step))
        return self._lam

    @property
    def lam(self) -> float:
        """The lambda returned by the last ``update`` (0 before the first)."""
        return self._lam

    def metrics(self) -> dict[str, float]:
        return {"sepa_lambda": self._lam, "sepa_gate_open": float(self.gate_open)}

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable state (None where a value does not exist yet)."""
        return {
            "version": _STATE_VERSION,
            "config": {
                "steps": self.steps,
                "schedule": self.schedule,
                "delay_steps": self.delay_steps,
                "correct_rate_gate": self.correct_rate_gate,
                "ema_decay": self.ema_decay,
                "var_threshold": self.var_threshold,
                "warmup": self.warmup,
            },
            "var_ema": self.var_ema,
            "var_0": self.var_0,
            "observations": self.observations,
            "gate_open": self.gate_open,
            "last_step": self.last_step,
            "lam": self._lam,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved. The schedule's settings stay those this
        scheduler was built with (the run's current config); only the learned state
        (EMA, var_0, observation count, gate, last lambda) is restored."""
        if not isinstance(state, dict):
            raise ValueError("SEPA state must be a dict")
        version = state.get("version", _STATE_VERSION)
        if version != _STATE_VERSION:
            raise ValueError(f"unsupported SEPA state version {version!r}")
        try:
            var_ema = state["var_ema"]
            var_0 = state["var_0"]
            observations = int(state["observations"])
            gate_open = bool(state["gate_open"])
            last_step = state.get("last_step")
            lam = float(state.get("lam", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed SEPA state: {exc}") from None
        self.var_ema = None if var_ema is None else float(var_ema)
        self.var_0 = None if var_0 is None else float(var_0)
        self.observations = observations
        self.gate_open = gate_open or self.correct_rate_gate <= 0.0
        self.last_step = None if last_step is None else int(last_step)
        self._lam = lam

    def __repr__(self) -> str:
        return (
            f"SEPAScheduler(schedule={self.schedule!r}, steps={self.steps}, "
            f"delay_steps={self.delay_steps}, gate={self.correct_rate_gate}, "
            f"lam={self._lam:.4f}, gate_open={self.gate_open})"
        )
