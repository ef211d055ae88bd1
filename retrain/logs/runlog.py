"""What a run writes into its log directory while it trains: config.resolved.toml,
metrics.jsonl, emergence/steps.jsonl, emergence/generations.jsonl, run.json (status and
heartbeat) and the optional wandb mirror."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrain.errors import RetrainError
from retrain.logs.jsonl import JsonlWriter, truncate_from_step, write_json_atomic
from retrain.logs.metrics import EVAL, eval_row, generation_rows, steps_row
from retrain.logs.rundir import GENERATIONS, METRICS, RUN_INFO
from retrain.types import EvalResult, StepResult

STEP_FILES = (METRICS, "emergence/steps.jsonl", str(GENERATIONS))


class RunLog:
    def __init__(self, config, log_dir: Path, config_path: str | None, say: Callable[[str], None]):
        self.config = config
        self.log_dir = log_dir
        self.config_path = config_path
        self.say = say
        self.started = time.time()
        self.wandb = None
        self._writers: dict[str, JsonlWriter] = {}
        # the run's backend and what it guarantees, once built (run.json's `backend`)
        self.backend: dict[str, Any] | None = None
        # what reserve() found, for release() to put back: the directories it made
        # (deepest first) and the previous run.json
        self._held: tuple[list[Path], bytes | None] | None = None

    def reserve(self, step: int) -> None:
        """Before the model loads (seconds to minutes): run.json says this run is running,
        so a second run started meanwhile is refused as live (logs/ownership.live_run)
        instead of writing beside it. The rows and the resolved config come with open()."""
        made = [p for p in (self.log_dir, *self.log_dir.parents) if not p.exists()]
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            before = (self.log_dir / RUN_INFO).read_bytes()
        except FileNotFoundError:
            before = None
        except OSError as exc:
            raise RetrainError(f"cannot write in {self.log_dir}: {exc.strerror or exc}") from exc
        self._held = (made, before)
        self.started = time.time()
        self.write_status("running", step=step)

    def release(self) -> None:
        """The run ended before open(): put back what reserve() found (the previous run.json
        of a resumed run; no directories where there were none), as if it had not started."""
        if self._held is None or self.is_open:
            return
        made, before = self._held
        self._held = None
        path = self.log_dir / RUN_INFO
        try:
            if before is not None:
                tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
                tmp.write_bytes(before)
                os.replace(tmp, path)  # never half a file
                return
            path.unlink(missing_ok=True)
        except OSError as exc:
            self.say(f"warning: could not put back {path}: {exc.strerror or exc}")
            return
        for directory in made:
            try:
                directory.rmdir()  # only when empty: nothing else is removed
            except OSError:
                break  # something else is in it now, so it and those above stay

    def open(self, start_step: int) -> None:
        """Create the directory, set aside rows of steps a resumed run will redo, write the
        resolved config and the first heartbeat."""
        from retrain.config.toml_writer import config_to_toml

        (self.log_dir / "emergence").mkdir(parents=True, exist_ok=True)
        if start_step > 0:
            for name in STEP_FILES:
                moved = truncate_from_step(self.log_dir / name, start_step)
                if moved:
                    self.say(
                        f"Moved {moved} rows after step {start_step} of {name} to its .superseded.jsonl"
                    )
            # an evaluation's step counts steps done: the one at the checkpoint's step stays
            truncate_from_step(self.log_dir / EVAL, start_step + 1)
        header = f"Resolved configuration of the run in {self.log_dir} (written by retrain)."
        path = self.log_dir / "config.resolved.toml"
        try:
            path.write_text(config_to_toml(self.config, header=header), encoding="utf-8")
        except OSError as exc:
            raise RetrainError(f"cannot write {path}: {exc.strerror or exc}") from exc
        self._writers = {name: JsonlWriter(self.log_dir / name) for name in STEP_FILES}
        self.started = time.time()
        self.write_status("running")
        if self.config.logging.wandb_project:
            from retrain.logs.wandb import WandbSink

            self.wandb = WandbSink.start(self.config, self.say)

    @property
    def is_open(self) -> bool:
        return bool(self._writers)

    def write_step(self, result: StepResult, row: dict[str, Any]) -> None:
        self._writers[METRICS].write(row)
        self._writers["emergence/steps.jsonl"].write(steps_row(row))
        generations = generation_rows(result)
        self._writers[str(GENERATIONS)].write_many(generations)
        if self.wandb is not None:
            self.wandb.log(row, generations)
        self.write_status("running", step=result.step + 1)

    def write_eval(self, result: EvalResult) -> None:
        """One eval.jsonl row (the file is created by the first evaluation)."""
        if EVAL not in self._writers:
            self._writers[EVAL] = JsonlWriter(self.log_dir / EVAL)
        self._writers[EVAL].write(eval_row(result, self.config.condition))

    def write_status(self, status: str, **extra: Any) -> None:
        data = {
            "status": status,
            "pid": os.getpid(),
            "host": socket.gethostname(),  # `retrain status` checks the pid on this host only
            "condition": self.config.condition,
            "config": self.config_path,
            "max_steps": self.config.training.max_steps,
            "started_at": self.started,
            "heartbeat": time.time(),
            "workdir": os.getcwd(),  # the run's relative paths are read from there
            **({"backend": self.backend} if self.backend else {}),
            **extra,
        }
        write_json_atomic(self.log_dir / RUN_INFO, data)

    def close(self, status: str, last_saved_step: int | None) -> None:
        if not self._writers:
            return
        for writer in self._writers.values():
            writer.close()
        try:
            self.write_status(status, step=last_saved_step, finished_at=time.time())
        except RetrainError as exc:  # e.g. the disk filled up: report, keep the original error
            self.say(f"warning: {exc}")
        if self.wandb is not None:
            self.wandb.finish(status)
