"""`retrain compare` and the statistics in retrain.compare, on synthetic campaigns."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from retrain.cli.main import main
from retrain.compare import stats
from retrain.compare.comparison import compare_runs
from retrain.compare.render import render_text
from retrain.compare.runs import collect_runs, load_run
from retrain.errors import RetrainError
from retrain.logs.rundir import run_dir_name

STEPS = 40
SEEDS = [1, 2, 3, 4, 5, 6, 7, 8]


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def write_run(
    run_dir: Path,
    condition: str,
    seed: int,
    rates,
    *,
    batch=4,
    group=8,
    resolved=True,
    generations=False,
    sizes=True,
):
    run_dir.mkdir(parents=True)
    n = batch * group
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for step, rate in enumerate(rates):
            correct = int(round(rate * n))
            row = {
                "step": step,
                "condition": condition,
                "correct_rate": correct / n,
                "mean_reward": correct / n,
            }
            if sizes:
                row.update(batch_size=batch, group_size=group)
            fh.write(json.dumps(row) + "\n")
    if resolved:
        (run_dir / "config.resolved.toml").write_text(f"[training]\nseed = {seed}\n")
    if generations:
        (run_dir / "emergence").mkdir()
        with open(run_dir / "emergence" / "generations.jsonl", "w") as fh:
            for step, rate in enumerate(rates):
                correct = int(round(rate * n))
                for i in range(n):
                    fh.write(json.dumps({"step": step, "index": i, "correct": i < correct}) + "\n")


def curve(rng, start, end, noise=0.03, steps=STEPS):
    base = np.linspace(start, end, steps)
    return np.clip(base + rng.normal(0, noise, size=steps), 0, 1)


def make_campaign(root: Path, conditions: dict, seeds=SEEDS, steps=STEPS, rng_seed=0) -> Path:
    """conditions: name -> (start, end) of a linear learning curve, plus noise."""
    rng = np.random.default_rng(rng_seed)
    camp = root / "campaign_20250101_120000"
    entries = []
    for cond, (start, end) in conditions.items():
        for seed in seeds:
            d = camp / "runs" / f"{cond}_s{seed}"
            write_run(d, cond, seed, curve(rng, start, end, steps=steps))
            entries.append(
                {
                    "condition": cond,
                    "seed": seed,
                    "log_dir": str(d.relative_to(camp)),
                    "status": "finished",
                }
            )
    camp.mkdir(exist_ok=True)
    (camp / "manifest.json").write_text(json.dumps({"runs": entries}))
    return camp


# ---------------------------------------------------------------- statistics


def test_permutation_exact_and_monte_carlo():
    # 3 vs 3 fully separated: only the observed labelling and its mirror are as extreme
    assert stats.permutation_test([4, 5, 6], [1, 2, 3]) == pytest.approx(2 / 20)
    assert stats.permutation_test([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.5, 1, 12), rng.normal(0, 1, 12)  # C(24, 12) > limit: Monte Carlo
    assert math.comb(24, 12) > stats.EXACT_PERMUTATION_LIMIT
    p_mc = stats.permutation_test(a, b, n_permutations=20000, seed=1)
    assert 0 < p_mc <= 1
    # a second Monte Carlo estimate, with another seed, agrees
    assert p_mc == pytest.approx(stats.permutation_test(a, b, n_permutations=20000), abs=0.02)


# The numbers of the hand-written implementation these functions replaced (numpy
# resampling and enumeration, before scipy.stats), on fixed inputs, seed 0, label "t",
# 10,000 resamples. Exact results (Fisher, Holm, exact permutation tests) must match to
# rounding. A Monte Carlo permutation p-value may differ by resampling noise: over 100
# seeds it had a standard deviation of 0.0055; two independent estimates then differ
# with SD sqrt(2) x that, so a tolerance of 5 such SDs (0.04) fails only on a real
# change of method. (The confidence intervals are t intervals now: test_compare_stats.py.)
X = [0.31, 0.42, 0.38, 0.45, 0.29, 0.36, 0.40, 0.33]
Y = [0.22, 0.30, 0.27, 0.35, 0.25, 0.28, 0.31, 0.24]
MC_A = [2.5409, -2.0557, 0.9181, -0.0678, 0.0474, 0.2844, -1.52, 0.2681, -0.3652, 3.823]
MC_A += [0.7258, 0.1474]
MC_B = [-0.2813, -0.668, -1.0552, -0.3908, 0.4819, -0.2386, 0.9578, -0.1998, 0.0243, 1.5458]
MC_B += [0.5451, -0.5052]
PERMUTATION_TOL = 0.04


def test_permutation_matches_the_previous_implementation():
    assert stats.permutation_test(X, Y) == pytest.approx(0.00404040404040404, rel=1e-12)
    unequal = stats.permutation_test([0.5, 0.61, 0.47], [0.3, 0.52, 0.41, 0.38])
    assert unequal == pytest.approx(0.14285714285714285, rel=1e-12)  # 5 of 35 relabellings
    # one value against several: scipy needs two per group, the 5 relabellings by hand
    assert stats.permutation_test([0.5], [0.3, 0.52, 0.41, 0.38]) == pytest.approx(0.6)
    assert stats.permutation_test([0.3, 0.52, 0.41, 0.38], [0.35]) == pytest.approx(0.6)
    assert stats.permutation_test([0.3], [0.4]) == pytest.approx(1.0)
    monte_carlo = stats.permutation_test(MC_A, MC_B, label="t")
    assert monte_carlo == pytest.approx(0.47155284471552844, abs=PERMUTATION_TOL)


def test_fisher_and_holm_match_the_previous_implementation():
    assert stats.fisher_exact_test(30, 100, 15, 100) == pytest.approx(
        (2.4285714285714284, 0.01714902276840841), rel=1e-12
    )
    assert stats.fisher_exact_test(412, 640, 371, 640) == pytest.approx(
        (1.3102094859790987, 0.021742462890603522), rel=1e-12
    )
    adjusted = stats.holm([0.01, 0.04, 0.03, math.nan, 0.2])
    assert adjusted[:3] + adjusted[4:] == pytest.approx([0.04, 0.09, 0.09, 0.2], rel=1e-12)
    assert math.isnan(adjusted[3])


def test_statistics_without_scipy_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    with pytest.raises(RetrainError, match=r"retrain\[plots\]"):
        stats.fisher_exact_test(1, 2, 1, 2)
    with pytest.raises(RetrainError, match=r"retrain\[plots\]"):
        stats.t_ci([1.0, 2.0])


def test_holm_and_moving_average():
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    adj = stats.holm([0.5, math.nan])
    assert adj[0] == pytest.approx(0.5) and math.isnan(adj[1])
    assert stats.moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]


# ---------------------------------------------------------------- comparisons


@pytest.fixture
def campaign(tmp_path):
    return make_campaign(
        tmp_path / "logs",
        {
            "grpo+none": (0.30, 0.32),
            "maxrl+none": (0.30, 0.32),
            "maxrl+gtpo_sepa": (0.30, 0.60),
        },
    )


def test_known_difference_is_detected(campaign):
    warnings: list[str] = []
    runs, order = collect_runs([campaign], warnings)
    assert len(runs) == 24 and order == ["grpo+none", "maxrl+none", "maxrl+gtpo_sepa"]
    comp = compare_runs(runs, "correct_rate", order=order, n_resamples=4000)
    assert comp.baseline == "grpo+none" and comp.horizon == STEPS
    by = {p.condition: p for p in comp.pairwise}
    sepa = by["maxrl+gtpo_sepa"]
    assert sepa.final_diff.low > 0.2  # true difference ~0.28 at the end
    assert sepa.auc_diff.low > 0  # CI excludes 0
    assert sepa.final_p < 0.001 and sepa.auc_p < 0.001
    assert sepa.fisher_p is not None and sepa.fisher_p < 1e-6
    same = by["maxrl+none"]
    assert same.final_diff.contains(0.0) and same.auc_diff.contains(0.0)
    assert same.final_p > 0.05
    summary = {c.condition: c for c in comp.conditions}
    assert summary["maxrl+gtpo_sepa"].n == 8
    assert summary["maxrl+gtpo_sepa"].final.contains(summary["maxrl+gtpo_sepa"].final.estimate)


def test_identical_conditions_include_zero(tmp_path):
    rng = np.random.default_rng(11)
    camp = tmp_path / "campaign_x"
    entries = []
    for seed in range(4):
        rates = curve(rng, 0.2, 0.4)
        for cond in ("a+none", "b+none"):
            d = camp / "runs" / f"{cond}_s{seed}"
            write_run(d, cond, seed, rates)  # exactly the same data
            entries.append({"condition": cond, "seed": seed, "log_dir": str(d)})
    (camp / "manifest.json").write_text(json.dumps({"runs": entries}))
    runs, order = collect_runs([camp], [])
    comp = compare_runs(runs, "correct_rate", order=order, n_resamples=2000)
    p = comp.pairwise[0]
    assert p.final_diff.estimate == 0 and p.final_diff.contains(0.0) and p.auc_diff.contains(0.0)
    assert p.final_p == pytest.approx(1.0) and p.fisher_p == pytest.approx(1.0)


def test_pooled_counts_from_metrics_and_generations(tmp_path):
    write_run(tmp_path / "a", "x+none", 1, [0.25, 0.5], batch=2, group=4)
    write_run(
        tmp_path / "b", "x+none", 2, [0.25, 0.5], batch=2, group=4, sizes=False, generations=True
    )
    a = load_run(tmp_path / "a")
    b = load_run(tmp_path / "b")
    assert a.correct_counts() == (6, 16)
    assert b.correct_counts() == (6, 16)  # batch/group missing: from generations.jsonl
    assert a.correct_counts(horizon=1) == (2, 8)


def test_run_dirs_seed_and_condition_sources(tmp_path):
    write_run(tmp_path / "r1", "grpo+none", 7, [0.1, 0.2])
    write_run(tmp_path / "maxrl+gtpo_s9", "maxrl+gtpo", 0, [0.1, 0.2], resolved=False)
    r1 = load_run(tmp_path / "r1")
    r2 = load_run(tmp_path / "maxrl+gtpo_s9")
    assert (r1.condition, r1.seed) == ("grpo+none", 7)
    assert (r2.condition, r2.seed) == ("maxrl+gtpo", 9)


def test_duplicate_steps_keep_the_last_row(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    rows = [
        {"step": 0, "correct_rate": 0.1},
        {"step": 1, "correct_rate": 0.2},
        {"step": 1, "correct_rate": 0.9},
    ]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{truncated")
    run_data = load_run(d)
    assert run_data.series("correct_rate")[1].tolist() == [0.1, 0.9]


def test_different_lengths_use_the_common_horizon(tmp_path):
    rng = np.random.default_rng(2)
    for seed in (1, 2):
        write_run(tmp_path / f"a+none_s{seed}", "a+none", seed, curve(rng, 0.1, 0.2))
        write_run(
            tmp_path / f"b+none_s{seed}",
            "b+none",
            seed,
            curve(rng, 0.1, 0.2, steps=25 if seed == 2 else STEPS),
        )
    runs, order = collect_runs([tmp_path], [])
    comp = compare_runs(runs, order=order, n_resamples=500)
    assert comp.horizon == 25
    assert any("differ in length" in w and "b+none_s2" in w for w in comp.warnings)
    comp = compare_runs(runs, order=order, n_resamples=500, horizon=30)
    assert comp.horizon == 30 and {c.condition: c.n for c in comp.conditions} == {
        "a+none": 2,
        "b+none": 1,
    }
    assert any("b+none_s2" in w and "skipped" in w for w in comp.warnings)
    # "final" averages the last final_window steps, or all of them where there are fewer
    comp = compare_runs(runs, order=order, n_resamples=500, horizon=6, final_window=10)
    assert comp.final_window == 6 and "final = mean of the last 6 steps" in render_text(comp)
    assert all(c.final_values == c.auc_values for c in comp.conditions)  # both: all 6 steps


# ---------------------------------------------------------------- the command


def test_cli_writes_tables_json_and_plots(campaign, tmp_path, capsys):
    out_dir = tmp_path / "report"
    code, out, _ = run(
        ["compare", str(campaign), "--out", str(out_dir), "--resamples", "2000"], capsys
    )
    assert code == 0
    assert "grpo+none (baseline)" in out and "maxrl+gtpo_sepa" in out and "p perm" in out
    md = (out_dir / "compare.md").read_text()
    assert "| maxrl+gtpo_sepa |" in md and "curves_correct_rate.png" in md
    data = json.loads((out_dir / "compare.json").read_text())
    comp = data["comparisons"][0]
    assert comp["metric"] == "correct_rate" and comp["baseline"] == "grpo+none"
    sepa = next(p for p in comp["pairwise"] if p["condition"] == "maxrl+gtpo_sepa")
    assert sepa["final_diff"]["low"] > 0 and sepa["final_p"] < 0.01
    assert len(comp["curves"]["grpo+none"]["mean"]) == STEPS
    for name in ("curves_correct_rate.png", "final_correct_rate.png"):
        png = out_dir / name
        assert png.stat().st_size > 5000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_several_metrics_and_baseline(campaign, capsys):
    code, out, _ = run(
        [
            "compare",
            str(campaign.parent),  # a folder holding the campaign
            "--metric",
            "correct_rate,mean_reward",
            "--baseline",
            "maxrl+none",
            "--json",
            "--resamples",
            "500",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    assert [c["metric"] for c in data["comparisons"]] == ["correct_rate", "mean_reward"]
    assert all(c["baseline"] == "maxrl+none" for c in data["comparisons"])
    assert "curves" not in data["comparisons"][0]


def test_cli_errors(campaign, tmp_path, capsys):
    code, _, err = run(["compare", str(campaign), "--baseline", "grpo+nonee"], capsys)
    assert code == 2 and "did you mean 'grpo+none'" in err
    code, _, err = run(["compare", str(campaign), "--metric", "nope"], capsys)
    assert code == 2 and "nope" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(["compare", str(empty)], capsys)
    assert code == 2 and "no runs to compare" in err
    code, _, err = run(["compare", str(tmp_path / "missing")], capsys)
    assert code == 2


def test_cli_without_scipy_says_what_to_install(campaign, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    code, out, err = run(["compare", str(campaign), "--resamples", "500"], capsys)
    assert code == 1 and "needs scipy" in err and "retrain[plots]" in err


def test_campaign_run_without_metrics_is_skipped(campaign, capsys):
    manifest = json.loads((campaign / "manifest.json").read_text())
    manifest["runs"].append(
        {"condition": "grpo+none", "seed": 99, "log_dir": "runs/grpo+none_s99", "status": "pending"}
    )
    (campaign / "manifest.json").write_text(json.dumps(manifest))
    warnings: list[str] = []
    runs, _ = collect_runs([campaign], warnings)
    assert len(runs) == 24
    assert any("grpo+none_s99" in w and "pending" in w for w in warnings)


def test_conditions_that_differ_only_by_overrides_are_compared_apart(tmp_path):
    """A campaign's labels come from its manifest; loose run dirs from their rows."""
    camp = make_campaign(
        tmp_path / "logs",
        {"maxrl+gtpo": (0.3, 0.32), "maxrl+gtpo~lr=0.0001": (0.3, 0.6)},
        seeds=[1, 2, 3],
    )
    runs, order = collect_runs([camp], [])
    assert order == ["maxrl+gtpo", "maxrl+gtpo~lr=0.0001"]
    comp = compare_runs(runs, "correct_rate", order=order, baseline="maxrl+gtpo", n_resamples=500)
    assert [c.condition for c in comp.conditions] == order
    assert [c.n for c in comp.conditions] == [3, 3]
    assert comp.pairwise[0].condition == "maxrl+gtpo~lr=0.0001"
    # loose runs, found by a directory search: the rows' labels keep them apart
    loose = tmp_path / "loose"
    rng = np.random.default_rng(3)
    for label in ("grpo+none", "grpo+none~lr=0.0001,uncertainty_kind=surprisal"):
        for seed in (1, 2):
            write_run(loose / run_dir_name(label, seed), label, seed, curve(rng, 0.2, 0.3))
    runs, order = collect_runs([loose], [])
    assert order == ["grpo+none", "grpo+none~lr=0.0001,uncertainty_kind=surprisal"]
    assert sorted(r.label for r in runs)[-1] == "grpo+none~lr=0.0001,uncertainty_kind=surprisal_s2"


