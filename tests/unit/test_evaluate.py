"""Held-out evaluation: pass@k, the held-out set, the Evaluator, and how status and
compare read evaluations back (synthetic eval rows)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from retrain.compare.comparison import compare_runs
from retrain.compare.runs import load_run
from retrain.config import config_from_dict
from retrain.config.schema import EVAL_SEED_OFFSET, EvalConfig
from retrain.errors import ConfigError, DataError
from retrain.evaluate import (
    Evaluator,
    held_out_data,
    load_eval_examples,
    pass_at_k,
    summarise,
    training_overlap,
)
from retrain.logs.console import eval_line
from retrain.logs.metrics import eval_fields, eval_row, read_eval_rows
from retrain.logs.status import collect, read_run, render
from retrain.types import EvalResult, Example, GroupRollout, Sample, SamplingParams

# ------------------------------------------------------------------ pass@k


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (c of them correct) holding a correct one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_special_cases():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the correct rate
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 1, 5) == 1.0  # n = k: any correct sample passes
    assert 0.0 < pass_at_k(200, 1, 10) < 1.0  # large n stays finite (product form)
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


# ------------------------------------------------------------------ the held-out set

GYM = {
    "source": "reasoning_gym",
    "task": "basic_arithmetic",
    "size": 200,
    "seed": 7,
    "args": {"min_terms": 3, "max_terms": 3, "min_digits": 3, "max_digits": 3},
}


def test_reasoning_gym_eval_seed_stream_is_far_from_training():
    cfg = config_from_dict({"data": GYM, "eval": {"every": 5, "size": 50}})
    d = held_out_data(cfg)
    assert d.seed == 7 + EVAL_SEED_OFFSET and d.size == 50 and not d.shuffle
    # reasoning-gym seeds item i with seed + i: the two seed ranges do not overlap
    assert set(range(d.seed, d.seed + d.size)).isdisjoint(range(7, 7 + 200))


def test_reasoning_gym_eval_problems_are_disjoint_from_training():
    pytest.importorskip("reasoning_gym")
    from retrain.data import build_data_source

    cfg = config_from_dict({"data": GYM, "eval": {"every": 5, "size": 64}})
    train = build_data_source(cfg.data)
    held_out = load_eval_examples(cfg, train)
    assert len(held_out) == 64
    assert training_overlap(held_out, train.examples) == 0
    assert not {e.prompt for e in held_out} & {e.prompt for e in train.examples}
    # a nearby seed would have been a shifted copy: seed + 1 repeats items 1.. of seed
    shifted = build_data_source(
        config_from_dict({"data": {**GYM, "seed": 8, "size": 5}}).data
    ).examples
    assert [e.prompt for e in shifted[:4]] == [e.prompt for e in train.examples[1:5]]
    # and the held-out set is the same for every run (no dependence on the training seed)
    again = load_eval_examples(
        config_from_dict({"data": GYM, "eval": {"every": 5, "size": 64}, "training": {"seed": 9}}),
        train,
    )
    assert [e.prompt for e in again] == [e.prompt for e in held_out]


def test_other_sources_use_their_split_or_file(tmp_path):
    math_cfg = config_from_dict({"data": {"source": "math"}, "eval": {"every": 1}})
    assert held_out_data(math_cfg).split == "test"
    jsonl = tmp_path / "eval.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(10)) + "\n"
    )
    (tmp_path / "train.jsonl").write_text(jsonl.read_text())
    cfg = config_from_dict(
        {
            "data": {"source": "jsonl", "path": str(tmp_path / "train.jsonl")},
            "eval": {"every": 1, "size": 4, "path": str(jsonl)},
        }
    )
    held_out = load_eval_examples(cfg)
    assert len(held_out) == 4 and all(e.prompt.startswith("q") for e in held_out)
    assert [e.prompt for e in held_out] == [e.prompt for e in load_eval_examples(cfg)]
    # no held-out file: the config does not load, and a Config built without the loader
    # is refused where the held-out set is read
    no_path = {"data": {"source": "jsonl", "path": str(tmp_path / "train.jsonl")}}
    with pytest.raises(ConfigError, match=r"\[eval\] path: a held-out evaluation"):
        config_from_dict({**no_path, "eval": {"every": 1}})
    with pytest.raises(DataError, match=r"\[eval\] path"):
        held_out_data(replace(config_from_dict(no_path), eval=EvalConfig(every=1)))


def test_a_local_math_copy_without_split_names_is_said_to_be_the_cause(tmp_path):
    """A folder whose file names name no split gives the held-out split the training
    problems: the start says every held-out problem is a training one, and why."""
    from retrain.data import build_data_source
    from retrain.evaluate import prepare_held_out

    rows = [{"problem": f"p{i}", "solution": f"\\boxed{{{i}}}"} for i in range(6)]
    (tmp_path / "algebra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_from_dict(
        {"data": {"source": "math", "path": str(tmp_path)}, "eval": {"every": 1, "size": 4}}
    )
    train = build_data_source(cfg.data, max_examples=0, shuffle_seed=None)
    said = []
    renderer = type("Renderer", (), {"encode": lambda self, example: None})()
    prepare_held_out(cfg, train, renderer, said.append)
    assert said == [
        "Held-out set: 4 problems; 4 share a question text with a training problem (check "
        "[eval] split: a local copy whose file names name no split gives every split all "
        "its files)"
    ]


def test_eval_config_is_checked():
    with pytest.raises(ConfigError):
        config_from_dict({"eval": {"every": -1}})
    with pytest.raises(ConfigError):
        config_from_dict({"eval": {"samples": 0}})
    with pytest.raises(ConfigError):
        config_from_dict({"eval": {"temperature": -0.5}})
    assert config_from_dict({}).eval.every == 0  # off unless asked for


# ------------------------------------------------------------------ the Evaluator


def _group(example: Example, correct: list[bool]) -> GroupRollout:
    samples = [Sample(np.array([1, 2]), np.zeros(2), "eos") for _ in correct]
    rewards = [1.0 if c else 0.0 for c in correct]
    return GroupRollout(example, [0], samples, ["t"] * len(correct), rewards, [None] * 3, correct)


class FakeRollout:
    """Problem i has `i % (samples + 1)` correct completions."""

    def __init__(self):
        self.calls: list[int] = []
        self.offsets: list[int] = []

    def __call__(self, examples, group_size, params, timer):
        self.calls.append(len(examples))
        self.offsets.append(params.prompt_offset)
        groups = [
            _group(e, [j < int(e.reference) % (group_size + 1) for j in range(group_size)])
            for e in examples
        ]
        counters = {"reward_errors": 1.0, "reward_timeouts": 0.0, "no_answer_rate": 0.5}
        return groups, counters


def test_evaluator_chunks_and_summarises():
    examples = [Example(f"q{i}", str(i)) for i in range(7)]
    rollout = FakeRollout()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    result = Evaluator(rollout, examples, params, 3, chunk=3)(step=5)
    assert rollout.calls == [3, 3, 1]
    # each chunk's rows draw on from where the previous chunk's stopped (the engines
    # skip prompt_offset prompts' random numbers), so problem i of every chunk does not
    # get the same draws
    assert rollout.offsets == [0, 3, 6]
    correct = [i % 4 for i in range(7)]  # 0,1,2,3,0,1,2
    assert result.step == 5 and result.num_problems == 7 and result.samples == 3
    assert result.num_correct == sum(correct)
    assert result.correct_rate == pytest.approx(sum(correct) / 21)
    assert result.mean_reward == pytest.approx(sum(correct) / 21)
    assert result.pass_at_k == pytest.approx(5 / 7)  # k = n = 3: any correct passes
    assert result.reward_counters == {
        "reward_errors": 3.0,
        "reward_timeouts": 0.0,
        "no_answer_rate": pytest.approx(0.5),
    }


def test_an_environment_that_scores_its_own_format_reports_no_no_answer_rate():
    """A multi-turn environment (or a rubric) does not extract \\boxed{} answers, so its
    rollout reports no no_answer_rate; eval then reports none either (not 0)."""

    class EnvRollout(FakeRollout):
        def __call__(self, examples, group_size, params, timer):
            groups, _ = super().__call__(examples, group_size, params, timer)
            return groups, {"reward_errors": 0.0, "reward_timeouts": 0.0, "env_errors": 0.0}

    examples = [Example(f"q{i}", str(i)) for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    result = Evaluator(EnvRollout(), examples, params, 2, chunk=3)(step=0)
    assert result.reward_counters == {"reward_errors": 0.0, "reward_timeouts": 0.0}


def test_summarise_pass_at_k_averages_problems():
    ex = Example("q", "1")
    result = summarise(0, [_group(ex, [True, False]), _group(ex, [False, False])], 2, 0.7, 1.0)
    assert result.pass_at_k == pytest.approx(0.5)
    assert result.correct_rate == pytest.approx(0.25)


def test_rows_and_console_line():
    result = EvalResult(15, 64, 1, 0.0, 40, 40 / 64, 40 / 64, 40 / 64, 3.5, {"no_answer_rate": 0.1})
    fields = eval_fields(result)
    assert fields["eval_step"] == 15 and fields["eval_num_completions"] == 64
    row = eval_row(result, "grpo+none")
    assert row["step"] == 15 and row["kind"] == "eval" and row["eval_no_answer_rate"] == 0.1
    line = eval_line(15, "grpo+none", result)
    assert line.startswith("Eval after 15 steps [grpo+none] | held-out correct=62.5%")
    assert "greedy" in line


# ------------------------------------------------------------------ reading evaluations back


def write_run(run_dir: Path, condition: str, seed: int, evals: dict[int, float], steps: int = 10):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for step in range(steps):
            row = {"step": step, "condition": condition, "correct_rate": 0.5, "mean_reward": 0.5}
            row.update(batch_size=4, group_size=8)
            if step + 1 in evals:
                row.update(eval_step=step + 1, eval_correct_rate=evals[step + 1])
            fh.write(json.dumps(row) + "\n")
    with open(run_dir / "eval.jsonl", "w") as fh:
        for step, rate in evals.items():
            result = EvalResult(step, 50, 1, 0.0, round(rate * 50), rate, rate, rate, 1.0)
            fh.write(json.dumps(eval_row(result, condition)) + "\n")
    (run_dir / "config.resolved.toml").write_text(f"[training]\nseed = {seed}\n")


def test_read_eval_rows_prefers_eval_jsonl_and_falls_back_to_metrics(tmp_path):
    write_run(tmp_path / "r", "a", 1, {0: 0.1, 5: 0.3, 10: 0.6})
    assert [r["step"] for r in read_eval_rows(tmp_path / "r")] == [0, 5, 10]
    (tmp_path / "r" / "eval.jsonl").unlink()
    metrics = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = read_eval_rows(tmp_path / "r", metrics)
    assert [(r["step"], r["eval_correct_rate"]) for r in rows] == [(5, 0.3), (10, 0.6)]


def test_status_shows_the_last_eval(tmp_path):
    write_run(tmp_path / "logs" / "run1", "a", 1, {0: 0.1, 5: 0.3, 10: 0.625})
    st = read_run(tmp_path / "logs" / "run1")
    assert st.last_eval_step == 10 and st.last_eval_correct_rate == 0.625
    text = render(collect(tmp_path / "logs"))
    assert "EVAL" in text and "62.5% @10" in text


def test_compare_on_held_out_accuracy(tmp_path):
    rng = np.random.default_rng(0)
    runs = []
    for cond, gain in (("grpo+none", 0.1), ("maxrl+gtpo", 0.4)):
        for seed in range(1, 5):
            evals = {s: float(np.clip(0.1 + gain * s / 10 + rng.normal(0, 0.02), 0, 1))
                     for s in (0, 5, 10)}  # fmt: skip
            d = tmp_path / f"{cond}_s{seed}"
            write_run(d, cond, seed, evals)
            runs.append(load_run(d))
    comp = compare_runs(runs, "eval_correct_rate", n_resamples=200)
    assert comp.horizon == 10
    base, treated = comp.conditions
    assert base.condition == "grpo+none"
    # final = the last evaluation (after 10 steps); its counts feed Fisher's test
    assert base.final_values == [r.eval_rows[-1]["eval_correct_rate"] for r in runs[:4]]
    assert treated.completions == 4 * 50
    assert comp.curves["maxrl+gtpo"].steps.tolist() == [0, 5, 10]
    pair = comp.pairwise[0]
    assert pair.final_diff.estimate == pytest.approx(0.3, abs=0.05)
    assert pair.fisher_p is not None and pair.fisher_p < 0.05
    # --steps 5: evaluations after 0 and 5 steps
    assert compare_runs(runs, "eval_correct_rate", horizon=5, n_resamples=200).curves[
        "grpo+none"
    ].steps.tolist() == [0, 5]


def test_compare_cli_adds_eval_correct_rate_by_default(tmp_path, capsys):
    from retrain.cli.main import main

    for seed in (1, 2):
        write_run(tmp_path / "runs" / f"a_s{seed}", "a", seed, {0: 0.1, 10: 0.5})
    assert main(["compare", str(tmp_path / "runs"), "--json", "--resamples", "200"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["metric"] for c in data["comparisons"]] == ["correct_rate", "eval_correct_rate"]


def test_explain_lists_eval(tmp_path, capsys):
    from retrain.cli.main import main

    cfg = tmp_path / "retrain.toml"
    assert main(["init", "--template", "quickstart", "--output", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["explain", str(cfg)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Eval:"))
    assert "every 5 steps" in line and "64 held-out problems" in line and "greedy" in line
    assert main(["explain", str(cfg), "--eval-every", "0"]) == 0
    assert "Eval:        off" in capsys.readouterr().out
