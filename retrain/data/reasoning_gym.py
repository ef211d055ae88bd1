"""`[data] source = "reasoning_gym"`: procedural problems from any reasoning-gym task.

    [data]
    source = "reasoning_gym"
    task = "chain_sum"
    size = 1000
    seed = 0
    [data.args]        # the task's own config options
    min_terms = 2

`reasoning_gym.create_dataset(task, size=size, seed=seed, **args)` generates the items;
the same (task, args, size, seed) always gives the same examples. Each Example keeps the
entry in `meta` so the `gym` reward can call the task's own `score_answer`.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrain.data.base import DataSource
from retrain.errors import DataError
from retrain.types import Example

if TYPE_CHECKING:
    from retrain.config.schema import DataConfig


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as exc:
        raise DataError(
            "[data] source = 'reasoning_gym' needs reasoning-gym: pip install 'retrain[gym]'"
        ) from exc
    return reasoning_gym


def task_names() -> list[str]:
    """reasoning-gym's task names (DataError when reasoning-gym is not installed)."""
    return list(_catalog()["tasks"])


def defaults_problem(task: str) -> str | None:
    """Why registered `task` generates nothing with its default options (e.g.
    'composite', which needs its datasets named), or None: a one-item dataset built
    once per task and install (importing reasoning-gym is the cost), then cached."""
    catalog = _catalog()
    checked = catalog["defaults"]
    if task not in checked:
        try:
            _create(_import_reasoning_gym(), task, {}, 1, 0)[0]
            checked[task] = ""
        except Exception as exc:  # the task's own check of its defaults
            checked[task] = str(exc).removeprefix("[data.args] ")
        _keep(catalog)
    return checked[task] or None


def _catalog() -> dict[str, Any]:
    """The task names, and what `defaults_problem` found per task so far. Importing
    reasoning-gym imports every task (about 1 s: sympy, matplotlib), which `explain`
    and `doctor` would pay on every call just to check `[data] task`, so the catalog is
    kept in the retrain cache, per installed copy (its version and the time its package
    was written), and read from there after the first call."""
    path = _catalog_file()
    if path is not None:
        try:
            catalog = json.loads(path.read_text())
            if _is_catalog(catalog):
                return catalog
        except (OSError, ValueError):
            pass
    catalog = {"tasks": _registered(), "defaults": {}}
    _keep(catalog)
    return catalog


def _keep(catalog: dict[str, Any]) -> None:
    path = _catalog_file()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(catalog))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or this one
    except OSError:
        pass  # a read-only cache: the catalog is read from reasoning-gym each time


def _is_catalog(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("tasks"), list)
        and all(isinstance(n, str) for n in value["tasks"])
        and isinstance(value.get("defaults"), dict)
        and all(isinstance(v, str) for v in value["defaults"].values())
    )


def _registered() -> list[str]:
    """The task names reasoning-gym registers, from the imported package."""
    _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _catalog_file() -> Path | None:
    """Where the installed reasoning-gym's task names are cached; None when it is not
    installed (or cannot be placed)."""
    from importlib import metadata, util

    from retrain.models import cache_dir

    try:
        spec = util.find_spec("reasoning_gym")
        if spec is None or spec.origin is None:
            return None
        stamp = Path(spec.origin).stat().st_mtime_ns
        version = metadata.version("reasoning-gym")
    except (ImportError, ValueError, OSError, metadata.PackageNotFoundError):
        return None
    return cache_dir() / "reasoning_gym" / f"catalog-{version}-{stamp}.json"


def _create(rg: Any, task: str, args: dict[str, Any], size: int, seed: int) -> Any:
    """reasoning-gym's dataset, its refusal of `args` as a DataError."""
    try:
        return rg.create_dataset(task, size=int(size), seed=int(seed), **args)
    except TypeError as exc:
        raise DataError(
            f"[data.args] invalid option for reasoning-gym task {task!r}: {exc}"
        ) from exc
    except (ValueError, AssertionError) as exc:
        raise DataError(f"[data.args] rejected by reasoning-gym task {task!r}: {exc}") from exc


