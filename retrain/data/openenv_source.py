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
is not a valid action ends the episode with the rewards so far: the model's mistake,
trained on. Example i of `[data] size` resets with seed i; one session (a WebSocket to
the server, or a fresh instance) per trajectory.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import typing
from typing import Any

from retrain.config.schema import FALLBACK_MAX_TURNS
from retrain.data.base import DataSource
from retrain.errors import DataError
from retrain.types import Example

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


class _ServerSession:
    """One WebSocket session on a running OpenEnv server (openenv's own client)."""

    def __init__(self, base_url: str) -> None:
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=base_url)

    async def reset(self, **kwargs: Any) -> tuple[Any, float, bool]:
        await self.client.__aenter__()
        r = await self.client.reset(**kwargs)
        return r.observation, float(r.reward or 0.0), bool(r.done)

    async def step(self, action: dict[str, Any]) -> tuple[Any, float, bool]:
        r = await self.client.step(action)
        return r.observation, float(r.reward or 0.0), bool(r.done)

    async def close(self) -> None:
        await self.client.close()


class _InProcessSession:
    """A fresh instance of an OpenEnv `Environment` class, stepped off the event loop."""

    def __init__(self, cls: type, action_cls: type, args: dict[str, Any]) -> None:
        self.env, self.action_cls = cls(**args), action_cls

    async def reset(self, **kwargs: Any) -> tuple[Any, float, bool]:
        obs = await asyncio.to_thread(self.env.reset, **kwargs)
        return obs, float(obs.reward or 0.0), bool(obs.done)

    async def step(self, action: dict[str, Any]) -> tuple[Any, float, bool]:
        obs = await asyncio.to_thread(self.env.step, self.action_cls(**action))
        return obs, float(obs.reward or 0.0), bool(obs.done)

    async def close(self) -> None:
        await asyncio.to_thread(self.env.close)


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
        self.env_id, self.new_session, self.args = env_id, session, args
        self.fields, self.required = action_fields(schema)
        self.max_turns = max_turns if max_turns > 0 else FALLBACK_MAX_TURNS

    async def play(self, example: Example, ask: Any) -> float:
        session = self.new_session()
        try:
            obs, total, done = await session.reset(seed=example.meta["seed"], **self.args)
            messages = [{"role": "user", "content": render_observation(obs)}]
            while not done:
                turn = await ask(list(messages))
                if turn is None:
                    break
                reply = turn.text
                action = action_of(reply, self.fields, self.required)
                if action is None:  # not an action: the episode ends on the model's mistake
                    break
                obs, reward, done = await session.step(action)
                total += reward
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": render_observation(obs)},
                ]
            return total
        finally:
            await session.close()

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
        base_url, path = environment.get("base_url") or "", environment.get("id") or ""
        if base_url:  # args are reset() kwargs
            self.api, env_id = "openenv-server", base_url
            schema = _server_schema(base_url)
            self.turn_environment = OpenEnvTurns(
                env_id, lambda: _ServerSession(base_url), schema, args, max_turns
            )
        else:  # args are the constructor's kwargs
            self.api, env_id = "openenv-in-process", path
            cls, action = load_environment_class(path)
            self.turn_environment = OpenEnvTurns(
                env_id,
                lambda: _InProcessSession(cls, action, args),
                action.model_json_schema(),
                {},
                max_turns,
            )
        examples = [
            Example(prompt="", reference="", meta={"source": "openenv", "seed": seed + i})
            for i in range(max(1, int(size)))
        ]
        super().__init__(examples, name=f"openenv:{env_id}", shuffle=False, reward=None)
