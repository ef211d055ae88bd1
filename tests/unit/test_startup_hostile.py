"""Hostile configs that the run used to accept at its start and fail on later (after the
model loaded, or at step 1): each is now refused by `retrain explain` (exit 2, the key
with its file and line), by `retrain doctor` and by the run's own startup checks, before
any model loads."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrain.advantages import AdvantagePipeline
from retrain.cli.main import main
from retrain.config import load_config
from retrain.errors import ConfigError, RetrainError
from retrain.logs.ownership import claim, launch_for
from retrain.startup import check_startup, preflight

BASE = (
    '[backend]\ndevices = "cpu"\n[model]\nmodel = "HuggingFaceTB/SmolLM2-135M-Instruct"\n'
    "[training]\nseed = 1\n"
)


def explain(capsys, path: Path, *flags: str) -> tuple[int, list[str]]:
    code = main(["explain", str(path), *flags, "--json"])
    return code, json.loads(capsys.readouterr().out)["errors"]


def write(project: Path, text: str, name: str = "c.toml") -> Path:
    (project / name).write_text(BASE + text)
    return Path(name)  # relative to the project, the cwd: errors name c.toml:LINE


# ------------------------------------------------------- [algorithm.advantage_params]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ('{eps = "x"}', "eps (c.toml:8): must be a finite number > 0 for advantage_mode 'maxrl'"),
        ("{eps = -0.5}", "eps (c.toml:8): must be a finite number > 0"),
        ("{epsilon = 1e-3}", "epsilon (c.toml:8): advantage_mode 'maxrl' does not read"),
    ],
)
def test_the_default_modes_params_are_checked(project, capsys, params, says):
    path = write(project, f"[algorithm]\nadvantage_params = {params}\n")
    code, errors = explain(capsys, path)
    assert code == 2
    assert any(e.startswith(f"[algorithm.advantage_params] {says}") for e in errors), errors
    with pytest.raises(RetrainError, match=r"\[algorithm.advantage_params\]"):
        preflight(load_config(path))  # the run's start


def test_grpo_reads_no_params_and_maxrl_only_eps():
    with pytest.raises(ConfigError, match="'grpo' does not read 'eps'"):
        AdvantagePipeline(advantage_mode="grpo", advantage_params={"eps": 1e-3})
    with pytest.raises(ConfigError, match="'maxrl' does not read 'other'"):
        AdvantagePipeline(advantage_mode="maxrl", advantage_params={"other": 1})
    AdvantagePipeline(advantage_mode="maxrl", advantage_params={"eps": 1e-3})


def test_a_table_form_param_names_its_own_line(project, capsys):
    path = write(project, "[algorithm.advantage_params]\nfoo = 1\neps = 0\n")
    code, errors = explain(capsys, path)
    assert code == 2
    assert any(e.startswith("[algorithm.advantage_params] foo (c.toml:8)") for e in errors)


# ------------------------------------------------------------- output directories


@pytest.mark.parametrize(
    ("table", "key", "says"),
    [
        ("logging", "log_dir", "'afile' is a file, not a directory"),
        ("logging", "log_dir/sub", "'afile/sub' cannot be made:"),
        ("backend", "adapter_path/sub", "'afile/sub' cannot be made:"),
    ],
)
def test_an_output_directory_that_cannot_be_written(project, capsys, table, key, says):
    (project / "afile").write_text("not a directory\n")
    key, _, sub = key.partition("/")
    value = "afile" + (f"/{sub}" if sub else "")
    setting = f'[{table}]\n{key} = "{value}"\n'
    text = BASE.replace(f"[{table}]\n", setting) if f"[{table}]" in BASE else BASE + setting
    (project / "c.toml").write_text(text)
    path = Path("c.toml")
    code, errors = explain(capsys, path)
    assert code == 2
    assert any(e.startswith(f"[{table}] {key} (c.toml:") and says in e for e in errors), errors
    with pytest.raises(ConfigError, match=f"\\[{table}\\] {key}: {says}"):
        check_startup(load_config(path))  # the run's start, before any model loads


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_directory(project, capsys):
    locked = project / "locked"
    locked.mkdir(mode=0o500)
    path = write(project, '[logging]\nlog_dir = "locked/logs"\n')
    code, errors = explain(capsys, path)
    assert code == 2 and any("is not writable by this user" in e for e in errors), errors


# ------------------------------------------------------------------------ plugins

GOOD = "NOT_CALLABLE = 3\n\ndef fn(rewards, params=None):\n    return [0.0 for _ in rewards]\n"


@pytest.fixture
def plugins(project):
    (project / "good.py").write_text(GOOD)
    (project / "raiser.py").write_text('raise RuntimeError("boom")\n\ndef fn(r):\n    return r\n')
    return project


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        (
            '[algorithm]\nadvantage_mode = "raiser.fn"\n',
            "[algorithm] advantage_mode",
            "importing module 'raiser' for plugin 'raiser.fn' raised RuntimeError: boom",
        ),
        (
            '[reward]\ntype = "custom"\ncustom_module = "raiser.py"\n',
            "[reward] custom_module",
            "RuntimeError: boom",
        ),
        (
            '[reward]\ntype = "custom"\ncustom_module = "raiser"\n[plugins]\nsearch_paths = ["."]\n',
            "[reward] custom_module",
            "importing 'raiser' failed: RuntimeError: boom",
        ),
        (
            'policy_loss = "good.nope"\n',
            "[training] policy_loss",
            "module 'good' has no attribute 'nope'",
        ),
        ('policy_loss = "good.NOT_CALLABLE"\n', "[training] policy_loss", "is not callable"),
        ('[data]\nsource = "good.nope"\n', "[data] source", "has no attribute 'nope'"),
        ('[planning]\ndetector = "good.nope"\n', "[planning] detector", "has no attribute 'nope'"),
        ('[planning]\ndetector = "good.NOT_CALLABLE"\n', "[planning] detector", "not a detector"),
        ('[data]\nsource = "good.NOT_CALLABLE"\n', "[data] source", "not a function or class"),
    ],
)
def test_plugins_are_imported_before_the_model_loads(plugins, capsys, text, key, says):
    path = write(plugins, text)
    code, errors = explain(capsys, path)
    assert code == 2
    assert any(e.startswith(f"{key} (c.toml:") and says in e for e in errors), errors


def test_a_plugin_backend_that_does_not_resolve_is_one_error_under_its_key(plugins, capsys):
    path = plugins / "c.toml"
    path.write_text(BASE.replace("[backend]\n", '[backend]\nbackend = "good.nope"\n'))
    code, errors = explain(capsys, Path("c.toml"))
    assert code == 2
    assert errors == [
        "[backend] backend (c.toml:2): module 'good' has no attribute 'nope' (plugin "
        "'good.nope'). Fix: a built-in name or an importable pkg.module.attr ([plugins] "
        "search_paths are put on sys.path)"
    ]
    with pytest.raises(ConfigError, match=r"\[backend\] backend: module 'good'"):
        check_startup(load_config(path))


def test_a_backend_path_that_names_a_module_is_refused(project, capsys):
    path = write(project, "")
    code, errors = explain(capsys, path, "--backend", "os.path")
    assert code == 2
    assert any(
        e.startswith("[backend] backend (from --backend): backend 'os.path' names a module")
        for e in errors
    )
    assert main(["backends", "os.path"]) != 0


# ---------------------------------------------------------------- reasoning-gym args

GYM = '[data]\nsource = "reasoning_gym"\ntask = "chain_sum"\n[data.args]\n'


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            "bogus_arg = 5",
            "[data.args] bogus_arg (c.toml:11): reasoning-gym task 'chain_sum' has no option",
        ),
        ('min_terms = "two"', "[data.args] min_terms (c.toml:11): must be an integer"),
        ("min_terms = 9", "[data] args (c.toml:10): rejected by reasoning-gym task 'chain_sum'"),
    ],
)
def test_reasoning_gym_args_are_checked_as_the_data_source_uses_them(project, capsys, args, says):
    pytest.importorskip("reasoning_gym")
    path = write(project, GYM + args + "\n")
    code, errors = explain(capsys, path)
    assert code == 2 and any(e.startswith(says) for e in errors), errors
    with pytest.raises(ConfigError, match="data"):
        check_startup(load_config(path))


def test_a_task_whose_defaults_generate_nothing_is_refused_without_args(project, capsys):
    """reasoning-gym's 'composite' refuses its defaults (no datasets named): found from the
    cached catalog, so explain and the run's start say so before any model loads."""
    pytest.importorskip("reasoning_gym")
    path = write(project, GYM.replace("chain_sum", "composite").replace("[data.args]\n", ""))
    code, errors = explain(capsys, path)
    assert code == 2
    says = "reasoning-gym task 'composite' generates nothing with its default options: "
    assert any(e.startswith("[data] args") and says in e for e in errors), errors
    with pytest.raises(ConfigError, match="Must specify at least one dataset"):
        check_startup(load_config(path))


