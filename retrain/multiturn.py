"""Multi-turn rollouts: the model and an environment take turns until the environment
is done or `max_turns` model turns were sampled; then the environment scores the whole
conversation.

One trajectory is ONE token sequence after the example's prompt: model turn 1, the
environment's reply (rendered with the chat template), model turn 2, ... Each turn's
prompt is the previous turn's tokens plus the environment's new tokens, so an engine
with prefix caching reuses the shared prefix, and what the model is trained on is exactly
what it was sampled on. `loss_mask` marks the model's tokens; the environment's tokens
are context only (logprob 0, advantage 0, out of the loss).

Per step every trajectory of every group runs as one asyncio task; the environment's
work runs concurrently, and the model's turns are sampled with ONE batched
`backend.sample(prompts, 1, params)` call per round, across every trajectory that is
waiting for its next turn. An environment that raises, outlives `turn_timeout_s` or
hands back malformed messages fails that trajectory only: reward 0, not trained on,
counted in the metrics, and the first traceback is logged.

The environment side is a `TurnEnvironment` (retrain/data/verifiers.py adapts
verifiers' classic MultiTurnEnv and its v1 Env.run API to it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from retrain.errors import DataError, EnvironmentUnusable
from retrain.logs.timer import PhaseTimer
from retrain.rewards.base import LoopThread
from retrain.rewards.boxed import extract_boxed
from retrain.tool_calls import ToolCall, format_of, supported
from retrain.types import Example, GroupRollout, Sample, SamplingParams

logger = logging.getLogger("retrain.multiturn")

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Reply:
    """The model's turn as the environment reads it: its text (without the tool calls,
    when tools were offered) and the tool calls parsed from its tokens."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed_calls: int = 0  # calls begun in the tool-call format but not readable
    cut_short: bool = False  # the turn ended at [training] max_tokens, not at a stop token


# The model's next turn: called with the conversation so far (the environment's newest
# messages last) and the tools on offer (OpenAI function schemas; None: no tools);
# returns the model's reply, or None when `max_turns` is reached.
AskModel = Callable[..., Awaitable[Reply | None]]


class MalformedMessages(ValueError):
    """The environment handed back something that is not a list of chat messages."""


class TurnEnvironment(Protocol):
    """What the multi-turn rollout needs of an environment."""

    env_id: str
    max_turns: int  # the cap on model turns per trajectory (>= 1)

    async def play(self, example: Example, ask: AskModel) -> Any:
        """Run one conversation, calling `ask` with the whole conversation so far (the
        model's earlier replies included, as assistant messages) for each model turn;
        returns the environment's state for `score`."""

    async def score(self, example: Example, states: Sequence[Any]) -> list[float]:
        """Rewards of one group's finished conversations (same example)."""


def check_messages(messages: Any) -> Messages:
    """`messages` as plain {"role", "content"} dicts; MalformedMessages otherwise."""
    if not isinstance(messages, list) or not messages:
        raise MalformedMessages(f"expected a non-empty list of messages, got {messages!r:.200}")
    out = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [
                p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content
            ]
            content = "\n".join(t for t in texts if t)
        if role == "assistant" and content is None:  # a reply that only called tools
            content = ""
        if role not in ("system", "user", "assistant", "tool") or not isinstance(content, str):
            raise MalformedMessages(f"not a chat message: {m!r:.200}")
        message: dict[str, Any] = {"role": str(role), "content": content}
        call_id = m.get("tool_call_id") if isinstance(m, dict) else getattr(m, "tool_call_id", None)
        if role == "tool" and call_id:  # templates pair a result with its call by id
            message["tool_call_id"] = str(call_id)
        out.append(message)
    return out


# ---------------------------------------------------------------- tokens


