"""`retrain compare` on damaged, partial and unusual runs: runs without values in the
compared steps, missing or corrupt held-out evaluations, dynamic sampling's correct
counts, a baseline without a default metric, bad generations rows, unfinished runs,
damaged manifests and `--out` paths with `..`. Hand-made run directories, as retrain
writes them (metrics.jsonl, run.json, trainer_state.json, eval.jsonl, generations)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from retrain.cli.main import main
from retrain.compare.comparison import compare_runs, learning_curve
from retrain.compare.render import render_text
from retrain.compare.runs import collect_runs
from retrain.logs.rundir import RunDir, run_dir_holding

pytest.importorskip("scipy")  # compare's statistics

BATCH, GROUP = 4, 8


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_run(
    d: Path,
    cond: str,
    seed: int,
    rates,
    *,
    evals: dict[int, tuple[int, int]] | None = None,
    status: str = "finished",
    max_steps: int | None = None,
    rows: list[dict] | None = None,
) -> Path:
    """A run directory; `rates[step]` None leaves the step out, `rows` replaces the rows."""
    d.mkdir(parents=True)
    n = BATCH * GROUP
    if rows is None:
        rows = [
            {
                "step": step,
                "condition": cond,
                "correct_rate": round(rate * n) / n,
                "mean_reward": round(rate * n) / n,
                "batch_size": BATCH,
                "group_size": GROUP,
            }
            for step, rate in enumerate(rates)
            if rate is not None
        ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = {"status": status, "condition": cond, "max_steps": max_steps or len(rates)}
    info.update(heartbeat=time.time(), host="another-host", pid=1, step=len(rates))
    (d / "run.json").write_text(json.dumps(info))
    state = {"step": len(rates), "finished": status == "finished"}
    (d / "trainer_state.json").write_text(json.dumps(state))
    (d / "config.resolved.toml").write_text(f"[training]\nseed = {seed}\n")
    if evals:
        lines = [
            json.dumps(
                {
                    "step": step,
                    "kind": "eval",
                    "condition": cond,
                    "eval_step": step,
                    "eval_correct_rate": c / total,
                    "eval_num_correct": c,
                    "eval_num_completions": total,
                    "eval_pass_at_k": min(1.0, 2 * c / total),
                }
            )
            for step, (c, total) in sorted(evals.items())
        ]
        (d / "eval.jsonl").write_text("\n".join(lines) + "\n")
    return d


def campaign(root: Path, runs: list[tuple[str, int, dict]]) -> Path:
    """A campaign directory: manifest.json listing `runs` (condition, seed, write_run's
    keyword arguments, with "rates"), each under runs/{condition}_s{seed}."""
    entries = []
    for cond, seed, kw in runs:
        kw = dict(kw)
        rates = kw.pop("rates")
        name = f"{cond}_s{seed}"
        write_run(root / "runs" / name, cond, seed, rates, **kw)
        status = kw.get("status", "finished")
        entries.append({"name": name, "condition": cond, "seed": seed, "status": status})
    (root / "manifest.json").write_text(json.dumps({"version": 1, "runs": entries}))
    return root


def rates(base: float, seed: int, n: int = 20) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(np.clip(base + 0.005 * np.arange(n) + rng.normal(0, 0.03, n), 0, 1))


def two_conditions(root: Path, n: int = 20, **kw) -> Path:
    return campaign(
        root,
        [
            (cond, seed, {"rates": rates(base, seed + 10 * i, n), **kw})
            for i, (cond, base) in enumerate((("grpo+none", 0.3), ("maxrl+none", 0.4)))
            for seed in (1, 2, 3)
        ],
    )


def compare(paths, metric="correct_rate", **kw):
    found: list[str] = []
    runs, order = collect_runs(paths, found)
    comp = compare_runs(runs, metric, order=order, n_resamples=500, **kw)
    comp.warnings[:0] = found
    return comp


def by_condition(comp):
    return {c.condition: c for c in comp.conditions}


# ---------------------------------------------------------------- 1. no values in the steps


def test_a_run_without_values_in_the_compared_steps_is_left_out_and_named(tmp_path):
    camp = two_conditions(tmp_path / "c")
    late = camp / "runs" / "maxrl+none_s1" / "metrics.jsonl"
    rows = [json.loads(line) for line in late.read_text().splitlines()]
    for row in rows[:15]:  # correct_rate only at steps 15..19
        del row["correct_rate"]
    late.write_text("".join(json.dumps(r) + "\n" for r in rows))
    short = camp / "runs" / "grpo+none_s2" / "metrics.jsonl"
    short.write_text("".join(short.read_text().splitlines(keepends=True)[:12]))  # 12 steps
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Mean of empty slice" from numpy
        comp = compare([camp])
    assert comp.horizon == 12
    maxrl = by_condition(comp)["maxrl+none"]
    assert maxrl.n == 2 and len(maxrl.final_values) == 2
    assert all(np.isfinite(maxrl.final_values)) and all(np.isfinite(maxrl.auc_values))
    assert not any("maxrl+none_s1" in r for r in maxrl.runs)
    assert any(
        "maxrl+none_s1: no value of 'correct_rate' in steps 0..11 (its first is at step 15); "
        "left out of maxrl+none" in w
        for w in comp.warnings
    )
    assert comp.incomplete == 0  # the run left out is not also a run with missing steps


def test_learning_curve_at_a_step_with_one_seed_warns_nothing():
    series = [(np.array([0, 1]), np.array([0.1, 0.2])), (np.array([0]), np.array([0.3]))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Degrees of freedom <= 0"
        curve = learning_curve(series)
    assert curve.n.tolist() == [2, 1] and curve.mean.tolist() == pytest.approx([0.2, 0.2])


# ---------------------------------------------------------------- 2. held-out evaluations


def eval_campaign(root: Path) -> Path:
    runs = []
    for i, (cond, b) in enumerate((("grpo+none", 40), ("maxrl+none", 50))):
        for s in (1, 2, 3):
            ev = {0: (30, 100), 5: (b - 5 + s, 100), 10: (b + s, 100), 20: (b + 6 + s, 100)}
            runs.append((cond, s, {"rates": rates(0.3, s + 10 * i), "evals": ev}))
    return campaign(root, runs)


def test_a_run_missing_its_last_evaluation_or_with_a_corrupt_one_is_said(tmp_path):
    camp = eval_campaign(tmp_path / "c")
    missing = camp / "runs" / "maxrl+none_s1" / "eval.jsonl"
    missing.write_text("".join(missing.read_text().splitlines(keepends=True)[:-1]))
    corrupt = camp / "runs" / "grpo+none_s2" / "eval.jsonl"
    lines = corrupt.read_text().splitlines(keepends=True)
    lines[2] = lines[2][:40] + "\n"  # the evaluation after 10 steps, torn
    corrupt.write_text("".join(lines))
    comp = compare([camp], "eval_correct_rate")
    text = "\n".join(comp.warnings)
    assert f"skipped 1 corrupt line(s) in {corrupt}: line(s) 3" in text
    assert "maxrl+none_s1: 3 of the 4 evaluations" in text
    assert "its final is its last evaluation, after 10 steps, where other runs' is after 20" in text
    assert "grpo+none_s2: 3 of the 4 evaluations" in text and "missing after 10 steps" in text
    assert comp.incomplete == 2
    assert "(2 run(s) lack some of these evaluations: see the warnings)" in render_text(comp)
    # the final it contributes is its evaluation after 10 steps, as the warning says
    assert by_condition(comp)["maxrl+none"].final_values[0] == pytest.approx(0.51)


# ---------------------------------------------------------------- 3. dynamic sampling counts


def dynamic_step(tmp_path: Path) -> tuple[dict, list[dict], tuple[int, int]]:
    """A real metrics row and generations rows of a step with dynamic sampling (the
    rounds of retrain.shaping.sample_step on a fake rollout), and the true counts."""
    from retrain.advantages.pipeline import AdvantageStats, BatchAdvantages
    from retrain.data.base import ExampleStream
    from retrain.logs.metrics import RunContext, RunCounters, generation_rows, metrics_row
    from retrain.logs.timer import PhaseTimer
    from retrain.shaping import Shaping, sample_step
    from retrain.types import (
        Example,
        GroupRollout,
        RunPosition,
        Sample,
        SamplingParams,
        StepResult,
        TrainResult,
    )

    def rollout(examples, group_size, params, timer):
        groups = []
        for e in examples:  # "flat": every completion correct (no signal); "mixed": 1 of 4
            correct = [True] * group_size if e.reference == "flat" else [True, False, False, False]
            samples = [Sample([1, 2], [0.0, 0.0], "eos") for _ in range(group_size)]
            groups.append(
                GroupRollout(
                    e,
                    [0],
                    samples,
                    ["x"] * group_size,
                    [float(c) for c in correct],
                    [None] * group_size,
                    correct,
                )
            )
        return groups, {}

    kinds = "ffmfmfffmm"  # batch 3, 1 extra round: round 1 f f m, round 2 f m: 5 groups
    data = ExampleStream(
        [Example(f"p{i}", {"f": "flat", "m": "mixed"}[k]) for i, k in enumerate(kinds)],
        shuffle=False,
    )
    shaped = sample_step(
        Shaping(dynamic_sampling=True, max_rounds=1),
        data.next_batch,
        rollout,
        (3, 4),
        SamplingParams(max_tokens=10, temperature=1.0, seed=0),
        PhaseTimer(),
    )
    assert len(shaped.groups) > 3  # more groups than batch_size stay in the step
    result = StepResult(
        step=0,
        groups=shaped.groups,
        reward_counters=shaped.reward_counters,
        planning=[[np.zeros(2, bool)] * len(g) for g in shaped.groups],
        advantages=BatchAdvantages([None] * len(shaped.groups), AdvantageStats(), []),
        num_datums=0,
        train=TrainResult(loss=0.0, num_tokens=0),
        seconds={},
        batch_size=3,
        group_size=4,
        position=RunPosition(0, 0, False),
        off_policy_steps=0,
        shaping=shaped.report,
    )
    counters = RunCounters()
    counters.add(result)
    row = metrics_row(
        result,
        RunContext("dapo", 1e-5, False, time.time()),
        counters,
        examples_seen=0,
        epoch=0,
        sepa_gate_open=False,
    )
    return row, generation_rows(result), (result.num_correct, result.num_completions)


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_dynamic_sampling_counts_are_exact_from_the_row_or_the_generations(tmp_path):
    row, generations, truth = dynamic_step(tmp_path)
    assert row["sampling_rounds"] > 1 and row["groups_dropped"] > 0
    assert (row["num_correct"], row["num_completions"]) == truth
    assert truth[1] > row["batch_size"] * row["group_size"]
    write_rows(tmp_path / "new" / "metrics.jsonl", [row])
    assert RunDir(tmp_path / "new").correct_counts() == truth
    # a row from before the counts were written: the generations hold them
    old = {k: v for k, v in row.items() if k not in ("num_correct", "num_completions")}
    write_rows(tmp_path / "old" / "metrics.jsonl", [old])
    write_rows(tmp_path / "old" / "emergence" / "generations.jsonl", generations)
    assert RunDir(tmp_path / "old").correct_counts() == truth


def test_dynamic_sampling_row_without_counts_uses_the_generations(tmp_path):
    # the audit's DS: 128 correct of 224 completions in 3 rounds (8 prompts x 16 wanted)
    row = {"step": 0, "correct_rate": 128 / 224, "batch_size": 8, "group_size": 16}
    row.update(groups_dropped=6, sampling_rounds=3)
    write_rows(tmp_path / "metrics.jsonl", [row])
    gens = [{"step": 0, "correct": i < 128} for i in range(224)]
    write_rows(tmp_path / "emergence" / "generations.jsonl", gens)
    assert RunDir(tmp_path).correct_counts() == (128, 224)


# ---------------------------------------------------------------- 4. baseline of a default metric


def test_a_default_metric_the_baseline_lacks_is_skipped_a_named_one_fails(tmp_path, capsys):
    camp = eval_campaign(tmp_path / "c")
    for s in (1, 2, 3):
        (camp / "runs" / f"maxrl+none_s{s}" / "eval.jsonl").unlink()
    code, out, err = cli(capsys, "compare", str(camp), "--baseline", "maxrl+none")
    assert code == 0, err
    assert "== correct_rate ==" in out and "== eval_correct_rate ==" not in out
    assert (
        "warning: eval_correct_rate not compared: --baseline 'maxrl+none' has no values of "
        "'eval_correct_rate'" in out
    )
    code, _, err = cli(
        capsys,
        "compare",
        str(camp),
        "--baseline",
        "maxrl+none",
        "--metric",
        "eval_correct_rate",
    )
    assert code == 2 and "--baseline 'maxrl+none' has no values of 'eval_correct_rate'" in err
    assert "not among the conditions" not in err


def test_the_standard_baseline_without_values_is_said(tmp_path):
    camp = eval_campaign(tmp_path / "c")
    for s in (1, 2, 3):
        (camp / "runs" / f"grpo+none_s{s}" / "eval.jsonl").unlink()
    comp = compare([camp], "eval_correct_rate")
    assert comp.baseline == "maxrl+none"
    assert any("grpo+none has no values of 'eval_correct_rate'" in w for w in comp.warnings)


# ---------------------------------------------------------------- 6. generations rows


def test_generations_rows_without_a_step_number_are_skipped_and_counted(tmp_path, capsys):
    for cond in ("grpo+none", "maxrl+none"):
        for seed in (1, 2):
            rows = [{"step": s, "condition": cond, "correct_rate": 0.5} for s in range(3)]
            d = write_run(tmp_path / f"{cond}_s{seed}", cond, seed, [0.5] * 3, rows=rows)
            gens = [{"step": s, "correct": i % 2 == 0} for s in range(3) for i in range(4)]
            if (cond, seed) == ("maxrl+none", 2):
                gens += [{"step": None, "correct": True}, {"step": "1", "correct": True}]
                gens += [{"correct": True}]
            write_rows(d / "emergence" / "generations.jsonl", gens)
    run = RunDir(tmp_path / "maxrl+none_s2")
    assert run.correct_counts(horizon=2) == (4, 8)  # (a null step was a TypeError)
    assert run.correct_counts() == (6, 12)
    assert any("skipped 3 row(s)" in w and "without a step number" in w for w in run.warnings)
    code, out, err = cli(capsys, "compare", str(tmp_path))
    assert code == 0, err
    assert "skipped 3 row(s)" in out and "Traceback" not in err


# ---------------------------------------------------------------- 7. Fisher for counts only


def test_fisher_and_pooled_counts_only_for_correct_rates(tmp_path):
    camp = eval_campaign(tmp_path / "c")
    for metric in ("mean_reward", "eval_pass_at_k"):
        comp = compare([camp], metric)
        assert all(c.correct is None and c.completions is None for c in comp.conditions)
        assert all(p.fisher_p is None for p in comp.pairwise)
        text = render_text(comp)
        assert "Fisher" not in text and "pooled correct" not in text
        assert "Holm p (final/AUC)" in text
    for metric in ("correct_rate", "eval_correct_rate"):
        comp = compare([camp], metric)
        assert all(c.completions for c in comp.conditions)
        assert all(p.fisher_p is not None for p in comp.pairwise)
        assert "Holm p (final/AUC/Fisher)" in render_text(comp)
    # the held-out counts are the last evaluation's, pooled over seeds
    comp = compare([camp], "eval_correct_rate")
    assert by_condition(comp)["grpo+none"].completions == 300


# ---------------------------------------------------------------- 8. unfinished runs


def test_unfinished_runs_are_named_with_their_steps(tmp_path):
    camp = campaign(
        tmp_path / "b",
        [
            ("grpo+none", 1, {"rates": rates(0.3, 1)}),
            ("grpo+none", 2, {"rates": rates(0.3, 2)}),
            ("grpo+none", 3, {"rates": rates(0.3, 3, n=12), "status": "failed", "max_steps": 20}),
            ("maxrl+none", 1, {"rates": rates(0.4, 4)}),
            ("maxrl+none", 2, {"rates": rates(0.4, 5)}),
            ("maxrl+none", 3, {"rates": rates(0.4, 6), "status": "running", "max_steps": 30}),
        ],
    )
    comp = compare([camp])
    assert "grpo+none_s3: not finished (failed, 12 of 20 steps done)" in comp.warnings
    assert "maxrl+none_s3: not finished (running, 20 of 30 steps done)" in comp.warnings
    assert not any("grpo+none_s1: not finished" in w for w in comp.warnings)
    assert any(
        "compared over steps 0..11, fewer than the 30 steps the runs are configured for" in w
        for w in comp.warnings
    )


# ---------------------------------------------------------------- 9. the header's run count


def test_the_header_counts_the_runs_compared(tmp_path, capsys):
    camp = two_conditions(tmp_path / "c")
    (camp / "runs" / "grpo+none_s3" / "metrics.jsonl").write_text("")  # nothing to compare
    code, out, _ = cli(capsys, "compare", str(camp), "--resamples", "500")
    assert code == 0
    assert out.startswith("5 runs, conditions: grpo+none, maxrl+none")


# ---------------------------------------------------------------- 10. the manifest


def test_an_unreadable_manifest_says_why(tmp_path):
    camp = two_conditions(tmp_path / "c")
    (camp / "manifest.json").write_text('{"runs": [\n')
    found: list[str] = []
    runs, _ = collect_runs([camp], found)
    assert len(runs) == 6
    assert any(
        f"cannot read {camp / 'manifest.json'}: Expecting value" in w and "scanning" in w
        for w in found
    )
    assert not any("has no 'runs' list" in w for w in found)


def test_runs_the_manifest_does_not_list_are_named(tmp_path):
    camp = two_conditions(tmp_path / "c")
    manifest = json.loads((camp / "manifest.json").read_text())
    manifest["runs"] = [e for e in manifest["runs"] if e["seed"] != 3]
    (camp / "manifest.json").write_text(json.dumps(manifest))
    found: list[str] = []
    runs, _ = collect_runs([camp], found)
    assert len(runs) == 4
    assert any(
        "left out 2 run(s) under runs/ that its manifest.json does not list: "
        "grpo+none_s3, maxrl+none_s3" in w
        for w in found
    )


# ---------------------------------------------------------------- 11. --out with ..


def test_out_with_dot_dot_is_judged_where_it_lands(tmp_path, capsys):
    camp = two_conditions(tmp_path / "c")
    inside = camp / "runs" / "grpo+none_s1"
    assert run_dir_holding(f"{inside}/../../report") is None
    code, _, err = cli(
        capsys, "compare", str(camp), "--out", f"{inside}/../../report", "--no-plots"
    )
    assert code == 0, err
    assert (camp / "report" / "compare.json").is_file()
    # a symlink to a run is the run, named as typed
    (tmp_path / "to_run").symlink_to(inside)
    assert run_dir_holding(tmp_path / "to_run" / "report") == tmp_path / "to_run"
    # through a symlink into a run the path lands inside it, whatever the text says
    (inside / "sub").mkdir()
    (tmp_path / "into_run").symlink_to(inside / "sub")
    for out in (tmp_path / "into_run" / "report", tmp_path / "into_run" / ".." / "report"):
        assert run_dir_holding(out) == inside.resolve()


# ---------------------------------------------------------------- 12. final_window


def test_compare_json_reports_the_final_window_used(tmp_path):
    camp = eval_campaign(tmp_path / "c")
    assert compare([camp], "eval_correct_rate").as_dict()["final_window"] == 1
    assert compare([camp], "correct_rate").as_dict()["final_window"] == 10


# ---------------------------------------------------------------- 14. a damaged rate


def test_a_non_finite_correct_rate_leaves_only_its_step_out_of_the_counts(tmp_path):
    camp = two_conditions(tmp_path / "c")
    path = camp / "runs" / "maxrl+none_s1" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[7]["correct_rate"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    comp = compare([camp])
    maxrl = by_condition(comp)["maxrl+none"]
    assert maxrl.completions == (3 * 20 - 1) * BATCH * GROUP
    assert next(p for p in comp.pairwise).fisher_p is not None
    assert any("maxrl+none_s1: 19 of the 20 steps" in w and "7" in w for w in comp.warnings)


def test_unknown_counts_say_why_fisher_is_missing(tmp_path):
    camp = two_conditions(tmp_path / "c")
    path = camp / "runs" / "maxrl+none_s2" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text(
        "".join(json.dumps({"step": r["step"], "correct_rate": 0.4}) + "\n" for r in rows)
    )
    comp = compare([camp])
    assert by_condition(comp)["maxrl+none"].completions is None
    assert any(
        "maxrl+none: no pooled correct counts or Fisher test: the counts of maxrl+none_s2 are "
        "unknown" in w
        for w in comp.warnings
    )
