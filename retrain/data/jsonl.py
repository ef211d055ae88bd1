"""`[data] source = "jsonl"`: one JSON object per line of `[data] path`.

`prompt_field` (default "question") holds the question text and `answer_field` (default
"answer") the reference; a number answer is turned into its string. Blank lines are
skipped. A line that is not a JSON object, or lacks either field, is a DataError naming
the file and line number. The whole record rides along in `Example.meta["record"]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrain.data.base import DataSource
from retrain.errors import DataError
from retrain.types import Example

if TYPE_CHECKING:
    from retrain.config.schema import DataConfig


def _as_reference(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def read_jsonl_examples(
    path: str | Path, prompt_field: str = "question", answer_field: str = "answer"
) -> list[Example]:
    if not str(path):
        raise DataError("[data] path is required for source = 'jsonl'")
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"[data] path: JSONL file {str(p)!r} not found")
    examples = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for field in (prompt_field, answer_field):
                if field not in record:
                    keys = ", ".join(sorted(record)) or "none"
                    which = "prompt_field" if field == prompt_field else "answer_field"
                    raise DataError(
                        f"{where}: missing field {field!r} ([data] {which}); the record has: {keys}"
                    )
            prompt = record[prompt_field]
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{where}: field {prompt_field!r} must be a non-empty string")
            reference = _as_reference(record[answer_field])
            if reference is None:
                raise DataError(
                    f"{where}: field {answer_field!r} must be a string or number, "
                    f"got {type(record[answer_field]).__name__}"
                )
            examples.append(
                Example(
                    prompt=prompt,
                    reference=reference,
                    meta={"source": "jsonl", "path": str(p), "line": lineno, "record": record},
                )
            )
    if not examples:
        raise DataError(f"{p}: no examples (the file is empty)")
    return examples


class JsonlSource(DataSource):
    name = "jsonl"

    def __init__(
        self,
        *,
        path: str = "",
        prompt_field: str = "question",
        answer_field: str = "answer",
        max_examples: int = 0,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        seed: int = 0,
    ) -> None:
        if not path:
            raise DataError("[data] path is required for source = 'jsonl'")
        examples = read_jsonl_examples(path, prompt_field or "question", answer_field or "answer")
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
            prompt_field=data.prompt_field,
            answer_field=data.answer_field,
            max_examples=max_examples,
            shuffle=data.shuffle,
            shuffle_seed=shuffle_seed,
            seed=data.seed,
        )
