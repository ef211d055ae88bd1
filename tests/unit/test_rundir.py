"""retrain.logs.rundir: the run and campaign directory reader behind status, compare and
campaigns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from retrain.logs.rundir import (
    CampaignDir,
    RunDir,
    is_run_dir,
    read_json,
    run_dir_name,
    safe_label,
)


def write_rows(path: Path, rows, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "maxrl+gtpo_s3"
    rows = [
        {
            "step": 0,
            "condition": "maxrl+gtpo",
            "correct_rate": 0.25,
            "batch_size": 2,
            "group_size": 4,
        },
        {
            "step": 1,
            "condition": "maxrl+gtpo",
            "correct_rate": 0.5,
            "batch_size": 2,
            "group_size": 4,
        },
        {
            "step": 1,
            "condition": "maxrl+gtpo",
            "correct_rate": 0.75,
            "batch_size": 2,
            "group_size": 4,
        },
    ]
    write_rows(d / "metrics.jsonl", rows, tail='{"step": 2, "corr')
    (d / "run.json").write_text(
        json.dumps({"status": "running", "condition": "x", "max_steps": 10, "heartbeat": 123.5})
    )
    (d / "trainer_state.json").write_text(json.dumps({"step": 5, "finished": False}))
    (d / "config.resolved.toml").write_text("[training]\nseed = 7\nmax_steps = 20\n")
    return d


def test_run_files_and_facts(run_dir):
    run = RunDir(run_dir)
    assert [r["step"] for r in run.metrics] == [0, 1, 1]
    assert [r["correct_rate"] for r in run.step_rows] == [0.25, 0.75]  # the last row wins
    assert run.corrupt_lines == [4]
    assert any("skipped 1 corrupt line(s)" in w for w in run.warnings)
    assert run.condition == "maxrl+gtpo"  # the metrics rows before run.json
    assert run.seed == 7  # the configured seed before the directory name's
    assert run.max_steps == 10  # run.json before the config
    assert run.steps_done == 5  # the checkpoint got further than the logged rows
    assert run.heartbeat == 123.5
    assert run.has_checkpoint and not run.finished
    assert run.run_info["status"] == "running" and run.trainer_state["step"] == 5


def test_correct_counts_from_metrics_then_generations(run_dir):
    run = RunDir(run_dir)
    assert run.correct_counts() == (8, 16)  # 2 + 6 of 8 each, from the deduplicated rows
    assert run.correct_counts(horizon=1) == (2, 8)
    write_rows(run_dir / "metrics.jsonl", [{"step": 0, "correct_rate": 0.5}])
    write_rows(
        run_dir / "emergence" / "generations.jsonl",
        [{"step": 0, "correct": True}, {"step": 0, "correct": False}, {"step": 1, "correct": True}],
    )
    run = RunDir(run_dir)
    assert run.correct_counts() == (2, 3)  # no batch/group sizes: counted completions
    assert run.correct_counts(horizon=1) == (1, 2)


def test_missing_and_unreadable_files_are_tolerated(tmp_path):
    empty = RunDir(tmp_path / "nowhere")
    assert empty.metrics == [] and empty.step_rows == [] and empty.run_info == {}
    assert empty.condition is None and empty.seed is None and empty.max_steps is None
    assert empty.steps_done == 0 and empty.heartbeat is None and empty.correct_counts() is None
    assert not empty.has_checkpoint and not empty.finished and empty.warnings == []

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "run.json").write_text('{"status": "runn')
    (broken / "trainer_state.json").write_text("[1, 2]")
    run = RunDir(broken)
    assert run.run_info == {} and run.trainer_state == {}
    assert any(w.startswith("cannot read") for w in run.warnings)
    assert any("does not hold a JSON object" in w for w in run.warnings)
    warnings: list[str] = []
    assert read_json(broken / "absent.json", warnings) is None and warnings == []


def test_heartbeat_falls_back_to_the_newest_file(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [{"step": 0}])
    os.utime(tmp_path / "metrics.jsonl", (1000.0, 1000.0))
    assert RunDir(tmp_path).heartbeat == 1000.0
    assert is_run_dir(tmp_path) and not is_run_dir(tmp_path / "elsewhere")


def test_condition_and_seed_from_config_or_name(tmp_path):
    by_config = tmp_path / "plain"
    by_config.mkdir()
    (by_config / "run.toml").write_text(
        '[algorithm]\nadvantage_mode = "grpo"\ntransform_mode = "none"\n[training]\nseed = 4\n'
    )
    run = RunDir(by_config)
    assert (run.condition, run.seed) == ("grpo+none", 4)  # run.toml when not resolved yet

    by_name = tmp_path / "maxrl+gtpo_sepa_s11"
    by_name.mkdir()
    (by_name / "config.resolved.toml").write_text("[training]\nseed = -1\n")
    run = RunDir(by_name)
    assert run.name_parts == ("maxrl+gtpo_sepa", 11)
    assert (run.condition, run.seed) == ("maxrl+gtpo_sepa", 11)
    assert RunDir(tmp_path / "no_suffix").name_parts is None


def test_campaign_entries_and_where_their_runs_are(tmp_path, monkeypatch):
    camp = tmp_path / "campaign_1"
    for name in ("a_s1", "b_s2", "c_s3", "d_s4"):
        write_rows(camp / "runs" / name / "metrics.jsonl", [{"step": 0}])
    (camp / "runs" / "not_a_run").mkdir()
    entries = [
        {"name": "a_s1", "log_dir": "/elsewhere/a_s1"},  # by name
        {"log_dir": "runs/b_s2"},  # relative to the campaign
        {"log_dir": "/moved/away/c_s3"},  # a moved campaign: the last part under runs/
        {"condition": "d", "seed": 4},  # by condition and seed
        {"condition": "e", "seed": 5},  # not there
        "not an entry",
    ]
    (camp / "manifest.json").write_text(json.dumps({"runs": entries, "max_steps": 3}))
    monkeypatch.chdir(tmp_path)
    campaign = CampaignDir(camp)
    assert len(campaign.entries) == 5 and campaign.manifest["max_steps"] == 3
    found = [campaign.run_dir(e) for e in campaign.entries]
    assert found == [camp / "runs" / n for n in ("a_s1", "b_s2", "c_s3", "d_s4")] + [None]
    assert [p.name for p in campaign.run_dirs()] == ["a_s1", "b_s2", "c_s3", "d_s4"]
    assert campaign.warnings == []


def test_campaign_without_a_runs_list(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    campaign = CampaignDir(tmp_path)
    assert campaign.manifest == {} and campaign.entries is None and campaign.run_dirs() == []
    assert campaign.warnings and campaign.warnings[0].startswith("cannot read")


def test_condition_label_with_overrides_and_safe_run_dirs(tmp_path):
    label = "maxrl+gtpo~model=Qwen/Qwen3-0.6B"
    name = run_dir_name(label, 3)
    assert "/" not in name and name.endswith("_s3") and name != run_dir_name(label + "x", 3)
    assert run_dir_name("maxrl+gtpo~lr=0.0001", 3) == "maxrl+gtpo~lr=0.0001_s3"
    assert safe_label(".hidden") != ".hidden" and not safe_label(".hidden").startswith(".")
    # a run whose config carries the campaign's label (no rows yet)
    camp = tmp_path / "campaign_1"
    run = camp / "runs" / name
    run.mkdir(parents=True)
    (run / "run.toml").write_text(
        '[algorithm]\nadvantage_mode = "maxrl"\ntransform_mode = "gtpo"\n'
        f'[logging]\ncondition_label = "{label}"\n'
    )
    assert RunDir(run).condition == label
    assert RunDir(run).name_parts == (name[: -len("_s3")], 3)
    # a manifest entry with only condition + seed finds the sanitised directory
    (camp / "manifest.json").write_text(json.dumps({"runs": [{"condition": label, "seed": 3}]}))
    campaign = CampaignDir(camp)
    assert campaign.run_dir(campaign.entries[0]) == run
