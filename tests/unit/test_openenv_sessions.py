"""OpenEnv sessions as openenv's own server runs them, and what stops a run rather than
silently losing conversations: a reply whose values the action refuses is the model's
mistake (trained on), a server at its session limit stops the step with the fix, an
in-process class gets a thread per session (or its one thread), its async methods, a
check of its args and of its concurrency flag before the run, and a close that fails
keeps the episode. openenv cannot share the project's environment, so without it the
bodies run under .venv-openenv (scripts/openenv_venv.sh; CI builds it), once per file.

The multi-turn rollout's handling of an unusable environment needs no openenv and runs
here (the last test)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import openenv_server
import pytest
from openenv_server import serving

REPO = Path(__file__).resolve().parents[2]


def runs_here(test_name: str) -> bool:
    return openenv_server.runs_here(__file__, test_name)


GAMES = textwrap.dedent(
    """
    import asyncio
    import threading

    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    THREADS = []  # (instance id, what, thread name)


    class GuessAction(Action):
        guess: int


    class GuessObservation(Observation):
        prompt: str


    class GuessGame(Environment[GuessAction, GuessObservation, State]):
        '''Guess 3; one step. Records which thread ran what.'''

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self, fail_close: bool = False):
            super().__init__()
            self.fail_close = fail_close
            THREADS.append((id(self), "init", threading.current_thread().name))

        def reset(self, seed=None, episode_id=None, **kwargs):
            THREADS.append((id(self), "reset", threading.current_thread().name))
            return GuessObservation(prompt="Guess a number.", reward=0.25)

        def step(self, action, timeout_s=None, **kwargs):
            THREADS.append((id(self), "step", threading.current_thread().name))
            hit = action.guess == 3
            return GuessObservation(prompt="Done.", done=True, reward=1.0 if hit else 0.0)

        def close(self):
            THREADS.append((id(self), "close", threading.current_thread().name))
            if self.fail_close:
                raise RuntimeError("cleanup failed")

        @property
        def state(self):
            return State()


    class OneThreadGame(GuessGame):
        REQUIRES_SINGLE_THREAD_EXECUTOR = True


    class SharedStateGame(GuessGame):
        SUPPORTS_CONCURRENT_SESSIONS = False


    class AsyncOnlyGame(GuessGame):
        def reset(self, seed=None, episode_id=None, **kwargs):
            raise NotImplementedError("use reset_async")

        def step(self, action, timeout_s=None, **kwargs):
            raise NotImplementedError("use step_async")

        async def reset_async(self, seed=None, episode_id=None, **kwargs):
            await asyncio.sleep(0)
            return GuessObservation(prompt=f"Guess a number (seed {seed}).", reward=0.0)

        async def step_async(self, action, timeout_s=None, **kwargs):
            return GuessObservation(prompt="Done.", done=True, reward=float(action.guess == 3))


    one_session = create_app(
        GuessGame, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=1
    )
    """
)


@pytest.fixture
def games(tmp_path, monkeypatch):
    """The games as a fresh module on sys.path: (module name, module)."""
    name = f"guess_games_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(GAMES)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    return name, module


def source(environment: dict):
    from retrain.data.openenv_source import OpenEnvSource

    return OpenEnvSource({"max_turns": 2, **environment}, size=4, seed=7)


def play(src, replies: list[str], example: int = 0) -> float:
    """One episode, the model's replies scripted."""
    from retrain.multiturn import Reply

    said = iter(replies)

    async def ask(messages, tools=None):
        return Reply(next(said))

    turns = src.turn_environment
    return asyncio.run(turns.play(src.examples[example], ask))


def test_a_reply_the_action_refuses_ends_the_episode_as_the_models_mistake(request):
    if not runs_here("test_a_reply_the_action_refuses_ends_the_episode"):
        return
    name, _ = request.getfixturevalue("games")
    src = source({"id": f"{name}.GuessGame"})
    assert play(src, ["3"]) == 1.25  # reset's reward and the step's
    # text where the action wants an int: no step, the rewards so far, not an error
    assert play(src, ["I guess three"]) == 0.25


def test_each_in_process_session_keeps_to_one_thread_and_a_failed_close_keeps_the_episode(
    request,
):
    if not runs_here("test_each_in_process_session_keeps_to_one_thread"):
        return
    name, module = request.getfixturevalue("games")

    async def many(src, n):
        from retrain.multiturn import Reply

        async def ask(messages, tools=None):
            await asyncio.sleep(0.01)  # the sessions interleave
            return Reply("3")

        turns = src.turn_environment
        return await asyncio.gather(*(turns.play(e, ask) for e in src.examples[:n]))

    src = source({"id": f"{name}.GuessGame"})
    module.THREADS.clear()
    assert asyncio.run(many(src, 4)) == [1.25] * 4
    time.sleep(0.2)  # the closes run on the sessions' threads, not awaited
    by_env: dict = {}
    for env, what, thread in module.THREADS:
        by_env.setdefault(env, []).append((what, thread))
    assert len(by_env) == 4
    for calls in by_env.values():  # built, reset, stepped and closed on one thread each
        assert [w for w, _ in calls] == ["init", "reset", "step", "close"]
        assert len({t for _, t in calls}) == 1
    assert len({calls[0][1] for calls in by_env.values()}) == 4
    assert all(t != threading.current_thread().name for calls in by_env.values() for _, t in calls)

    one = source({"id": f"{name}.OneThreadGame"})
    module.THREADS.clear()
    assert asyncio.run(many(one, 4)) == [1.25] * 4
    time.sleep(0.2)
    assert len({t for _, _, t in module.THREADS}) == 1  # the class's one thread

    failing = source({"id": f"{name}.GuessGame", "args": {"fail_close": True}})
    assert play(failing, ["3"]) == 1.25  # logged; the episode stands


