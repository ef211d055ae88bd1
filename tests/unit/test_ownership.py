"""Which directories hold another run (retrain/logs/ownership.py), on real directories:
what counts, what a resumed run or a campaign may reuse, and where --overwrite moves
things. (tests/integration/test_run_dirs_cli.py runs the user's commands end to end.)"""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from retrain.config import config_from_dict
from retrain.errors import ConfigError, UsageError
from retrain.logs.ownership import Launch, aside_path, claim, launch_for, occupied_dirs


def config(tmp_path, **tables):
    raw = {
        "logging": {"log_dir": str(tmp_path / "logs")},
        "backend": {"adapter_path": str(tmp_path / "adapters"), "devices": "cpu"},
    }
    for name, values in tables.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def a_finished_run(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (tmp_path / "logs" / "trainer_state.json").write_text(json.dumps({"step": 2, "finished": True}))
    (tmp_path / "adapters" / "final").mkdir(parents=True)


def test_empty_files_and_other_names_are_not_another_run(tmp_path):
    # what a run that stopped before its first step leaves, and a campaign's run files
    logs = tmp_path / "logs"
    (logs / "emergence").mkdir(parents=True)
    for name in ("metrics.jsonl", "emergence/steps.jsonl", "run.json", "config.resolved.toml"):
        (logs / name).write_text("")
    (logs / "run.toml").write_text("[training]\n")
    (logs / "metrics.attempt1.jsonl").write_text('{"step": 0}\n')  # set aside by a campaign
    (tmp_path / "adapters" / "live").mkdir(parents=True)
    assert occupied_dirs(config(tmp_path)) == []


def test_rows_a_state_and_checkpoints_are_another_run(tmp_path):
    a_finished_run(tmp_path)
    (tmp_path / "logs" / "eval.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "adapters" / "checkpoint_step_1").mkdir()
    logs, adapters = occupied_dirs(config(tmp_path))
    assert (logs.key, logs.resumable, logs.finished) == ("log_dir", True, True)
    assert logs.found == (
        "metrics.jsonl: 2 rows",
        "eval.jsonl: 1 rows",
        "trainer_state.json: step 2, finished",
    )
    assert (adapters.key, adapters.found) == ("adapter_path", ("checkpoint_step_1/", "final/"))


def test_a_resumed_run_writes_into_its_own_directories(tmp_path):
    a_finished_run(tmp_path)
    assert occupied_dirs(config(tmp_path, resume={"from": str(tmp_path / "logs")})) == []
    # resuming into another log dir that holds a run is still refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 0}\n')
    resumed = config(tmp_path, resume={"from": str(tmp_path / "logs")})
    resumed.logging.log_dir = str(other)
    assert [o.path for o in occupied_dirs(resumed)] == [other]


def test_a_backend_that_ignores_adapter_path_is_not_refused_for_it(tmp_path):
    a_finished_run(tmp_path)
    (tmp_path / "logs" / "metrics.jsonl").unlink()
    (tmp_path / "logs" / "trainer_state.json").unlink()
    assert occupied_dirs(config(tmp_path, backend={"backend": "tinker"})) == []
    assert [o.key for o in occupied_dirs(config(tmp_path))] == ["adapter_path"]


def test_the_refusal_names_every_key_where_it_was_set_and_the_fixes(tmp_path):
    a_finished_run(tmp_path)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[logging]\nlog_dir = "{tmp_path / "logs"}"\n')
    launch = launch_for(str(toml), ["--adapter-path", str(tmp_path / "adapters"), "--seed", "3"])
    with pytest.raises(ConfigError) as caught:
        claim(config(tmp_path), launch, say=print)
    assert caught.value.exit_code == 2
    log_line, adapter_line = caught.value.problems
    assert log_line.startswith(f"[logging] log_dir ({toml}:2): {tmp_path / 'logs'} holds another")
    # the run finished its 2 steps: the command raises max_steps to this config's (500)
    assert (
        f"--seed 3 --resume {tmp_path / 'logs'} --max-steps 500 (it finished its 2 steps; "
        "this trains steps 2 to 499: --max-steps 500 is this command's max_steps)"
    ) in log_line
    assert adapter_line.startswith("[backend] adapter_path (from --adapter-path): ")
    assert "--seed 3 --overwrite (moves" in adapter_line and "nothing is deleted" in adapter_line


def test_checkpoints_of_the_run_in_the_log_dir_name_its_resume(tmp_path):
    """The log dir's trainer state names a checkpoint inside adapter_path: that run wrote
    them, and its resume command is the fix; a state naming another directory, or none,
    leaves the writer unknown."""
    a_finished_run(tmp_path)
    state = tmp_path / "logs" / "trainer_state.json"
    saved = {"adapter": str(tmp_path / "adapters" / "final"), "state": "x"}
    state.write_text(json.dumps({"step": 2, "finished": True, "checkpoint": saved}))
    launch = launch_for(None, ["--seed", "3"])
    with pytest.raises(ConfigError) as caught:
        claim(config(tmp_path), launch, say=print)
    adapter_line = caught.value.problems[1]
    want = f"continue the run that wrote them: retrain --seed 3 --resume {tmp_path / 'logs'}"
    assert want in adapter_line and "ITS_LOG_DIR" not in adapter_line
    for elsewhere in ({"adapter": str(tmp_path / "other" / "final")}, None, "final"):
        state.write_text(json.dumps({"step": 2, "checkpoint": elsewhere}))
        (occupied,) = [o for o in occupied_dirs(config(tmp_path)) if o.key == "adapter_path"]
        assert occupied.writer is None, elsewhere


def test_launch_for_drops_resume_flags_from_the_command(tmp_path):
    flags = ["--resume", "logs/a", "--lr", "1e-4", "--resume-from=logs/b"]
    assert launch_for("my run.toml", flags).line("--resume", "x") == (
        "retrain 'my run.toml' --lr 1e-4 --resume x"
    )
    assert launch_for("retrain.toml").line() == "retrain"


def test_overwrite_moves_both_aside_whole_and_never_deletes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a_finished_run(tmp_path)
    said = []
    claim(config(tmp_path), Launch(overwrite=True), say=said.append)
    (logs_aside,) = tmp_path.glob("logs.old-*")
    (adapters_aside,) = tmp_path.glob("adapters.old-*")
    assert (logs_aside / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert (adapters_aside / "final").is_dir()
    assert not (tmp_path / "logs").exists() and not (tmp_path / "adapters").exists()
    assert len(said) == 2 and f"aside to {logs_aside}" in said[0]


def test_aside_names_never_collide(tmp_path):
    now = datetime(2025, 1, 2, 3, 4, 5)
    first = aside_path(tmp_path / "logs", now)
    assert first.name == "logs.old-20250102-030405"
    first.mkdir()
    assert aside_path(tmp_path / "logs", now).name == "logs.old-20250102-030405-2"


def test_overwrite_never_moves_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, logging={"log_dir": "."})
    with pytest.raises(UsageError, match="holds the working directory"):
        claim(cfg, Launch(overwrite=True), say=print)
    assert (tmp_path / "metrics.jsonl").exists()


def test_a_campaign_makes_its_own_directories(tmp_path):
    a_finished_run(tmp_path)
    assert occupied_dirs(config(tmp_path, campaign={"seeds": [1]})) == []


def test_a_campaign_retry_from_scratch_sets_the_failed_attempt_aside(tmp_path):
    """A campaign run that crashed before its first trainer_state.json (rows logged, a
    checkpoint directory written) starts over: its directories must not read as another
    run's, or the retry would be refused."""
    from retrain.campaign.expand import expand_campaign
    from retrain.campaign.run import set_aside_partial_logs

    base = config(tmp_path, campaign={"seeds": [1]})
    run = expand_campaign(base, tmp_path / "campaign")[0]
    log_dir, adapters = (
        tmp_path / "campaign" / "runs" / run.name,
        tmp_path / "campaign" / "runs" / run.name / "adapter",
    )
    (adapters / "checkpoint_step_1").mkdir(parents=True)
    (log_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (log_dir / "console.log").write_text("attempt 1\n")
    assert [o.key for o in occupied_dirs(run.config)] == ["log_dir", "adapter_path"]
    moved = set_aside_partial_logs(run, 1)
    assert moved == [str(log_dir / "metrics.attempt1.jsonl"), str(log_dir / "adapter.attempt1")]
    assert occupied_dirs(run.config) == []
    assert (log_dir / "adapter.attempt1" / "checkpoint_step_1").is_dir()
