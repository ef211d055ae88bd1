"""Campaigns end to end.

Two kinds of tests:
* executor mechanics (ordering, worker limit, stagger, failures, resume, Ctrl-C) with a
  stand-in child process: the campaign code is real, only the command each run starts is
  swapped for a short Python script, so these take a second or two;
* real campaigns on the tiny random model: 2 conditions x 2 seeds x 2 steps in parallel
  workers with one run crashing mid-way, then resumed; and the Ray executor on a local Ray
  instance.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

import retrain.campaign.run as campaign_run
from retrain.campaign.run import CampaignError, run_campaign
from retrain.cli.main import main as cli_main
from retrain.config import config_from_dict
from retrain.errors import ConfigError
from retrain.logs.jsonl import read_jsonl
from retrain.logs.rundir import run_dir_name

# ----------------------------------------------------------------------------- stand-in runs

FAKE_RUN = r"""
import json, os, signal, sys, time
name, log_dir, mode, plan_path, events = sys.argv[1:6]
plan = json.load(open(plan_path)).get(name, {})

def log(kind):
    with open(events, "a") as fh:
        fh.write(json.dumps({"name": name, "kind": kind, "t": time.time(), "mode": mode}) + "\n")

def on_term(signum, frame):
    log("term")
    sys.exit(143)

signal.signal(signal.SIGTERM, on_term)
log("start")
print(f"hello from {name}", flush=True)
time.sleep(plan.get("sleep", 0.0))
code = plan.get("exit", 0)
os.makedirs(log_dir, exist_ok=True)
with open(os.path.join(log_dir, "trainer_state.json"), "w") as fh:
    json.dump({"step": 2 if code == 0 else 1, "finished": code == 0}, fh)
