"""`[data] source = "math"` (the default): hendrycks MATH, five subjects, train split.

From the hub: `datasets.load_dataset("EleutherAI/hendrycks_math", subject, split=split)`
for intermediate_algebra, precalculus, number_theory, counting_and_probability and
geometry (about 4,500 train problems together; the reference is the last `\\boxed{}` of
each solution; the few solutions without one are skipped). `max_examples` keeps the
first N, in subject order.

From a local copy (`[data] path`), any of these layouts (columns or keys `problem`,
`solution`, and optionally `level`, `type`):
- the hub layout: `<path>/<subject>/train-00000-of-00001.parquet` (also `.jsonl`/`.json`,
  and any file under the subject folder whose path mentions the split);
- the original release: `<path>/train/<subject>/*.json`, one problem per file;
- one file or a flat folder of parquet/jsonl files; rows are kept when their `type` is one
  of the five subjects ("Intermediate Algebra", ...) or when they have no `type`.

Offline (no network, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set and no cached copy)
loading fails fast with a DataError naming the dataset and the alternatives. "Fast": with
the offline variables unset, one TCP connection to the hub endpoint is attempted with a
3-second limit before `datasets` gets a chance to retry for minutes.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from retrain.data.base import DataSource
from retrain.errors import DataError
from retrain.rewards.boxed import extract_boxed
from retrain.types import Example

if TYPE_CHECKING:
    from retrain.config.schema import DataConfig

DATASET_ID = "EleutherAI/hendrycks_math"
SUBJECTS = (
    "intermediate_algebra",
    "precalculus",
    "number_theory",
    "counting_and_probability",
    "geometry",
)
# The `type` column spells subjects as words.
_TYPE_TO_SUBJECT = {
    "intermediate algebra": "intermediate_algebra",
    "precalculus": "precalculus",
    "number theory": "number_theory",
    "counting & probability": "counting_and_probability",
    "counting and probability": "counting_and_probability",
    "geometry": "geometry",
}
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
ALTERNATIVES = (
    "use [data] source = 'reasoning_gym' (procedural, no download), "
    "[data] source = 'jsonl' with your own file, "
    "or point [data] path at a local copy of the dataset "
    "(folders <subject>/train-*.parquet as on the hub)"
)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("HF_DATASETS_OFFLINE")
    )


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the hub endpoint ($HF_ENDPOINT or huggingface.co)."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def subject_of(row: dict[str, Any], default: str | None = None) -> str | None:
    t = row.get("type")
    if isinstance(t, str):
        return _TYPE_TO_SUBJECT.get(t.strip().lower())
    return default


def row_to_example(row: dict[str, Any], subject: str | None, where: str) -> Example | None:
    """An Example from one MATH row, or None when the solution has no boxed answer."""
    problem, solution = row.get("problem"), row.get("solution")
    if not isinstance(problem, str) or not isinstance(solution, str):
        missing = [k for k in ("problem", "solution") if not isinstance(row.get(k), str)]
        raise DataError(f"{where}: MATH row without text field(s) {missing}; keys: {sorted(row)}")
    answer = extract_boxed(solution)
    if not answer:
        return None
    meta = {
        "source": "math",
        "subject": subject,
        "level": row.get("level"),
        "type": row.get("type"),
    }
    return Example(prompt=problem, reference=answer, meta=meta)


# -- reading local files ------------------------------------------------------------
def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError(
            f"reading {path} needs pyarrow: pip install 'retrain[data]' (or convert it to JSONL)"
        ) from exc
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:
        raise DataError(f"{path}: not a readable parquet file: {exc}") from exc


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        # Some copies name JSONL files *.json.
        try:
            return _read_jsonl(path)
        except DataError:
            raise DataError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg})") from None
    if isinstance(data, dict):
        return [data]
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        return data
    raise DataError(f"{path}: expected a JSON object or a list of objects")


def read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    raise DataError(f"{path}: unsupported file type (expected .parquet, .jsonl or .json)")


def _data_files(folder: Path, split: str) -> list[Path]:
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in _FILE_SUFFIXES
    )
    with_split = [p for p in files if split in p.relative_to(folder).as_posix()]
    return with_split or ([] if any(_mentions_other_split(p, folder) for p in files) else files)


def _mentions_other_split(p: Path, folder: Path) -> bool:
    rel = p.relative_to(folder).as_posix()
    return any(s in rel for s in ("train", "test", "validation"))


def _examples_from(files: Iterable[Path], subject: str | None, keep: set[str]) -> list[Example]:
    out = []
    for f in files:
        for i, row in enumerate(read_rows(f), start=1):
            subj = subject_of(row, subject) if subject is None else subject
            if subject is None and row.get("type") is not None and subj not in keep:
                continue
            ex = row_to_example(row, subj, f"{f} (row {i})")
            if ex is not None:
                out.append(ex)
    return out


def load_local_math(path: str | Path, split: str = "train") -> list[Example]:
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"[data] path: {str(root)!r} does not exist (a local MATH copy)")
    keep = set(SUBJECTS)
    if root.is_file():
        return _examples_from([root], None, keep)
    # The original release: <root>/<split>/<subject>/*.json
    if (root / split).is_dir() and any((root / split / s).is_dir() for s in SUBJECTS):
        root = root / split
    subject_dirs = [root / s for s in SUBJECTS if (root / s).is_dir()]
    if subject_dirs:
        examples: list[Example] = []
        for d in subject_dirs:
            examples += _examples_from(_data_files(d, split), d.name, keep)
        return examples
    files = _data_files(root, split)
    if not files:
        raise DataError(
            f"[data] path: no .parquet/.jsonl/.json files for split {split!r} under {root}"
        )
    return _examples_from(files, None, keep)


# -- the hub ------------------------------------------------------------------------
def load_hub_math(split: str = "train") -> list[Example]:
    offline = hub_offline()
    if not offline and not hub_reachable():
        raise DataError(
            f"cannot reach the Hugging Face hub to download {DATASET_ID} (no network). "
            f"Alternatives: {ALTERNATIVES}. With a cached copy, set HF_HUB_OFFLINE=1."
        )
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"[data] source = 'math' downloads {DATASET_ID} with the `datasets` package: "
            f"pip install 'retrain[data]'; or {ALTERNATIVES}"
        ) from exc
    examples: list[Example] = []
    for subject in SUBJECTS:
        try:
            ds = datasets.load_dataset(DATASET_ID, subject, split=split)
        except Exception as exc:
            why = "offline mode is on and there is no cached copy" if offline else str(exc)
            raise DataError(
                f"cannot load {DATASET_ID} ({subject}, split {split!r}): {why}. "
                f"Alternatives: {ALTERNATIVES}."
            ) from exc
        for i, row in enumerate(ds):
            ex = row_to_example(dict(row), subject, f"{DATASET_ID}/{subject} row {i}")
            if ex is not None:
                examples.append(ex)
    return examples


class MathSource(DataSource):
    name = "math"
    reward_hint = None  # math or match both fit; the trainer's default decides

    def __init__(
        self,
        *,
        path: str = "",
        split: str = "train",
        max_examples: int = 0,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        seed: int = 0,
    ) -> None:
        split = split or "train"
        examples = load_local_math(path, split) if path else load_hub_math(split)
        if not examples:
            raise DataError(
                f"no MATH examples with a boxed answer found{f' under {path}' if path else ''}"
            )
        super().__init__(
            examples,
            max_examples=max_examples,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            seed=seed,
        )
        self.path = path

    @classmethod
    def from_config(cls, data: DataConfig, *, max_examples: int, shuffle_seed: int | None):
        return cls(
            path=data.path,
            split=data.split,
            max_examples=max_examples,
            shuffle=data.shuffle,
            shuffle_seed=shuffle_seed,
            seed=data.seed,
        )
