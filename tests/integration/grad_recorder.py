"""One optimizer step's gradients without moving the weights: for tests that compare two
ways of computing the same step (Adam's first update is ~lr * sign(g), so float noise on
a near-zero gradient would flip it and hide what is being compared)."""

from __future__ import annotations

import dataclasses


class GradRecorder:
    """Stands in for the backend's optimizer: keeps the step's (clipped) gradients."""

    def __init__(self, params):
        self.params, self.param_groups, self.grads = params, [{}], None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads = [p.grad.detach().clone() for p in self.params]


def step_gradients(backend, datums, hyper, budget: int):
    """(TrainResult, gradients) of one local-backend step at micro-batch budget `budget`."""
    backend.options = dataclasses.replace(backend.options, micro_batch_tokens=budget)
    optimizer, backend.optimizer = backend.optimizer, GradRecorder(backend.params)
    try:
        result = backend.train_step(datums, hyper)
        return result, backend.optimizer.grads
    finally:
        backend.optimizer = optimizer