log("end")
sys.exit(code)
"""


class Fake:
    """Swap the command each run starts for FAKE_RUN, steered by a plan {name: {exit, sleep}}."""

    def __init__(self, tmp_path: Path, monkeypatch, plan=None, real: set[str] | None = None):
        self.plan_path = tmp_path / "plan.json"
        self.events_path = tmp_path / "events.jsonl"
        self.set_plan(plan or {})
        original = campaign_run.run_python_args

        def args(run, resume):
            if real and run.name in real:
                return original(run, resume)
            mode = "resume" if resume else "fresh"
            return [
                "-c",
                FAKE_RUN,
                run.name,
                run.log_dir,
                mode,
                str(self.plan_path),
                str(self.events_path),
            ]

        monkeypatch.setattr(campaign_run, "run_python_args", args)

    def set_plan(self, plan):
        self.plan_path.write_text(json.dumps(plan))

    def events(self):
        rows, _ = read_jsonl(self.events_path)
        return rows


BASE_MODEL = ""  # the tiny model's directory, set for each test by the fixture below


@pytest.fixture(autouse=True)
def _base_model(tiny_model_dir, monkeypatch):
    """The stand-in runs load no model, but the campaign's start checks the base config's
    model and devices as each run would: the tiny model on the CPU passes them."""
    monkeypatch.setattr(sys.modules[__name__], "BASE_MODEL", str(tiny_model_dir))


def campaign_config(tmp_path, **campaign):
    camp = {
        "seeds": [1, 2],
        "max_steps": 2,
        "conditions": [
            {"advantage_mode": "grpo", "transform_mode": "none"},
            {"advantage_mode": "maxrl", "transform_mode": "none"},
        ],
    }
    camp.update(campaign)
    return config_from_dict(
        {
            "backend": {"devices": "cpu"},
            "model": {"model": BASE_MODEL},
            # procedural data: the runs' start checks would refuse MATH with no hub here
            "data": {"source": "reasoning_gym", "task": "basic_arithmetic"},
            "logging": {"log_dir": str(tmp_path / "logs" / "train")},
            "campaign": camp,
        }
    )


def only_campaign(tmp_path) -> Path:
    (d,) = sorted((tmp_path / "logs").glob("campaign_*"))
    return d


def manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


NAMES = ["grpo+none_s1", "grpo+none_s2", "maxrl+none_s1", "maxrl+none_s2"]


def test_sequential_runs_in_order_survives_a_failure_and_resumes(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch, {"grpo+none_s2": {"exit": 3}})
    cfg = campaign_config(tmp_path)
    cfg.squeeze = config_from_dict({"squeeze": {}}).squeeze  # auto-squeeze: no adapter here
    lines: list[str] = []
    assert run_campaign(cfg, "camp.toml", out=lines.append) == 1
    d = only_campaign(tmp_path)
    assert d.name.startswith("campaign_") and len(d.name) == len("campaign_20250101_000000")

    events = fake.events()
    assert [(e["name"], e["kind"]) for e in events] == [
        (n, k) for n in NAMES for k in ("start", "end")
    ], "one run at a time, in submission order"
    text = "\n".join(lines)
    assert "[grpo+none_s1] hello from grpo+none_s1" in text  # streamed with a prefix
    assert "FAILED grpo+none_s2: exit code 3" in text
    assert f"Resume with: retrain camp.toml --resume {d}" in text
    assert "Auto-squeeze failed" in text  # reported, and the runs went on

    m = manifest(d)
    assert m["status"] == "failed" and m["executor"] == "sequential"
    assert m["conditions"] == ["grpo+none", "maxrl+none"] and m["seeds"] == [1, 2]
    assert m["max_steps"] == 2 and m["base_config"]["campaign"]["seeds"] == [1, 2]
    assert m["squeeze"]["run"] == "grpo+none_s1" and "error" in m["squeeze"]
    runs = {r["name"]: r for r in m["runs"]}
    assert list(runs) == NAMES
    for name, r in runs.items():
        failed = name == "grpo+none_s2"
        assert r["status"] == ("failed" if failed else "finished")
        assert r["exit_code"] == (3 if failed else 0) and r["attempts"] == 1
        assert r["finished_at"] >= r["started_at"] and r["duration_s"] >= 0
        assert r["log_dir"] == str(d / "runs" / name)
        assert r["adapter_path"] == str(d / "runs" / name / "adapter")
        assert Path(r["config_path"]).is_file()
        assert f"hello from {name}" in (d / "runs" / name / "console.log").read_text()
    assert (d / "base_config.toml").is_file()

    # resume: the failed run continues from its checkpoint; finished runs are skipped
    fake.set_plan({})
    cfg.resume.from_ = str(d)
    lines.clear()
    assert run_campaign(cfg, "camp.toml", out=lines.append) == 0
    again = fake.events()[len(events) :]
    assert [(e["name"], e["kind"], e["mode"]) for e in again] == [
        ("grpo+none_s2", "start", "resume"),
        ("grpo+none_s2", "end", "resume"),
    ]
    m = manifest(d)
    assert m["status"] == "finished"
    assert {r["name"]: r["attempts"] for r in m["runs"]} == {
        "grpo+none_s1": 1,
        "grpo+none_s2": 2,
        "maxrl+none_s1": 1,
        "maxrl+none_s2": 1,
    }
    assert "3 already finished" in "\n".join(lines)


def test_parallel_bounds_workers_and_staggers_launches(tmp_path, monkeypatch):
    names = [f"{c}_s{s}" for c in ("grpo+none", "maxrl+none") for s in (1, 2, 3)]
    fake = Fake(tmp_path, monkeypatch, {n: {"sleep": 0.6} for n in names})
    cfg = campaign_config(
        tmp_path, seeds=[1, 2, 3], parallel=True, max_workers=2, stagger_seconds=0.3
    )
    lines: list[str] = []
    assert run_campaign(cfg, None, out=lines.append) == 0
    events = sorted(fake.events(), key=lambda e: (e["t"], e["kind"] == "start"))
    running = peak = 0
    for e in events:
        running += 1 if e["kind"] == "start" else -1
        peak = max(peak, running)
    assert peak == 2
    m = manifest(only_campaign(tmp_path))
    assert m["executor"] == "parallel" and m["status"] == "finished"
    starts = sorted(r["started_at"] for r in m["runs"])
    assert all(b - a >= 0.2 for a, b in zip(starts, starts[1:]))  # 0.3 s minus jitter
    assert not any("hello from" in line for line in lines)  # parallel output goes to console.log


def test_ctrl_c_or_sigterm_stops_children_gracefully(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch, {n: {"sleep": 60} for n in NAMES})
    cfg = campaign_config(tmp_path, parallel=True, max_workers=2)

    def interrupt_when_started():
        deadline = time.time() + 60
        while time.time() < deadline:
            if sum(e["kind"] == "start" for e in fake.events()) == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the campaign treats it like Ctrl-C
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    lines: list[str] = []
    start = time.time()
    assert run_campaign(cfg, "camp.toml", out=lines.append) == 130
    assert time.time() - start < 30
    terms = {e["name"] for e in fake.events() if e["kind"] == "term"}
    assert terms == {"grpo+none_s1", "grpo+none_s2"}
    m = manifest(only_campaign(tmp_path))
    assert m["status"] == "interrupted"
    assert [r["status"] for r in m["runs"]] == ["interrupted", "interrupted", "pending", "pending"]
    assert [r["exit_code"] for r in m["runs"][:2]] == [143, 143]
    assert any(line.startswith("Resume with: retrain camp.toml --resume") for line in lines)


def test_config_problems_stop_the_campaign_before_it_starts(tmp_path):
    cfg = campaign_config(
        tmp_path, conditions=[{"advantage_mode": "maxrl", "transform_mode": "gtpo"}]
    )
    cfg.backend.backend = "prime_rl"  # cannot train token-level advantages
    with pytest.raises(ConfigError, match="maxrl\\+gtpo_s1"):
        run_campaign(cfg, None, out=lambda s: None)
    assert not (tmp_path / "logs").exists()


def test_conditions_with_overrides_run_under_their_labels_and_resume(tmp_path, monkeypatch):
    """Two conditions that differ only by overrides: separate runs, labels, run.toml
    values and manifest entries; a resume rebuilds each run from the manifest."""
    tuned = "grpo+none~lr=0.0001,uncertainty_kind=shannon_entropy"
    # a model a condition overrides is checked before the campaign starts: one that can be had
    small = "HuggingFaceTB/SmolLM2-135M-Instruct"
    odd = f"grpo+none~model.model={small}"
    odd_name = run_dir_name(odd, 1)
    fake = Fake(tmp_path, monkeypatch, {odd_name: {"exit": 3}})
    cfg = campaign_config(
        tmp_path,
        seeds=[1],
        conditions=[
            {"advantage_mode": "grpo", "transform_mode": "none"},
            {
                "advantage_mode": "grpo",
                "transform_mode": "none",
                "lr": 1e-4,
                "uncertainty_kind": "shannon_entropy",
            },
            {"advantage_mode": "grpo", "transform_mode": "none", "model": {"model": small}},
        ],
    )
    assert run_campaign(cfg, "camp.toml", out=lambda s: None) == 1
    d = only_campaign(tmp_path)
    m = manifest(d)
    assert m["conditions"] == ["grpo+none", tuned, odd]
    by = {r["condition"]: r for r in m["runs"]}
    assert by[tuned]["name"] == f"{tuned}_s1" and by[tuned]["overrides"] == {
        "lr": 1e-4,
        "uncertainty_kind": "shannon_entropy",
    }
    assert by[odd]["overrides"] == {"model.model": small} and "/" not in by[odd]["name"]
    assert by["grpo+none"]["overrides"] == {}
    run_toml = config_from_dict(tomllib.loads(Path(by[tuned]["config_path"]).read_text()))
    assert run_toml.training.lr == 1e-4 and run_toml.algorithm.uncertainty_kind == "shannon_entropy"
    assert run_toml.logging.wandb_group == tuned
    odd_toml = config_from_dict(tomllib.loads(Path(by[odd]["config_path"]).read_text()))
    assert odd_toml.model.model == small and odd_toml.training.lr == 4e-5

    # resume from a TOML without the overrides: the manifest's conditions are used
    fake.set_plan({})
    plain = campaign_config(tmp_path, seeds=[1])
    plain.resume.from_ = str(d)
    lines: list[str] = []
    assert run_campaign(plain, "camp.toml", out=lines.append) == 0
    assert [e["name"] for e in fake.events() if e["kind"] == "start"][-1] == odd_name
    again = config_from_dict(tomllib.loads(Path(by[odd]["config_path"]).read_text()))
    assert again.model.model == small
    assert manifest(d)["status"] == "finished"


def test_resume_needs_a_campaign_directory(tmp_path):
    cfg = campaign_config(tmp_path)
    cfg.resume.from_ = str(tmp_path / "missing")
    with pytest.raises(CampaignError, match="does not exist"):
        run_campaign(cfg, None, out=lambda s: None)
    run_dir = tmp_path / "a_run"
    run_dir.mkdir()
    (run_dir / "trainer_state.json").write_text("{}")
    cfg.resume.from_ = str(run_dir)
    with pytest.raises(CampaignError, match="single run's log dir"):
        run_campaign(cfg, None, out=lambda s: None)


# ----------------------------------------------------------------------------- real runs

FAILING_REWARD = """
import os, sys
_calls = [0]

