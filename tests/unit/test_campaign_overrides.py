"""Per-condition overrides in `[[campaign.conditions]]`: resolution, validation, labels,
run configs, directory names and `retrain explain`'s matrix."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from retrain.campaign.conditions import campaign_conditions, condition_from_manifest
from retrain.campaign.expand import check_runs, expand_campaign, expand_run
from retrain.cli.main import main
from retrain.compat import config_from_dict, load_config
from retrain.config.conditions import Condition, condition_label, parse_entry
from retrain.errors import ConfigError
from retrain.logs.rundir import run_dir_name, safe_label

# A campaign in the original's style: flat run keys next to the two modes.
ORIGINAL_STYLE = """
[training]
seed = 1
lr = 4e-5

[campaign]
seeds = [42, 101]
max_steps = 20

[[campaign.conditions]]
advantage_mode = "grpo"
transform_mode = "none"

[[campaign.conditions]]
advantage_mode = "maxrl"
transform_mode = "gtpo_sepa"
lr = 1e-4
uncertainty_kind = "shannon_entropy"

[[campaign.conditions]]
advantage_mode = "maxrl"
transform_mode = "gtpo_sepa"
model = "Qwen/Qwen3-0.6B"
sepa.steps = 100
"gtpo.beta" = 0.2
gtpo_beta_typo_free = 1
"""


def load(text: str) -> object:
    return config_from_dict(tomllib.loads(text))


def original_style():
    """ORIGINAL_STYLE without its one bad key."""
    return load(ORIGINAL_STYLE.replace("gtpo_beta_typo_free = 1\n", ""))


def test_flat_and_table_qualified_keys_reach_their_fields():
    cfg = original_style()
    conds = campaign_conditions(cfg)
    assert [c.label for c in conds] == [
        "grpo+none",
        "maxrl+gtpo_sepa~lr=0.0001,uncertainty_kind=shannon_entropy",
        "maxrl+gtpo_sepa~gtpo.beta=0.2,model=Qwen/Qwen3-0.6B,sepa.steps=100",
    ]
    fields = {o.key: o.spec.label for c in conds for o in c.overrides}
    assert fields == {
        "lr": "[training] lr",
        "uncertainty_kind": "[algorithm] uncertainty_kind",
        "model": "[model] model",
        "sepa.steps": "[sepa] steps",
        "gtpo.beta": "[gtpo] beta",
    }


def test_runs_carry_their_condition_overrides_and_nothing_else():
    cfg = original_style()
    runs = expand_campaign(cfg, "/tmp/camp")
    assert len(runs) == 6
    plain, tuned, other = runs[0], runs[2], runs[4]
    assert plain.config.training.lr == 4e-5 and plain.overrides == {}
    c = tuned.config
    assert c.training.lr == 1e-4 and c.algorithm.uncertainty_kind == "shannon_entropy"
    assert (c.algorithm.advantage_mode, c.algorithm.transform_mode) == ("maxrl", "gtpo_sepa")
    assert c.training.seed == 42 and c.training.max_steps == 20
    assert tuned.overrides == {"lr": 1e-4, "uncertainty_kind": "shannon_entropy"}
    assert c.logging.wandb_group == tuned.condition
    assert c.logging.wandb_tags.split(",") == [
        "maxrl+gtpo_sepa",
        "lr=0.0001",
        "uncertainty_kind=shannon_entropy",
        "seed42",
    ]
    o = other.config
    assert (o.model.model, o.sepa.steps, o.gtpo.beta) == ("Qwen/Qwen3-0.6B", 100, 0.2)
    assert o.training.lr == 4e-5  # another condition's override does not leak
    assert cfg.training.lr == 4e-5 and cfg.model.model != "Qwen/Qwen3-0.6B"  # base untouched
    for run in runs:  # each run.toml reloads to the same config and validates
        assert config_from_dict(tomllib.loads(run.toml())) == run.config
    assert check_runs(runs) == []


def test_label_format_follows_the_original():
    assert condition_label("grpo", "none") == "grpo+none"
    assert condition_label("grpo", "none", {}) == "grpo+none"
    label = condition_label("maxrl", "gtpo", {"uncertainty_kind": "surprisal", "lr": 1e-4})
    assert label == "maxrl+gtpo~lr=0.0001,uncertainty_kind=surprisal"  # sorted by key
    assert condition_label("a", "b", {"x": 1e-5, "y": True, "z": 3}) == "a+b~x=1e-05,y=True,z=3"


def test_run_directories_stay_filesystem_safe_and_distinct():
    label = "maxrl+gtpo~lr=0.0001,uncertainty_kind=surprisal"
    assert safe_label(label) == label  # the original's names where they are safe
    assert run_dir_name(label, 42) == f"{label}_s42"
    slash = "maxrl+gtpo~model=Qwen/Qwen3-0.6B"
    underscore = "maxrl+gtpo~model=Qwen_Qwen3-0.6B"
    a, b = safe_label(slash), safe_label(underscore)
    assert "/" not in a and a != b and a.startswith("maxrl+gtpo~model=Qwen_Qwen3-0.6B-")
    long = "maxrl+gtpo~" + ",".join(f"k{i}=v{i}" for i in range(60))
    assert len(safe_label(long)) <= 130
    assert safe_label(long) != safe_label(long + ",x=1")
    cfg = original_style()
    runs = expand_campaign(cfg, "/tmp/camp")
    assert runs[4].condition == "maxrl+gtpo_sepa~gtpo.beta=0.2,model=Qwen/Qwen3-0.6B,sepa.steps=100"
    assert "/" not in runs[4].name and Path(runs[4].log_dir).parent == Path("/tmp/camp/runs")
    assert runs[4].config.logging.wandb_run_name == runs[4].name


def test_original_flat_field_names_resolve_like_cli_flags():
    cond = parse_entry(
        {"advantage_mode": "maxrl", "transform_mode": "gtpo", "gtpo_beta": 0.3, "data_seed": 7}
    )
    assert isinstance(cond, Condition)
    assert {o.key: o.spec.label for o in cond.overrides} == {
        "gtpo_beta": "[gtpo] beta",
        "data_seed": "[data] seed",
    }
    assert cond.label == "maxrl+gtpo~data_seed=7,gtpo_beta=0.3"


def test_the_originals_field_names_work_and_later_keys_are_refused_by_name():
    """Condition keys of the original were its config field names (bp_enabled,
    optim_beta1, backend_options, ...); keys of later originals are refused with why."""
    cond = parse_entry(
        {
            "advantage_mode": "grpo",
            "transform_mode": "none",
            "bp_enabled": True,
            "optim_beta1": 0.8,
            "tinker_max_concurrent": 3,
            "algorithm": {"params": {"alpha": 1}},  # the original's [algorithm.params]
        }
    )
    assert isinstance(cond, Condition)
    assert {o.key: o.spec.label for o in cond.overrides} == {
        "bp_enabled": "[backpressure] enabled",
        "optim_beta1": "[optimizer] beta1",
        "tinker_max_concurrent": "[backend] max_concurrent",
        "algorithm.params": "[algorithm] transform_params",
    }
    assert cond.label.startswith("grpo+none~algorithm.params={'alpha': 1},bp_enabled=True,")
    (problem,) = parse_entry(
        {"advantage_mode": "grpo", "transform_mode": "none", "kl_cov_coef": 0.2}
    )
    assert problem.startswith("kl_cov_coef: [training] kl_cov_coef is not supported in this build")
    (problem,) = parse_entry(
        {"advantage_mode": "grpo", "transform_mode": "none", "echo": {"enabled": True}}
    )
    assert problem.startswith("echo.enabled: not supported in this build")


def test_a_condition_may_set_its_own_max_steps():
    cfg = load(
        '[campaign]\nseeds = [1]\nmax_steps = 5\n[[campaign.conditions]]\nadvantage_mode = "grpo"\n'
        'transform_mode = "none"\nmax_steps = 9\n'
    )
    (run,) = expand_campaign(cfg, "c")
    assert run.config.training.max_steps == 9 and run.condition == "grpo+none~max_steps=9"


def test_the_full_label_reaches_the_run_config():
    cfg = original_style()
    runs = expand_campaign(cfg, "c")
    assert runs[0].config.condition == "grpo+none"
    assert runs[2].config.condition == runs[2].condition  # the full label reaches the rows


def test_manifest_overrides_round_trip():
    cfg = original_style()
    for run in expand_campaign(cfg, "c"):
        entry = json.loads(
            json.dumps(
                {
                    "advantage_mode": run.advantage_mode,
                    "transform_mode": run.transform_mode,
                    "overrides": run.overrides,
                }
            )
        )
        cond = condition_from_manifest(entry)
        assert cond.label == run.condition
        assert expand_run(cfg, cond, run.seed, "c").config == run.config
    with pytest.raises(ConfigError, match="lrr"):
        condition_from_manifest(
            {"advantage_mode": "grpo", "transform_mode": "none", "overrides": {"lrr": 1}}
        )


ENTRY = '[[campaign.conditions]]\nadvantage_mode = "grpo"\ntransform_mode = "none"\n'


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("lrr = 1e-4\n", "entry 1: lrr: unknown key (did you mean 'lr'?)"),
        ('lr = "fast"\n', "entry 1: lr: expected a number"),
        ("lr = -1.0\n", "entry 1: lr: must be > 0.0"),
        ('uncertainty_kind = "entropyy"\n', "entry 1: uncertainty_kind:"),
        (
            "training.lrr = 1e-4\n",
            "entry 1: training.lrr: unknown key in [training] (did you mean 'lr'?)",
        ),
        ("trainng.lr = 1e-4\n", "entry 1: trainng: unknown key"),
        ('"trainng.lr" = 1e-4\n', "entry 1: trainng.lr: unknown table (did you mean 'training'?)"),
        ("seed = 3\n", "entry 1: seed: cannot be overridden by a condition"),
        ('log_dir = "x"\n', "entry 1: log_dir: cannot be overridden"),
        (
            "steps = 3\n",
            "entry 1: steps: not reachable as a bare key; write it table-qualified: sepa.steps",
        ),
        (
            "campaign.max_steps = 3\n",
            "entry 1: campaign.max_steps ([campaign] max_steps): [campaign] is not a run setting",
        ),
        ('judge_api_key = "sk-x"\n', "entry 1: judge_api_key: a secret cannot"),
        ("lr = 1e-4\ntraining.lr = 2e-4\n", "sets [training] lr again"),
    ],
)
def test_bad_overrides_fail_at_load_naming_entry_and_key(extra, expected):
    text = f"[campaign]\nseeds = [1]\n{ENTRY}{ENTRY}{extra}"
    with pytest.raises(ConfigError) as err:
        config_from_dict(tomllib.loads(text))
    (problem,) = err.value.problems
    assert problem.startswith("[campaign] conditions: [[campaign.conditions]] entry 1: ")
    assert expected in problem


def test_bad_modes_and_repeated_conditions():
    text = (
        "[campaign]\nseeds = [1]\n"
        + ENTRY
        + ENTRY
        + '[[campaign.conditions]]\nadvantage_mode = "grpoo"\ntransform_mode = "none"\n'
        + '[[campaign.conditions]]\nadvantage_mode = "grpo"\n'
    )
    with pytest.raises(ConfigError) as err:
        config_from_dict(tomllib.loads(text))
    problem = err.value.problems[0]
    assert "entry 1: repeats entry 0 (grpo+none)" in problem
    assert "entry 2: advantage_mode: unknown advantage_mode 'grpoo'" in problem
    assert "entry 3: transform_mode: required" in problem


def test_conditions_that_differ_only_by_overrides_are_distinct():
    text = "[campaign]\nseeds = [1]\n" + ENTRY + ENTRY + "lr = 1e-4\n"
    runs = expand_campaign(load(text), "c")
    assert [r.name for r in runs] == ["grpo+none_s1", "grpo+none~lr=0.0001_s1"]


# ---------------------------------------------------------------- explain


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_explain_shows_the_matrix_with_overrides(tmp_path, capsys, one_gpu):
    path = tmp_path / "c.toml"
    path.write_text(ORIGINAL_STYLE.replace("gtpo_beta_typo_free = 1\n", "max_steps = 30\n"))
    code, out, _ = run_cli(["explain", str(path)], capsys)
    assert code == 0
    assert "3 conditions x 2 seeds = 6 runs x 20 steps (some conditions set their own)" in out
    assert "  - maxrl+gtpo_sepa~lr=0.0001,uncertainty_kind=shannon_entropy\n" in out
    assert '      [algorithm] uncertainty_kind = "shannon_entropy"' in out
    assert "      [training] lr = 0.0001" in out
    assert "      runs/maxrl+gtpo_sepa~lr=0.0001,uncertainty_kind=shannon_entropy_s{42, 101}" in out
    code, out, _ = run_cli(["explain", str(path), "--json"], capsys)
    camp = json.loads(out)["campaign"]
    assert camp["total_steps"] == 2 * 20 + 2 * 20 + 2 * 30
    assert camp["conditions"][1] == "maxrl+gtpo_sepa~lr=0.0001,uncertainty_kind=shannon_entropy"
    third = camp["condition_details"][2]
    assert third["max_steps"] == 30
    assert {o["key"]: (o["field"], o["value"]) for o in third["overrides"]} == {
        "gtpo.beta": ("[gtpo] beta", 0.2),
        "max_steps": ("[training] max_steps", 30),
        "model": ("[model] model", "Qwen/Qwen3-0.6B"),
        "sepa.steps": ("[sepa] steps", 100),
    }
    assert len(camp["matrix"]) == 6 and camp["matrix"][2] == camp["condition_details"][1]["runs"][0]


def test_explain_exits_2_on_a_bad_override(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(ORIGINAL_STYLE)
    code, _, err = run_cli(["explain", str(path)], capsys)
    assert code == 2
    assert "[[campaign.conditions]] entry 2: gtpo_beta_typo_free: unknown key" in err
    assert f"{path}:" in err


def test_explain_checks_each_condition_against_the_backend(tmp_path, capsys):
    """An override the backend cannot serve (tinker returns no entropies) is an error for
    that condition's runs, as the campaign would report it before starting."""
    path = tmp_path / "c.toml"
    path.write_text(
        '[backend]\nbackend = "tinker"\n[campaign]\nseeds = [1]\n'
        + ENTRY
        + ENTRY
        + 'uncertainty_kind = "shannon_entropy"\n'
    )
    load_config(path)  # the base config is fine
    code, out, _ = run_cli(["explain", str(path)], capsys)
    assert code == 2
    assert (
        "ERROR: grpo+none~uncertainty_kind=shannon_entropy_s1: [algorithm] uncertainty_kind" in out
    )
