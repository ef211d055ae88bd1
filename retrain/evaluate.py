"""Held-out evaluation (`[eval]`): the current adapter on problems it never trains on.

    examples = prepare_held_out(config, data, renderer, say)   # before the model loads
    evaluator = build_evaluator(config, rollout, examples)
    result = evaluator(step)                                    # an EvalResult

The held-out set comes from the training data's own kind, never from its examples:

- reasoning_gym: the same task and args, generated from the seed stream that starts
  `EVAL_SEED_OFFSET` (10^9) above `[data] seed`. reasoning-gym seeds item i with
  `seed + i`, so nearby seeds give shifted copies of the same items; the offset keeps
  the two streams apart for any realistic `[data] size`. (A task with a small problem
  space, such as one-digit additions, still repeats question texts:
  `training_overlap` counts them and the run says so.)
- math: the `[eval] split` split (default test); jsonl: the file `[eval] path`;
  verifiers: the environment's eval dataset; a plugin source is called with
  `split = [eval] split`.

Evaluation samples with the same Rollout as training (same renderer, reward and
correctness threshold) at `[eval] temperature` (0 = greedy), `[eval] samples`
completions per problem, in chunks no larger than a training step. It is not a training
step: nothing is trained, no data position or counter moves.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from retrain.config import Config
from retrain.config.schema import EVAL_SEED_OFFSET, DataConfig
from retrain.errors import DataError
from retrain.logs.timer import PhaseTimer
from retrain.rollout import RolloutFn
from retrain.types import EvalResult, Example, GroupRollout, SamplingParams

# Which problems of a large held-out split are used: the same for every run and seed.
SUBSET_SEED = 0
# The sampling seed of an evaluation with temperature > 0: fixed, so two evaluations
# differ only by the adapter.
SAMPLING_SEED = 20_240_601


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct (Chen et al.
    2021): 1 - C(n - c, k) / C(n, k), computed as a product to stay exact for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def held_out_data(config: Config) -> DataConfig:
    """The `[data]` table of the held-out set (not used for verifiers environments)."""
    d, e = config.data, config.eval
    if d.source == "reasoning_gym":
        return replace(d, seed=d.seed + EVAL_SEED_OFFSET, size=e.size, shuffle=False)
    if d.source == "jsonl":
        if not e.path:
            raise DataError(
                "[eval] path is required for a held-out evaluation of [data] source = 'jsonl' "
                "(a JSONL file of problems the run does not train on)"
            )
        return replace(d, path=e.path, shuffle=False)
    return replace(d, split=e.split, shuffle=False)


def _verifiers_eval_examples(data: Any) -> list[Example]:
    """The eval dataset of a classic verifiers environment, as Examples."""
    from types import SimpleNamespace

    from retrain.data.verifiers import _classic_examples

    env, env_id = getattr(data, "env", None), getattr(data, "env_id", "?")
    if getattr(data, "api", None) != "classic":
        raise DataError(
            f"verifiers environment {env_id!r}: held-out evaluation reads a classic "
            "environment's eval dataset; this one has none here. Set [eval] every = 0, or "
            "train on [data] source = 'jsonl' with [eval] path"
        )
    getter = getattr(env, "get_eval_dataset", None)
    dataset = getter() if callable(getter) else getattr(env, "eval_dataset", None)
    if dataset is None or len(dataset) == 0:
        raise DataError(
            f"verifiers environment {env_id!r} has no eval dataset for [eval]; set [eval] every = 0"
        )
    return _classic_examples(SimpleNamespace(get_dataset=lambda: dataset), env_id)


def load_eval_examples(config: Config, train_data: Any = None) -> list[Example]:
    """The held-out problems: at most `[eval] size`, the same subset for every run."""
    from retrain.data import build_data_source

    if config.environment.provider:
        examples = _verifiers_eval_examples(train_data)
    else:
        source = build_data_source(
            held_out_data(config),
            max_examples=0,
            shuffle_seed=0,
            search_paths=tuple(config.plugins.search_paths),
        )
        examples = list(source.examples)
    size = config.eval.size
    if len(examples) > size:
        keep = sorted(random.Random(SUBSET_SEED).sample(range(len(examples)), size))
        examples = [examples[i] for i in keep]
    return examples


def training_overlap(held_out: Sequence[Example], training: Sequence[Example]) -> int:
    """How many held-out problems have the text of a training problem."""
    seen = {e.prompt for e in training}
    return sum(e.prompt in seen for e in held_out)


class Evaluator:
    """Samples and scores the held-out problems with the current adapter."""

    def __init__(
        self,
        rollout: RolloutFn,
        examples: Sequence[Example],
        params: SamplingParams,
        samples: int,
        *,
        chunk: int = 0,
    ):
        if not examples:
            raise DataError("the held-out set is empty")
        self.rollout = rollout
        self.examples = list(examples)
        self.params = params
        self.samples = samples
        self.chunk = chunk or len(self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def groups(
        self, on_phase: Callable[[str], None] | None = None
    ) -> tuple[list[GroupRollout], dict[str, float]]:
        groups: list[GroupRollout] = []
        errors = timeouts = no_answer = 0.0
        extracts_answers = False
        for start in range(0, len(self.examples), self.chunk):
            part = self.examples[start : start + self.chunk]
            # each chunk's rows draw their own random numbers, as if sampled in one call
            params = replace(self.params, prompt_offset=self.params.prompt_offset + start)
            got, counters = self.rollout(part, self.samples, params, PhaseTimer(on_phase))
            groups += got
            errors += counters.get("reward_errors", 0.0)
            timeouts += counters.get("reward_timeouts", 0.0)
            # the training side's rule (BatchScore.extracts_answers): the rate is reported
            # only by a reward that extracts \boxed{} answers, never as 0 for the others
            if "no_answer_rate" in counters:
                extracts_answers = True
                no_answer += counters["no_answer_rate"] * len(part) * self.samples
        total = len(self.examples) * self.samples
        out = {"reward_errors": errors, "reward_timeouts": timeouts}
        if extracts_answers:
            out["no_answer_rate"] = no_answer / total
        return groups, out

    def __call__(self, step: int, on_phase: Callable[[str], None] | None = None) -> EvalResult:
        started = time.perf_counter()
        groups, counters = self.groups(on_phase)
        return summarise(
            step,
            groups,
            self.samples,
            self.params.temperature,
            time.perf_counter() - started,
            counters,
        )


def summarise(
    step: int,
    groups: Sequence[GroupRollout],
    samples: int,
    temperature: float,
    seconds: float,
    counters: dict[str, float] | None = None,
) -> EvalResult:
    """The EvalResult of scored held-out groups (each of `samples` completions)."""
    rewards = [r for g in groups for r in g.rewards]
    correct = sum(g.num_correct for g in groups)
    total = len(rewards)
    passes = [pass_at_k(len(g), g.num_correct, samples) for g in groups]
    return EvalResult(
        step=step,
        num_problems=len(groups),
        samples=samples,
        temperature=temperature,
        num_correct=correct,
        correct_rate=correct / total if total else 0.0,
        mean_reward=math.fsum(rewards) / total if total else 0.0,
        pass_at_k=math.fsum(passes) / len(passes) if passes else 0.0,
        seconds=seconds,
        reward_counters=dict(counters or {}),
    )


def describe(config: Config) -> str:
    """Where the held-out problems come from, in words (explain, the run's opening lines)."""
    e, d = config.eval, config.data
    if config.environment.provider:
        where = f"the eval dataset of {config.environment.id!r}"
    elif d.source == "reasoning_gym":
        seed = d.seed + EVAL_SEED_OFFSET
        where = f"reasoning_gym {d.task!r} seeds {seed}..{seed + e.size - 1} (training: {d.seed}..{d.seed + d.size - 1})"
    elif d.source == "jsonl":
        where = f"jsonl {e.path or '<[eval] path not set>'}"
    else:
        where = f"{d.source} split {e.split!r}"
    how = "greedy" if e.temperature <= 0 else f"temperature {e.temperature}"
    return (
        f"every {e.every} steps, before step 0 and at the end: {e.size} held-out problems from "
        f"{where}; {how}, {e.samples} completion(s) each (pass@{e.samples})"
    )


def _overlap_cause(config: Config) -> str:
    """Why held-out problems may repeat training ones, by where they come from."""
    d = config.data
    if config.environment.provider:
        return "the environment's eval dataset repeats its training one"
    if d.source == "reasoning_gym":
        return "a small problem space"
    if d.source == "math" and d.path:  # the local copy's file names decide the splits
        return (
            "check [eval] split: a local copy whose file names name no split gives every "
            "split all its files"
        )
    return "check [eval] path" if d.source == "jsonl" else "check [eval] split"


def prepare_held_out(
    config: Config, train_data: Any, renderer: Any, say: Callable[[str], None]
) -> list[Example]:
    """Load and pre-encode the held-out problems, and say how they relate to training.
    (Runs before the model loads, so a bad `[eval]` fails fast.)"""
    examples = load_eval_examples(config, train_data)
    for example in examples:
        renderer.encode(example)
    overlap = training_overlap(examples, train_data.examples)
    note = (
        f"; {overlap} share a question text with a training problem ({_overlap_cause(config)})"
        if overlap
        else "; none shares a question text with a training problem"
    )
    say(f"Held-out set: {len(examples)} problems{note}")
    e = config.eval
    if e.temperature <= 0 and e.samples > 1:
        say(f"Note: [eval] temperature = 0 is greedy: its {e.samples} samples are identical")
    return examples


def build_evaluator(config: Config, rollout: RolloutFn, examples: Sequence[Example]) -> Evaluator:
    """The run's Evaluator: the training Rollout on the held-out problems, in chunks of
    at most one training step's completions."""
    e, t = config.eval, config.training
    params = SamplingParams(
        max_tokens=t.max_tokens,
        temperature=e.temperature,
        seed=SAMPLING_SEED,
        top_p=t.top_p,
        held_out=True,
    )
    chunk = max(1, (t.batch_size * t.group_size) // e.samples)
    return Evaluator(rollout, examples, params, e.samples, chunk=chunk)