@dataclass
class Trajectory:
    """One conversation's tokens after the prompt, and what the metrics need."""

    example: Example
    group: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    stop_reason: str = "eos"
    truncated: bool = False  # stopped by max_turns
    error: str | None = None  # "error" | "timeout" | "malformed"
    state: Any = None
    replies: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # offered at the first turn, kept throughout
    tool_calls: int = 0
    malformed_calls: int = 0

    def add_model_turn(self, sample: Sample, reply: Reply) -> None:
        n = len(sample)
        self.ids += sample.token_ids.tolist()
        self.mask += [True] * n
        self.logprobs += sample.logprobs.tolist()
        ent = sample.entropies if sample.entropies is not None else np.zeros(n)
        self.entropies += ent.tolist()
        self.turns += 1
        self.stop_reason = sample.stop_reason
        self.replies.append(reply.text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.text, "turn": self.turns}
        if reply.tool_calls:
            message["tool_calls"] = [c.openai() for c in reply.tool_calls]
            self.tool_calls += len(reply.tool_calls)
        self.malformed_calls += reply.malformed_calls
        self.transcript.append(message)

    def add_env_tokens(self, ids: Sequence[int], messages: Messages) -> None:
        self.ids += list(ids)
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.entropies += [0.0] * len(ids)
        for m in messages:
            self.transcript.append({**m, "turn": self.turns})

    def open_with(self, prompt_ids: list[int]) -> None:
        """The environment spoke first: the prompt is its opening, rendered."""
        self.prompt_ids = list(prompt_ids)

    def split_prompt(self, keep: int) -> None:
        """Keep the first `keep` prompt tokens (the group's shared prompt); the rest of
        this trajectory's opening becomes environment tokens (context, out of the loss)."""
        tail = self.prompt_ids[keep:]
        self.prompt_ids = self.prompt_ids[:keep]
        n = len(tail)
        self.ids = tail + self.ids
        self.mask = [False] * n + self.mask
        self.logprobs = [0.0] * n + self.logprobs
        self.entropies = [0.0] * n + self.entropies

    def sample(self, with_entropies: bool) -> Sample:
        mask = np.asarray(self.mask, dtype=np.bool_)
        if self.error is not None:  # a failed conversation is never trained on
            mask = np.zeros_like(mask)
        return Sample(
            self.ids,
            self.logprobs,
            self.stop_reason,
            np.asarray(self.entropies) if with_entropies else None,
            loss_mask=mask,
        )


