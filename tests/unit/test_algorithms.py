"""The map of named algorithms (retrain/algorithms.py): every row retrain reproduces loads
through the config loader from a TOML file and `retrain explain` names it; the rows it
does not reproduce say why; explain names nothing for a config no row describes; the zoo
template's conditions are the rows they are named after; the manual and docs/ carry the
generated table; a campaign condition's `name` is its label."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrain import algorithms as A
from retrain.cli.init import templates
from retrain.cli.summaries import named_algorithm
from retrain.config import config_from_dict, load_config
from retrain.config.toml_writer import value_to_toml

REPO = Path(__file__).resolve().parents[2]
REPRODUCED = [row for row in A.ALGORITHMS if row.reproduced]


def _id(row: A.Algorithm) -> str:
    return f"{row.peer}:{row.name}:{row.peer_name}"


def write_toml(path: Path, tables: dict[str, dict]) -> Path:
    lines = []
    for table, keys in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {value_to_toml(v)}" for k, v in keys.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def cli(args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


@pytest.mark.parametrize("row", REPRODUCED, ids=_id)
def test_row_loads_and_explain_names_it(tmp_path, row):
    config = load_config(write_toml(tmp_path / "retrain.toml", row.toml()))
    named = named_algorithm(config)
    assert named is not None, row.label
    assert row.label in named["text"]
    assert any(r["name"] == row.name and r["peer"] == row.peer for r in named["rows"])


@pytest.mark.parametrize("row", [r for r in A.ALGORITHMS if not r.reproduced], ids=_id)
def test_rows_not_reproduced_say_why_and_set_nothing(row):
    assert row.differs, f"{row.label}: a row retrain does not reproduce must say why"
    assert not row.toml()
    assert row.status in (A.NOT_REPRODUCED, A.DIFFERS) or row.kind == A.METRIC


def test_every_row_is_well_formed():
    assert len({_id(r) for r in A.ALGORITHMS}) == len(A.ALGORITHMS)
    for row in A.ALGORITHMS:
        assert row.status in (A.SAME, A.DIFFERS, A.NOT_REPRODUCED), row.label
        assert row.kind in (A.ALGORITHM, A.OPTION, A.METRIC), row.label
        if row.status == A.DIFFERS:
            assert row.differs, f"{row.label}: say how it differs"
        if row.loss is not None:  # one source of truth: the loss-level row's keys
            kept = {
                k: v
                for k, v in row.loss.settings.items()
                if k not in ("max_tokens", "bnpo_batch_size")
            }
            assert kept.items() <= dict(row.training).items(), row.label


def test_every_peer_of_the_issue_is_mapped():
    names = {(r.peer, r.peer_name.split(",")[0]) for r in A.ALGORITHMS}
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"):
        assert (A.TRL, f"loss_type={loss_type}") in names
    verl = " ".join(r.peer_name for r in A.ALGORITHMS if r.peer == A.VERL)
    for mode in (
        "vanilla",
        "gspo",
        "sapo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "geo_mean",
        "cispo",
        "dppo",
    ):
        assert f"loss_mode={mode}" in verl
    for adv in (
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
    ):
        assert f"adv_estimator={adv}" in verl
    assert "filter_groups" in verl and "rollout_is" in verl and "rollout_rs" in verl
    assert {A.PRIME, A.SKYRL, A.ORIGINAL, A.RETRAIN} <= {r.peer for r in A.ALGORITHMS}


@pytest.mark.parametrize(
    "tables",
    [
        # retrain's default estimator under a PPO clip: no peer ships it
        {"training": {"policy_loss": "ppo_clip"}},
        # a known recipe plus a correction no row names
        {
            "algorithm": {"advantage_mode": "grpo_std", "transform_mode": "none"},
            "training": {
                "policy_loss": "ppo_clip",
                "is_correction": "truncate",
                "is_level": "geometric",
            },
        },
    ],
)
def test_no_row_no_name(tables):
    assert A.identify(config_from_dict(tables)) == []
    assert named_algorithm(config_from_dict(tables)) is None


def test_parameters_do_not_change_the_name():
    dapo = {"advantage_mode": "grpo_std", "transform_mode": "none"}
    config = config_from_dict(
        {
            "algorithm": dapo,
            "training": {"policy_loss": "ppo_clip", "clip_eps": 0.1, "clip_eps_high": 0.5},
        }
    )
    assert [r.name for r in A.identify(config)] == ["DAPO loss"]


CPU = '[backend]\ndevices = "cpu"\n\n'
DAPO_TOML = """[algorithm]
advantage_mode = "grpo_std"
transform_mode = "none"