def test_good_reasoning_gym_args_pass(project, capsys):
    pytest.importorskip("reasoning_gym")
    code, errors = explain(capsys, write(project, GYM + "min_terms = 3\n"))
    assert not [e for e in errors if "data" in e], errors


# ---------------------------------------------------------------------- campaigns

CAMPAIGN = (
    BASE
    + "[campaign]\nseeds = [1]\nmax_steps = 1\n"
    + "".join(
        f'[[campaign.conditions]]\nadvantage_mode = "{mode}"\ntransform_mode = "none"\n{extra}\n'
        for mode, extra in [
            ("grpo", ""),
            ("grpo", "lr = 1e-4"),  # an override without a problem
            ("maxrl", 'advantage_params = {eps = "x"}'),
            ("maxrl", 'devices = "gpu:7"'),
            ("grpo", 'devices = "gpu:7"'),
            ("maxrl", 'model = "nope/nope"'),
            ("maxrl", 'data = {source = "reasoning_gym", task = "nope_task"}'),
        ]
    )
)


def test_campaign_conditions_get_the_startup_checks(project, capsys, hub):
    hub.missing.add("nope/nope")
    (project / "camp.toml").write_text(CAMPAIGN)
    code, errors = explain(capsys, Path("camp.toml"))
    assert code == 2
    expected = [
        ("[algorithm.advantage_params] eps: must be", "condition maxrl+none~advantage_params"),
        ("[backend] devices: 'gpu:7'", "conditions maxrl+none~devices=gpu:7, grpo+none~devices"),
        ("[model] model: 'nope/nope'", "condition maxrl+none~model=nope/nope"),
    ]
    if importlib.util.find_spec("reasoning_gym") is not None:
        expected.append(("[data] task: unknown reasoning-gym task 'nope_task'", "condition"))
    for start, names in expected:
        # one line per problem, naming its conditions
        assert len([e for e in errors if e.startswith(start) and names in e]) == 1, (start, errors)
    assert not any("lr=0.0001" in e for e in errors)
    # the campaign's own start refuses them before any run (or directory) starts
    from retrain.campaign.run import run_campaign

    with pytest.raises(ConfigError) as exc:
        run_campaign(load_config("camp.toml"), "camp.toml", out=lambda s: None)
    assert "condition maxrl+none~model=nope/nope" in str(exc.value)
    assert not (project / "logs").exists()