class ChatTokens:
    """The chat template as token deltas: what the environment's messages add to a
    trajectory, so the next prompt is exactly the previous tokens plus new ones."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "multi-turn environments need a tokenizer with a chat template (the "
                "conversation is rendered with it); pick an instruct/chat model"
            )
        self.tokenizer = tokenizer
        self.eos_id = getattr(tokenizer, "eos_token_id", None)

    def render(self, messages: Messages, generation_prompt: bool, tools: Any = None) -> str:
        # tools only when offered: some templates change their system prompt on tools=[]
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )
        return text if isinstance(text, str) else text[0]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def env_delta(
        self,
        prompt_ids: Sequence[int],
        ids: Sequence[int],
        history: Messages,
        new: Messages,
        tools: Any = None,
    ) -> list[int]:
        """Token ids that follow `prompt_ids + ids` (the conversation `history` so far,
        ending with the model's turn) when the environment adds `new`: the end of the
        model's turn the template adds (e.g. a newline after the end-of-turn token),
        the new messages, and the next generation prompt."""
        full = self.render(history + new, generation_prompt=True, tools=tools)
        so_far = self.tokenizer.decode(
            list(prompt_ids) + list(ids),
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        if full.startswith(so_far):  # the usual case: the sampled text is a prefix
            return self.encode(full[len(so_far) :])
        # The model's turn does not render back to itself (stopped by length, or the
        # template rewrites earlier turns): close it and append what the template adds.
        closed = self.render(history, generation_prompt=False, tools=tools)
        if not full.startswith(closed):
            raise DataError(
                "the chat template is not prefix-consistent across turns (rendering the "
                "conversation with a new message changes earlier text), so a multi-turn "
                "trajectory cannot be one token sequence; use a model whose template keeps "
                "earlier turns unchanged"
            )
        close = (
            [self.eos_id] if self.eos_id is not None and (not ids or ids[-1] != self.eos_id) else []
        )
        # and what the template writes after its end-of-turn token (e.g. a newline), which
        # the context would otherwise lack from this turn on
        eos_text = self.tokenizer.decode([self.eos_id]) if self.eos_id is not None else ""
        after = closed[closed.rfind(eos_text) + len(eos_text) :] if eos_text in closed else ""
        return close + self.encode(after + full[len(closed) :])


# ---------------------------------------------------------------- one step


@dataclass
class _Waiting:
    trajectory: Trajectory
    prompt: list[int]
    reply: asyncio.Future


@dataclass
class StepStats:
    sampling_s: float = 0.0
    environment_s: float = 0.0
    scoring_s: float = 0.0
    sampler_calls: int = 0
    template_fallbacks: int = 0
    unusable: EnvironmentUnusable | None = None  # the first: it stops the run


@dataclass
class MultiTurnRollout:
    """The multi-turn RolloutFn (retrain.rollout): the same call as the single-turn
    Rollout, the same GroupRollout records (with loss masks and transcripts)."""

    backend: Any
    environment: TurnEnvironment
    renderer: Any  # PromptRenderer: the first prompt is tokenised exactly as single-turn
    correct_above: float
    turn_timeout_s: float = 60.0
    loop: LoopThread = field(default_factory=lambda: LoopThread("retrain-multiturn"))
    _logged: bool = False

    def __post_init__(self) -> None:
        self.chat = ChatTokens(self.renderer.tokenizer)
        self.tool_format = format_of(self.renderer.tokenizer)

    def __call__(
        self,
        examples: Sequence[Example],
        group_size: int,
        params: SamplingParams,
        timer: PhaseTimer,
    ) -> tuple[list[GroupRollout], dict[str, float]]:
        prompts = [self.renderer.encode(e) for e in examples]
        trajectories = [
            Trajectory(e, gi, p)
            for gi, (e, p) in enumerate(zip(examples, prompts))
            for _ in range(group_size)
        ]
        stats = StepStats()
        (result,) = self.loop.gather([self._run(trajectories, params, stats)])
        if isinstance(result, BaseException):
            raise result
        if stats.unusable is not None:
            raise stats.unusable
        rewards = result
        for phase, seconds in (
            ("sampling", stats.sampling_s),
            ("environment", stats.environment_s),
            ("scoring", stats.scoring_s),
        ):
            timer.add(phase, seconds)
        groups = self._groups(examples, prompts, trajectories, rewards, params.return_entropy)
        return groups, self._counters(trajectories, stats)

    async def _run(self, trajectories: list[Trajectory], params, stats: StepStats) -> list[float]:
        queue: list[_Waiting] = []
        changed = asyncio.Event()
        tasks = [asyncio.ensure_future(self._play(t, queue, changed, stats)) for t in trajectories]
        order = {id(t): i for i, t in enumerate(trajectories)}
        turn = 0
        while True:
            start = time.perf_counter()
            await self._settle(trajectories, tasks, queue, changed)
            stats.environment_s += time.perf_counter() - start
            if not queue:
                break
            # in the trajectories' order, not the order their environments answered in (a
            # thread's timing): a row's random stream depends on its place in the batch
            batch, queue[:] = sorted(queue, key=lambda w: order[id(w.trajectory)]), []
            await self._sample(batch, replace(params, seed=_turn_seed(params.seed, turn)), stats)
            turn += 1
        start = time.perf_counter()
        rewards = await self._score(trajectories)
        stats.scoring_s += time.perf_counter() - start
        return rewards

    async def _settle(self, trajectories, tasks, queue: list[_Waiting], changed) -> None:
        """Wait until every live conversation is waiting for the model or finished;
        those still busy after `turn_timeout_s` fail with a timeout."""
        deadline = time.perf_counter() + self.turn_timeout_s
        while True:
            waiting = {id(w.trajectory) for w in queue}
            busy = [
                task
                for t, task in zip(trajectories, tasks)
                if not task.done() and id(t) not in waiting
            ]
            if not busy:
                return
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                for t, task in zip(trajectories, tasks):
                    if task in busy:
                        self._fail(
                            t,
                            "timeout",
                            TimeoutError(
                                f"the environment took over {self.turn_timeout_s:g} s "
                                "([environment] turn_timeout_s) to answer a turn"
                            ),
                        )
                        task.cancel()
                await asyncio.gather(*busy, return_exceptions=True)
                return
            changed.clear()
            waiter = asyncio.ensure_future(changed.wait())
            await asyncio.wait(
                [waiter, *busy], timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            waiter.cancel()

    async def _sample(
        self, batch: list[_Waiting], params: SamplingParams, stats: StepStats
    ) -> None:
        start = time.perf_counter()
        try:
            # One batched call for every waiting conversation; off the loop's thread,
            # since an engine may run its own event loop.
            samples = await asyncio.to_thread(
                self.backend.sample, [w.prompt for w in batch], 1, params
            )
        except BaseException as exc:
            for w in batch:
                w.reply.set_exception(exc)
            raise
        finally:
            stats.sampling_s += time.perf_counter() - start
            stats.sampler_calls += 1
        for w, group in zip(batch, samples, strict=True):
            w.reply.set_result(group[0])

    async def _play(self, t: Trajectory, queue: list[_Waiting], changed, stats: StepStats) -> None:
        env = self.environment
        # The conversation as retrain renders it: the prompt's messages exactly as the
        # first prompt was tokenised, then each model reply and each new env message.
        history: Messages = self.renderer.messages(t.example)
        seen = 0  # how many of the environment's messages the trajectory holds

        async def ask(messages: Messages, tools: Any = None) -> Reply | None:
            nonlocal seen
            messages = check_messages(messages)
            if t.turns >= env.max_turns:
                t.truncated = True
                for m in messages[seen + 1 :]:  # the reply the model never answered
                    t.transcript.append({**m, "turn": t.turns})
                return None
            if t.turns == 0:
                self._open(t, messages, history, tools)
                prompt = list(t.prompt_ids)
            else:
                # the environment's messages after the model's last reply
                new = messages[seen + 1 :]
                if not new:
                    raise MalformedMessages("the environment asked for a turn without replying")
                delta = self.chat.env_delta(t.prompt_ids, t.ids, history, new, t.tools)
                t.add_env_tokens(delta, new)
                history.extend(new)
                prompt = t.prompt_ids + t.ids
            reply_future: asyncio.Future = asyncio.get_running_loop().create_future()
            queue.append(_Waiting(t, prompt, reply_future))
            changed.set()
            sample = await reply_future
            reply = self._reply(sample, t)
            t.add_model_turn(sample, reply)
            history.append(_assistant(reply))
            seen = len(messages)
            return reply

        try:
            t.state = await env.play(t.example, ask)
            # an environment that enforces max_turns itself (classic) says so on its state
            if getattr(env, "truncated", None) is not None and env.truncated(t.state):
                t.truncated = True
        except asyncio.CancelledError:
            if t.error is None:
                raise
        except MalformedMessages as exc:
            self._fail(t, "malformed", exc)
        except EnvironmentUnusable as exc:
            self._fail(t, "error", exc)
            stats.unusable = stats.unusable or exc
        except Exception as exc:
            self._fail(t, "error", exc)
        finally:
            changed.set()

    def _open(self, t: Trajectory, messages: Messages, history: Messages, tools: Any) -> None:
        """The first turn's prompt: the example's (as single-turn tokenises it), or the
        environment's opening messages; rendered with the tools when it offers any."""
        if tools:
            if self.tool_format is None:
                raise DataError(
                    f"environment {self.environment.env_id!r} offers tools, but the model's chat "
                    f"template has no tool-call format retrain can parse (supported: "
                    f"{supported()}); pick a model whose chat template supports tools"
                )
            t.tools = list(tools)
        opening = _spoken_first(messages, history)
        if opening is not None:  # the environment opened: its messages are the prompt
            history[:] = opening
            t.transcript.extend({**m, "turn": 0} for m in opening)
        if opening is not None or t.tools:
            t.open_with(self.chat.encode(self.chat.render(history, True, t.tools)))

    def _reply(self, sample: Sample, t: Trajectory) -> Reply:
        """The sampled turn as the environment reads it; with tools on offer, the calls
        are parsed from the tokens in the template's own format (special tokens kept:
        some formats open with one) and given ids the results can name."""
        tok = self.renderer.tokenizer
        cut_short = sample.stop_reason == "length"
        if not t.tools or self.tool_format is None:
            return Reply(
                tok.decode(sample.token_ids, skip_special_tokens=True), cut_short=cut_short
            )
        ids = list(sample.token_ids)
        if ids and ids[-1] == self.chat.eos_id:  # the stop token, which
            ids = ids[:-1]  # would otherwise end the last call's arguments ("{...}</s>")
        raw = tok.decode(ids, skip_special_tokens=False)
        parsed = self.tool_format.parse(raw)
        content = parsed.content
        for special in getattr(tok, "all_special_tokens", []):
            content = content.replace(special, "")
        calls = [
            ToolCall(c.name, c.arguments, c.id or f"call_{t.turns + 1}_{i}")
            for i, c in enumerate(parsed.calls)
        ]
        return Reply(content.strip(), calls, parsed.malformed, cut_short)

    async def _score(self, trajectories: list[Trajectory]) -> list[float]:
        """Each group's finished conversations scored together (group rubrics need that);
        a failed conversation scores 0 and a scoring failure fails its group."""
        by_group: dict[int, list[Trajectory]] = {}
        for t in trajectories:
            by_group.setdefault(t.group, []).append(t)
        rewards = {id(t): 0.0 for t in trajectories}

        async def one(members: list[Trajectory]) -> None:
            ok = [t for t in members if t.error is None]
            if not ok:
                return
            try:
                values = await asyncio.wait_for(
                    self.environment.score(ok[0].example, [t.state for t in ok]),
                    self.turn_timeout_s,
                )
            except Exception as exc:
                for t in ok:
                    self._fail(t, "score_error", exc)
                return
            for t, v in zip(ok, values, strict=True):
                rewards[id(t)] = float(v)

        await asyncio.gather(*(one(m) for m in by_group.values()))
        return [rewards[id(t)] for t in trajectories]

    def _fail(self, t: Trajectory, kind: str, exc: BaseException) -> None:
        t.error = kind
        t.transcript.append(
            {"role": "error", "content": f"{type(exc).__name__}: {exc}", "turn": t.turns}
        )
        if not self._logged:  # the first traceback only; later failures are counted
            self._logged = True
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            logger.warning(
                "a conversation with environment %r failed (%s); it scores 0 and is not "
                "trained on (further failures are counted, not logged):\n%s",
                self.environment.env_id,
                kind,
                tb.rstrip(),
            )

    def _groups(
        self, examples, prompts, trajectories, rewards, with_entropies
    ) -> list[GroupRollout]:
        groups = []
        for gi, example in enumerate(examples):
            members = [(t, r) for t, r in zip(trajectories, rewards) if t.group == gi]
            prompt = _shared_prompt([t for t, _ in members])
            texts = [self._text(t) for t, _ in members]
            answers = [extract_boxed(t.replies[-1]) if t.replies else None for t, _ in members]
            rs = [r for _, r in members]
            groups.append(
                GroupRollout(
                    example,
                    prompt,
                    [t.sample(with_entropies) for t, _ in members],
                    texts,
                    rs,
                    answers,
                    [r > self.correct_above for r in rs],
                    transcripts=[t.transcript for t, _ in members],
                    failed=[t.error is not None for t, _ in members],
                )
            )
        return groups

    def _text(self, t: Trajectory) -> str:
        # The whole conversation after the prompt, turn markers included.
        return self.renderer.tokenizer.decode(t.ids, skip_special_tokens=False)

    @staticmethod
    def _counters(trajectories: list[Trajectory], stats: StepStats) -> dict[str, float]:
        n = max(1, len(trajectories))
        turns = [t.turns for t in trajectories]
        errors = [t.error for t in trajectories]
        return {
            "reward_errors": float(errors.count("score_error")),
            "reward_timeouts": 0.0,
            "turns_mean": float(np.mean(turns)) if turns else 0.0,
            "turns_max": float(max(turns, default=0)),
            "truncated_max_turns_rate": sum(t.truncated for t in trajectories) / n,
            "env_errors": float(errors.count("error")),
            "env_timeouts": float(errors.count("timeout")),
            "env_malformed": float(errors.count("malformed")),
            "sampler_calls": float(stats.sampler_calls),
            "tool_calls": float(sum(t.tool_calls for t in trajectories)),
            "tool_calls_malformed": float(sum(t.malformed_calls for t in trajectories)),
        }

    def close(self) -> None:
        """Stop the event loop the conversations run on."""
        self.loop.close()


def _assistant(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [c.openai() for c in reply.tool_calls]
    return message


def _spoken_first(messages: Messages, history: Messages) -> Messages | None:
    """The conversation the environment opened with, when it is not the example's prompt
    (an OpenEnv reset observation, a v1 Env's message before the model's first turn, a
    task without a prompt); None when the example's rendered prompt already holds it."""
    rendered = [m["content"] for m in history if m["content"]]
    if all(any(m["content"] in r for r in rendered) for m in messages if m["content"]):
        return None
    return messages


def _shared_prompt(members: list[Trajectory]) -> list[int]:
    """The group's prompt: the tokens every member's prompt starts with. Members that
    were opened differently by the environment keep the rest as environment tokens."""
    first = members[0].prompt_ids
    keep = len(first)
    for t in members[1:]:
        same = 0
        for a, b in zip(first[:keep], t.prompt_ids):
            if a != b:
                break
            same += 1
        keep = same
    for t in members:
        if len(t.prompt_ids) > keep:
            t.split_prompt(keep)
    return list(first[:keep])


def _turn_seed(seed: int | None, turn: int) -> int | None:
    # A different seed per round, so turn 2 is not drawn with turn 1's random stream.
    return None if seed is None else seed + 7919 * turn