def score(response, reference):
    _calls[0] += 1
    # die hard in step 2 (after the step-1 checkpoint) of one run while the marker exists
    if _calls[0] > 8 and os.path.exists({marker!r}) and any({victim!r} in a for a in sys.argv):
        os._exit(3)
    return float(len(response) % 2 == 0)
"""


def real_campaign_toml(tmp_path: Path, tiny_raw: dict, victim: str, **campaign) -> Path:
    raw = copy.deepcopy(tiny_raw)
    marker = tmp_path / "fail.marker"
    marker.write_text("")
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(FAILING_REWARD.format(marker=str(marker), victim=victim))
    raw["reward"]["custom_module"] = str(reward)
    raw["training"].update(save_every=1)
    raw["logging"]["log_dir"] = str(tmp_path / "logs" / "train")
    raw["campaign"] = {
        "seeds": [1, 2],
        "max_steps": 2,
        "conditions": [
            {"advantage_mode": "grpo", "transform_mode": "none"},
            {"advantage_mode": "maxrl", "transform_mode": "none"},
        ],
        **campaign,
    }
    raw["squeeze"] = {"min_variance_retention": 0.9}
    from retrain.config.toml_writer import config_to_toml

    path = tmp_path / "campaign.toml"
    path.write_text(config_to_toml(config_from_dict(raw)))
    return path


def assert_recommendation_follows_the_retention(sq: dict, retention: float) -> None:
    """The recommended rank is the smallest analysed rank whose mean retained variance
    reaches the target, read from the variances the manifest records (which must grow
    with the rank and reach 1 at the source rank)."""
    assert sq["min_variance_retention"] == retention
    variance = {int(k): v for k, v in sq["mean_variance"].items()}
    ranks = sorted(variance)
    assert ranks == [1, 2, 4]
    assert all(variance[a] <= variance[b] + 1e-9 for a, b in zip(ranks, ranks[1:]))
    assert variance[4] == pytest.approx(1.0)
    expected = min(r for r in ranks if variance[r] >= retention - 1e-12)
    assert sq["recommended_rank"] == expected, variance


def test_real_parallel_campaign_with_a_crash_then_resume(tmp_path, tiny_raw, capsys):
    toml = real_campaign_toml(tmp_path, tiny_raw, "maxrl+none_s2", parallel=True)
    assert cli_main([str(toml)]) == 1
    out = capsys.readouterr().out
    d = only_campaign(tmp_path)
    assert "FAILED maxrl+none_s2: exit code 3" in out
    assert "<- recommended" in out  # the squeeze table of the first run

    m = manifest(d)
    assert m["status"] == "failed" and m["executor"] == "parallel"
    runs = {r["name"]: r for r in m["runs"]}
    assert {n: r["status"] for n, r in runs.items()} == {
        "grpo+none_s1": "finished",
        "grpo+none_s2": "finished",
        "maxrl+none_s1": "finished",
        "maxrl+none_s2": "failed",
    }
    assert runs["maxrl+none_s2"]["exit_code"] == 3
    sq = m["squeeze"]
    assert sq["run"] == "grpo+none_s1" and sq["source_rank"] == 4
    assert_recommendation_follows_the_retention(sq, 0.9)
    assert sq["adapter_path"] == str(d / "runs" / "grpo+none_s1" / "adapter" / "final")

    for name in ("grpo+none_s1", "maxrl+none_s2"):
        rd = d / "runs" / name
        for part in (
            "run.toml",
            "console.log",
            "metrics.jsonl",
            "emergence",
            "run.json",
            "trainer_state.json",
            "config.resolved.toml",
            "adapter/checkpoint_step_1",
        ):
            assert (rd / part).exists(), f"{name}/{part}"
        resolved = (rd / "config.resolved.toml").read_text()
        assert f'wandb_run_name = "{name}"' in resolved
        assert f'wandb_tags = "{name.rsplit("_s", 1)[0]},seed{name[-1]}"' in resolved
    assert (d / "runs" / "grpo+none_s1" / "adapter" / "final" / "adapter_config.json").exists()
    assert not (d / "runs" / "maxrl+none_s2" / "adapter" / "final").exists()
    rows, _ = read_jsonl(d / "runs" / "grpo+none_s1" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["condition"] == "grpo+none"

    # resume, sequentially this time: only the crashed run runs, from its checkpoint
    (tmp_path / "fail.marker").unlink()
    assert cli_main([str(toml), "--resume", str(d), "--campaign-parallel", "false"]) == 0
    out = capsys.readouterr().out
    assert "[maxrl+none_s2] Resumed from" in out and "at step 1" in out
    assert "[grpo+none_s1]" not in out
    m = manifest(d)
    assert m["status"] == "finished" and m["executor"] == "sequential"
    runs = {r["name"]: r for r in m["runs"]}
    assert runs["maxrl+none_s2"]["attempts"] == 2 and runs["maxrl+none_s2"]["resumed"] is True
    assert all(r["attempts"] == 1 for n, r in runs.items() if n != "maxrl+none_s2")
    rows, bad = read_jsonl(d / "runs" / "maxrl+none_s2" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and not bad

    assert cli_main(["status", str(tmp_path / "logs")]) == 0
    status = capsys.readouterr().out
    assert "grpo+none: 2/2 finished" in status and "maxrl+none: 2/2 finished" in status


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_executor_on_a_local_instance(tmp_path, tiny_raw, monkeypatch, local_ray):
    # one real run, and one stand-in that fails, as two Ray tasks
    Fake(tmp_path, monkeypatch, {"grpo+none_s2": {"exit": 5}}, real={"grpo+none_s1"})
    toml = real_campaign_toml(
        tmp_path,
        tiny_raw,
        "nobody",
        executor="ray",
        conditions=[{"advantage_mode": "grpo", "transform_mode": "none"}],
    )
    lines: list[str] = []
    from retrain.config import load_config

    cfg = load_config(toml)
    assert run_campaign(cfg, str(toml), out=lines.append) == 1
    assert local_ray.is_initialized()  # a Ray instance it did not start is left alone
    d = only_campaign(tmp_path)
    m = manifest(d)
    assert m["executor"] == "ray"
    runs = {r["name"]: r for r in m["runs"]}
    assert runs["grpo+none_s1"]["status"] == "finished" and runs["grpo+none_s1"]["exit_code"] == 0
    assert runs["grpo+none_s2"]["status"] == "failed" and runs["grpo+none_s2"]["exit_code"] == 5
    assert runs["grpo+none_s1"]["host"] and runs["grpo+none_s1"]["pid"] != os.getpid()
    final = d / "runs" / "grpo+none_s1" / "adapter" / "final"
    assert (final / "adapter_model.safetensors").exists()
    assert "Saved final adapter" in (d / "runs" / "grpo+none_s1" / "console.log").read_text()
    assert m["squeeze"]["run"] == "grpo+none_s1"
    assert_recommendation_follows_the_retention(m["squeeze"], 0.9)
    assert "FAILED grpo+none_s2: exit code 5" in "\n".join(lines)


def test_ray_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    Fake(tmp_path, monkeypatch)
    cfg = campaign_config(tmp_path, executor="ray")
    with pytest.raises(Exception, match=r"retrain\[ray\]"):
        run_campaign(cfg, None, out=lambda s: None)
