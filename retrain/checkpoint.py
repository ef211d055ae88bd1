"""Trainer state: what `trainer_state.json` holds and how it is written and read.

The backend writes the weights (+ optimizer) to a checkpoint directory first; only then
is `trainer_state.json` replaced atomically to point at it. A crash at any moment leaves
the previous state file and the checkpoint it names intact.

The paths a run writes are relative to the directory it was started in (its `workdir`,
recorded in the state), as the user gave them; reading the state from another directory
reads them from there.
"""

from __future__ import annotations

import json
import random
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from retrain.errors import CheckpointError
from retrain.logs.jsonl import write_json_atomic
from retrain.logs.rundir import RUN_INFO, read_json
from retrain.types import CheckpointInfo

STATE_FILE = "trainer_state.json"
# Beside a local checkpoint's adapter: its optimizer (AdamW's moments of the rank-r
# factors) and RNG state, which belong to those weights alone (a squeezed copy has none).
TRAINING_STATE = "training_state.pt"
STATE_VERSION = 1


@dataclass
class TrainerState:
    step: int  # steps completed; the next step to run
    model: str
    lora_rank: int
    condition: str
    batch_size: int
    group_size: int
    data: dict[str, Any]
    counters: dict[str, float]
    sepa: dict[str, Any]
    checkpoint: CheckpointInfo  # what the backend needs to restore, and where the adapter is
    backpressure: dict[str, Any] | None = None
    rng: dict[str, Any] = field(default_factory=dict)
    # the zero-signal guard's run of steps without a datum (None in older state files:
    # counted from 0), so a resumed run stops where the straight run would
    zero_signal: dict[str, Any] | None = None
    finished: bool = False
    saved_at: float = field(default_factory=time.time)
    version: int = STATE_VERSION
    # The directory the run was started in: the relative paths of its config and of
    # `checkpoint` are read from there ("" in states written before it was recorded).
    workdir: str = ""
    # The command that started the run, without --resume/--overwrite: what the hints
    # that continue it type (["retrain", "run.toml", "--max-steps", "12"]).
    launch: list[str] = field(default_factory=list)