def _recorded_run(root: Path, label: str, seed: int, **tables) -> None:
    """A run directory whose config.resolved.toml is what retrain writes for `tables`."""
    from retrain.config import config_from_dict
    from retrain.config.toml_writer import config_to_toml

    d = root / run_dir_name(label, seed)
    write_run(d, label, seed, [0.2, 0.3, 0.4], resolved=False)
    raw = {t: dict(v) for t, v in tables.items()}
    raw.setdefault("training", {})["seed"] = seed
    raw.setdefault("logging", {})["log_dir"] = str(d)  # per run: never a difference
    (d / "config.resolved.toml").write_text(config_to_toml(config_from_dict(raw)))


def _setup_warnings(root: Path) -> list[str]:
    runs, order = collect_runs([root], [])
    comp = compare_runs(runs, "correct_rate", order=order, n_resamples=200)
    return [w for w in comp.warnings if "differ in" in w and "length" not in w]


def test_runs_of_one_condition_that_differ_besides_the_seed_are_a_warning(tmp_path):
    for seed, lr in ((1, 2e-4), (2, 2e-4), (3, 1e-3)):
        _recorded_run(tmp_path, "grpo+none", seed, training={"lr": lr})
    for seed in (1, 2, 3):
        _recorded_run(tmp_path, "maxrl+gtpo", seed, training={"lr": 2e-4})
    assert _setup_warnings(tmp_path) == [
        "grpo+none: its runs differ in [training] lr (0.0002 in 2 runs, 0.001 in 1 run); "
        "seeds of one condition should differ in the seed alone"
    ]