def test_a_campaign_whose_base_config_cannot_start_is_refused_before_any_run(project, hub):
    """A problem of the base config would fail every run, each after the campaign had made
    its directory and started it: the campaign's own start refuses it, once."""
    from retrain.campaign.expand import expand_campaign
    from retrain.campaign.run import _condition_problems, run_campaign

    hub.missing.add("nope/nope")
    base = (
        '[backend]\ndevices = "cpu"\n[model]\nmodel = "nope/nope"\n'
        "[campaign]\nseeds = [1, 2]\nmax_steps = 1\n"
        '[[campaign.conditions]]\nadvantage_mode = "grpo"\ntransform_mode = "none"\n'
    )
    (project / "camp.toml").write_text(base)
    with pytest.raises(ConfigError) as exc:
        run_campaign(load_config("camp.toml"), "camp.toml", out=lambda s: None)
    assert [p for p in exc.value.problems if p.startswith("[model] model: 'nope/nope'")]
    assert not (project / "logs").exists()
    # where every condition overrides the broken key, the campaign starts
    (project / "camp.toml").write_text(base + 'model = "HuggingFaceTB/SmolLM2-135M-Instruct"\n')
    config = load_config("camp.toml")
    assert _condition_problems(config, expand_campaign(config, "CAMPAIGN_DIR")) == []


