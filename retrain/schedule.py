"""The learning-rate schedule: a pure function of the step.

Because the rate depends on nothing but `(step, base_lr, schedule, warmup_steps,
max_steps)`, a resumed run that restores its step gets exactly the rates of the
uninterrupted run; no scheduler state is checkpointed.

    warmup (step < W):   lr = base * (step + 1) / W
    after, with p = (step - W) / (max_steps - W) in [0, 1):
      constant           lr = base
      linear             lr = base * (1 - p)
      cosine             lr = base * (1 + cos(pi * p)) / 2

Both decays reach 0 at `max_steps` (one past the last step), so every trained step has a
positive rate.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, base_lr: float, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """The learning rate of training step `step` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return base_lr * (1.0 - progress)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
