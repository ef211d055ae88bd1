"""`[environment] provider = "verifiers"`: train on a verifiers environment.

    [environment]
    provider = "verifiers"
    id = "primeintellect/gsm8k"     # owner/name[@version] or a module name
    args = { split = "train" }      # passed to the environment
    max_turns = -1                  # -1: the environment's default
    auto_install = false            # true: `prime env install <id>` when missing

The environment's training examples become the data, and its scorer becomes
`data_source.reward` (a Reward-like object), so `[reward] type` is not used. A
single-turn environment gets one completion per prompt, scored by that reward. An
environment that talks back (a classic `MultiTurnEnv`, or a v1 taskset package that
exports its own `Env`) is exposed as `turn_environment`, and the run rolls it out turn by
turn with retrain's own sampler (retrain/multiturn.py; `[environment] max_turns`,
`turn_timeout_s`).

Supported verifiers versions (both were probed; see the tests):
- the classic API, verifiers 0.1.x - 0.3.x: the environment package exposes
  `load_environment(**args)` returning an Environment with a training `dataset`
  (`get_dataset()`; columns prompt / question / answer / info / task) and a `rubric`
  whose async `score_group(states)` / `score_rollout(state)` score a completion. We call
  the package's `load_environment` directly (what `vf.load_environment` does). These are
  the Prime Hub environments.
- the v1 API (`verifiers.v1`; 0.4.0 ships only this): the package exports a `Taskset`
  subclass; `args` validate into its `TasksetConfig`; each `Task` becomes an example and
  `task.score(trace)` (its `@vf.reward` functions and judges, without a runtime) scores a
  one-turn trace holding the completion. An infinite taskset is cut at `[data] size`
  tasks. Single-turn tasksets work on verifiers 0.3.1+; a multi-turn v1 `Env` needs 0.4+
  (on 0.3.x it is refused with a DataError naming the installed version).

Multi-turn (both APIs, retrain plays the model's seat):
- classic: the environment's own `rollout()` loop runs unchanged (env_response, its
  `@vf.stop` conditions, cleanup) with a retrain client whose responses are the sampled
  turns; its rubric scores each group, then its cleanup runs. A single-turn environment
  on verifiers 0.3 is scored the same way: its rollout runs on the whole dataset row
  with the sampled completion as the reply, so reward functions get what verifiers gives
  them (every column by name, message objects). A reward function that raises (which
  verifiers' Rubric would score 0) fails its group and counts in `reward_errors`.
- v1: the package's `Env` subclass (one agent seat) runs its `run(task, agents)`; the
  seat's `interaction(task).turn(...)` returns the sampled turn as a `vf.Segment`. The
  task's rewards, what `run` recorded on the trace, and the Env's `finalize` score it.
  v1 tool-calling harnesses (MCP toolsets) are not driven; a classic ToolEnv is: its
  tools go into the prompt through the chat template and the model's calls are parsed
  from its tokens (retrain/tool_calls.py) into the client's tool_calls.

An environment without a training dataset (evaluation-only: only `eval_dataset`, or a
taskset that yields nothing) fails fast with a DataError saying what to do instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from retrain.config.schema import FALLBACK_MAX_TURNS
from retrain.data.base import DataSource
from retrain.errors import DataError
from retrain.rewards.base import BatchScore, LoopThread, Reward
from retrain.rewards.boxed import extract_boxed
from retrain.types import Example

if TYPE_CHECKING:
    from retrain.config.schema import DataConfig, EnvironmentConfig

logger = logging.getLogger("retrain.data")

INSTALL_HINT = "pip install 'retrain[verifiers]'"


def module_name(env_id: str) -> str:
    """The importable module of an environment id: `owner/my-env@0.1` -> `my_env`."""
    name = env_id.rsplit("/", 1)[-1].split("@", 1)[0]
    return name.replace("-", "_").strip().lower()


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _find_module(name: str) -> str | None:
    # verifiers' own order (verifiers.v1.utils.loaders): its bundled tasksets first, so
    # `id = "textarena"` is verifiers' taskset even with the TextArena library installed;
    # then an installed package or [plugins] search_paths; retrain's own come last.
    for candidate in (f"verifiers.v1.tasksets.{name}", name):
        if _importable(candidate):
            return candidate
    return None


API_GENERATIONS = (
    "classic (verifiers 0.1 - 0.3.x, the Prime Hub environments): load_environment(**args) "
    "returns an Environment; "
    "interim (verifiers dev builds before 0.4, e.g. the `tasksets` package): "
    "load_environment(config: vf.EnvConfig) or load_taskset(config) with vf.Taskset at the "
    "top level of verifiers; "
    "v1 (verifiers.v1, the only API of 0.4; single-turn tasksets also on 0.3.1): the module "
    "exports a Taskset subclass (and, multi-turn, an Env, which needs 0.4+) in __all__"
)


def _installed_verifiers() -> str:
    import importlib.metadata as md

    try:
        return md.version("verifiers")
    except md.PackageNotFoundError:
        return "not installed"


def interim_api_error(env_id: str, target: str, why: str) -> DataError:
    """The interim API (config-object loaders) is not driven: say which generation the
    module is, what the three are, and what to use instead."""
    have = _installed_verifiers()
    return DataError(
        f"verifiers environment {env_id!r} (module {target!r}) is written for the interim "
        f"verifiers API ({why}), which retrain does not drive and verifiers {have} does not "
        f"ship. The three API generations: {API_GENERATIONS}. Fix: use the v1 taskset of the "
        'same environment if verifiers bundles one (e.g. id = "textarena" is '
        "verifiers.v1.tasksets.textarena), pick another module with [environment] module, "
        "or install a classic (verifiers<0.4) or v1 (verifiers>=0.4) build of it"
    )


def _interim_loader(module: Any) -> str | None:
    """'load_environment(config)' when the module's loader takes one config object."""
    import inspect

    for name in ("load_environment", "load_taskset"):
        fn = getattr(module, name, None)
        if not callable(fn):
            continue
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            continue
        if params and params[0].name == "config" and params[0].kind is not params[0].VAR_KEYWORD:
            return f"{name}(config)"
    return None


