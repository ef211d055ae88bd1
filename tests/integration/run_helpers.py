"""Shared pieces for tests that run the training loop: a console that keeps its lines,
and a stop request delivered after a chosen step (as SIGTERM would)."""

from __future__ import annotations

import signal

from retrain import trainer as trainer_module
from retrain.logs.console import Console


class QuietConsole(Console):
    """retrain's console, printing nothing and keeping every line."""

    def __init__(self):
        super().__init__(live=False)
        self.lines: list[str] = []

    def print(self, text: str = "") -> None:
        self.lines.append(text)


def stop_after_step(monkeypatch, step: int) -> None:
    """Make every run that is not a resume receive a stop request (SIGTERM) once `step`
    has run; the loop then saves and exits with 143."""
    stops: list = []

    class _Recorded(trainer_module._StopRequest):
        def __init__(self):
            super().__init__()
            stops.append(self)

        def install(self) -> None:  # no real signal handlers in a test
            pass

    original = trainer_module.Trainer.run_step

    def run_step(self, n):
        row = original(self, n)
        if n == step and not self.config.resume.from_:
            stops[-1].signal = signal.SIGTERM
        return row

    monkeypatch.setattr(trainer_module, "_StopRequest", _Recorded)
    monkeypatch.setattr(trainer_module.Trainer, "run_step", run_step)
