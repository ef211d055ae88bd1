"""The new objectives, the off-policy correction and the new aggregations through the real
local backend on the tiny random model: the step does not depend on its micro-batch split
(clip_cov and kl_cov select their tokens in a pre-pass over the whole step), the pre-pass
selects what the selection rule says on the trainer's own logprobs, and a short run of
each trains and logs the correction metrics on every row."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from grad_recorder import step_gradients
from test_loss_options_run import run, with_training

from retrain.config import config_from_dict

NEW = {
    "gspo_dual": dict(policy_loss="gspo", clip_eps_high=0.28, clip_ratio_c=1.2),
    "cispo_sequence": dict(policy_loss="cispo", ratio_level="sequence", clip_eps_high=0.4),
    "sapo": dict(policy_loss="sapo", loss_agg="seq_mean_token_mean"),
    "vespo": dict(policy_loss="vespo"),
    "clip_cov": dict(
        policy_loss="clip_cov",
        clip_eps=0.3,
        clip_eps_high=0.4,
        clip_cov_fraction=0.3,
        clip_cov_lb=-5.0,
    ),
    "kl_cov": dict(policy_loss="kl_cov", kl_cov_fraction=0.2, kl_cov_beta=0.5),
    "mask_geometric": dict(is_correction="mask", is_level="geometric", is_low=0.7, is_high=1.2),
    "truncate_sequence": dict(is_correction="truncate", is_level="sequence", is_high=1.5),
    "bnpo": dict(loss_agg="bnpo", bnpo_batch_size=3),
    "dr_grpo": dict(loss_agg="seq_mean_token_sum_norm"),
}


@pytest.fixture
def backend_and_datums(tiny_raw, tiny_model_dir):
    from transformers import AutoTokenizer

    from retrain.build import build_backend
    from retrain.types import Datum, SamplingParams

    b = build_backend(
        config_from_dict(tiny_raw),
        AutoTokenizer.from_pretrained(tiny_model_dir),
        say=lambda s: None,
    )
    with torch.no_grad():  # a non-trivial adapter, so the gradient reaches every LoRA matrix
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    groups = b.sample(prompts, 4, SamplingParams(max_tokens=8, temperature=1.0, seed=2))
    datums = [
        # sampler logprobs shifted so that ratios leave the clip and correction bands
        Datum(
            prompt,
            s.token_ids,
            s.logprobs + 0.3 * (-1) ** i,
            [1.0 - 0.6 * (i % 3)] * len(s.token_ids),
        )
        for prompt, g in zip(prompts, groups, strict=True)
        for i, s in enumerate(g)
    ]
    return b, datums


@pytest.mark.parametrize("name", list(NEW))
def test_the_split_does_not_change_the_update(backend_and_datums, name):
    """One micro-batch or one completion per micro-batch: the same loss, metrics and
    gradients (the torch generator reset before each, for clip_cov's draw)."""
    from retrain.types import TrainHyper

    b, datums = backend_and_datums
    hyper = replace(
        TrainHyper(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, max_tokens=8),
        **NEW[name],
    )
    hyper = replace(hyper, clip_eps_high=hyper.clip_eps_high or hyper.clip_eps)
    torch.manual_seed(0)
    big, grad_big = step_gradients(b, datums, hyper, 10_000)
    torch.manual_seed(0)
    small, grad_small = step_gradients(b, datums, hyper, 12)  # one completion per micro-batch
    assert big.loss == pytest.approx(small.loss, abs=1e-6)
    big.extra.pop("micro_batch_tokens"), small.extra.pop("micro_batch_tokens")
    assert big.extra == pytest.approx(small.extra, abs=1e-6)
    assert big.extra["mismatch_kl"] > 0  # the shifted sampler logprobs
    assert any(g.abs().max() > 1e-3 for g in grad_big)
    for x, y in zip(grad_big, grad_small, strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-7)
    if name in ("gspo_dual", "cispo_sequence", "clip_cov"):
        assert 0 < big.extra["clip_fraction"] < 1
    if name == "mask_geometric":
        assert 0 < big.extra["is_masked_fraction"] < 1
    if name == "truncate_sequence":
        assert 0 < big.extra["is_truncated_fraction"] < 1


def test_the_pre_pass_selects_on_the_trainers_logprobs(backend_and_datums):
    """kl_cov's pre-pass ranks the step's tokens by (A - mean A)(logp - mean logp) with
    the trained weights' logprobs: its picks are the top tokens of that covariance
    computed here from completion_logprobs, whatever the split."""
    from retrain.types import TrainHyper

    b, datums = backend_and_datums
    hyper = TrainHyper(
        lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, policy_loss="kl_cov",
        kl_cov_fraction=0.1,
    )  # fmt: skip
    b.model.train()
    logps = []
    for d in datums:
        row = b.completion_logprobs(d.prompt_ids, [d.completion_ids], 1.0)
        logps.append(row[0, : d.completion_ids.size].detach().float().numpy())
    lp, adv = np.concatenate(logps), np.concatenate([d.advantages for d in datums])
    cov = (adv - adv.mean()) * (lp - lp.mean())
    k = max(1, int(0.1 * lp.size))
    want = set(np.argsort(-cov, kind="stable")[:k].tolist())
    for budget in (10_000, 12):
        b.options = replace(b.options, micro_batch_tokens=budget)
        picks = b._step_selection(datums, hyper)
        got = np.concatenate([picks[id(d)] for d in datums])
        assert set(np.flatnonzero(got).tolist()) == want


@pytest.mark.parametrize("name", ["clip_cov", "gspo_dual", "mask_geometric", "bnpo"])
def test_a_short_run_trains_and_logs_the_correction_metrics(tiny_raw, tmp_path, name):
    options = dict(NEW[name], max_steps=2)
    raw = with_training(tiny_raw, tmp_path, name, **options)
    code, rows = run(raw)
    assert code == 0 and [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        for key in ("mismatch_kl", "is_masked_fraction", "is_truncated_fraction"):
            assert key in r and r[key] >= 0
