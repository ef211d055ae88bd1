"""The wandb sink, against the real wandb library in offline mode."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from retrain.config import config_from_dict
from retrain.logs import wandb as wandb_log
from retrain.logs.wandb import WandbSink, wandb_key, wandb_metrics

wandb = pytest.importorskip("wandb")


# ---------------------------------------------------------------- reading the offline run


def _wandb_chunks(path: Path) -> list[bytes]:
    """Records of a `.wandb` file: a 7-byte header, then 32 KiB blocks of records, each
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block = 32768
    pos, out, partial = 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            out.append(partial + chunk)
            partial = b""
        elif kind == 0 and length == 0:
            pos += left - 7  # zero padding up to the end of the block
    return out


def _wait_until_written(path: Path, timeout: float = 30.0) -> None:
    """wandb's service process may still be writing the file when finish() returns:
    wait until it holds records and its size has stopped changing."""
    deadline = time.monotonic() + timeout
    sizes: list[int] = []
    while time.monotonic() < deadline:
        sizes.append(path.stat().st_size)
        if sizes[-1] > 7 and len(sizes) >= 4 and len(set(sizes[-4:])) == 1:
            return
        time.sleep(0.05)


def read_offline_run(root: Path) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(root.rglob("offline-run-*/run-*.wandb"))
    assert files, f"no offline run under {root}"
    run_dir = files[-1].parent
    _wait_until_written(files[-1])
    history: list[dict] = []
    config: dict = {}
    run_info: dict = {}
    for chunk in _wandb_chunks(files[-1]):
        rec = pb.Record()
        rec.ParseFromString(chunk)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
        elif kind == "config":
            for item in rec.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":
            r = rec.run
            run_info = {
                "name": r.display_name,
                "group": r.run_group,
                "tags": list(r.tags),
                "project": r.project,
                "entity": r.entity,
            }
            for item in r.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    # config entries may be stored as {"value": ...}
    config = {
        k: v["value"] if isinstance(v, dict) and set(v) <= {"value", "desc"} and "value" in v else v
        for k, v in config.items()
    }
    return {"dir": run_dir, "history": history, "config": config, "run": run_info}


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_root"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_root").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path / "wandb_root"


def make_config(tmp_path, **logging):
    raw_logging = {"log_dir": str(tmp_path / "logs"), "wandb_project": "retrain-test", **logging}
    return config_from_dict(
        {
            "algorithm": {"advantage_mode": "grpo", "transform_mode": "gtpo"},
            "training": {"lr": 3e-5, "batch_size": 4, "group_size": 8, "seed": 7},
            "reward": {"type": "judge", "judge_api_key": "sk-do-not-log-me"},
            "logging": raw_logging,
        }
    )


def metrics_row(step: int) -> dict:
    return {
        "step": step,
        "condition": "grpo+gtpo",
        "loss": 0.1 * step,
        "loss_is_placeholder": False,
        "mean_reward": 0.25 + 0.1 * step,
        "correct_rate": 0.25,
        "running_correct_rate": 0.2,
        "no_answer_rate": 0.0,
        "exec_entropy_mean": 1.5,
        "plan_entropy_var": float("nan"),
        "num_planning_tokens": 3,
        "sepa_lambda": 0.0,
        "sepa_gate_open": True,
        "grad_norm": None,
        "bp_p_star": 12.0,
        "bp_regime": "warmup",
        "step_time_s": 1.5,
        "time": 1700000000.0,
    }


def generation_rows(step: int, n: int = 3) -> list[dict]:
    return [
        {
            "step": step,
            "group": 0,
            "index": i,
            "prompt": "What is 2+2?",
            "reference": "4",
            "completion": f"The answer is \\boxed{{{i}}}" + "x" * (5000 if i == 0 else 0),
            "reward": float(i == 4),
            "answer": str(i),
            "correct": i == 4,
            "num_tokens": 10,
            "stop_reason": "eos",
            "planning_tokens": 0,
            "advantage_mean": 0.0,
        }
        for i in range(n)
    ]


# ---------------------------------------------------------------- tests


def test_key_mapping():
    assert wandb_key("mean_reward") == "train/rewards/mean_reward"
    assert wandb_key("correct_rate") == "train/rewards/correct_rate"
    assert wandb_key("reward_errors") == "train/rewards/reward_errors"
    assert wandb_key("exec_entropy_var") == "train/entropy/exec_entropy_var"
    assert wandb_key("num_planning_tokens") == "train/entropy/num_planning_tokens"
    assert wandb_key("bp_p_star") == "train/backpressure/p_star"
    assert wandb_key("loss") == "train/loss"
    assert wandb_key("sepa_lambda") == "train/sepa_lambda"
    out = wandb_metrics(metrics_row(2))
    assert "train/step" not in out and "train/condition" not in out and "train/time" not in out
    assert out["train/sepa_gate_open"] == 1
    assert "train/grad_norm" not in out  # None is skipped
    assert "train/entropy/plan_entropy_var" not in out  # NaN is skipped
    assert "train/backpressure/regime" not in out  # text stays in the JSONL


