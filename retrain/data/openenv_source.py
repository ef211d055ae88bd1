"""`[environment] provider = "openenv"`: train on an OpenEnv environment.

    [environment]
    provider = "openenv"
    base_url = "http://127.0.0.1:8000"   # a running OpenEnv server, or:
    id = "my_env.server.MyEnvironment"   # an Environment class run in-process
    args = {}                            # constructor kwargs (in-process) / reset kwargs

OpenEnv environments speak first: `reset()`'s observation is the opening user turn. Each
model reply becomes the environment's action: the text itself as the action's one
field when the action has one (besides `metadata`), else the reply parsed as a JSON
object of its fields. The step's observation is the next user turn; the episode ends
when `done`, or after `[environment] max_turns` model turns. The trajectory's reward is
the sum of the steps' rewards (correct above `[reward] correct_threshold`). A reply that
is not a valid action (missing fields, or values of the wrong type) ends the episode
with the rewards so far: the model's mistake, trained on. Example i of `[data] size`
resets with seed `[data] seed + i`; one session per trajectory, all of a step's at once.

A server (`base_url`) must accept that many sessions (openenv's `max_concurrent_envs` >=
batch_size x group_size); one at its limit stops the run with that fix. In-process, each
session is a fresh instance of the class, built, stepped and closed on its own thread
(one thread shared by all for a class that sets REQUIRES_SINGLE_THREAD_EXECUTOR), its
async reset/step when it overrides them, as openenv's own server runs it; a class not
marked SUPPORTS_CONCURRENT_SESSIONS is refused, as openenv's server refuses it more than
one session.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import itertools
import json
import logging
import typing
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from retrain.config.schema import FALLBACK_MAX_TURNS
from retrain.data.base import DataSource
from retrain.errors import DataError, EnvironmentUnusable
from retrain.types import Example

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'retrain[openenv]' (openenv 0.4.1)"
_OBS_SKIP = {"done", "reward", "metadata"}


def render_observation(obs: Any) -> str:
    """An observation as the user's turn: its one text field, else its fields as JSON."""
    data = obs.model_dump() if hasattr(obs, "model_dump") else dict(obs or {})
    fields = {k: v for k, v in data.items() if k not in _OBS_SKIP}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(fields) == 1 and len(texts) == 1:
        return texts[0]
    return json.dumps(fields, default=str)


