"""Real 3-step runs of each loss option and lr schedule on the tiny random model, and
exact resume with a schedule (straight run vs stopped-and-resumed run)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from run_helpers import QuietConsole, stop_after_step

from retrain.config import config_from_dict
from retrain.logs.jsonl import read_jsonl
from retrain.schedule import lr_at
from retrain.trainer import train


def run(raw: dict) -> tuple[int, list[dict]]:
    code = train(config_from_dict(raw), console=QuietConsole())
    rows, bad = read_jsonl(Path(raw["logging"]["log_dir"]) / "metrics.jsonl")
    assert not bad
    return code, rows


def with_training(raw: dict, tmp_path: Path, name: str, **training) -> dict:
    out = copy.deepcopy(raw)
    out["training"].update(training)
    out["logging"]["log_dir"] = str(tmp_path / name / "logs")
    out["backend"]["adapter_path"] = str(tmp_path / name / "adapter")
    return out


OPTIONS = {
    "ppo_clip_higher_dual": dict(policy_loss="ppo_clip", clip_eps_high=0.28, clip_ratio_c=3.0),
    "adv_clip": dict(adv_clip_max=0.5),
    "kl_k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": dict(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "linear_warmup": dict(lr_schedule="linear", warmup_steps=1),
    "cosine_warmup": dict(lr_schedule="cosine", warmup_steps=2),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_three_step_run_per_option(tiny_raw, tmp_path, name):
    options = OPTIONS[name]
    raw = with_training(tiny_raw, tmp_path, name, **options)
    code, rows = run(raw)
    assert code == 0 and [r["step"] for r in rows] == [0, 1, 2]
    t = config_from_dict(raw).training
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert 0.0 <= r["clip_fraction"] <= 1.0
        assert r["lr"] == lr_at(r["step"], t.lr, t.lr_schedule, t.warmup_steps, t.max_steps)
    if "kl_coef" in options:
        # LoRA B starts at zero: the adapter changes nothing before the first update.
        assert rows[0]["kl_mean"] == 0.0
        assert all(r["kl_mean"] != 0.0 for r in rows[1:])
        if options["kl_estimator"] != "k1":  # k2 and k3 are never negative
            assert all(r["kl_mean"] > 0 for r in rows[1:])
    else:
        assert all("kl_mean" not in r for r in rows)
    if name == "linear_warmup":
        assert [r["lr"] for r in rows] == pytest.approx([t.lr, t.lr, t.lr / 2])
    if name == "cosine_warmup":
        assert [r["lr"] for r in rows] == pytest.approx([t.lr / 2, t.lr, t.lr])
    adapter = Path(raw["backend"]["adapter_path"]) / "final" / "adapter_model.safetensors"
    assert adapter.exists()


def test_aggregations_rescale_the_same_first_step(tiny_raw, tmp_path):
    """Step 0 samples the same completions under every option (same seed, same initial
    weights), so the aggregations' losses differ by their known factors: token_mean
    divides by the tokens N, seq_mean_token_sum by the completions G."""
    rows = {}
    for agg in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        raw = with_training(tiny_raw, tmp_path, agg, loss_agg=agg, max_steps=1)
        code, rows[agg] = run(raw)
        assert code == 0 and len(rows[agg]) == 1
    base, seq_sum = rows["token_mean"][0], rows["seq_mean_token_sum"][0]
    n, g = base["trained_tokens"], base["num_datums"]
    assert seq_sum["trained_tokens"] == n and seq_sum["num_datums"] == g
    assert seq_sum["loss"] == pytest.approx(base["loss"] * n / g, rel=1e-4, abs=1e-7)
    assert math.isfinite(rows["seq_mean_token_mean"][0]["loss"])
    # The default options still train exactly the previous objective (on-policy, r = 1):
    # ppo_clip without clipped tokens equals it too.
    ppo = with_training(tiny_raw, tmp_path, "ppo", policy_loss="ppo_clip", max_steps=1)
    code, ppo_rows = run(ppo)
    assert code == 0 and ppo_rows[0]["clip_fraction"] == 0.0
    assert ppo_rows[0]["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-8)


def test_resume_with_a_schedule_and_kl_matches_the_straight_run(tiny_raw, tmp_path, monkeypatch):
    options = dict(
        max_steps=4,
        save_every=0,
        lr_schedule="cosine",
        warmup_steps=1,
        policy_loss="ppo_clip",
        clip_eps_high=0.28,
        kl_coef=0.05,
    )
    straight = with_training(tiny_raw, tmp_path, "straight", **options)
    code, rows_a = run(straight)
    assert code == 0

    # The same run stopped after step 1 (as SIGTERM would), then resumed.
    stop_after_step(monkeypatch, 1)
    split = with_training(tiny_raw, tmp_path, "split", **options)
    run(split)
    state = (Path(split["logging"]["log_dir"]) / "trainer_state.json").read_text()
    assert '"step": 2' in state
    resumed = copy.deepcopy(split)
    resumed["resume"] = {"from": split["logging"]["log_dir"]}
    code, rows_b = run(resumed)
    assert code == 0

    assert [r["step"] for r in rows_b] == [0, 1, 2, 3]
    assert [r["lr"] for r in rows_a] == [r["lr"] for r in rows_b]
    assert len({r["lr"] for r in rows_a}) == 3  # warmup, peak, then the cosine decay
    for x, y in zip(rows_a, rows_b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
        assert x["kl_mean"] == pytest.approx(y["kl_mean"], abs=1e-6)
        assert x["clip_fraction"] == y["clip_fraction"]
        assert x["mean_reward"] == y["mean_reward"]
    from safetensors.torch import load_file

    ta = load_file(
        str(Path(straight["backend"]["adapter_path"]) / "final" / "adapter_model.safetensors")
    )
    tb = load_file(
        str(Path(split["backend"]["adapter_path"]) / "final" / "adapter_model.safetensors")
    )
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.allclose(ta[k], tb[k], atol=1e-6), k


def test_micro_batching_does_not_change_the_update_under_every_option(tiny_raw, tiny_model_dir):
    """The local backend with every option on: the loss, its statistics and the update
    are the same whether a step is one micro-batch or one completion per micro-batch."""
    from dataclasses import replace

    from grad_recorder import step_gradients
    from transformers import AutoTokenizer

    from retrain.build import build_backend
    from retrain.types import Datum, SamplingParams, TrainHyper

    b = build_backend(
        config_from_dict(tiny_raw),
        AutoTokenizer.from_pretrained(tiny_model_dir),
        say=lambda s: None,
    )
    with torch.no_grad():  # a non-trivial adapter, so the KL to the base model is not 0
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    groups = b.sample(prompts, 4, SamplingParams(max_tokens=8, temperature=1.0, seed=2))
    datums = [
        # sampler logprobs shifted so that some ratios leave the clip range
        Datum(prompt, s.token_ids, s.logprobs + 0.3 * (-1) ** i, [0.5 - (i % 2)] * len(s.token_ids))
        for prompt, g in zip(prompts, groups, strict=True)
        for i, s in enumerate(g)
    ]
    hyper = replace(
        TrainHyper(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8),
        policy_loss="ppo_clip",
        clip_eps_high=0.28,
        clip_ratio_c=1.2,
        adv_clip_max=0.4,
        loss_agg="seq_mean_token_mean",
        kl_coef=0.1,
        kl_estimator="k3",
    )

    big, grad_big = step_gradients(b, datums, hyper, 10_000)
    small, grad_small = step_gradients(b, datums, hyper, 12)  # one completion per micro-batch
    assert big.loss == pytest.approx(small.loss, abs=1e-6)
    assert (big.extra.pop("micro_batch_tokens"), small.extra.pop("micro_batch_tokens")) == (
        10_000,
        12,
    )  # the budget each step trained with, the only metric that differs
    assert big.extra == pytest.approx(small.extra, abs=1e-6)
    assert 0 < big.extra["clip_fraction"] < 1 and big.extra["kl_mean"] > 0
    assert any(g.abs().max() > 1e-3 for g in grad_big)  # a real gradient
    for x, y in zip(grad_big, grad_small, strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-7)