def test_conditions_that_differ_besides_the_algorithm_are_said(tmp_path):
    algo = {"advantage_mode": "maxrl", "transform_mode": "gtpo"}
    for seed in (1, 2):
        _recorded_run(tmp_path, "grpo+none", seed, training={"group_size": 8})
        # a named algorithm's own [training] keys are the condition, not a second variable
        _recorded_run(
            tmp_path,
            "maxrl+gtpo",
            seed,
            algorithm=algo,
            training={"group_size": 16, "policy_loss": "ppo_clip"},
            gtpo={"beta": 0.3},
        )
    assert _setup_warnings(tmp_path) == [
        "conditions differ in more than the algorithm: [training] group_size "
        "(grpo+none 8; maxrl+gtpo 16)"
    ]


def test_a_campaigns_named_override_and_unrecorded_runs_are_not_differences(tmp_path):
    for seed in (1, 2):
        _recorded_run(tmp_path / "a", "grpo+none", seed)
        _recorded_run(tmp_path / "a", "grpo+none~lr=0.0001", seed, training={"lr": 1e-4})
    assert _setup_warnings(tmp_path / "a") == []
    rng = np.random.default_rng(0)
    for seed in (1, 2):  # config.resolved.toml of the seed alone: nothing to compare
        write_run(tmp_path / "b" / f"x_s{seed}", "x", seed, curve(rng, 0.2, 0.3, steps=5))
    assert _setup_warnings(tmp_path / "b") == []
