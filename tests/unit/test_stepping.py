"""The training strategies' sequencing (retrain/stepping.py), on a fake backend that trains
nothing: which steps come back when, what waits for what, and how a failure surfaces.
tests/integration/test_overlap.py runs the same sequencing on the real local backend."""

from __future__ import annotations

import math

import pytest

from retrain.errors import TrainingError
from retrain.logs.timer import PhaseTimer
from retrain.stepping import BlockingTraining, OverlappedTraining, SampledStep, step_training
from retrain.types import Datum, RunPosition, TrainHyper, TrainResult

ADVANTAGES = object()  # passed through untouched


class FakeBackend:
    """A step's loss is its number (carried in hyper.lr), so each result shows whose
    training it holds; `events` records the calls in order."""

    def __init__(self, *, fail: set[int] = frozenset(), nan: set[int] = frozenset()):
        self.events: list[tuple[str, int]] = []
        self.fail = fail  # steps whose background training raises
        self.nan = nan  # steps whose loss is not finite

    def result(self, step: int, datums: list[Datum]) -> TrainResult:
        return TrainResult(
            loss=math.nan if step in self.nan else float(step), num_tokens=len(datums)
        )

    def train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        self.events.append(("train", int(hyper.lr)))
        return self.result(int(hyper.lr), datums)

    def start_train_step(self, datums: list[Datum], hyper: TrainHyper) -> FakeHandle:
        self.events.append(("start", int(hyper.lr)))
        return FakeHandle(self, int(hyper.lr), datums)


class FakeHandle:
    def __init__(self, backend: FakeBackend, step: int, datums: list[Datum]):
        self.backend, self.step, self.datums = backend, step, datums

    def finish(self) -> TrainResult:
        self.backend.events.append(("finish", self.step))
        if self.step in self.backend.fail:
            raise RuntimeError(f"step {self.step}'s training failed")
        return self.backend.result(self.step, self.datums)

    def wait(self) -> None:
        self.backend.events.append(("wait", self.step))


def sampled(
    step: int, *, datums: int = 1, off_policy: int = 0, labels: list[str] | None = None
) -> SampledStep:
    return SampledStep(
        step=step,
        groups=[],
        reward_counters={"reward_errors": 0.0},
        planning=[],
        advantages=ADVANTAGES,
        datums=[Datum([1], [2, 3], [-0.5, -0.5], [1.0, 1.0]) for _ in range(datums)],
        batch_size=2,
        group_size=4,
        position=RunPosition(examples_seen=2 * (step + 1), epoch=0, sepa_gate_open=step > 1),
        off_policy_steps=off_policy,
        timer=PhaseTimer(labels.append if labels is not None else None),
    )


def hyper(step: int) -> TrainHyper:
    return TrainHyper(lr=float(step), weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8)


def drive(overlap: bool, steps: int, *, settle_after: tuple[int, ...] = ()) -> list[tuple]:
    """The trainer's use: each step samples with `steps_behind` as its off-policy count;
    a checkpoint after `settle_after` steps settles; the end settles."""
    training, got = step_training(FakeBackend(), overlap=overlap), []
    for n in range(steps):
        got += training.submit(sampled(n, off_policy=training.steps_behind), hyper(n))
        if n + 1 in settle_after:
            got += training.settle()
    got += training.settle()
    return [(r.step, r.train.loss, r.off_policy_steps) for r in got]


def test_the_overlap_flag_picks_the_strategy():
    assert isinstance(step_training(FakeBackend(), overlap=False), BlockingTraining)
    assert isinstance(step_training(FakeBackend(), overlap=True), OverlappedTraining)


def test_a_sampled_step_completes_into_its_step_result():
    s = sampled(3, datums=2, off_policy=1)
    s.timer.add("sampling", 1.5)
    train = TrainResult(loss=0.25, num_tokens=4)
    result = s.complete(train)
    assert (result.step, result.num_datums, result.train) == (3, 2, train)
    assert (result.batch_size, result.group_size, result.off_policy_steps) == (2, 4, 1)
    assert result.position == RunPosition(examples_seen=8, epoch=0, sepa_gate_open=True)
    assert result.advantages is ADVANTAGES and result.reward_counters == {"reward_errors": 0.0}
    assert result.seconds == {"sampling": 1.5}


