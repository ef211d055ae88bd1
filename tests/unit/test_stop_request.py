"""The run's SIGINT/SIGTERM handler (retrain/trainer.py `_StopRequest`), with real signals
sent to this process: during the steps a SIGTERM asks for a stop after the step; once the
steps are over it is taken quietly, so a rank whose run is already failing (torchrun's
agent terminates the others as soon as one rank fails) lives to say why it stops."""

from __future__ import annotations

import os
import signal

from retrain import trainer


def test_a_sigterm_during_the_steps_stops_the_run_after_the_step(capsys):
    before = signal.getsignal(signal.SIGTERM)
    stop = trainer._StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGTERM
        assert "Received SIGTERM: stopping after this step" in capsys.readouterr().err
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_once_the_steps_are_over_is_taken_quietly(capsys):
    stop = trainer._StopRequest()
    stop.install()
    try:
        stop.closing = True
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this process
        assert stop.signal is None and capsys.readouterr().err == ""
    finally:
        stop.restore()
