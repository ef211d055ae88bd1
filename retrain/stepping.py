"""How a sampled step is trained: at once (`BlockingTraining`), or on a background thread
while the next step samples (`OverlappedTraining`, `[backend.options] overlap`). The
trainer picks one at set-up and records every finished step it hands back, in order:

    training = step_training(backend, overlap=...)
    for result in training.submit(sampled, hyper):  # the steps whose training is done
        record(result)
    for result in training.settle():  # before a checkpoint or an evaluation
        record(result)
    training.abandon()  # the run is failing: let a background training end, drop it

A step's metrics row is written once its training is done (rows are appended, never
patched), so each row carries the loss and grad_norm of its own datums.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from retrain.errors import TrainingError
from retrain.logs.timer import PhaseTimer
from retrain.types import (
    Datum,
    GroupRollout,
    RunPosition,
    ShapingReport,
    StepResult,
    TrainHyper,
    TrainResult,
)

if TYPE_CHECKING:
    import numpy as np

    from retrain.advantages import BatchAdvantages


@dataclass(frozen=True, kw_only=True)
class SampledStep:
    """One step sampled, scored and turned into datums: everything its StepResult needs
    but the TrainResult. With overlap it waits here while the next step samples."""

    step: int
    groups: list[GroupRollout]
    reward_counters: dict[str, float]  # reward_errors, reward_timeouts, no_answer_rate
    planning: list[list[np.ndarray]]  # per group, per completion: planning-token mask
    advantages: BatchAdvantages
    datums: list[Datum]
    batch_size: int  # the sizes this step sampled with (back pressure may change them)
    group_size: int
    position: RunPosition  # as it was when this step sampled
    off_policy_steps: int  # optimizer steps between the weights sampled and those trained
    timer: PhaseTimer  # this step's phases; the training phase is added when it ends
    shaping: ShapingReport = field(default_factory=ShapingReport)  # retrain.shaping

    def complete(self, train: TrainResult) -> StepResult:
        return StepResult(
            step=self.step,
            groups=self.groups,
            reward_counters=self.reward_counters,
            planning=self.planning,
            advantages=self.advantages,
            num_datums=len(self.datums),
            train=train,
            seconds=self.timer.seconds,
            batch_size=self.batch_size,
            group_size=self.group_size,
            position=self.position,
            off_policy_steps=self.off_policy_steps,
            shaping=self.shaping,
        )


def finite_loss(step: int, result: TrainResult) -> TrainResult:
    if not math.isfinite(result.loss):
        raise TrainingError(
            f"step {step}: the backend reported a non-finite loss ({result.loss}); stopping (the last checkpoint is kept)"
        )
    return result


class TrainingHandle(Protocol):
    """One optimizer step running in the background (backends.local.TrainingInFlight)."""

    def finish(self) -> TrainResult:
        """Wait, re-raise the training's error, or publish the new weights to the sampler."""

    def wait(self) -> None:
        """Wait only: the result and any error are dropped."""


class TrainsSteps(Protocol):
    """What the strategies call on the backend: train_step (BlockingTraining; every
    backend has it) or start_train_step (OverlappedTraining; the local backend, the one
    that offers `overlap`)."""

    def train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult: ...

    def start_train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainingHandle: ...


class StepTraining(Protocol):
    """How the trainer hands a sampled step to the backend. Every StepResult handed back
    is trained, its weights are published to the sampler, and steps come in order."""

    @property
    def steps_behind(self) -> int:
        """Optimizer steps between the weights a step sampled now reads and the weights
        its datums will be trained on."""

    def submit(self, sampled: SampledStep, hyper: TrainHyper) -> Iterator[StepResult]:
        """Train `sampled`, handing back the steps finished meanwhile. An iterator, to be
        consumed: each step is handed back before `sampled` starts training, so recording
        it (and an evaluation due after it) sees the weights it left."""

    def settle(self) -> list[StepResult]:
        """The step still training, once done; nothing is in flight afterwards."""

    def abandon(self) -> None:
        """The run is failing: let a background training end before the model is closed;
        its result, and any error of its own, are dropped."""


class BlockingTraining:
    """backend.train_step: a step trains, and the sampler has its weights, before the
    next step samples (on-policy)."""

    def __init__(self, backend: TrainsSteps):
        self.backend = backend

    @property
    def steps_behind(self) -> int:
        return 0

    def submit(self, sampled: SampledStep, hyper: TrainHyper) -> Iterator[StepResult]:
        with sampled.timer.phase("training", f"training on {len(sampled.datums)} completions"):
            train = finite_loss(sampled.step, self.backend.train_step(sampled.datums, hyper))
        yield sampled.complete(train)

    def settle(self) -> list[StepResult]:
        return []

    def abandon(self) -> None:
        pass


@dataclass(frozen=True)
class _InFlight:
    sampled: SampledStep
    handle: TrainingHandle


class OverlappedTraining:
    """backend.start_train_step: step n trains in the background while step n+1 samples
    from the weights before it, one optimizer step behind. Step n is handed back when
    step n+1 is submitted, or by settle()."""

    def __init__(self, backend: TrainsSteps):
        self.backend = backend
        self._in_flight: _InFlight | None = None

    @property
    def steps_behind(self) -> int:
        # A step without datums changes no weight, so the next one samples on-policy.
        return int(self._in_flight is not None and bool(self._in_flight.sampled.datums))

    def submit(self, sampled: SampledStep, hyper: TrainHyper) -> Iterator[StepResult]:
        # The previous step first: recording it may run an evaluation, which must see the
        # weights that step left, not those of a training running under it.
        yield from self.settle()
        self._in_flight = _InFlight(sampled, self.backend.start_train_step(sampled.datums, hyper))

    def settle(self) -> list[StepResult]:
        """Wait for the step in flight (the wait counts as its training phase: the part not
        hidden behind sampling), publish its weights and hand it back."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        s = flight.sampled
        with s.timer.phase("training", f"waiting for training on {len(s.datums)} completions"):
            train = finite_loss(s.step, flight.handle.finish())
        return [s.complete(train)]

    def abandon(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            flight.handle.wait()


def step_training(backend: TrainsSteps, *, overlap: bool) -> StepTraining:
    """The run's strategy: `[backend.options] overlap` (the local backend's option; config
    validation refuses it where the sampler would read the weights being trained)."""
    return OverlappedTraining(backend) if overlap else BlockingTraining(backend)