def args_problems(task: str, args: dict[str, Any], seed: int) -> list[tuple[str, str]]:
    """(key, problem) for `[data.args]` of a registered `task`, found before the run
    loads anything: an option the task's config does not have, a value of another type
    than the option's, then what the task itself refuses, from a one-item dataset built
    and its item generated as the run will (milliseconds; importing reasoning-gym is
    the cost)."""
    import dataclasses
    import typing

    rg = _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[task][1]
    if dataclasses.is_dataclass(config_cls):
        options = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
        hints = typing.get_type_hints(config_cls)
        found = [
            (f"[data.args] {key}", why)
            for key, value in args.items()
            if (why := _option_problem(task, key, value, options, hints.get(key)))
        ]
        if found:
            return found
    try:
        _create(rg, task, args, 1, seed)[0]
    except DataError as exc:
        fix = ". Fix: change [data.args] to options the task accepts"
        return [("[data] args", str(exc).removeprefix("[data.args] ") + fix)]
    except Exception as exc:  # the task's generator failed on these options
        return [
            (
                "[data] args",
                f"reasoning-gym task {task!r} failed generating an item with them: "
                f"{type(exc).__name__}: {exc}",
            )
        ]
    return []


def _option_problem(task: str, key: str, value: Any, options: list[str], hint: Any) -> str | None:
    if key in ("seed", "size"):
        return f"is set by [data] {key}, not in [data.args]. Fix: [data] {key} = {value!r}"
    if key not in options:
        close = difflib.get_close_matches(key, options, n=3)
        hint_text = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        return (
            f"reasoning-gym task {task!r} has no option {key!r}{hint_text}; its options: "
            f"{', '.join(options) or 'none'}. Fix: remove the key or correct its name"
        )
    # the simple types only; other hints (lists, optionals) are left to the task's own check
    allowed = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}.get(hint)
    if allowed is None:
        return None
    if isinstance(value, allowed) and (hint is bool or not isinstance(value, bool)):
        return None
    kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[hint]
    return f"must be {kind} for reasoning-gym task {task!r}, got {value!r}. Fix: {key} = {kind}"


def unknown_task(task: str, names: list[str]) -> str:
    """The problem with a `[data] task` reasoning-gym does not have, with the close names."""
    close = difflib.get_close_matches(task, names, n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return (
        f"unknown reasoning-gym task {task!r}{hint}. Fix: one of reasoning-gym's "
        f"{len(names)} tasks, e.g. {', '.join(names[:5])}"
    )


def load_gym_examples(
    task: str, args: dict[str, Any] | None = None, size: int = 1000, seed: int = 0
) -> list[Example]:
    rg = _import_reasoning_gym()
    if not task:
        raise DataError(
            "[data] task is required for source = 'reasoning_gym' (for example task = 'chain_sum')"
        )
    names = _registered()  # imported here anyway: the registry itself, not the cache
    if task not in names:
        raise DataError(f"[data] task: {unknown_task(task, names)}")
    if size < 1:
        raise DataError(f"[data] size must be >= 1, got {size}")
    args = dict(args or {})
    dataset = _create(rg, task, args, size, seed)
    examples = []
    for i in range(len(dataset)):
        entry = dataset[i]
        examples.append(
            Example(
                prompt=str(entry["question"]),
                reference=str(entry["answer"]),
                meta={"source": "reasoning_gym", "task": task, "args": args, "entry": entry},
            )
        )
    return examples


class ReasoningGymSource(DataSource):
    name = "reasoning_gym"
    reward_hint = "gym"

    def __init__(
        self,
        *,
        task: str = "",
        args: dict[str, Any] | None = None,
        size: int = 1000,
        seed: int = 0,
        max_examples: int = 0,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
    ) -> None:
        examples = load_gym_examples(task, args, size, seed)
        super().__init__(
            examples,
            name=f"reasoning_gym:{task}",
            max_examples=max_examples,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            seed=seed,
        )
        self.task = task
        self.args = dict(args or {})

    @classmethod
    def from_config(cls, data: DataConfig, *, max_examples: int, shuffle_seed: int | None):
        return cls(
            task=data.task,
            args=dict(data.args),
            size=data.size,
            seed=data.seed,
            max_examples=max_examples,
            shuffle=data.shuffle,
            shuffle_seed=shuffle_seed,
        )