def install_environment(env_id: str) -> None:
    """`prime env install <id>`; DataError when the prime CLI is missing or fails."""
    prime = shutil.which("prime")
    if prime is None:
        raise DataError(
            f"verifiers environment {env_id!r} is not installed and [environment] auto_install "
            "needs the `prime` CLI, which is not on PATH: pip install prime (then rerun), or "
            f"install the environment yourself with `prime env install {env_id}`"
        )
    logger.info("installing verifiers environment %s with %s", env_id, prime)
    try:
        proc = subprocess.run(
            [prime, "env", "install", env_id], capture_output=True, text=True, timeout=900
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataError(f"`prime env install {env_id}` failed: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-1500:]
        raise DataError(
            f"`prime env install {env_id}` exited with status {proc.returncode}:\n{tail}"
        )
    importlib.invalidate_caches()


def import_environment(
    env_id: str, search_paths: Sequence[str] = (), auto_install: bool = False, module: str = ""
) -> Any:
    """The environment's module: `[environment] module` when set, else the id looked up in
    verifiers' order (see _find_module)."""
    if not env_id and not module:
        raise DataError("[environment] id is required when [environment] provider = 'verifiers'")
    for p in search_paths:
        if p and p not in sys.path:
            sys.path.insert(0, p)
    from retrain.environments import ENVIRONMENTS_DIR

    if str(ENVIRONMENTS_DIR) not in sys.path:  # retrain's own environments, found last
        sys.path.append(str(ENVIRONMENTS_DIR))
    env_id = env_id or module
    if module:
        target = module if _importable(module) else None
        if target is None:
            raise DataError(
                f"[environment] module = {module!r}: no such module. Install the package "
                "that provides it, add the folder holding it to [plugins] search_paths, or "
                "remove the key to look the id up"
            )
    else:
        name = module_name(env_id)
        target = _find_module(name)
        if target is None and auto_install:
            install_environment(env_id)
            target = _find_module(name)
        if target is None:
            raise DataError(
                f"verifiers environment {env_id!r} is not installed (no module {name!r}). "
                f"Install it with `prime env install {env_id}`, set [environment] "
                "auto_install = true, add the folder holding it to [plugins] search_paths, or "
                "name the module with [environment] module"
            )
    try:
        return importlib.import_module(target)
    except AttributeError as exc:
        if "verifiers" in str(exc):  # `vf.Taskset`, `vf.UserConfig`: an older API's names
            raise interim_api_error(env_id, target, f"importing it failed: {exc}") from exc
        raise DataError(f"importing verifiers environment {env_id!r} failed: {exc}") from exc
    except ImportError as exc:
        hint = f" ({INSTALL_HINT})" if "verifiers" in str(exc) else ""
        raise DataError(
            f"importing verifiers environment {env_id!r} (module {target!r}) failed: {exc}{hint}. "
            "If it was written for another verifiers API, check the installed verifiers version."
        ) from exc


def _is_v1_taskset_class(obj: Any) -> bool:
    return isinstance(obj, type) and any(
        c.__name__ == "Taskset" and c.__module__.startswith("verifiers.v1") for c in obj.__mro__[1:]
    )


def exports_v1_taskset(module: Any) -> bool:
    names = getattr(module, "__all__", None) or []
    return any(_is_v1_taskset_class(getattr(module, n, None)) for n in names)


def _message_dicts(messages: Any) -> list[dict[str, str]] | None:
    """Chat messages as plain {"role", "content"} dicts (text parts joined)."""
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, list):  # content parts
            texts = []
            for part in content:
                text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
                if text:
                    texts.append(text)
            content = "\n".join(texts)
        if role is None:
            continue
        out.append({"role": str(role), "content": "" if content is None else str(content)})
    return out


def _question_of(messages: list[dict[str, str]]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else (messages[-1]["content"] if messages else "")


def _eval_only(env_id: str, what: str) -> DataError:
    return DataError(
        f"verifiers environment {env_id!r} is evaluation-only: {what}. It cannot be trained "
        "on. Pick a trainable environment (one with a training dataset), pass [environment] "
        "args that select a training split if it has one, or train on your own data with "
        "[data] source = 'jsonl'."
    )


# -- the classic API ----------------------------------------------------------------
def _classic_examples(env: Any, env_id: str) -> list[Example]:
    dataset = None
    if hasattr(env, "get_dataset"):
        try:
            dataset = env.get_dataset()
        except (ValueError, AttributeError):
            dataset = None
    if dataset is None:
        dataset = getattr(env, "dataset", None)
    if dataset is None or len(dataset) == 0:
        has_eval = getattr(env, "eval_dataset", None) is not None or (
            getattr(env, "eval_dataset_source", None) is not None
        )
        raise _eval_only(
            env_id,
            "it has no training dataset" + (" (only an eval_dataset)" if has_eval else ""),
        )
    examples = []
    for i, row in enumerate(dataset):
        row = dict(row)
        messages = _message_dicts(row.get("prompt"))
        question = row.get("question")
        if not isinstance(question, str) or not question:
            if isinstance(row.get("prompt"), str):
                question = row["prompt"]
            elif messages:
                question = _question_of(messages)
            else:
                raise DataError(
                    f"verifiers environment {env_id!r}: dataset row {i} has neither a prompt "
                    f"nor a question (columns: {sorted(row)})"
                )
        answer = row.get("answer")
        meta = {
            "source": "verifiers",
            "api": "classic",
            "env_id": env_id,
            "row": row,
            "row_index": i,
            "messages": messages,
        }
        examples.append(
            Example(prompt=question, reference="" if answer is None else str(answer), meta=meta)
        )
    return examples


def _rollout_input(example: Example) -> dict[str, Any]:
    """The example's dataset row as verifiers' own rollouts get it (`inputs.to_list()`):
    every column, since `init_state` keeps them all in `state["task"]` and the rubric
    passes the extra ones to reward functions by name (a `question` or `difficulty`
    parameter). A string prompt becomes the user message retrain renders it as."""
    row = dict(example.meta["row"])
    row.setdefault("example_id", example.meta.get("row_index", 0))
    if isinstance(row.get("prompt"), str):
        row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    return row


def _runs_rollouts(env: Any) -> bool:
    """Whether the environment has verifiers 0.3's `rollout(input, client, model, ...)`
    and the client class it takes, so retrain can run its own rollout around a sampled
    completion (older classic APIs get a hand-built state: `_classic_state`)."""
    try:
        from verifiers.clients import Client  # noqa: F401

        params = list(inspect.signature(env.rollout).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
    return params[:1] == ["input"]


async def _classic_rollout(env: Any, example: Example, response: str) -> Any:
    """The state verifiers itself would score for this completion: the environment's
    own rollout (init_state, the response as its message objects, render_completion,
    its cleanup) with a client that answers with the completion retrain sampled."""
    from retrain.multiturn import Reply

    async def ask(messages: Any, tools: Any = None) -> Reply:
        return Reply(response)

    state = await env.rollout(_rollout_input(example), _classic_client(ask), "retrain", {})
    if state.get("error") is not None:
        raise state["error"]
    return state


def _classic_state(example: Example, response: str, message_type: str) -> Any:
    """A scoring state built by hand for classic verifiers without 0.3's rollout API:
    the whole row (what those versions' rollouts carried too), with verifiers' message
    objects where it has them (reward functions may read `m.content`)."""
    try:
        from verifiers.types import State  # classic verifiers
    except ImportError:
        State = dict  # noqa: N806
    try:
        from verifiers.types import flatten_task_input
    except ImportError:
        flatten_task_input = None
    try:
        from verifiers.types import AssistantMessage
        from verifiers.utils.message_utils import normalize_messages
    except ImportError:
        AssistantMessage = normalize_messages = None  # noqa: N806
    inp = _rollout_input(example)
    if isinstance(inp.get("info"), str):
        with contextlib.suppress(json.JSONDecodeError):
            inp["info"] = json.loads(inp["info"])
    inp.setdefault("info", {})
    state = State(input=dict(inp))
    for key, value in inp.items():
        state[key] = value
    if flatten_task_input is not None:
        try:
            state["task"] = flatten_task_input(inp)
        except Exception:
            state["task"] = inp.get("task")
    completion: Any = response
    if message_type != "completion":
        completion = [{"role": "assistant", "content": response}]
        if normalize_messages is not None:
            state["prompt"] = normalize_messages(inp["prompt"], field_name="input.prompt")
            completion = [AssistantMessage(content=response)]
    state["completion"] = completion
    state["responses"] = []
    state["trajectory"] = []
    state["turn"] = 1
    state["is_completed"] = True
    state["is_truncated"] = False
    state["timing"] = {}
    return state


# The reward-function failures of the group being scored (see _recording).
_FAILURES: contextvars.ContextVar[list[tuple[str, BaseException]] | None] = contextvars.ContextVar(
    "retrain_rubric_failures", default=None
)


def _recording(func: Any) -> Any:
    """`func`, noting an exception it raises before raising it on. verifiers 0.3's Rubric
    catches a reward function's exception, logs it and scores it 0, which would keep it
    out of `reward_errors`. functools.wraps keeps the name and, through `__wrapped__`,
    the signature verifiers reads to pick the function's arguments."""
    if getattr(func, "_retrain_recording", False):
        return func

    @functools.wraps(func)
    async def recording(*args: Any, **kwargs: Any) -> Any:
        try:
            result = func(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result
        except Exception as exc:
            failures = _FAILURES.get()
            if failures is not None:
                failures.append((getattr(func, "__name__", repr(func)), exc))
            raise

    recording._retrain_recording = True  # type: ignore[attr-defined]
    return recording


def _watch_rubric(rubric: Any) -> None:
    """Wrap the reward functions of a rubric (and of a RubricGroup's rubrics) with
    _recording, in place."""
    funcs = getattr(rubric, "funcs", None)
    if isinstance(funcs, list):
        funcs[:] = [_recording(f) for f in funcs]
    for inner in getattr(rubric, "rubrics", None) or []:
        _watch_rubric(inner)


async def _score_classic(rubric: Any, states: list[Any], env_id: str) -> list[float]:
    """One group's states scored as verifiers scores them (`score_group`, else
    `score_rollout` each), then the rubric's cleanup for each (what verifiers does after
    scoring). A reward function that raised fails the group: the caller counts it."""
    failures: list[tuple[str, BaseException]] = []
    token = _FAILURES.set(failures)
    try:
        if hasattr(rubric, "score_group"):
            await rubric.score_group(states)
        else:
            for state in states:
                await rubric.score_rollout(state)
    finally:
        _FAILURES.reset(token)
        if hasattr(rubric, "cleanup"):
            for state in states:
                await rubric.cleanup(state)
    if failures:
        name, exc = failures[0]
        raise DataError(
            f"verifiers environment {env_id!r}: reward function {name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return [float(state["reward"]) for state in states]


class ClassicRubricReward(Reward):
    """A classic verifiers Environment's rubric as a retrain Reward."""

    name = "verifiers"

    def __init__(self, env: Any, env_id: str) -> None:
        super().__init__()
        self.env = env
        self.env_id = env_id
        self.rubric = getattr(env, "rubric", None)
        if self.rubric is None:
            raise DataError(f"verifiers environment {env_id!r} has no rubric to score with")
        self.message_type = getattr(env, "message_type", "chat") or "chat"
        rollout = getattr(self.rubric, "score_rollout", None)
        if rollout is None and not hasattr(self.rubric, "score_group"):
            raise DataError(
                f"verifiers environment {env_id!r}: its rubric has neither score_group nor "
                "score_rollout"
            )
        self._rollout_params = set(inspect.signature(rollout).parameters) if rollout else set()
        self._runs_rollouts = _runs_rollouts(env)
        _watch_rubric(self.rubric)
        self._loop = LoopThread("retrain-verifiers")

    async def _score_group(self, examples: list[Example], responses: list[str]) -> list[float]:
        """All completions of one example together (group reward functions need that)."""
        if self._runs_rollouts:
            states = list(
                await asyncio.gather(
                    *(_classic_rollout(self.env, e, r) for e, r in zip(examples, responses))
                )
            )
        else:
            states = [_classic_state(e, r, self.message_type) for e, r in zip(examples, responses)]
        return await _score_classic(self.rubric, states, self.env_id)

    async def _score_one(self, example: Example, response: str) -> list[float]:
        """A rubric without score_group scores one completion at a time; verifiers <= 0.1's
        score_rollout takes keywords and returns the score."""
        if "completion" not in self._rollout_params:
            return await self._score_group([example], [response])
        state = _classic_state(example, response, self.message_type)
        result = await self.rubric.score_rollout(
            prompt=state.get("prompt"),
            completion=state["completion"],
            answer=state.get("answer", ""),
            state=state,
            task=state.get("task", "default"),
            info=state.get("info", {}),
        )
        return [float(result["reward"] if isinstance(result, dict) else result.reward)]

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        out = BatchScore(rewards=[0.0] * len(responses), extracts_answers=False)
        groups: dict[Any, list[int]] = {}
        for i, (response, example) in enumerate(zip(responses, examples)):
            meta = example.meta or {}
            if meta.get("source") != "verifiers" or meta.get("api") != "classic":
                raise DataError(
                    f"the {self.env_id!r} rubric scores examples from that environment only"
                )
            out.answers.append(extract_boxed(response))  # logged; the scorer reads its own
            groups.setdefault(meta.get("row_index", id(example)), []).append(i)
        if hasattr(self.rubric, "score_group"):
            # One call per example's group; a failure fails that group only.
            order = list(groups.values())
            coros = [
                self._score_group([examples[i] for i in g], [responses[i] for i in g])
                for g in order
            ]
        else:
            order = [[i] for i in range(len(responses))]
            coros = [self._score_one(examples[i], responses[i]) for i in range(len(responses))]
        for idx, result in zip(order, self._loop.gather(coros)):
            if isinstance(result, BaseException):
                out.errors += len(idx)
                self._log_first_failure(f"verifiers rubric of {self.env_id!r}", result)
                continue
            for i, value in zip(idx, result):
                out.rewards[i] = value
        return out

    def close(self) -> None:
        self._loop.close()


# -- the v1 API ---------------------------------------------------------------------
def _v1_id(env_id: str, explicit: str) -> str:
    """The id verifiers' own loaders resolve to the chosen module (they import by id)."""
    if not explicit:
        return env_id
    prefix = "verifiers.v1.tasksets."
    if explicit.startswith(prefix) and "." not in explicit[len(prefix) :]:
        return explicit[len(prefix) :]
    if "." not in explicit and not _importable(prefix + explicit):
        return explicit
    raise DataError(
        f"[environment] module = {explicit!r}: verifiers loads a v1 taskset by a top-level "
        "module name (its bundled tasksets first), and this name does not resolve to that "
        "module. Fix: install the taskset as a top-level package, or use its id"
    )


def _v1_examples(
    env_id: str, args: dict[str, Any], size: int, opens: bool = False
) -> tuple[list[Example], Any]:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise DataError(f"verifiers environments need verifiers: {INSTALL_HINT}") from exc
    try:
        config_cls = vf.taskset_config_type(env_id)
        config = config_cls.model_validate({**args, "id": env_id})
    except Exception as exc:
        raise DataError(f"[environment] args for verifiers taskset {env_id!r}: {exc}") from exc
    try:
        taskset = vf.load_taskset(config)
        tasks = list(_v1_bounded(taskset, max(1, int(size))))
    except Exception as exc:
        raise DataError(f"loading verifiers taskset {env_id!r} failed: {exc}") from exc
    if not tasks:
        raise _eval_only(env_id, "its taskset yields no tasks for these args")
    examples = []
    for task in tasks:
        data = task.data
        messages = None if isinstance(data.prompt, str) else _message_dicts(data.prompt)
        prompt = data.prompt if isinstance(data.prompt, str) else data.prompt_text
        if not prompt and not messages and not opens:
            raise DataError(
                f"verifiers taskset {env_id!r}: task {data.idx} has no prompt and the taskset "
                "has no Env to open the conversation; retrain needs a prompt or an opening "
                "message to sample from"
            )
        answer = getattr(data, "answer", None)
        meta = {
            "source": "verifiers",
            "api": "v1",
            "env_id": env_id,
            "task": task,
            "messages": messages,
            "system_prompt": data.system_prompt,
        }
        examples.append(
            Example(prompt=prompt, reference="" if answer is None else str(answer), meta=meta)
        )
    return examples, taskset


def _v1_bounded(taskset: Any, size: int) -> Any:
    """The taskset, or its first `size` tasks when it is infinite. verifiers 0.4 says
    so with `bounded` and cuts with `take`; 0.3.1 with `INFINITE` and `head`."""
    bounded = getattr(taskset, "bounded", None)
    if bounded is None:
        bounded = not getattr(taskset, "INFINITE", False)
    if bounded:
        return taskset
    return taskset.take(size) if hasattr(taskset, "take") else taskset.head(size)


class TaskScoreReward(Reward):
    """A v1 verifiers Task's own scoring (`task.score(trace)`) as a retrain Reward."""

    name = "verifiers"

    def __init__(self, env_id: str) -> None:
        super().__init__()
        self.env_id = env_id
        self._loop = LoopThread("retrain-verifiers")

    @staticmethod
    def build_trace(task: Any, response: str) -> Any:
        import verifiers.v1 as vf

        data = task.data
        nodes = []
        if data.system_prompt:
            nodes.append(vf.MessageNode(message=vf.SystemMessage(content=data.system_prompt)))
        prompt = data.prompt if isinstance(data.prompt, list) else None
        if prompt:
            for message in prompt:
                parent = len(nodes) - 1 if nodes else None
                nodes.append(vf.MessageNode(parent=parent, message=message))
        elif data.prompt:
            parent = len(nodes) - 1 if nodes else None
            nodes.append(vf.MessageNode(parent=parent, message=vf.UserMessage(content=data.prompt)))
        nodes.append(
            vf.MessageNode(
                parent=len(nodes) - 1 if nodes else None,
                message=vf.AssistantMessage(content=response),
                sampled=True,
            )
        )
        return vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="retrain", trainable=True),
            nodes=nodes,
            root_reply=response,
            is_completed=True,
            ok=True,
        )

    async def _score(self, task: Any, response: str) -> float:
        trace = self.build_trace(task, response)
        await task.score(trace)
        return float(trace.reward)

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        out = BatchScore(extracts_answers=False)
        coros = []
        for response, example in zip(responses, examples):
            meta = example.meta or {}
            if meta.get("source") != "verifiers" or meta.get("api") != "v1":
                raise DataError(
                    f"the {self.env_id!r} task scorer scores examples from that taskset only"
                )
            out.answers.append(extract_boxed(response))  # logged; the scorer reads its own
            coros.append(self._score(meta["task"], response))
        for result in self._loop.gather(coros):
            if isinstance(result, BaseException):
                out.errors += 1
                self._log_first_failure(f"verifiers task scoring of {self.env_id!r}", result)
                out.rewards.append(0.0)
            else:
                out.rewards.append(result)
        return out

    def close(self) -> None:
        self._loop.close()


# -- multi-turn: verifiers environments driven by retrain's sampler -----------------


def _v1_env_class(env_id: str) -> Any:
    """The taskset package's own multi-turn `Env` subclass, or None (a plain taskset:
    verifiers runs it with SingleAgentEnv, which retrain samples in one turn)."""
    from verifiers.v1.utils import loaders

    cls = loaders.environment_class(env_id)
    return None if cls.__name__ == "SingleAgentEnv" else cls


def _v1_opening(task: Any) -> list[dict[str, str]]:
    data = task.data
    msgs = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):  # "": the Env opens the conversation itself
        return msgs + ([{"role": "user", "content": data.prompt}] if data.prompt else [])
    return msgs + (_message_dicts(data.prompt) or [])


class _V1Interaction:
    """verifiers' `Interaction` surface (`turn`, `trace`) with retrain as the model: each
    turn's reply is sampled by retrain's batched sampler instead of a harness."""

    def __init__(self, task: Any, ask: Any) -> None:
        import verifiers.v1 as vf

        self.vf, self.task, self.ask = vf, task, ask
        self.trace = TaskScoreReward.build_trace(task, "")
        self.trace.nodes.pop()  # build_trace ends with a reply; the turns add them
        self.trace.root_reply, self.trace.is_completed = None, False
        self.messages = _v1_opening(task)
        self.started = self.over = False

    def _append(self, message: Any, sampled: bool = False) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(
            self.vf.MessageNode(parent=parent, message=message, sampled=sampled)
        )

    async def turn(self, message: Any = None) -> Any:
        from retrain.multiturn import MalformedMessages, check_messages

        vf = self.vf
        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        if message is None and self.started:
            raise MalformedMessages("turn() without a message after the opening turn")
        if message is not None:
            new = check_messages(
                [{"role": "user", "content": message}] if isinstance(message, str) else message
            )
            for m in new:
                self.messages.append(m)
                cls = {"user": vf.UserMessage, "system": vf.SystemMessage}.get(
                    m["role"], vf.UserMessage
                )
                self._append(cls(content=m["content"]))
        self.started = True
        turn = await self.ask(list(self.messages))
        if turn is None:  # retrain's max_turns
            self.over = True
            self.trace.stop("max_turns")
            return vf.Segment(messages=[], terminated=True)
        reply = turn.text
        self.messages.append({"role": "assistant", "content": reply})
        assistant = vf.AssistantMessage(content=reply)
        self._append(assistant, sampled=True)
        self.trace.root_reply = reply
        return vf.Segment(messages=[assistant], root_reply=reply)


class _V1Agent:
    """One seat of a verifiers v1 Env, played by the model retrain trains."""

    def __init__(self, name: str, config: Any, ask: Any, played: list[Any]) -> None:
        self.name, self.config, self.ask, self.played = name, config, ask, played
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        interaction = _V1Interaction(task, self.ask)
        self.played.append((task, interaction))
        yield interaction
        if not interaction.trace.is_completed:
            interaction.trace.stop("user_closed")

    async def run(self, task: Any, **_: Any) -> Any:
        raise DataError(
            "this verifiers Env calls agent.run(); retrain drives multi-turn environments "
            "through agent.interaction(task) turns"
        )


class V1TurnEnvironment:
    """A verifiers v1 `Env` (its `run(task, agents)` is the control flow) whose single
    agent seat is played by retrain's sampler; scored by the task's rewards plus what
    the Env recorded on the trace (and its `finalize`)."""

    def __init__(self, env: Any, env_id: str, max_turns: int) -> None:
        from verifiers.v1.configs.agent import agent_config_fields

        seats = agent_config_fields(env.config)
        if len(seats) != 1:
            raise DataError(
                f"verifiers environment {env_id!r} has {len(seats)} agent seats "
                f"({sorted(seats)}); retrain trains environments with one agent seat"
            )
        ((self.seat, spec),) = seats.items()
        self.env, self.env_id = env, env_id
        self.max_turns = max_turns if max_turns > 0 else (spec.max_turns or FALLBACK_MAX_TURNS)

    async def play(self, example: Example, ask: Any) -> Any:
        import verifiers.v1 as vf

        task = example.meta["task"]
        played: list[Any] = []
        agents = vf.Agents(self.env.config, lambda name, spec: _V1Agent(name, spec, ask, played))
        await self.env.setup(agents)
        await self.env.run(task, agents)
        if not played:
            raise DataError(f"verifiers environment {self.env_id!r} ran no interaction")
        return played

    async def score(self, example: Example, states: Sequence[Any]) -> list[float]:
        import verifiers.v1 as vf

        rewards = []
        for played in states:
            task, trace = played[-1][0], played[-1][1].trace
            await task.score(trace)
            episode = vf.Episode(
                env=vf.EnvInfo(id=self.env_id),
                task=vf.TraceTask(
                    type=type(task).__name__, data=task.data, key=task.key, hash=task.hash
                ),
                traces=[i.trace for _, i in played],
            )
            await self.env.finalize(task, episode)
            rewards.append(float(trace.reward))
        return rewards


def _classic_tool_schemas(tools: Any) -> list[dict[str, Any]] | None:
    """A classic environment's `vf.Tool`s (name, description, JSON-schema parameters) as
    the OpenAI function schemas chat templates take."""
    from retrain.tool_calls import tool_schema

    if not tools:
        return None
    return [tool_schema(t.name, t.description or "", dict(t.parameters)) for t in tools]


def _classic_client(ask: Any) -> Any:
    """A classic verifiers `Client` whose responses are the model's turns sampled by
    retrain (the environment's own rollout loop runs unchanged around it)."""
    import time

    import verifiers as vf
    from verifiers.clients import Client

    class RetrainClient(Client):
        def setup_client(self, config: Any) -> Any:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

        async def get_response(
            self, prompt: Any, model: str, tools: Any = None, **kwargs: Any
        ) -> Any:
            reply = await ask(list(prompt), _classic_tool_schemas(tools))
            over = reply is None
            calls = [] if over else reply.tool_calls
            # a turn cut by max_tokens is "length" and truncated, as verifiers' own clients
            # report it (its state's is_truncated)
            cut = over or reply.cut_short
            message = vf.types.ResponseMessage(
                content="" if over else reply.text,
                finish_reason="length" if cut else ("tool_calls" if calls else "stop"),
                is_truncated=cut,
                tool_calls=[
                    vf.types.ToolCall(id=c.id, name=c.name, arguments=json.dumps(c.arguments))
                    for c in calls
                ]
                or None,
            )
            return vf.types.Response(
                id="retrain", created=int(time.time()), model=model, message=message
            )

    return RetrainClient(None)


class ClassicTurnEnvironment:
    """A classic verifiers MultiTurnEnv (0.3.x): its own `rollout` loop (env_response,
    stop conditions, cleanup) with retrain's sampler as the client; scored by its
    rubric, a group at a time."""

    # Set on a state by `play`: the conversation was cut by max_turns (see `truncated`).
    CUT = "retrain_cut_by_max_turns"

    def __init__(self, env: Any, env_id: str, max_turns: int) -> None:
        env_turns = int(getattr(env, "max_turns", -1) or -1)
        self.max_turns = (
            max_turns if max_turns > 0 else (env_turns if env_turns > 0 else FALLBACK_MAX_TURNS)
        )
        env.max_turns = self.max_turns  # the environment's own stop condition agrees
        self.env, self.env_id = env, env_id
        _watch_rubric(env.rubric)

    async def play(self, example: Example, ask: Any) -> Any:
        client = _classic_client(ask)
        state = await self.env.rollout(_rollout_input(example), client, "retrain", {})
        if state.get("error") is not None:
            raise state["error"]
        state[self.CUT] = state.get("stop_condition") == "max_turns_reached" and not (
            await self._ended_anyway(state)
        )
        return state

    async def _ended_anyway(self, state: Any) -> bool:
        """Whether another stop condition fires too. verifiers checks them by priority,
        then name, so `max_turns_reached` is the one recorded when the last allowed turn
        also ended the conversation (a ToolEnv's `no_tools_called`: the model answered
        without a call); that conversation was not cut short."""
        try:
            from verifiers.utils.async_utils import maybe_call_with_named_args
        except ImportError:  # a classic verifiers without it: max_turns decides, as before
            return False
        for condition in getattr(self.env, "_stop_conditions", None) or []:
            if getattr(condition, "__name__", "") == "max_turns_reached":
                continue
            if await maybe_call_with_named_args(condition, state=state, env=self.env):
                return True
        return False

    def truncated(self, state: Any) -> bool:
        return state is not None and bool(state.get(self.CUT))

    async def score(self, example: Example, states: Sequence[Any]) -> list[float]:
        return await _score_classic(self.env.rubric, list(states), self.env_id)


def is_classic_multi_turn(env: Any) -> bool:
    """A classic environment that talks back: a MultiTurnEnv that is not single-turn."""
    names = {c.__name__ for c in type(env).__mro__}
    return "MultiTurnEnv" in names and "SingleTurnEnv" not in names


def _v1_turn_environment(env_cls: Any, env_id: str, args: dict[str, Any], max_turns: int) -> Any:
    import verifiers.v1 as vf
    from verifiers.v1.utils import loaders

    # retrain plays a v1 Env's seat through 0.4's Trace (root_reply); 0.3.1's lacks it
    if "root_reply" not in getattr(vf.Trace, "model_fields", {}):
        raise DataError(
            f"verifiers environment {env_id!r} is a multi-turn v1 Env, which retrain drives "
            f"with verifiers 0.4 or later; verifiers {_installed_verifiers()} is installed. "
            "Fix: pip install 'verifiers>=0.4' (single-turn v1 tasksets also work on 0.3.1)"
        )

    try:
        config = loaders.resolve_env_config({"taskset": {**args, "id": env_id}})
        env = env_cls(config)
    except Exception as exc:
        raise DataError(f"loading verifiers environment {env_id!r} failed: {exc}") from exc
    return V1TurnEnvironment(env, env_id, max_turns)


def _parse_args(raw: Any) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DataError(f"[environment] args: not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise DataError(f"[environment] args must be a table, got {type(raw).__name__}")
    return dict(raw)


class VerifiersSource(DataSource):
    name = "verifiers"
    reward_hint = "verifiers"

    def __init__(
        self,
        *,
        environment: dict[str, Any] | None = None,
        size: int = 1000,
        max_examples: int = 0,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        seed: int = 0,
        search_paths: Sequence[str] = (),
    ) -> None:
        environment = dict(environment or {})
        provider = environment.get("provider", "verifiers") or "verifiers"
        if provider != "verifiers":
            raise DataError(
                f"[environment] provider: unknown provider {provider!r} (valid: 'verifiers')"
            )
        explicit = str(environment.get("module") or "")
        env_id = str(environment.get("id") or "") or explicit
        args = _parse_args(environment.get("args"))
        self.max_turns = int(environment.get("max_turns", -1) or -1)
        module = import_environment(
            env_id, search_paths, bool(environment.get("auto_install", False)), explicit
        )
        self.env_id = env_id
        self.env: Any = None
        # Set when the environment talks back (retrain.multiturn drives it turn by turn).
        self.turn_environment: Any = None
        # A classic ToolEnv's tools: the model must write native tool calls
        # (retrain/tool_calls.py), so `build` checks its chat template has a format.
        self.needs_tools = False
        interim = _interim_loader(module)
        if exports_v1_taskset(module):
            self.api = "v1"
            vf_id = _v1_id(env_id, explicit)
            env_cls = _v1_env_class(vf_id)
            examples, self.env = _v1_examples(vf_id, args, size, opens=env_cls is not None)
            reward: Reward = TaskScoreReward(env_id)
            if env_cls is not None:
                self.turn_environment = _v1_turn_environment(env_cls, vf_id, args, self.max_turns)
        elif interim is not None:
            raise interim_api_error(env_id, module.__name__, f"its {interim}")
        elif callable(getattr(module, "load_environment", None)):
            self.api = "classic"
            try:
                self.env = module.load_environment(**args)
            except TypeError as exc:
                raise DataError(f"[environment] args for {env_id!r}: {exc}") from exc
            except DataError:
                raise
            except Exception as exc:
                raise DataError(
                    f"loading verifiers environment {env_id!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
            examples = _classic_examples(self.env, env_id)
            reward = ClassicRubricReward(self.env, env_id)
            if is_classic_multi_turn(self.env):
                self.turn_environment = ClassicTurnEnvironment(self.env, env_id, self.max_turns)
                self.needs_tools = bool(getattr(self.env, "tool_defs", None))
        else:
            raise DataError(
                f"module {module.__name__!r} for environment {env_id!r} is not a verifiers "
                "environment: it neither defines load_environment() (classic API) nor "
                f"exports a Taskset subclass in __all__ (v1 API). The API generations: "
                f"{API_GENERATIONS}. Fix: name the environment's module with [environment] "
                "module if the id picked another one"
            )
        super().__init__(
            examples,
            name=f"verifiers:{env_id}",
            max_examples=max_examples,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            seed=seed,
            reward=reward,
        )

    @classmethod
    def from_config(
        cls,
        env: EnvironmentConfig,
        data: DataConfig,
        *,
        max_examples: int,
        shuffle_seed: int | None,
        search_paths: Sequence[str],
    ) -> VerifiersSource:
        return cls(
            environment={
                "provider": env.provider,
                "id": env.id,
                "args": env.args,
                "max_turns": env.max_turns,
                "module": env.module,
                "auto_install": env.auto_install,
            },
            size=data.size,
            max_examples=max_examples,
            shuffle=data.shuffle,
            shuffle_seed=shuffle_seed,
            seed=data.seed,
            search_paths=search_paths,
        )

    def close(self) -> None:
        if self.reward is not None:
            self.reward.close()
