"""`[reward] type = "gym"`: reasoning-gym's own `score_answer` on the boxed answer.

Works on examples from the `reasoning_gym` data source: their `meta` holds
`{"source": "reasoning_gym", "task": name, "args": {...}, "entry": entry}`. The task's
dataset object (rebuilt once per (task, args) and cached) scores the extracted answer
against the entry, so partial credit is whatever the task gives. No boxed answer scores
0.0 (counted as no answer); an exception inside `score_answer` scores 0.0 and is counted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from retrain.errors import RewardError
from retrain.rewards.base import BatchScore, Reward
from retrain.rewards.boxed import extract_boxed
from retrain.types import Example


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as exc:
        raise RewardError(
            "the `gym` reward needs reasoning-gym: pip install 'retrain[gym]'"
        ) from exc
    return reasoning_gym


class GymReward(Reward):
    name = "gym"

    def __init__(self) -> None:
        super().__init__()
        self._datasets: dict[tuple[str, str], Any] = {}

    def _dataset(self, task: str, args: dict | None) -> Any:
        key = (task, json.dumps(args or {}, sort_keys=True, default=repr))
        ds = self._datasets.get(key)
        if ds is None:
            rg = _import_reasoning_gym()
            try:
                ds = rg.create_dataset(task, size=1, seed=0, **(args or {}))
            except Exception:
                # Some configs insist on a larger size; the default config scores the same.
                try:
                    ds = rg.create_dataset(task, size=10, seed=0, **(args or {}))
                except Exception as exc:
                    raise RewardError(
                        f"gym reward: cannot rebuild reasoning-gym task {task!r} "
                        f"with args {args!r}: {exc}"
                    ) from exc
            self._datasets[key] = ds
        return ds

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        out = BatchScore()
        for response, example in zip(responses, examples):
            meta = example.meta or {}
            if meta.get("source") != "reasoning_gym" or "entry" not in meta:
                raise RewardError(
                    "the `gym` reward scores reasoning-gym examples only ([data] source = "
                    f"'reasoning_gym'); got an example from {meta.get('source', 'an unknown source')!r}. "
                    "Use [reward] type = 'match' or 'math' for other data."
                )
            answer = extract_boxed(response)
            out.answers.append(answer)
            if answer is None:
                out.no_answer += 1
                out.rewards.append(0.0)
                continue
            ds = self._dataset(meta["task"], meta.get("args"))
            try:
                value = float(ds.score_answer(answer, meta["entry"]))
                if not math.isfinite(value):
                    raise ValueError(f"score_answer returned {value}")
            except Exception as exc:
                out.errors += 1
                self._log_first_failure(f"reasoning-gym {meta['task']}.score_answer", exc)
                value = 0.0
            out.rewards.append(value)
        return out
