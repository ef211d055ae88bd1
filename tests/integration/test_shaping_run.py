"""Batch shaping in real runs on the tiny model (CPU): dynamic sampling refills the batch
with informative groups and resumes exactly, mask_truncated trains only the completions
that ended, and the overlong penalty lands in the rewards and the metrics.

The reward makes whole groups constant by their prompt: a prompt whose reference has an
even character sum gives every completion 1.0 (no signal); the others score the parity of
the response, as the other integration tests do."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from run_helpers import QuietConsole

from retrain.config import config_from_dict
from retrain.logs.jsonl import read_jsonl
from retrain.shaping import overlong_penalty
from retrain.trainer import train

HALF_FLAT = (
    "def score(response, reference):\n"
    "    if sum(map(ord, reference)) % 2 == 0:\n"
    "        return 1.0\n"
    "    return float(sum(map(ord, response)) % 2)\n"
)


def shaped_raw(tiny_raw: dict, tmp_path: Path, name: str, **training) -> dict:
    (tmp_path / "half_flat.py").write_text(HALF_FLAT)
    raw = copy.deepcopy(tiny_raw)
    raw["reward"]["custom_module"] = str(tmp_path / "half_flat.py")
    raw["backend"]["adapter_path"] = str(tmp_path / name / "adapter")
    raw["logging"]["log_dir"] = str(tmp_path / name / "logs")
    raw["training"].update(training)
    return raw


def run(raw: dict) -> tuple[int, list[str]]:
    console = QuietConsole()
    return train(config_from_dict(raw), console=console), console.lines


def rows(raw: dict, name: str = "metrics.jsonl") -> list[dict]:
    found, bad = read_jsonl(Path(raw["logging"]["log_dir"]) / name)
    assert not bad
    return found


def generations(raw: dict) -> list[dict]:
    return rows(raw, "emergence/generations.jsonl")


def test_dynamic_sampling_drops_flat_groups_and_fills_the_batch(tiny_raw, tmp_path):
    plain = shaped_raw(tiny_raw, tmp_path, "plain", max_steps=3, save_every=0)
    assert run(plain)[0] == 0
    dyn = shaped_raw(tiny_raw, tmp_path, "dyn", max_steps=3, save_every=0, dynamic_sampling=True)
    code, lines = run(dyn)
    assert code == 0

    plain_rows, dyn_rows = rows(plain), rows(dyn)
    assert sum(r["kept_groups"] for r in plain_rows) < 3 * 2  # flat groups cost the plain run
    assert sum(r["groups_dropped"] for r in dyn_rows) > 0
    examples = 0
    for r in dyn_rows:
        assert r["kept_groups"] == r["batch_size"] == 2  # every step reached batch_size
        # the dropped groups are the all-equal ones the advantages skip, kept in the stats
        assert r["groups_dropped"] == r["skipped_all_correct"] + r["skipped_all_wrong"]
        examples += r["kept_groups"] + r["groups_dropped"]
        assert r["examples_seen"] == examples  # every prompt drawn is in its step
        assert r["sampling_rounds"] >= 1 and r["num_datums"] > 0
    assert any(r["sampling_rounds"] > 1 for r in dyn_rows)
    step_lines = [x for x in lines if x.startswith("Step ")]
    assert all(" | dropped=" in x and " | rounds=" in x for x in step_lines)
    assert not any(x.startswith("Warning: step") for x in lines)
    # round 0 is the plain run's batch: the same seed, prompts and weights at step 0
    first = [(g["prompt"], g["completion"]) for g in generations(plain) if g["step"] == 0]
    again = [(g["prompt"], g["completion"]) for g in generations(dyn) if g["step"] == 0]
    assert again[: len(first)] == first


def test_the_bound_warns_and_trains_on_what_it_found(tiny_raw, tmp_path):
    (tmp_path / "flat.py").write_text("def score(response, reference):\n    return 1.0\n")
    raw = shaped_raw(tiny_raw, tmp_path, "flat", max_steps=1, save_every=0)
    raw["training"].update(dynamic_sampling=True, dynamic_sampling_max_rounds=1)
    raw["reward"]["custom_module"] = str(tmp_path / "flat.py")
    code, lines = run(raw)
    assert code == 0
    [row] = rows(raw)
    assert (row["groups_dropped"], row["sampling_rounds"], row["num_datums"]) == (4, 2, 0)
    warning = next(x for x in lines if x.startswith("Warning: step 0:"))
    assert "found no informative group in 2 sampling rounds" in warning
    assert "this step trains on nothing" in warning and "Fix:" in warning


def test_resume_with_dynamic_sampling_reproduces_the_straight_run(tiny_raw, tmp_path):
    straight = shaped_raw(
        tiny_raw, tmp_path, "straight", max_steps=4, save_every=2, dynamic_sampling=True
    )
    assert run(straight)[0] == 0
    part = shaped_raw(tiny_raw, tmp_path, "split", max_steps=2, save_every=2, dynamic_sampling=True)
    assert run(part)[0] == 0
    resumed = copy.deepcopy(part)
    resumed["training"]["max_steps"] = 4
    resumed["resume"] = {"from": part["logging"]["log_dir"]}
    code, lines = run(resumed)
    assert code == 0 and any("Resumed from" in x for x in lines)

    a, b = rows(straight), rows(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    keys = ("groups_dropped", "sampling_rounds", "examples_seen", "mean_reward", "num_datums")
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
    assert any(r["sampling_rounds"] > 1 for r in a[2:])  # the resumed part refilled too
    fields = ("step", "group", "prompt", "completion", "reward")
    assert [[g[f] for f in fields] for g in generations(straight)] == [
        [g[f] for f in fields] for g in generations(part)
    ]
    from safetensors.torch import load_file

    final = "final/adapter_model.safetensors"
    ta = load_file(str(Path(straight["backend"]["adapter_path"]) / final))
    tb = load_file(str(Path(part["backend"]["adapter_path"]) / final))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.allclose(ta[k], tb[k], atol=1e-6), k


def test_mask_truncated_and_the_overlong_penalty(tiny_raw, tmp_path):
    factor, buffer, max_tokens = 0.5, 4, 12
    raw = shaped_raw(
        tiny_raw,
        tmp_path,
        "masked",
        max_steps=3,
        save_every=0,
        max_tokens=max_tokens,
        mask_truncated=True,
        overlong_buffer=buffer,
        overlong_penalty=factor,
    )
    assert run(raw)[0] == 0
    gens = generations(raw)
    assert {g["stop_reason"] for g in gens} == {"eos", "length"}  # both kinds were sampled
    for r in rows(raw):
        step = [g for g in gens if g["step"] == r["step"]]
        kept = [g for g in step if g["advantage_mean"] is not None]
        ended = [g for g in kept if g["stop_reason"] == "eos" and g["num_tokens"] > 0]
        # only the completions that ended are trained on, every token of them
        assert r["num_datums"] == len(ended)
        assert r["trained_tokens"] == sum(g["num_tokens"] for g in ended)
        # the reward (0 or 1) plus the penalty of the completion's length; correct is
        # the reward's own (a penalty of at most 0.5 keeps a 1 above 0 and a 0 at or below)
        pens = []
        for g in step:
            raw_reward = 1.0 if g["reward"] > 0 else 0.0
            assert g["correct"] == (raw_reward == 1.0)
            pen = overlong_penalty([g["num_tokens"]], max_tokens, buffer, factor)[0]
            assert g["reward"] == pytest.approx(raw_reward + pen)
            pens.append(pen)
        assert r["overlong_penalty_mean"] == pytest.approx(sum(pens) / len(pens))
        assert r["max_token_hit_rate"] == sum(g["stop_reason"] == "length" for g in step) / len(
            step
        )
    assert any(g["stop_reason"] == "length" for g in gens if g["advantage_mean"] is not None)


def test_dynamic_sampling_with_overlap(tiny_raw, tmp_path):
    # the extra rounds sample while the previous step trains in the background
    raw = shaped_raw(tiny_raw, tmp_path, "overlap", max_steps=3, save_every=0)
    raw["training"]["dynamic_sampling"] = True
    raw["backend"]["devices"] = "cpu,cpu"
    raw["backend"]["options"]["overlap"] = True
    code, lines = run(raw)
    assert code == 0
    found = rows(raw)
    assert [r["step"] for r in found] == [0, 1, 2]
    for r in found:  # full, or short after the bound with a warning that says so
        warned = [x for x in lines if x.startswith(f"Warning: step {r['step']}:")]
        if r["kept_groups"] == 2:
            assert not warned
        else:
            assert r["sampling_rounds"] == 4
            assert f"found {r['kept_groups']} of 2 informative groups" in warned[0]
    assert any(r["sampling_rounds"] > 1 for r in found)
    assert [r["off_policy_steps"] for r in found] == [0, 1, 1]
