"""`[reward] type = "custom"`: your function scores each response.

`custom_module` is a module name (`my_rewards`, `pkg.rewards`) or a path to a `.py` file;
module names are also looked up on `[plugins] search_paths`, relative file paths against
the working directory and then each search path. `custom_function` (default `score`) is
called as `fn(response, reference) -> float`; it may be `async def` (awaited; the batch's
calls run concurrently on the reward's own event loop, each limited to `timeout` seconds).

Failure policy:
- an exception inside the function scores 0.0, is counted in `BatchScore.errors`, and the
  first traceback is logged once (logger `retrain.rewards`, warning); the run goes on;
- returning something that is not a real number, or NaN/infinity, is a bug in the
  function: RewardError naming it (the run stops);
- a missing module or function is a RewardError at construction time.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retrain.errors import RewardError
from retrain.registry import add_search_paths, import_module
from retrain.rewards.base import BatchScore, LoopThread, Reward
from retrain.rewards.boxed import extract_boxed
from retrain.types import Example


def _load_file(path: Path) -> Any:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"retrain_custom_reward_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"[reward] custom_module: cannot import {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise RewardError(
            f"[reward] custom_module: importing {str(path)!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def load_custom_function(
    module: str, function: str = "score", search_paths: Sequence[str] = ()
) -> Callable[..., Any]:
    """Import `module` (name or .py path, also on `search_paths`) and return `function`."""
    if not module:
        raise RewardError(
            "[reward] custom_module is required for type = 'custom' "
            "(a module name such as 'my_rewards' or a path such as 'rewards.py')"
        )
    function = function or "score"
    looks_like_file = module.endswith(".py") or os.sep in module or "/" in module
    if looks_like_file:
        candidates = [Path(module)]
        if not Path(module).is_absolute():
            candidates += [Path(p) / module for p in search_paths if p]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            tried = ", ".join(str(c) for c in candidates)
            raise RewardError(f"[reward] custom_module: file {module!r} not found (tried {tried})")
        mod = _load_file(found.resolve())
        where = str(found)
    else:
        add_search_paths(search_paths)
        try:
            mod = import_module(module)  # the working directory last, as for plugins
        except ImportError as exc:
            extra = f", {list(search_paths)}" if search_paths else ""
            raise RewardError(
                f"[reward] custom_module: cannot import {module!r} (searched sys.path{extra} and "
                f"the working directory {os.getcwd()}): {exc}; "
                "set [plugins] search_paths or give a path to a .py file"
            ) from exc
        except Exception as exc:  # the module's own code raised as it ran, as for a file
            raise RewardError(
                f"[reward] custom_module: importing {module!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        where = module
    fn = getattr(mod, function, None)
    if fn is None:
        public = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_"))
        raise RewardError(
            f"[reward] custom_function: {where!r} has no function {function!r}"
            f" (callables there: {', '.join(public) or 'none'})"
        )
    if not callable(fn):
        raise RewardError(f"[reward] custom_function: {where}.{function} is not callable")
    return fn


class CustomReward(Reward):
    name = "custom"

    @classmethod
    def from_config(cls, reward, search_paths=()) -> CustomReward:
        return cls(
            custom_module=reward.custom_module,
            custom_function=reward.custom_function,
            search_paths=search_paths,
            timeout=reward.timeout,
        )

    def __init__(
        self,
        *,
        custom_module: str = "",
        custom_function: str = "score",
        search_paths: Sequence[str] = (),
        timeout: float | None = None,
        fn: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.fn = (
            fn
            if fn is not None
            else load_custom_function(custom_module, custom_function, search_paths)
        )
        self.label = f"{custom_module or getattr(self.fn, '__module__', '?')}.{custom_function}"
        self.timeout = float(timeout) if timeout and timeout > 0 else None
        self._loop = LoopThread("retrain-custom-reward")

    def _check_value(self, value: Any) -> float:
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"custom reward {self.label} returned {type(value).__name__} {value!r:.80}; "
                "it must return a float"
            )
        out = float(value)
        if not math.isfinite(out):
            raise RewardError(
                f"custom reward {self.label} returned {out}; rewards must be finite numbers"
            )
        return out

    async def _limited(self, awaitable):
        if self.timeout is None:
            return await awaitable
        return await asyncio.wait_for(awaitable, self.timeout)

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        # fn scores the whole response; the \boxed{} answer is only logged
        out = BatchScore(extracts_answers=False)
        results: list[Any] = []
        pending: list[tuple[int, Any]] = []
        for i, (response, example) in enumerate(zip(responses, examples)):
            answer = extract_boxed(response)
            out.answers.append(answer)
            out.no_answer += answer is None
            try:
                value = self.fn(response, example.reference)
            except Exception as exc:
                results.append(exc)
                continue
            if inspect.isawaitable(value):
                pending.append((i, value))
                results.append(None)
            else:
                results.append(value)
        if pending:
            settled = self._loop.gather([self._limited(aw) for _, aw in pending])
            for (i, _), value in zip(pending, settled):
                results[i] = value
        for value in results:
            if isinstance(value, (asyncio.TimeoutError, TimeoutError)):
                out.timeouts += 1
                self._log_first_failure(f"custom reward {self.label}", value)
                out.rewards.append(0.0)
            elif isinstance(value, BaseException):
                if not isinstance(value, Exception):
                    raise value  # KeyboardInterrupt, SystemExit: not a scoring failure
                out.errors += 1
                self._log_first_failure(f"custom reward {self.label}", value)
                out.rewards.append(0.0)
            else:
                out.rewards.append(self._check_value(value))
        return out

    def close(self) -> None:
        self._loop.close()