def action_fields(schema: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(fields, required fields) of an action's JSON schema, `metadata` left out."""
    props = [k for k in (schema.get("properties") or {}) if k != "metadata"]
    required = [k for k in (schema.get("required") or []) if k != "metadata"]
    return props, required


def action_of(text: str, fields: list[str], required: list[str]) -> dict[str, Any] | None:
    """The model's reply as the action's fields; None when it is not a valid action."""
    single = required if len(required) == 1 else fields if len(fields) == 1 else []
    if len(single) == 1:
        return {single[0]: text.strip()}
    start, end = text.find("{"), text.rfind("}")
    try:
        value = json.loads(text[start : end + 1]) if start >= 0 else None
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or any(k not in value for k in required):
        return None
    return {k: v for k, v in value.items() if k in fields}


class InvalidAction(ValueError):
    """The model's reply is not a valid action (the environment refused its values)."""


class _ServerSession:
    """One WebSocket session on a running OpenEnv server (openenv's own client)."""

    def __init__(self, base_url: str, turn_timeout_s: float) -> None:
        from openenv.core.generic_client import GenericEnvClient

        # A step may take up to [environment] turn_timeout_s, which the rollout enforces
        # (counted as a timeout); the client's own limit (60 s by default) comes after it.
        self.base_url = base_url
        self.client = GenericEnvClient(base_url=base_url, message_timeout_s=turn_timeout_s + 30)

    async def reset(self, **kwargs: Any) -> tuple[Any, float, bool]:
        try:
            await self.client.__aenter__()
            r = await self.client.reset(**kwargs)
        except Exception as exc:
            refusal = await self._refusal(exc)
            if refusal is None or "CAPACITY_REACHED" not in refusal:
                raise
            raise EnvironmentUnusable(
                f"[environment] base_url = {self.base_url!r}: the OpenEnv server refused a "
                f"session ({refusal}). A step opens one session per conversation, all at once "
                "([training] batch_size x group_size). Fix: serve the environment with "
                "max_concurrent_envs >= batch_size x group_size (create_app(..., "
                "max_concurrent_envs=N), its class marked SUPPORTS_CONCURRENT_SESSIONS = True)"
            ) from exc
        return r.observation, float(r.reward or 0.0), bool(r.done)

    async def _refusal(self, exc: BaseException) -> str | None:
        """The server's error for a session it refused at once: openenv's client raises
        it ("Server error: ... (code: X)"), or, when the server had closed the socket
        before the reset was sent, fails the send; the error is then still unread."""
        if isinstance(exc, RuntimeError):
            return str(exc)
        ws = getattr(self.client, "_ws", None)  # (openenv's client keeps its socket there)
        if ws is None or "ConnectionClosed" not in type(exc).__name__:
            return None
        try:
            data = json.loads(await asyncio.wait_for(ws.recv(), 1.0))["data"]
            return f"{data['message']} (code: {data['code']})"
        except Exception:
            return None

    async def step(self, action: dict[str, Any]) -> tuple[Any, float, bool]:
        try:
            r = await self.client.step(action)
        except RuntimeError as exc:  # the action's values failed the server's validation
            if "VALIDATION_ERROR" in str(exc):
                raise InvalidAction(str(exc)) from exc
            raise
        return r.observation, float(r.reward or 0.0), bool(r.done)

    async def close(self) -> None:
        await self.client.close()


def _overrides(env: Any, name: str) -> bool:
    """Whether the environment's class overrides the base Environment's `name` (openenv's
    server then awaits the async method instead of running the sync one)."""
    from openenv.core.env_server.interfaces import Environment

    return getattr(type(env), name, None) is not getattr(Environment, name, None)


def _accepted(method: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs `method` accepts (all with **kwargs), as openenv's server passes them."""
    params = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


_SESSION_NUMBERS = itertools.count()  # names each session's thread


def _closed(future: Future) -> None:
    exc = future.exception()
    if exc is not None:  # best effort, as openenv's server closes: the episode stands
        logger.warning("closing an OpenEnv environment failed: %s: %s", type(exc).__name__, exc)


class _InProcessSession:
    """A fresh instance of an OpenEnv `Environment` class on a thread of its own (or the
    class's one shared thread), built, stepped and closed there, as openenv's server runs
    a session; async reset/step on the event loop when the class overrides them."""

    def __init__(self, cls: type, action_cls: type, args: dict[str, Any], shared: Executor | None):
        self.cls, self.action_cls, self.args = cls, action_cls, args
        self.shared = shared is not None
        self.executor = shared or ThreadPoolExecutor(
            1, thread_name_prefix=f"retrain-openenv-{next(_SESSION_NUMBERS)}"
        )
        self.env: Any = None

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def reset(self, **kwargs: Any) -> tuple[Any, float, bool]:
        self.env = await self._run(self.cls, **self.args)
        if _overrides(self.env, "reset_async"):
            obs = await self.env.reset_async(**_accepted(self.env.reset_async, kwargs))
        else:
            obs = await self._run(self.env.reset, **_accepted(self.env.reset, kwargs))
        return obs, float(obs.reward or 0.0), bool(obs.done)

    async def step(self, action: dict[str, Any]) -> tuple[Any, float, bool]:
        from pydantic import ValidationError

        try:
            act = self.action_cls(**action)
        except ValidationError as exc:  # e.g. text where the action wants an int
            raise InvalidAction(str(exc)) from exc
        if _overrides(self.env, "step_async"):
            obs = await self.env.step_async(act)
        else:
            obs = await self._run(self.env.step, act)
        return obs, float(obs.reward or 0.0), bool(obs.done)

    async def close(self) -> None:
        """Queued on the session's thread behind a step still running (one the rollout
        timed out), not awaited: a step that never returns cannot hold up the rollout."""
        if self.env is not None:
            self.executor.submit(self.env.close).add_done_callback(_closed)
        if not self.shared:
            self.executor.shutdown(wait=False)


def _action_class(cls: type) -> type | None:
    """The `ActT` of `class MyEnv(Environment[MyAction, MyObservation, State])`."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and hasattr(args[0], "model_json_schema"):
                return args[0]
    return None


def load_environment_class(path: str) -> tuple[type, type]:
    """(Environment class, its Action class) from `[environment] id = "pkg.mod.Cls"`."""
    mod, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), attr) if mod else None
    except (ImportError, AttributeError) as exc:
        raise DataError(
            f"[environment] id = {path!r}: cannot import it ({exc}). Give the dotted path of "
            "an OpenEnv Environment class, with its folder in [plugins] search_paths"
        ) from exc
    action = _action_class(cls) if isinstance(cls, type) else None
    if action is None or not hasattr(cls, "reset") or not hasattr(cls, "step"):
        raise DataError(
            f"[environment] id = {path!r} is not an OpenEnv Environment class declared as "
            "Environment[MyAction, MyObservation, MyState] (its action type is read from that)"
        )
    return cls, action


def _check_in_process(cls: type, path: str, args: dict[str, Any]) -> None:
    """What would fail every conversation, said before the run: a class whose instances
    may share state (not SUPPORTS_CONCURRENT_SESSIONS: openenv's own server gives it one
    session at most), and constructor args it does not take (one instance is built and
    closed here, so `explain` and `doctor` say it)."""
    if not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
        raise DataError(
            f"[environment] id = {path!r}: a step runs one instance per conversation at once, "
            "but the class is not marked SUPPORTS_CONCURRENT_SESSIONS (its instances may share "
            "state; openenv's own server refuses it more than one session). Fix: set "
            "SUPPORTS_CONCURRENT_SESSIONS = True on the class if its instances share nothing"
        )
    try:
        env = cls(**args)
    except Exception as exc:
        raise DataError(
            f"[environment] args = {args!r}: building {path} failed: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        env.close()
    except Exception as exc:
        logger.warning("closing a probe instance of %s failed: %s", path, exc)


def _server_schema(base_url: str) -> dict[str, Any]:
    """The action's JSON schema from the server's GET /schema."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/schema", timeout=30) as reply:
            return json.loads(reply.read())["action"]
    except Exception as exc:
        raise DataError(
            f"[environment] base_url = {base_url!r}: no OpenEnv server answers ({exc}). Start "
            "it (e.g. `uvicorn my_env.server.app:app --port 8000`) or fix the URL"
        ) from exc


class OpenEnvTurns:
    """The TurnEnvironment (retrain.multiturn) of an OpenEnv environment."""

    def __init__(self, env_id: str, session: Any, schema: dict, args: dict, max_turns: int):
        self.env_id, self.new_session, self.args = env_id, session, args  # args: reset's
        self.fields, self.required = action_fields(schema)
        self.max_turns = max_turns if max_turns > 0 else FALLBACK_MAX_TURNS

    async def play(self, example: Example, ask: Any) -> float:
        session = self.new_session()
        try:
            # args given for reset (a server's) win over the example's seed
            obs, total, done = await session.reset(**{"seed": example.meta["seed"], **self.args})
            messages = [{"role": "user", "content": render_observation(obs)}]
            while not done:
                turn = await ask(list(messages))
                if turn is None:
                    break
                reply = turn.text
                action = action_of(reply, self.fields, self.required)
                if action is None:  # not an action: the episode ends on the model's mistake
                    break
                try:
                    obs, reward, done = await session.step(action)
                except InvalidAction:  # fields right, values refused: the model's mistake too
                    break
                total += reward
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": render_observation(obs)},
                ]
            return total
        finally:
            try:
                await session.close()
            except Exception as exc:  # best effort, as openenv closes: the episode stands
                logger.warning("closing an OpenEnv session failed: %s: %s", type(exc).__name__, exc)

    async def score(self, example: Example, states: Any) -> list[float]:
        return [float(s) for s in states]