def run_workdir(
    log_dir: str | Path, files: tuple[str, ...] = (STATE_FILE, RUN_INFO)
) -> Path | None:
    """The directory the run in `log_dir` was started in: recorded in the first of `files`
    that says (trainer_state.json: where its checkpoint's path is relative to; run.json:
    where the last start's config.resolved.toml is), else (a run of an earlier retrain)
    the directory its config.resolved.toml's relative `[logging] log_dir` names `log_dir`
    from. None when nothing says."""
    log_dir = Path(log_dir).expanduser()
    for name in files:
        recorded = (read_json(log_dir / name) or {}).get("workdir")
        if isinstance(recorded, str) and recorded:
            return Path(recorded)
    try:
        resolved = tomllib.loads((log_dir / "config.resolved.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    written = (resolved.get("logging") or {}).get("log_dir")
    if not isinstance(written, str) or not written:
        return None
    rel = Path(written)
    if rel.is_absolute() or any(part in ("..", ".", "~") for part in rel.parts):
        return None
    here = log_dir.resolve()
    if here.parts[-len(rel.parts) :] != rel.parts:
        return None
    return here.parents[len(rel.parts) - 1]


def workdir_elsewhere(log_dir: str | Path) -> Path | None:
    """The directory the run in `log_dir` was started in, when that is not the one retrain
    runs in now (the run's relative paths then name other places from here); None when it
    is, or when nothing records it."""
    workdir = run_workdir(log_dir)
    if workdir is None or workdir.resolve() == Path.cwd().resolve():
        return None
    return workdir


def _read_from(path: str, workdir: Path) -> str:
    """A local relative `path` of the run as seen from here (remote ones stay)."""
    if not path or "://" in path or Path(path).expanduser().is_absolute():
        return path
    return str(workdir / path)


def capture_rng() -> dict[str, Any]:
    """Python's and numpy's global RNG states, as JSON (torch's live with the backend)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def restore_rng(state: dict[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_state(log_dir: str | Path, state: TrainerState) -> Path:
    path = Path(log_dir) / STATE_FILE
    write_json_atomic(path, asdict(state))
    return path


def load_state(resume_dir: str | Path) -> TrainerState:
    d = Path(resume_dir)
    path = d / STATE_FILE if d.is_dir() or not d.name.endswith(".json") else d
    if not d.exists():
        raise CheckpointError(f"[resume] from: {d} does not exist")
    if not path.exists():
        raise CheckpointError(
            f"[resume] from: {path} not found. A resumable log dir holds the trainer_state.json "
            "that runs write at every save_every checkpoint and at the end."
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    if raw.get("version") != STATE_VERSION:
        raise CheckpointError(
            f"{path}: state version {raw.get('version')!r}, this retrain reads version {STATE_VERSION}"
        )
    try:
        state = TrainerState(**raw)
    except TypeError as exc:
        raise CheckpointError(f"{path} is missing fields: {exc}") from exc
    info = CheckpointInfo.from_dict(raw["checkpoint"] or {})
    workdir = run_workdir(path.parent)
    if workdir is not None and workdir.resolve() != Path.cwd().resolve():
        info = replace(
            info, adapter=_read_from(info.adapter, workdir), state=_read_from(info.state, workdir)
        )
    state.checkpoint = info
    return state


def check_compatible(
    state: TrainerState, backend: str, model: str, lora_rank: int, source: Path | str
) -> None:
    """Refuse to resume into a different backend, model or LoRA shape, naming the difference."""
    diffs = []
    saved_by = state.checkpoint.backend
    if saved_by and saved_by != backend:
        diffs.append(
            f"[backend] backend: the checkpoint was saved by the {saved_by!r} backend, the config "
            f"uses {backend!r} (a checkpoint only loads into the backend that wrote it)"
        )
    if state.model != model:
        diffs.append(f"[model] model: checkpoint {state.model!r}, config {model!r}")
    if state.lora_rank != lora_rank:
        diffs.append(f"[model] lora_rank: checkpoint {state.lora_rank}, config {lora_rank}")
    if diffs:
        raise CheckpointError(
            f"cannot resume from {source}: "
            + "; ".join(diffs)
            + ". Fix: resume with the settings the run was started with."
        )


def _gone_files(info: CheckpointInfo) -> list[str]:
    """The files on this machine the checkpoint record names that are no longer there: its
    state directory (unless the record carries the state itself, in `extra`), and a PEFT
    adapter directory's weights. Remote paths (`tinker://...`) are the service's."""
    state = info.state
    if not state or "://" in state:
        return []
    path = Path(state)
    if not path.exists():
        if info.extra:
            return []
        where = "" if path.is_absolute() else f" (read from here, {Path.cwd()})"
        return [f"the checkpoint directory {path}{where}"]
    weights = path / "adapter_model.safetensors"
    if (path / "adapter_config.json").is_file() and not weights.is_file():
        return [f"{weights}"]
    return []


def resume_problems(
    resume_dir: str, *, backend: str, model: str, lora_rank: int
) -> list[tuple[str, str]]:
    """(key, problem) for a `[resume] from` directory the run could not resume from, found
    before anything loads: not a run directory, an unreadable or incompatible state file,
    or checkpoint files that are gone."""
    key, where = "[resume] from", Path(resume_dir).expanduser()
    if not where.is_dir():
        return [
            (
                key,
                f"{resume_dir!r} is not a directory (relative paths are read from the directory "
                f"retrain runs in, {Path.cwd()}). Fix: the log directory of the run to continue "
                "(its [logging] log_dir), or drop --resume to start afresh",
            )
        ]
    try:
        state = load_state(where)
        check_compatible(state, backend, model, lora_rank, resume_dir)
    except CheckpointError as exc:
        message = str(exc).removeprefix(f"{key}: ")
        if "Fix:" not in message:
            message += " Fix: --resume the log directory of a run that saved a checkpoint"
        return [(key, message)]
    gone = _gone_files(state.checkpoint)
    if gone:
        return [
            (
                key,
                f"{where / STATE_FILE} names a checkpoint whose files are gone: "
                f"{', '.join(gone)}. Fix: restore them, or start afresh without --resume",
            )
        ]
    return []


def read_checkpoint_file(path: Path, read: Callable[[], Any]) -> Any:
    """`read()` of a checkpoint's file; a file that does not load (cut short by a full
    disk, a copy or an edit outside retrain's atomic writes) is a CheckpointError that
    names it, not the loader's own exception."""
    import pickle

    from safetensors import SafetensorError

    try:
        return read()
    except (
        OSError,
        RuntimeError,
        ValueError,
        EOFError,
        pickle.UnpicklingError,
        SafetensorError,
    ) as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # torch's is a RuntimeError: memory,
            raise  # not the file
        raise CheckpointError(
            f"{path} does not load ({type(exc).__name__}: {exc}): the checkpoint is damaged. "
            "Fix: put back an undamaged copy of it, or start the run again (--overwrite)"
        ) from exc
