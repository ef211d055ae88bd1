"""Append-only JSONL files, and reading them back tolerantly.

Writes are flushed per row so `retrain status` and `tail -f` see progress; a disk
error is raised as a RetrainError naming the file, never swallowed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from retrain.errors import RetrainError


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the row."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _clean(value.item())
    return value


class JsonlWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
        except OSError as exc:
            raise RetrainError(
                f"cannot open {self.path} for writing: {exc.strerror or exc}"
            ) from exc

    def write(self, row: dict[str, Any]) -> None:
        self.write_many([row])

    def write_many(self, rows: Iterable[dict[str, Any]]) -> None:
        try:
            for row in rows:
                self._fh.write(json.dumps(_clean(row), ensure_ascii=False) + "\n")
            self._fh.flush()
        except OSError as exc:
            raise RetrainError(f"cannot write to {self.path}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError as exc:
            raise RetrainError(f"cannot close {self.path}: {exc.strerror or exc}") from exc


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Rows of a JSONL file, skipping lines that do not parse (a run killed mid-write
    leaves a truncated last line). Returns (rows, 1-based numbers of skipped lines)."""
    rows: list[dict[str, Any]] = []
    bad: list[int] = []
    p = Path(path)
    if not p.exists():
        return rows, bad
    with open(p, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad.append(lineno)
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append(lineno)
    return rows, bad


def truncate_from_step(path: str | Path, step: int) -> int:
    """Keep rows with `step` < step; move the others to `<name>.superseded.jsonl` so a
    resumed run does not duplicate steps and nothing already written is lost.
    Returns how many rows were moved."""
    p = Path(path)
    if not p.exists():
        return 0
    keep, moved = [], []
    with open(p, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
                later = (
                    isinstance(row, dict)
                    and isinstance(row.get("step"), int)
                    and row["step"] >= step
                )
            except json.JSONDecodeError:
                later = True  # a torn line from the crash: keep it out of the live file
            (moved if later else keep).append(line if line.endswith("\n") else line + "\n")
    if not moved:
        return 0
    aside = p.with_name(p.name.replace(".jsonl", "") + ".superseded.jsonl")
    with open(aside, "a", encoding="utf-8") as fh:
        fh.writelines(moved)
    tmp = p.with_name(f".{p.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(keep)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)
    return len(moved)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON so a crash leaves either the old file or the new one, never half."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(_clean(data), fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RetrainError(f"cannot write {p}: {exc.strerror or exc}") from exc
