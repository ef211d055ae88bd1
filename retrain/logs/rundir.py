"""Reading run and campaign directories: the one reader behind status, compare and campaigns.

A run directory (a run's `[logging] log_dir`) holds any of::

    metrics.jsonl             one row per step (a resumed run may repeat steps)
    run.json                  status, condition, max_steps, heartbeat of the live process
    trainer_state.json        the last checkpoint's state ("finished": true at the end)
    config.resolved.toml      the configuration the run used (campaign runs also have run.toml)
    emergence/generations.jsonl   one row per completion, with "correct"

A campaign directory holds manifest.json and its runs under `runs/{condition}_s{seed}/`
(the condition label made safe for a directory name, see `run_dir_name`).

Everything is read on first use and tolerantly: a missing file reads as empty, a torn
JSONL line is skipped, and an unreadable file becomes a line in `warnings` rather than an
exception, so one damaged run never hides the others.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tomllib
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

from retrain.logs.jsonl import read_jsonl

METRICS = "metrics.jsonl"
RUN_INFO = "run.json"
TRAINER_STATE = "trainer_state.json"
GENERATIONS = Path("emergence") / "generations.jsonl"
CONFIG_FILES = ("config.resolved.toml", "run.toml")  # the first one that parses is used
RUN_MARKERS = (METRICS, RUN_INFO, TRAINER_STATE)
MANIFEST = "manifest.json"
_SEED_SUFFIX = re.compile(r"^(?P<cond>.+)_s(?P<seed>-?\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=~,-]")
MAX_LABEL_CHARS = 120  # of a directory name, before the `_s{seed}` suffix


def safe_label(label: str) -> str:
    """`label` as a directory name. A label of letters, digits and `. _ + = ~ , -` stays
    as it is (`maxrl+gtpo~lr=0.0001`); any other character becomes `_` and a very long
    label is cut, and then an 8-digit hash of the whole label is appended, so distinct
    labels never share a directory."""
    safe = _UNSAFE.sub("_", label)
    if safe == label and len(label) <= MAX_LABEL_CHARS and not label.startswith("."):
        return label
    digest = hashlib.sha1(label.encode("utf-8")).hexdigest()[:8]
    return f"{safe.lstrip('.')[:MAX_LABEL_CHARS]}-{digest}"


def run_dir_name(condition: str, seed: int) -> str:
    """The directory (and run name) of one campaign run: `{condition}_s{seed}`."""
    return f"{safe_label(condition)}_s{seed}"


def read_json(path: str | Path, warnings: list[str] | None = None) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when the file is absent or unreadable (why it
    could not be read is appended to `warnings`)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        problem = f"cannot read {path}: {exc}"
    else:
        if isinstance(data, dict):
            return data
        problem = f"{path} does not hold a JSON object"
    if warnings is not None:
        warnings.append(problem)
    return None


def as_int(value: Any) -> int | None:
    """`value` when it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_number(value: Any) -> float | None:
    """`value` as a float when it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def skipped_lines(path: Path, bad: list[int]) -> str:
    """The warning for the lines of a JSONL file that did not parse (1-based numbers)."""
    shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
    return f"skipped {len(bad)} corrupt line(s) in {path}: line(s) {shown}"


def is_run_dir(path: str | Path) -> bool:
    return any((Path(path) / name).exists() for name in RUN_MARKERS)


def run_dir_holding(path: str | Path) -> Path | None:
    """The run directory `path` is, or lies inside (a directory with metrics.jsonl,
    run.json or trainer_state.json at or above it), or None: what a command that writes
    files must stay out of, since a command never writes into a run's files. The path is
    taken as written with `..` removed (`run/x/../../out` is not inside `run/x`), and as
    the filesystem resolves it (through a symlink into a run, it is inside)."""
    path = Path(path).expanduser()
    written = Path(os.path.abspath(path))
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: nothing can be written there anyway
        real = written
    for p in dict.fromkeys((written, real)):
        found = next((d for d in (p, *p.parents) if d.is_dir() and is_run_dir(d)), None)
        if found is not None:
            return found
    return None


def blocked_at(path: Path) -> tuple[Path, str] | None:
    """Where a file or directory at `path` could not be made or written: its nearest
    existing part (`path` itself when it exists) and why, "file" (not a directory) or
    "unwritable" (os.access: this user may not write there, which root always may); None
    when nothing stands in the way."""
    path = path.absolute()
    nearest = next(p for p in (path, *path.parents) if p.exists())
    if not nearest.is_dir():
        return nearest, "file"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return nearest, "unwritable"
    return None


def cannot_write_in(path: Path) -> str | None:
    """`blocked_at(path)` in words, for a path that does not exist yet (or a directory)."""
    blocked = blocked_at(path)
    if blocked is None:
        return None
    where, why = blocked
    if why == "file":
        return f"{where} is a file, not a directory"
    return f"cannot write in {where} (permission denied)"


class RunDir:
    """One run directory; each property reads its file once, on first use."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.warnings: list[str] = []  # files that could not be read, lines skipped

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ---------------------------------------------------------------- files

    @cached_property
    def run_info(self) -> dict[str, Any]:
        """run.json ({} when absent or unreadable)."""
        return read_json(self.path / RUN_INFO, self.warnings) or {}

    @cached_property
    def trainer_state(self) -> dict[str, Any]:
        """trainer_state.json ({} when absent or unreadable)."""
        return read_json(self.path / TRAINER_STATE, self.warnings) or {}

    def _read_rows(self, path: Path) -> tuple[list[dict[str, Any]], list[int]]:
        """read_jsonl's answer, or no rows and a warning when the file cannot be read."""
        try:
            return read_jsonl(path)
        except OSError as exc:
            self.warnings.append(f"cannot read {path}: {exc.strerror or exc}")
            return [], []

    @cached_property
    def _metrics_file(self) -> tuple[list[dict[str, Any]], list[int]]:
        rows, bad = self._read_rows(self.path / METRICS)
        if bad:
            self.warnings.append(skipped_lines(self.path / METRICS, bad))
        return rows, bad

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl in file order (lines that do not parse are skipped)."""
        return self._metrics_file[0]

    @property
    def corrupt_lines(self) -> list[int]:
        """1-based numbers of the metrics.jsonl lines that did not parse."""
        return self._metrics_file[1]

    @cached_property
    def step_rows(self) -> list[dict[str, Any]]:
        """One metrics row per step, by step; the last row wins for a repeated step."""
        by_step = {
            step: row for row in self.metrics if (step := as_int(row.get("step"))) is not None
        }
        return [by_step[s] for s in sorted(by_step)]

    @cached_property
    def config(self) -> dict[str, Any]:
        """The run's configuration as TOML data: config.resolved.toml, else run.toml."""
        for name in CONFIG_FILES:
            try:
                return tomllib.loads((self.path / name).read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError):
                continue
        return {}

    # ---------------------------------------------------------------- facts

    def config_value(self, table: str, key: str) -> Any:
        section = self.config.get(table)
        return section.get(key) if isinstance(section, dict) else None

    @property
    def name_parts(self) -> tuple[str, int] | None:
        """(condition, seed) from a directory named `{condition}_s{seed}`."""
        match = _SEED_SUFFIX.match(self.path.name)
        return (match.group("cond"), int(match.group("seed"))) if match else None

    @cached_property
    def condition(self) -> str | None:
        """The label the metrics rows carry most often, else run.json's, trainer_state's,
        the configured one (`[logging] condition_label`, else the algorithm's), the
        directory name's; None when nothing says."""
        labels = Counter(
            r["condition"] for r in self.metrics if isinstance(r.get("condition"), str)
        )
        if labels:
            return labels.most_common(1)[0][0]
        for source in (self.run_info, self.trainer_state):
            if isinstance(source.get("condition"), str) and source["condition"]:
                return source["condition"]
        label = self.config_value("logging", "condition_label")
        if isinstance(label, str) and label:  # a campaign condition with overrides
            return label
        algo = self.config.get("algorithm")
        if isinstance(algo, dict):
            return algo.get("algorithm_mode") or (
                f"{algo.get('advantage_mode', 'maxrl')}+{algo.get('transform_mode', 'gtpo_sepa')}"
            )
        return self.name_parts[0] if self.name_parts else None

    @property
    def seed(self) -> int | None:
        """The configured `[training] seed` when >= 0, else the directory name's."""
        seed = as_int(self.config_value("training", "seed"))
        if seed is not None and seed >= 0:
            return seed
        return self.name_parts[1] if self.name_parts else None

    @property
    def max_steps(self) -> int | None:
        """run.json's max_steps, else the configured `[training] max_steps`."""
        return as_int(self.run_info.get("max_steps")) or as_int(
            self.config_value("training", "max_steps")
        )

    @property
    def steps_done(self) -> int:
        """Steps completed: the last logged step + 1, or the step run.json or the
        checkpoint reached when that is further."""
        logged = [s for r in self.metrics if (s := as_int(r.get("step"))) is not None]
        reached = [as_int(self.run_info.get("step")), as_int(self.trainer_state.get("step"))]
        return max([s + 1 for s in logged[-1:]] + [s or 0 for s in reached])

    @property
    def has_checkpoint(self) -> bool:
        return (self.path / TRAINER_STATE).is_file()

    @property
    def finished(self) -> bool:
        """The checkpoint says the run finished."""
        return self.trainer_state.get("finished") is True

    @property
    def heartbeat(self) -> float | None:
        """run.json's heartbeat (seconds since the epoch), else the newest file's mtime."""
        beat = as_number(self.run_info.get("heartbeat"))
        if beat is not None:
            return beat
        mtimes = [(self.path / n).stat().st_mtime for n in RUN_MARKERS if (self.path / n).exists()]
        return max(mtimes) if mtimes else None

    def correct_counts(self, horizon: int | None = None) -> tuple[int, int] | None:
        """(correct, completions) over the steps < horizon, or None when unknown.

        From metrics.jsonl: a row's `num_correct` and `num_completions`. A row written
        before those existed gives `round(correct_rate * batch_size * group_size)` of
        `batch_size * group_size`, exact because the rate was computed from those counts,
        except after dynamic sampling's extra rounds (`sampling_rounds` > 1: every group
        sampled stays in the step, more than batch_size of them). Then, and when a row
        lacks the sizes, every count comes from emergence/generations.jsonl. A row
        without a correct_rate (null, damaged) adds nothing: compare's warning about
        the steps missing from correct_rate names it."""
        correct = total = 0
        for row in self.step_rows:
            if horizon is not None and row["step"] >= horizon:
                break
            counted = as_int(row.get("num_correct")), as_int(row.get("num_completions"))
            if counted[0] is not None and counted[1] is not None:
                correct, total = correct + counted[0], total + counted[1]
                continue
            rate = as_number(row.get("correct_rate"))
            if rate is None:
                continue
            batch, group = as_int(row.get("batch_size")), as_int(row.get("group_size"))
            rounds = as_number(row.get("sampling_rounds"))
            if batch is None or group is None or (rounds is not None and rounds > 1):
                return self.generation_counts(horizon)
            correct += int(round(rate * batch * group))
            total += batch * group
        return (correct, total) if total else None

    @cached_property
    def _generations(self) -> list[tuple[int, bool]]:
        """(step, correct) of each completion in emergence/generations.jsonl. A line that
        does not parse, or a row without a step number, is skipped with a warning: its
        step, and so whether it lies within a horizon, is unknown."""
        path = self.path / GENERATIONS
        rows, bad = self._read_rows(path)
        if bad:
            self.warnings.append(skipped_lines(path, bad))
        out, no_step = [], 0
        for row in rows:
            if "correct" not in row:
                continue
            step = as_int(row.get("step"))
            if step is None:
                no_step += 1
            else:
                out.append((step, bool(row["correct"])))
        if no_step:
            self.warnings.append(
                f"skipped {no_step} row(s) of {path} without a step number (missing, null "
                "or not an integer)"
            )
        return out

    def generation_counts(self, horizon: int | None = None) -> tuple[int, int] | None:
        """(correct, completions) from emergence/generations.jsonl over steps < horizon."""
        kept = [ok for step, ok in self._generations if horizon is None or step < horizon]
        return (sum(kept), len(kept)) if kept else None


