"""`[environment] provider = "verifiers"`: train on a verifiers environment.

    [environment]
    provider = "verifiers"
    id = "primeintellect/gsm8k"     # owner/name[@version] or a module name
    args = { split = "train" }      # passed to the environment
    max_turns = -1                  # -1: the environment's default
    auto_install = false            # true: `prime env install <id>` when missing

The environment's training examples become the data, and its scorer becomes
`data_source.reward` (a Reward-like object), so `[reward] type` is not used. retrain
samples ONE completion per prompt and scores it; multi-turn environments (tools, games)
are not rolled out turn by turn - a warning says so.

Supported verifiers versions (both were probed; see the tests):
- the classic API, verifiers 0.1.x - 0.3.x: the environment package exposes
  `load_environment(**args)` returning an Environment with a training `dataset`
  (`get_dataset()`; columns prompt / question / answer / info / task) and a `rubric`
  whose async `score_group(states)` / `score_rollout(state)` score a completion. We call
  the package's `load_environment` directly (what `vf.load_environment` does). These are
  the Prime Hub environments.
- the v1 API, verifiers 0.3.1+ (`verifiers.v1`; 0.4.0 ships only this): the package
  exports a `Taskset` subclass; `args` validate into its `TasksetConfig`; each `Task`
  becomes an example and `task.score(trace)` (its `@vf.reward` functions and judges,
  without a runtime) scores a one-turn trace holding the completion. An infinite taskset
  is cut at `[data] size` tasks.

An environment without a training dataset (evaluation-only: only `eval_dataset`, or a
taskset that yields nothing) fails fast with a DataError saying what to do instead.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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


def _find_module(name: str) -> str | None:
    # An installed package first (cheap); then a taskset shipped inside verifiers.
    for candidate in (name, f"verifiers.v1.tasksets.{name}"):
        try:
            if importlib.util.find_spec(candidate) is not None:
                return candidate
        except (ImportError, ValueError):
            continue
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
    env_id: str, search_paths: Sequence[str] = (), auto_install: bool = False
) -> Any:
    if not env_id:
        raise DataError("[environment] id is required when [environment] provider = 'verifiers'")
    for p in search_paths:
        if p and p not in sys.path:
            sys.path.insert(0, p)
    name = module_name(env_id)
    target = _find_module(name)
    if target is None and auto_install:
        install_environment(env_id)
        target = _find_module(name)
    if target is None:
        raise DataError(
            f"verifiers environment {env_id!r} is not installed (no module {name!r}). Install it "
            f"with `prime env install {env_id}`, set [environment] auto_install = true, or add "
            "the folder holding it to [plugins] search_paths"
        )
    try:
        return importlib.import_module(target)
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


def _classic_state(row: dict[str, Any], response: str, message_type: str) -> Any:
    try:
        from verifiers.types import State  # classic verifiers
    except ImportError:
        State = dict  # noqa: N806
    try:
        from verifiers.types import flatten_task_input
    except ImportError:
        flatten_task_input = None
    inp = {k: row[k] for k in ("prompt", "answer", "info", "example_id", "task") if k in row}
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
            state["task"] = row.get("task")
    completion: Any = (
        response if message_type == "completion" else [{"role": "assistant", "content": response}]
    )
    state["completion"] = completion
    state["responses"] = []
    state["trajectory"] = []
    state["turn"] = 1
    state["is_completed"] = True
    state["is_truncated"] = False
    state["timing"] = {}
    return state


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
        import inspect

        rollout = getattr(self.rubric, "score_rollout", None)
        if rollout is None and not hasattr(self.rubric, "score_group"):
            raise DataError(
                f"verifiers environment {env_id!r}: its rubric has neither score_group nor "
                "score_rollout"
            )
        self._rollout_params = set(inspect.signature(rollout).parameters) if rollout else set()
        self._loop = LoopThread("retrain-verifiers")

    async def _score_group(self, states: list[Any]) -> list[float]:
        """All completions of one example together (group reward functions need that)."""
        await self.rubric.score_group(states)
        return [float(s["reward"]) for s in states]

    async def _score_one(self, state: Any) -> list[float]:
        rubric = self.rubric
        if "completion" in self._rollout_params:  # verifiers <= 0.1: keywords, returns a score
            result = await rubric.score_rollout(
                prompt=state.get("prompt"),
                completion=state["completion"],
                answer=state.get("answer", ""),
                state=state,
                task=state.get("task", "default"),
                info=state.get("info", {}),
            )
            reward = result["reward"] if isinstance(result, dict) else result.reward
        else:
            await rubric.score_rollout(state)
            reward = state["reward"]
        return [float(reward)]

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> BatchScore:
        self._check_lengths(responses, examples)
        out = BatchScore(rewards=[0.0] * len(responses))
        groups: dict[Any, list[int]] = {}
        states = []
        for i, (response, example) in enumerate(zip(responses, examples)):
            meta = example.meta or {}
            if meta.get("source") != "verifiers" or meta.get("api") != "classic":
                raise DataError(
                    f"the {self.env_id!r} rubric scores examples from that environment only"
                )
            answer = extract_boxed(response)
            out.answers.append(answer)
            out.no_answer += answer is None
            states.append(_classic_state(meta["row"], response, self.message_type))
            groups.setdefault(meta.get("row_index", id(example)), []).append(i)
        if hasattr(self.rubric, "score_group"):
            # One call per example's group; a failure fails that group only.
            order = list(groups.values())
            coros = [self._score_group([states[i] for i in g]) for g in order]
        else:
            order = [[i] for i in range(len(states))]
            coros = [self._score_one(states[i]) for i in range(len(states))]
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
def _v1_examples(env_id: str, args: dict[str, Any], size: int) -> tuple[list[Example], Any]:
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
        view = taskset if taskset.bounded else taskset.take(max(1, int(size)))
        tasks = list(view)
    except Exception as exc:
        raise DataError(f"loading verifiers taskset {env_id!r} failed: {exc}") from exc
    if not tasks:
        raise _eval_only(env_id, "its taskset yields no tasks for these args")
    examples = []
    for task in tasks:
        data = task.data
        messages = None if isinstance(data.prompt, str) else _message_dicts(data.prompt)
        prompt = data.prompt if isinstance(data.prompt, str) else data.prompt_text
        if not prompt and not messages:
            raise DataError(
                f"verifiers taskset {env_id!r}: task {data.idx} has no prompt (the user opens "
                "the conversation); retrain needs a prompt to sample from"
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
        out = BatchScore()
        coros = []
        for response, example in zip(responses, examples):
            meta = example.meta or {}
            if meta.get("source") != "verifiers" or meta.get("api") != "v1":
                raise DataError(
                    f"the {self.env_id!r} task scorer scores examples from that taskset only"
                )
            answer = extract_boxed(response)
            out.answers.append(answer)
            out.no_answer += answer is None
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
        env_id = str(environment.get("id") or "")
        args = _parse_args(environment.get("args"))
        self.max_turns = int(environment.get("max_turns", -1) or -1)
        module = import_environment(
            env_id, search_paths, bool(environment.get("auto_install", False))
        )
        self.env_id = env_id
        self.env: Any = None
        if exports_v1_taskset(module):
            self.api = "v1"
            examples, self.env = _v1_examples(env_id, args, size)
            reward: Reward = TaskScoreReward(env_id)
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
            self._warn_multi_turn()
        else:
            raise DataError(
                f"module {module.__name__!r} for environment {env_id!r} is not a verifiers "
                "environment: it neither defines load_environment() (classic API) nor "
                "exports a Taskset subclass in __all__ (v1 API)"
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
                "auto_install": env.auto_install,
            },
            size=data.size,
            max_examples=max_examples,
            shuffle=data.shuffle,
            shuffle_seed=shuffle_seed,
            seed=data.seed,
            search_paths=search_paths,
        )

    def _warn_multi_turn(self) -> None:
        env_turns = getattr(self.env, "max_turns", 1)
        turns = self.max_turns if self.max_turns > 0 else env_turns
        if turns is not None and turns != 1 and type(self.env).__name__ != "SingleTurnEnv":
            logger.warning(
                "verifiers environment %r is multi-turn (max_turns=%s); retrain samples and "
                "scores a single completion per prompt, without environment responses",
                self.env_id,
                turns,
            )

    def close(self) -> None:
        if self.reward is not None:
            self.reward.close()
