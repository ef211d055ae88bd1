"""The rows a step writes: metrics.jsonl, emergence/steps.jsonl, emergence/generations.jsonl,
and eval.jsonl (held-out evaluations). Built from typed records (StepResult,
EvalResult); nothing here measures or decides anything."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from retrain.logs.jsonl import read_jsonl
from retrain.logs.rundir import skipped_lines
from retrain.types import EvalResult, StepResult

EVAL = "eval.jsonl"  # one row per held-out evaluation, in the run's log directory


@dataclass
class RunCounters:
    """Totals since step 0 (saved with checkpoints, so a resumed run continues them)."""

    correct: float = 0
    completions: float = 0
    reward_sum: float = 0.0
    datums: float = 0
    tokens: float = 0
    skipped_steps: float = 0

    def add(self, result: StepResult) -> None:
        self.correct += result.num_correct
        self.completions += result.num_completions
        self.reward_sum += sum(r for g in result.groups for r in g.rewards)
        self.datums += result.num_datums
        self.tokens += sum(len(s) for g in result.groups for s in g.samples)

    @property
    def correct_rate(self) -> float:
        return self.correct / self.completions if self.completions else 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> RunCounters:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class RunContext:
    """What a metrics row needs besides the step itself."""

    condition: str
    lr: float
    loss_is_placeholder: bool
    started: float  # time.time() when the run (or this resumed part) started


def _completion_stats(result: StepResult) -> dict[str, Any]:
    samples = [s for g in result.groups for s in g.samples]
    # the model's tokens (a multi-turn trajectory's environment tokens are not generated)
    lengths = [len(s) if s.loss_mask is None else int(s.loss_mask.sum()) for s in samples]
    tokens = sum(lengths)
    row = {
        "tokens_generated": tokens,
        "tokens_per_s": tokens / max(result.seconds.get("sampling", 0.0), 1e-9),
        "mean_completion_tokens": tokens / len(lengths) if lengths else 0.0,
        "max_token_hit_rate": sum(s.stop_reason == "length" for s in samples)
        / max(len(samples), 1),
    }
    if samples and samples[0].entropies is not None:
        ents = [float(s.entropies.sum()) for s in samples]
        row["token_entropy_mean"] = sum(ents) / tokens if tokens else None
    return row


def metrics_row(
    result: StepResult,
    ctx: RunContext,
    counters: RunCounters,
    *,
    examples_seen: int,
    epoch: int,
    sepa_gate_open: bool,
) -> dict[str, Any]:
    """The metrics.jsonl row of one step (counters already include this step)."""
    rewards = [r for g in result.groups for r in g.rewards]
    stats = result.advantages.stats
    train = result.train
    seconds = result.seconds
    now = time.time()
    return {
        "step": result.step,
        "condition": ctx.condition,
        "loss": train.loss,
        "loss_is_placeholder": ctx.loss_is_placeholder,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "correct_rate": result.correct_rate,
        # the counts behind correct_rate: with dynamic sampling a step holds more than
        # batch_size x group_size completions, so the rate alone cannot give them back
        "num_correct": result.num_correct,
        "num_completions": result.num_completions,
        "running_correct_rate": counters.correct_rate,
        "num_datums": result.num_datums,
        "batch_size": result.batch_size,
        "group_size": result.group_size,
        "sepa_lambda": stats.sepa_lambda,
        "sepa_gate_open": sepa_gate_open,
        "step_time_s": sum(seconds.values()),
        **{f"time_{phase}_s": s for phase, s in seconds.items()},
        **_completion_stats(result),
        **stats.to_metrics(),
        "grad_norm": train.grad_norm,
        "log_ratio_mean": train.log_ratio_mean,
        "log_ratio_max_abs": train.log_ratio_max_abs,
        "trained_tokens": train.num_tokens,
        **result.reward_counters,
        **result.shaping.metrics,
        "lr": ctx.lr,
        "examples_seen": examples_seen,
        "epoch": epoch,
        "elapsed_s": now - ctx.started,
        "time": now,
        **train.extra,
    }


STEPS_KEYS = (
    "step",
    "condition",
    "mean_reward",
    "correct_rate",
    "sepa_lambda",
    "num_planning_tokens",
    "exec_entropy_mean",
    "plan_entropy_mean",
    "mean_completion_tokens",
    "skipped_all_correct",
    "skipped_all_wrong",
)


def steps_row(row: dict[str, Any]) -> dict[str, Any]:
    """The emergence/steps.jsonl row: the planning/entropy view of a metrics row."""
    out = {k: row[k] for k in STEPS_KEYS}
    out["planning_token_rate"] = row["num_planning_tokens"] / max(row["tokens_generated"], 1)
    return out


def generation_rows(result: StepResult) -> list[dict[str, Any]]:
    """One emergence/generations.jsonl row per completion."""
    rows = []
    advantages = result.advantages.advantages
    for gi, (g, plan, adv) in enumerate(
        zip(result.groups, result.planning, advantages, strict=True)
    ):
        for i, s in enumerate(g.samples):
            rows.append(
                {
                    "step": result.step,
                    "group": gi,
                    "index": i,
                    "prompt": g.example.prompt,
                    "reference": g.example.reference,
                    "completion": g.texts[i],
                    "reward": g.rewards[i],
                    "answer": g.answers[i],
                    "correct": g.correct[i],
                    "num_tokens": len(s),
                    "stop_reason": s.stop_reason,
                    "planning_tokens": int(plan[i].sum()),
                    "advantage_mean": float(adv[i].mean())
                    if adv is not None and len(adv[i])
                    else None,
                }
            )
            if g.transcripts is not None:  # multi-turn: the conversation, turn by turn
                rows[-1]["turns"] = sum(m["role"] == "assistant" for m in g.transcripts[i])
                rows[-1]["transcript"] = g.transcripts[i]
    return rows


def eval_fields(result: EvalResult) -> dict[str, Any]:
    """The `eval_*` fields of a held-out evaluation, as metrics.jsonl rows carry them."""
    return {
        "eval_step": result.step,
        "eval_correct_rate": result.correct_rate,
        "eval_mean_reward": result.mean_reward,
        "eval_pass_at_k": result.pass_at_k,
        "eval_k": result.samples,
        "eval_num_problems": result.num_problems,
        "eval_num_correct": result.num_correct,
        "eval_num_completions": result.num_completions,
        "eval_temperature": result.temperature,
        "eval_time_s": result.seconds,
    }


def eval_row(result: EvalResult, condition: str) -> dict[str, Any]:
    """The eval.jsonl row: `step` is the number of training steps done (0 = before
    training), so a row describes the adapter after that many steps."""
    return {
        "step": result.step,
        "kind": "eval",
        "condition": condition,
        **eval_fields(result),
        **{f"eval_{k}": v for k, v in result.reward_counters.items()},
        "time": time.time(),
    }


def read_eval_rows(
    log_dir: str | Path,
    metrics: list[dict[str, Any]] | None = None,
    warnings: list[str] | None = None,
) -> list[dict[str, Any]]:
    """A run's evaluations by step (the last row wins for a repeated step): eval.jsonl,
    else the `eval_*` fields of its metrics rows (`metrics`, when given). Lines of
    eval.jsonl that do not parse are skipped, and said in `warnings` when given."""
    rows, bad = read_jsonl(Path(log_dir) / EVAL)
    if bad and warnings is not None:
        warnings.append(skipped_lines(Path(log_dir) / EVAL, bad))
    if not rows and metrics:
        rows = [
            {**r, "step": r["eval_step"]}
            for r in metrics
            if isinstance(r.get("eval_step"), int) and r.get("eval_correct_rate") is not None
        ]
    by_step = {r["step"]: r for r in rows if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]