class CampaignDir:
    """A campaign directory: its manifest and where each listed run lives."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.warnings: list[str] = []

    @cached_property
    def manifest(self) -> dict[str, Any]:
        """manifest.json ({} when absent or unreadable)."""
        return read_json(self.path / MANIFEST, self.warnings) or {}

    @property
    def entries(self) -> list[dict[str, Any]] | None:
        """The manifest's run entries, or None when it has no `runs` list."""
        runs = self.manifest.get("runs")
        return [e for e in runs if isinstance(e, dict)] if isinstance(runs, list) else None

    def run_dir(self, entry: dict[str, Any]) -> Path | None:
        """The existing directory of a manifest entry: `runs/{name}`, else its log_dir
        (absolute; relative to the campaign, to the working directory; or its last part
        under `runs/`, for a campaign that was moved), else `runs/{condition}_s{seed}`."""
        runs = self.path / "runs"
        candidates: list[Path] = []
        if isinstance(entry.get("name"), str) and entry["name"]:
            candidates.append(runs / entry["name"])
        log_dir = entry.get("log_dir")
        if isinstance(log_dir, str) and log_dir:
            p = Path(log_dir)
            candidates += [p] if p.is_absolute() else [self.path / p, Path.cwd() / p]
            candidates.append(runs / p.name)
        condition, seed = entry.get("condition"), as_int(entry.get("seed"))
        if isinstance(condition, str) and seed is not None:
            candidates.append(runs / run_dir_name(condition, seed))
        return next((c for c in candidates if c.is_dir()), None)

    def run_dirs(self) -> list[Path]:
        """Every directory under `runs/` that holds a run, sorted (listed or not)."""
        runs = self.path / "runs"
        if not runs.is_dir():
            return []
        return sorted(p for p in runs.iterdir() if p.is_dir() and is_run_dir(p))