# ----------------------------------------------------------------------- live runs


def _run_json(
    log_dir: Path, pid: int, host: str, heartbeat: float, started_at: float | None = None
) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    info = {"status": "running", "pid": pid, "host": host, "heartbeat": heartbeat}
    if started_at is not None:
        info["started_at"] = started_at
    (log_dir / "run.json").write_text(json.dumps(info))


def test_a_live_run_is_neither_overwritten_nor_resumed(project, capsys):
    write(project, "", "retrain.toml")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _run_json(project / "logs" / "train", live.pid, socket.gethostname(), time.time())
        code, errors = explain(capsys, Path("retrain.toml"), "--overwrite")
        says = (
            f"the run in {project / 'logs' / 'train'} is running as pid {live.pid}; stop it first"
        )
        assert code == 2 and any(e.startswith("[logging] log_dir") and says in e for e in errors)
        config = load_config("retrain.toml")
        with pytest.raises(ConfigError, match=f"running as pid {live.pid}"):
            claim(config, launch_for("retrain.toml", overwrite=True), print)
        assert (project / "logs" / "train" / "metrics.jsonl").exists()  # nothing moved
        code, errors = explain(capsys, Path("retrain.toml"), "--resume", "logs/train")
        assert any(e.startswith("[resume] from (from --resume):") and says in e for e in errors)
        # a run that started (its run.json) after the process did: its own process
        _run_json(
            project / "logs" / "train", live.pid, socket.gethostname(), time.time(), time.time()
        )
        assert explain(capsys, Path("retrain.toml"), "--overwrite")[0] == 2
        # ...and one that started an hour before it: the pid is another process's now
        hour_ago = time.time() - 3600
        _run_json(project / "logs" / "train", live.pid, socket.gethostname(), hour_ago, hour_ago)
        code, errors = explain(capsys, Path("retrain.toml"), "--overwrite")
        assert not any("running as pid" in e for e in errors), errors
    finally:
        live.kill()
        live.wait()
    code, errors = explain(capsys, Path("retrain.toml"), "--overwrite")
    assert not any("running as pid" in e for e in errors), errors


def test_a_run_on_another_host_is_live_while_its_heartbeat_is_fresh(project, capsys):
    write(project, "", "retrain.toml")
    log_dir = project / "logs" / "train"
    _run_json(log_dir, 12345, "another-host", time.time())
    code, errors = explain(capsys, Path("retrain.toml"), "--overwrite")
    assert any("running as pid 12345 on another-host" in e for e in errors), errors
    _run_json(log_dir, 12345, "another-host", time.time() - 3600)  # stale: not live
    code, errors = explain(capsys, Path("retrain.toml"), "--overwrite")
    assert not any("running as pid" in e for e in errors), errors