def test_offline_run_holds_metrics_config_and_table(tmp_path, offline):
    config = make_config(
        tmp_path, wandb_group="grpo+gtpo", wandb_tags="grpo+gtpo, seed7", wandb_entity=""
    )
    said: list[str] = []
    sink = WandbSink.start(config, said.append)
    assert sink is not None, said
    for step in range(3):
        sink.log(metrics_row(step), generation_rows(step))
    sink.finish("finished")

    run = read_offline_run(offline)
    assert run["run"]["name"] == "grpo+gtpo"  # default name: the condition label
    assert run["run"]["group"] == "grpo+gtpo"
    assert run["run"]["tags"] == ["grpo+gtpo", "seed7"]
    assert run["run"]["project"] == "retrain-test"

    steps = [h for h in run["history"] if "train/loss" in h]
    assert [h["_step"] for h in steps] == [0, 1, 2]
    keys = set().union(*steps)
    for key in (
        "train/loss",
        "train/rewards/mean_reward",
        "train/rewards/correct_rate",
        "train/entropy/exec_entropy_mean",
        "train/entropy/num_planning_tokens",
        "train/backpressure/p_star",
        "train/sepa_lambda",
        "train/step_time_s",
    ):
        assert key in keys
    assert steps[2]["train/rewards/mean_reward"] == pytest.approx(0.45)

    cfg = run["config"]
    assert cfg["training"]["lr"] == pytest.approx(3e-5)
    assert cfg["training"]["batch_size"] == 4
    assert cfg["algorithm"]["advantage_mode"] == "grpo"
    assert cfg["condition"] == "grpo+gtpo"
    assert "judge_api_key" not in cfg["reward"]
    text = json.dumps(cfg)
    assert "sk-do-not-log-me" not in text

    # a completions table at step 0 (every TABLE_EVERY steps), texts bounded
    tables = sorted((run["dir"] / "files" / "media" / "table").glob("completions_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"][:5] == ["step", "group", "index", "prompt", "completion"]
    assert len(table["data"]) == 3
    assert len(table["data"][0][4]) <= wandb_log.TEXT_LIMIT + 3
    assert (tmp_path / "logs" / wandb_log.RUN_ID_FILE).read_text().strip()


def test_explicit_name_and_table_bound(tmp_path, offline, monkeypatch):
    monkeypatch.setattr(wandb_log, "TABLE_ROWS", 2)
    config = make_config(tmp_path, wandb_run_name="my-run")
    sink = WandbSink.start(config, lambda m: None)
    assert sink is not None
    sink.log(metrics_row(0), generation_rows(0, n=6))
    sink.finish("failed")
    run = read_offline_run(offline)
    assert run["run"]["name"] == "my-run"
    table = next((run["dir"] / "files" / "media" / "table").glob("completions_*.table.json"))
    assert len(json.loads(table.read_text())["data"]) == 2


def test_missing_wandb_warns_and_returns_none(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    said: list[str] = []
    assert WandbSink.start(make_config(tmp_path), said.append) is None
    assert len(said) == 1 and "not installed" in said[0] and "JSONL" in said[0]


def test_init_failure_warns_and_returns_none(tmp_path, monkeypatch):
    def boom(**kwargs):
        raise RuntimeError("api key invalid\nmore text")

    monkeypatch.setattr(wandb, "init", boom)
    said: list[str] = []
    assert WandbSink.start(make_config(tmp_path), said.append) is None
    assert len(said) == 1 and "api key invalid" in said[0] and "more text" not in said[0]


class _BrokenRun:
    id = "x"
    offline = True
    dir = "/nowhere"

    def __init__(self):
        self.calls = 0
        self.finished = None
        self.summary = {}

    def log(self, data, step=None):
        self.calls += 1
        raise ConnectionError("network down")

    def finish(self, exit_code=0):
        self.finished = exit_code


def test_log_failure_is_warned_once_and_disables(tmp_path):
    said: list[str] = []
    run = _BrokenRun()
    sink = WandbSink(wandb, run, said.append)
    for step in range(4):
        sink.log(metrics_row(step), [])  # never raises
    assert run.calls == 1 and sink.disabled
    assert len(said) == 1 and "network down" in said[0]
    sink.finish("interrupted")
    assert run.finished == 1
    sink.finish("finished")  # idempotent
