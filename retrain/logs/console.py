"""Console output of a run: the per-step line, group lines, and a live status line on a TTY."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from retrain.types import EvalResult


def step_line(
    step: int,
    condition: str,
    *,
    loss: float,
    loss_is_placeholder: bool,
    reward: float,
    correct_rate: float,
    datums: int,
    batch_size: int,
    group_size: int,
    sepa_lambda: float,
    seconds: float,
) -> str:
    loss_text = f"{loss:.4f}" + (" (async placeholder)" if loss_is_placeholder else "")
    return (
        f"Step {step} [{condition}] | loss={loss_text} | reward={reward:.3f} | "
        f"correct={100 * correct_rate:.1f}% | datums={datums} | bs={batch_size} | gs={group_size} | "
        f"sepa_l={sepa_lambda:.4f} | time={seconds:.1f}s"
    )


def eval_line(step: int | None, condition: str, result: EvalResult) -> str:
    """The held-out evaluation after `step` training steps (0 = before training; None:
    a saved adapter, `retrain eval`)."""
    r, k = result, result.samples
    how = "greedy" if r.temperature <= 0 else f"T={r.temperature:g}"
    when = "Eval" if step is None else f"Eval after {step} steps"
    return (
        f"{when} [{condition}] | held-out correct={100 * r.correct_rate:.1f}% | "
        f"reward={r.mean_reward:.3f} | pass@{k}={100 * r.pass_at_k:.1f}% | "
        f"{r.num_problems} problems x {k} ({how}) | time={r.seconds:.1f}s"
    )


def group_line(correct: int, total: int, answer: str) -> str:
    answer = answer.replace("\n", " ")
    if len(answer) > 60:
        answer = answer[:57] + "..."
    return f"  group: {correct}/{total} correct | answer={answer}"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Console:
    """Prints lines; on a TTY also keeps one live status line (phase, step x/N, ETA)
    at the bottom, cleared before every normal line."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None):
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self._status = ""

    def print(self, text: str = "") -> None:
        self._clear()
        print(text, file=self.stream, flush=True)
        if self._status:
            self._draw()

    def status(self, text: str) -> None:
        if not self.live:
            return
        self._status = text
        self._draw()

    def progress(self, step: int, total: int, phase: str, started: float, done_steps: int) -> None:
        if not self.live:
            return
        elapsed = time.time() - started
        eta = elapsed / done_steps * (total - step) if done_steps else None
        bar_width = 20
        filled = int(bar_width * step / max(total, 1))
        bar = "#" * filled + "-" * (bar_width - filled)
        eta_text = f" ETA {format_duration(eta)}" if eta is not None else ""
        self.status(f"[{bar}] step {step}/{total} {phase}{eta_text}")

    def done(self) -> None:
        self._clear()
        self._status = ""

    def _draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self._status[:200])
        self.stream.flush()

    def _clear(self) -> None:
        if self.live and self._status:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