[training]
policy_loss = "ppo_clip"
clip_eps_high = 0.28
loss_agg = "token_mean"
"""


def test_explain_names_the_algorithm_in_text_and_json(tmp_path):
    (tmp_path / "retrain.toml").write_text(CPU + DAPO_TOML + "tis_cap = 2.0\n")
    proc = cli(["explain"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Algorithm:"))
    assert line.startswith("Algorithm:   DAPO loss (TRL 1.16 loss_type=dapo)")
    assert "+ TIS (TRL 1.16 vllm_importance_sampling_mode=token_truncate)" in line
    proc = cli(["explain", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = [(r["name"], r["kind"]) for r in report["algorithm"]["rows"]]
    assert names[0] == ("DAPO loss", "algorithm") and ("TIS", "option") in names


def test_explain_says_nothing_when_no_row_matches(tmp_path):
    (tmp_path / "retrain.toml").write_text(CPU + '[training]\npolicy_loss = "ppo_clip"\n')
    proc = cli(["explain"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Algorithm:" not in proc.stdout
    report = json.loads(cli(["explain", "--json"], tmp_path).stdout)
    assert report["algorithm"] is None


def test_init_zoo_then_explain_names_each_condition(tmp_path):
    proc = cli(["init", "--template", "zoo"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "zoo.toml").read_text() == templates()["zoo"]
    assert "retrain explain zoo.toml" in proc.stdout
    proc = cli(["explain", "zoo.toml", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    camp = json.loads(proc.stdout)["campaign"]
    assert camp["runs"] == 18 and camp["seeds"] == [0, 1, 2]
    assert camp["total_steps"] == 18 * 10
    named = {c["label"]: c["algorithm"]["rows"][0]["name"] for c in camp["condition_details"]}
    assert named == {
        "GRPO": "GRPO",
        "Dr.GRPO": "Dr. GRPO",
        "GSPO": "GSPO",
        "CISPO": "CISPO",
        "RLOO": "RLOO",
        "MaxRL+GTPO+SEPA": "MaxRL + GTPO + SEPA",
    }
    text = cli(["explain", "zoo.toml"], tmp_path)
    assert text.returncode == 0 and "ERROR" not in text.stdout
    assert "  - Dr.GRPO\n      algorithm: Dr. GRPO (TRL 1.16 loss_type=dr_grpo" in text.stdout
    # each run has its own adapter directory, not the [backend] default
    assert "-> logs/campaign_*/runs/CONDITION_sSEED/adapter" in text.stdout
    # the base's objective is said as the base's: the conditions override its loss keys
    base = " (the base config; conditions below override parts of it)\n"
    assert "\nObjective:   is (importance-sampling policy gradient); " in text.stdout
    assert text.stdout.count(base) == 2 and "Loss:        policy_loss is, " in text.stdout


def test_zoo_runs_the_quickstart_task():
    zoo, quick = (
        load_config(REPO / "retrain/config/templates/zoo.toml"),
        load_config(REPO / "retrain/config/templates/quickstart.toml"),
    )
    assert zoo.model == quick.model and zoo.data == quick.data and zoo.reward == quick.reward
    assert zoo.eval.temperature == quick.eval.temperature and zoo.eval.size <= quick.eval.size
    assert zoo.eval.every == zoo.campaign.max_steps  # held out before step 0 and at the end


def test_man_topic_and_docs_carry_the_table(tmp_path):
    proc = cli(["man", "--topic", "algorithms"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = A.render_markdown()
    assert table in proc.stdout
    assert table in (REPO / "docs/algorithms.md").read_text()
    assert "docs/algorithms.md" in (REPO / "README.md").read_text()


def test_man_check_sees_a_stale_docs_copy(tmp_path):
    """The docs/ page is checked with the manual in a source checkout."""
    from retrain.cli.man import check_manual, manual_dir

    manual = tmp_path / "retrain" / "manual"
    manual.mkdir(parents=True)
    for page in manual_dir().glob("*.md"):
        (manual / page.name).write_text(page.read_text())
    (tmp_path / "docs").mkdir()
    docs = (REPO / "docs/algorithms.md").read_text()
    (tmp_path / "docs/algorithms.md").write_text(docs.replace("| GRPO |", "| GRPO? |"))
    assert check_manual(manual) == [
        f"{tmp_path / 'docs/algorithms.md'}: stale generated block(s) algorithm-map"
    ]
    check_manual(manual, write=True)
    assert (tmp_path / "docs/algorithms.md").read_text() == docs


CONDITIONS = """[campaign]
seeds = [1]
max_steps = 2

[[campaign.conditions]]
name = "GRPO"
advantage_mode = "grpo_std"
transform_mode = "none"
policy_loss = "ppo_clip"
"""


def test_a_named_condition_is_labelled_by_its_name(tmp_path):
    from retrain.campaign.conditions import campaign_conditions, condition_from_manifest
    from retrain.campaign.expand import expand_campaign

    path = tmp_path / "c.toml"
    path.write_text(CONDITIONS)
    config = load_config(path)
    (cond,) = campaign_conditions(config)
    assert cond.label == "GRPO"
    (run,) = expand_campaign(config, tmp_path / "camp")
    assert run.name == "GRPO_s1" and run.config.condition == "GRPO"
    again = condition_from_manifest(
        {
            "condition": "GRPO",
            "advantage_mode": "grpo_std",
            "transform_mode": "none",
            "overrides": run.overrides,
        }
    )
    assert again == cond


def test_an_empty_condition_name_is_a_config_error(tmp_path):
    (tmp_path / "retrain.toml").write_text(CONDITIONS.replace('name = "GRPO"', 'name = ""'))
    proc = cli(["explain"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "[[campaign.conditions]] entry 0: name: must be a non-empty string" in proc.stderr