def test_async_overrides_are_awaited_and_the_seed_reaches_them(request):
    if not runs_here("test_async_overrides_are_awaited"):
        return
    name, _ = request.getfixturevalue("games")
    src = source({"id": f"{name}.AsyncOnlyGame"})
    from retrain.multiturn import Reply

    seen = []

    async def ask(messages, tools=None):
        seen.append(messages[0]["content"])
        return Reply("3")

    assert asyncio.run(src.turn_environment.play(src.examples[1], ask)) == 1.0
    assert seen == ["Guess a number (seed 8)."]  # [data] seed 7 + example 1


def test_what_fails_every_conversation_is_said_before_the_run(request):
    if not runs_here("test_what_fails_every_conversation_is_said"):
        return
    from retrain.errors import DataError

    name, _ = request.getfixturevalue("games")
    with pytest.raises(DataError, match="not marked SUPPORTS_CONCURRENT_SESSIONS"):
        source({"id": f"{name}.SharedStateGame"})
    with pytest.raises(DataError, match=r"\[environment\] args = \{'tries': 2\}: building"):
        source({"id": f"{name}.GuessGame", "args": {"tries": 2}})


@pytest.fixture
def one_session_server(games, tmp_path):
    """openenv's own server for GuessGame, one session at a time (its template's default)."""
    name, _ = games
    with serving(f"{name}:one_session", tmp_path) as url:
        yield url


def test_a_server_refusing_the_steps_sessions_stops_the_run_and_refused_values_do_not(
    request,
):
    if not runs_here("test_a_server_refusing_the_steps_sessions"):
        return
    from retrain.errors import EnvironmentUnusable
    from retrain.multiturn import Reply

    url = request.getfixturevalue("one_session_server")
    src = source({"base_url": url, "turn_timeout_s": 100, "args": {"seed": 5}})
    session = src.turn_environment.new_session()
    assert session.client._message_timeout == 130  # past [environment] turn_timeout_s
    # one session at a time: the model's refused values end its episode, not an error
    assert play(src, ["3"]) == 1.25
    assert play(src, ["three"]) == 0.25

    async def two():
        async def ask(messages, tools=None):
            await asyncio.sleep(0.5)  # both sessions open at once
            return Reply("3")

        turns = src.turn_environment
        return await asyncio.gather(
            *(turns.play(e, ask) for e in src.examples[:2]), return_exceptions=True
        )

    outcomes = asyncio.run(two())
    refused = [o for o in outcomes if isinstance(o, EnvironmentUnusable)]
    assert len(refused) == 1 and "max_concurrent_envs >= batch_size x group_size" in str(refused[0])


def test_an_unusable_environment_stops_the_multi_turn_step():
    """One conversation's EnvironmentUnusable fails the whole step (raised from the
    rollout), where any other failure fails that conversation only."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import build_tokenizer

    from retrain.data.prompts import PromptRenderer
    from retrain.errors import EnvironmentUnusable
    from retrain.logs.timer import PhaseTimer
    from retrain.multiturn import MultiTurnRollout
    from retrain.types import Example, SamplingParams

    class Env:
        env_id, max_turns, opens = "capped", 2, False

        def __init__(self, error):
            self.error, self.calls = error, 0

        async def play(self, example, ask):
            self.calls += 1
            if self.calls == 2:
                raise self.error
            return 1.0

        async def score(self, example, states):
            return [float(s) for s in states]

    class NoModel:
        def sample(self, prompts, n, params):
            raise AssertionError("no turn is asked for")

    tok = build_tokenizer()
    examples = [Example("q", "a")]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    rollout = MultiTurnRollout(
        NoModel(), Env(RuntimeError("one game broke")), PromptRenderer(tok), 0.5
    )
    groups, counters = rollout(examples, 3, params, PhaseTimer())
    assert groups[0].failed == [False, True, False] and counters["env_errors"] == 1
    unusable = EnvironmentUnusable("the server is at its session limit")
    rollout = MultiTurnRollout(NoModel(), Env(unusable), PromptRenderer(tok), 0.5)
    with pytest.raises(EnvironmentUnusable, match="session limit"):
        rollout(examples, 3, params, PhaseTimer())


def test_a_turns_batch_is_in_the_trajectories_order_whatever_order_they_answer_in():
    """Environments that answer out of order (threads, servers) do not reorder the
    batch: a row's random stream depends on its place in it, so the run would not
    repeat."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import build_tokenizer

    from retrain.data.prompts import PromptRenderer
    from retrain.logs.timer import PhaseTimer
    from retrain.multiturn import MultiTurnRollout
    from retrain.types import Example, Sample, SamplingParams

    class SlowFirst:
        env_id, max_turns, opens = "slow-first", 1, False

        def __init__(self):
            self.started = 0

        async def play(self, example, ask):
            k, self.started = self.started, self.started + 1
            await asyncio.sleep(0.05 * (4 - k))  # the last one started answers first
            await ask([{"role": "user", "content": f"conversation {k}"}])
            return float(k)

        async def score(self, example, states):
            return [float(s) for s in states]

    tok = build_tokenizer()

    class Recorder:
        def __init__(self):
            self.batches = []

        def sample(self, prompts, n, params):
            self.batches.append([tok.decode(p) for p in prompts])
            return [[Sample([tok.eos_token_id], [-0.5], "eos")] for _ in prompts]

    backend = Recorder()
    rollout = MultiTurnRollout(backend, SlowFirst(), PromptRenderer(tok), 0.5)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    rollout([Example("q", "a")], 4, params, PhaseTimer())
    (batch,) = backend.batches
    assert [int(text.split("conversation ")[1][0]) for text in batch] == [0, 1, 2, 3]