class OpenEnvSource(DataSource):
    name = "openenv"
    reward_hint = "openenv"
    opens = True  # reset()'s observation opens every conversation

    def __init__(self, environment: dict[str, Any], size: int, seed: int = 0) -> None:
        try:
            importlib.import_module("openenv.core")
        except ImportError as exc:
            raise DataError(f"provider 'openenv' needs openenv: {INSTALL_HINT}") from exc
        args = dict(environment.get("args") or {})
        max_turns = int(environment.get("max_turns", -1) or -1)
        timeout = float(environment.get("turn_timeout_s") or 60.0)
        base_url, path = environment.get("base_url") or "", environment.get("id") or ""
        if base_url:  # args are reset() kwargs
            self.api, env_id = "openenv-server", base_url
            schema = _server_schema(base_url)
            self.turn_environment = OpenEnvTurns(
                env_id, lambda: _ServerSession(base_url, timeout), schema, args, max_turns
            )
        else:  # args are the constructor's kwargs
            self.api, env_id = "openenv-in-process", path
            cls, action = load_environment_class(path)
            _check_in_process(cls, path, args)
            shared = (
                ThreadPoolExecutor(1, thread_name_prefix="retrain-openenv")
                if getattr(cls, "REQUIRES_SINGLE_THREAD_EXECUTOR", False)
                else None
            )
            self.turn_environment = OpenEnvTurns(
                env_id,
                lambda: _InProcessSession(cls, action, args, shared),
                action.model_json_schema(),
                {},
                max_turns,
            )
        examples = [
            Example(prompt="", reference="", meta={"source": "openenv", "seed": seed + i})
            for i in range(max(1, int(size)))
        ]
        super().__init__(examples, name=f"openenv:{env_id}", shuffle=False, reward=None)