def test_blocking_trains_the_step_and_hands_it_back_at_once():
    backend, labels = FakeBackend(), []
    training = BlockingTraining(backend)
    assert training.steps_behind == 0
    (result,) = training.submit(sampled(0, datums=3, labels=labels), hyper(0))
    assert backend.events == [("train", 0)]
    assert (result.step, result.train.loss, result.num_datums) == (0, 0.0, 3)
    assert labels == ["training on 3 completions"] and "training" in result.seconds
    assert training.steps_behind == 0 and training.settle() == []
    training.abandon()
    assert backend.events == [("train", 0)]


def test_overlapped_hands_back_the_previous_step_before_this_one_starts():
    backend = FakeBackend()
    training = OverlappedTraining(backend)
    assert list(training.submit(sampled(0), hyper(0))) == []
    assert backend.events == [("start", 0)] and training.steps_behind == 1

    handed_back = training.submit(sampled(1, off_policy=1), hyper(1))
    previous = next(handed_back)
    assert (previous.step, previous.train.loss, previous.off_policy_steps) == (0, 0.0, 0)
    # step 1 is not started while step 0 is recorded (an evaluation then sees step 0's weights)
    assert backend.events == [("start", 0), ("finish", 0)]
    assert list(handed_back) == []
    assert backend.events[-1] == ("start", 1) and training.steps_behind == 1


def test_overlapped_settles_on_demand():
    backend, labels = FakeBackend(), []
    training = OverlappedTraining(backend)
    list(training.submit(sampled(0, datums=2, labels=labels), hyper(0)))
    (result,) = training.settle()
    assert (result.step, result.train.loss) == (0, 0.0)
    assert labels == ["waiting for training on 2 completions"] and "training" in result.seconds
    assert training.settle() == [] and training.steps_behind == 0
    # nothing in flight: the next step samples on-policy and hands nothing back
    assert list(training.submit(sampled(1), hyper(1))) == []
    assert backend.events == [("start", 0), ("finish", 0), ("start", 1)]


def test_a_step_in_flight_without_datums_leaves_the_next_one_on_policy():
    training = OverlappedTraining(FakeBackend())
    list(training.submit(sampled(0, datums=0), hyper(0)))
    assert training.steps_behind == 0


@pytest.mark.parametrize(
    ("overlap", "expected"),
    [
        (False, [(0, 0.0, 0), (1, 1.0, 0), (2, 2.0, 0), (3, 3.0, 0)]),
        # a checkpoint after step 1 settles it, so step 2 samples on-policy
        (True, [(0, 0.0, 0), (1, 1.0, 1), (2, 2.0, 0), (3, 3.0, 1)]),
    ],
)
def test_every_step_comes_back_once_in_order_with_its_own_training(overlap, expected):
    assert drive(overlap, 4, settle_after=(2,)) == expected


def test_a_background_error_is_raised_on_settle_and_nothing_stays_in_flight():
    backend = FakeBackend(fail={0})
    training = OverlappedTraining(backend)
    list(training.submit(sampled(0), hyper(0)))
    with pytest.raises(RuntimeError, match="step 0's training failed"):
        training.settle()
    assert training.steps_behind == 0 and training.settle() == []
    training.abandon()
    assert backend.events == [("start", 0), ("finish", 0)]


def test_a_background_error_surfaces_on_the_next_submit_before_it_starts():
    backend = FakeBackend(fail={0})
    training = OverlappedTraining(backend)
    list(training.submit(sampled(0), hyper(0)))
    with pytest.raises(RuntimeError, match="step 0's training failed"):
        list(training.submit(sampled(1), hyper(1)))
    assert ("start", 1) not in backend.events


def test_abandon_waits_for_the_step_in_flight_without_raising():
    backend = FakeBackend(fail={0})
    training = OverlappedTraining(backend)
    list(training.submit(sampled(0), hyper(0)))
    training.abandon()  # its error is dropped: the run is failing already
    assert backend.events == [("start", 0), ("wait", 0)]
    assert training.settle() == [] and training.steps_behind == 0
    training.abandon()
    assert backend.events == [("start", 0), ("wait", 0)]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_non_finite_loss_stops_the_run(overlap):
    training = step_training(FakeBackend(nan={0}), overlap=overlap)
    with pytest.raises(TrainingError, match="step 0: the backend reported a non-finite loss"):
        list(training.submit(sampled(0), hyper(0)))
        training.settle()
