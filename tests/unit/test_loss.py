"""The objective (retrain/loss/) and the learning-rate schedule (retrain/schedule.py)
against plain per-token reference implementations of their formulas, on random inputs;
plus the config keys, the backend capability checks and the Tinker mapping."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from reference_loss import ref_objective, ref_token  # tests/unit: the plain reference

from retrain.config import config_from_dict
from retrain.config.validate import flow_problems, loss_options_used
from retrain.errors import ConfigError
from retrain.loss import (
    KL_ESTIMATORS,
    LOSS_AGGS,
    LossInputs,
    LossStats,
    ppo_clipped,
    resolve_objective,
    sequence_weights,
    step_weights,
    token_scales,
)
from retrain.registry import BACKENDS
from retrain.schedule import lr_at
from retrain.types import BackendCapabilities, TrainHyper

BASE = TrainHyper(
    lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, max_tokens=12, bnpo_batch_size=2
)

# ---------------------------------------------------------------- the plain reference


def reference_objective(seqs, hyper):
    """(loss, grads, clip fraction, kl mean) of tests/unit/reference_loss.py's per-token
    loops."""
    ref = ref_objective(seqs, hyper)
    return ref.loss, ref.grads, ref.clip_fraction, ref.kl_mean


def random_batch(rng: random.Random, n: int = 5, spread: float = 0.5, with_ref: bool = True):
    seqs = []
    for _ in range(n):
        k = rng.randint(1, 9)
        lp = [rng.uniform(-4, -0.05) for _ in range(k)]
        old = [x + rng.gauss(0, spread) for x in lp]
        adv = [rng.gauss(0, 1.5) for _ in range(k)]
        ref = [x + rng.gauss(0, spread) for x in lp] if with_ref else None
        seqs.append((lp, old, adv, ref))
    return seqs


def padded(seqs, dtype=torch.float64):
    width = max(len(s[0]) for s in seqs)
    out = []
    for j in range(4):
        t = torch.zeros((len(seqs), width), dtype=dtype)
        for i, s in enumerate(seqs):
            if s[j] is not None:
                t[i, : len(s[j])] = torch.tensor(s[j], dtype=dtype)
        out.append(t)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        mask[i, : len(s[0])] = True
    return (*out, mask)


def run_objective(seqs, hyper, chunks=None):
    """The resolved objective over `seqs` (optionally split into micro-batches as the
    local backend does) -> (loss, per-token grads, stats)."""
    lengths = [len(s[0]) for s in seqs]
    weights, denominator = step_weights(lengths, hyper)
    loss_fn = resolve_objective(hyper.policy_loss)
    chunks = chunks or [len(seqs)]
    start, total, stats, grads = 0, 0.0, LossStats(), []
    for size in chunks:
        part = seqs[start : start + size]
        logp, old, adv, ref, mask = padded(part)
        logp.requires_grad_(True)
        seq_w = None
        if hyper.loss_agg != "token_mean":
            seq_w = torch.from_numpy(weights[start : start + size])
        ref_logp = ref if hyper.kl_coef > 0 else None
        out = loss_fn(LossInputs(logp, old, adv, mask, denominator, seq_w, ref_logp), hyper)
        loss, st = out.loss, out.stats
        loss.backward()
        total += float(loss.detach())
        stats.add(st)
        grads += [logp.grad[i, : len(s[0])].tolist() for i, s in enumerate(part)]
        start += size
    return total, grads, stats


OPTION_GRID = [
    dict(policy_loss="is"),
    dict(policy_loss="is", adv_clip_max=0.8),
    dict(policy_loss="ppo_clip", clip_eps=0.2, clip_eps_high=0.2),
    dict(policy_loss="ppo_clip", clip_eps=0.2, clip_eps_high=0.28),  # clip-higher
    dict(policy_loss="ppo_clip", clip_eps=0.1, clip_eps_high=0.3, clip_ratio_c=1.5),  # dual
    dict(
        policy_loss="ppo_clip", clip_eps=0.2, clip_eps_high=0.28, clip_ratio_c=3.0, adv_clip_max=1.0
    ),
    *(dict(policy_loss="is", kl_coef=0.05, kl_estimator=k) for k in KL_ESTIMATORS),
    *(
        dict(policy_loss="ppo_clip", kl_coef=0.1, kl_estimator=k, clip_ratio_c=2.0)
        for k in KL_ESTIMATORS
    ),
]


@pytest.mark.parametrize(("options", "loss_agg"), list(itertools.product(OPTION_GRID, LOSS_AGGS)))
def test_objective_matches_the_per_token_reference(options, loss_agg):
    hyper = replace(BASE, loss_agg=loss_agg, **options)
    for seed in range(4):
        seqs = random_batch(random.Random(seed * 31 + 7))
        want_loss, want_grads, want_clip, want_kl = reference_objective(seqs, hyper)
        loss, grads, stats = run_objective(seqs, hyper)
        assert loss == pytest.approx(want_loss, rel=1e-10, abs=1e-12)
        for g, w in zip(grads, want_grads, strict=True):
            assert g == pytest.approx(w, rel=1e-9, abs=1e-12)
        metrics = stats.metrics()
        assert metrics["clip_fraction"] == pytest.approx(want_clip)
        if hyper.kl_coef > 0:
            assert metrics["kl_mean"] == pytest.approx(want_kl, rel=1e-10)
        else:
            assert "kl_mean" not in metrics


def test_ppo_clip_actually_clips_on_these_inputs():
    """The random batches of the comparison above reach every branch of the dual-clipped
    loss (else the comparison would prove little)."""
    hyper = replace(BASE, policy_loss="ppo_clip", clip_eps=0.1, clip_eps_high=0.3, clip_ratio_c=1.5)
    branches = set()
    for seed in range(4):
        for lp, old, adv, _ in random_batch(random.Random(seed * 31 + 7)):
            for t in range(len(lp)):
                cut = ref_token(lp[t], old[t], adv[t], hyper).clipped
                r = math.exp(lp[t] - old[t])
                if adv[t] < 0 and cut and r >= 0.9:
                    branches.add("dual")
                else:
                    branches.add(("pos" if adv[t] > 0 else "neg") + ("-clipped" if cut else ""))
    assert branches == {"pos", "pos-clipped", "neg", "neg-clipped", "dual"}


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_micro_batches_sum_to_the_whole_step(loss_agg):
    hyper = replace(BASE, policy_loss="ppo_clip", loss_agg=loss_agg, kl_coef=0.1, clip_ratio_c=2.0)
    seqs = random_batch(random.Random(3), n=7)
    whole, g_whole, s_whole = run_objective(seqs, hyper)
    split, g_split, s_split = run_objective(seqs, hyper, chunks=[2, 1, 3, 1])
    assert split == pytest.approx(whole, rel=1e-12)
    for a, b in zip(g_whole, g_split, strict=True):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15)
    assert s_whole.metrics() == pytest.approx(s_split.metrics())


def test_default_objective_is_bitwise_the_previous_loss():
    """policy_loss = "is", token_mean: exactly -(1/N) sum A exp(logp - old) as the local
    backend computed it before the options existed (value and gradient, float32)."""
    seqs = random_batch(random.Random(11), n=6, with_ref=False)
    logp, old, adv, _, mask = padded(seqs, dtype=torch.float32)
    total = int(mask.sum())
    a = logp.clone().requires_grad_(True)
    log_ratio = torch.where(mask, a - old, torch.zeros_like(a))
    before = -(adv * torch.exp(log_ratio) * mask).sum() / total
    before.backward()
    b = logp.clone().requires_grad_(True)
    _, denominator = sequence_weights([len(s[0]) for s in seqs], "token_mean")
    out = resolve_objective("is")(LossInputs(b, old, adv, mask, denominator), BASE)
    now, stats = out.loss, out.stats
    now.backward()
    assert torch.equal(before.detach(), now.detach())
    assert torch.equal(a.grad, b.grad)
    assert stats.metrics()["clip_fraction"] == 0.0


def test_ppo_with_ratios_inside_the_band_is_the_plain_loss():
    seqs = random_batch(random.Random(5), spread=0.01, with_ref=False)
    plain, g_plain, _ = run_objective(seqs, BASE)
    ppo, g_ppo, stats = run_objective(seqs, replace(BASE, policy_loss="ppo_clip"))
    assert ppo == pytest.approx(plain, rel=1e-12)
    for a, b in zip(g_plain, g_ppo, strict=True):
        assert a == pytest.approx(b, rel=1e-12)
    assert stats.clipped == 0


def test_kl_is_zero_when_the_adapter_changes_nothing():
    seqs = [(lp, old, adv, list(lp)) for lp, old, adv, _ in random_batch(random.Random(2))]
    for k in KL_ESTIMATORS:
        _, _, stats = run_objective(seqs, replace(BASE, kl_coef=0.3, kl_estimator=k))
        assert stats.metrics()["kl_mean"] == 0.0


def test_aggregation_weights():
    lengths = [3, 1, 4]
    assert token_scales(lengths, "token_mean").tolist() == pytest.approx([1 / 8] * 3)
    assert token_scales(lengths, "seq_mean_token_sum").tolist() == pytest.approx([1 / 3] * 3)
    assert token_scales(lengths, "seq_mean_token_mean").tolist() == pytest.approx(
        [1 / 9, 1 / 3, 1 / 12]
    )
    # Dr. GRPO's constant: G = 3 completions x L = 10 tokens
    assert token_scales(lengths, "seq_mean_token_sum_norm", max_tokens=10).tolist() == (
        pytest.approx([1 / 30] * 3)
    )
    with pytest.raises(ValueError, match="max_tokens"):
        sequence_weights(lengths, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError):
        sequence_weights(lengths, "sum")


def test_bnpo_weights_by_hand():
    """Local batches of 2 consecutive completions: lengths [1, 3 | 2 | ...]."""
    # [1, 3] -> N_b = 4, [2] -> N_b = 2, K = 2 batches: 1/(2*4), 1/(2*4), 1/(2*2)
    assert token_scales([1, 3, 2], "bnpo", batch_size=2).tolist() == pytest.approx(
        [1 / 8, 1 / 8, 1 / 4]
    )
    # one batch (0 or at least G): token_mean, in token_mean's exact form
    for size in (0, 3, 7):
        assert sequence_weights([1, 3, 2], "bnpo", batch_size=size) == (
            pytest.approx([1.0, 1.0, 1.0]),
            6.0,
        )
    # batches of one completion: GRPO's per-completion mean
    assert token_scales([1, 3, 2], "bnpo", batch_size=1).tolist() == pytest.approx(
        token_scales([1, 3, 2], "seq_mean_token_mean").tolist()
    )
    # a batch without trained tokens counts 1, as TRL clamps it (its loss is 0 anyway)
    assert token_scales([0, 0, 5], "bnpo", batch_size=2).tolist() == pytest.approx(
        [1 / 2, 1 / 2, 1 / 10]
    )


def test_numpy_clip_mask_matches_the_torch_statistics():
    rng = random.Random(9)
    seqs = random_batch(rng, n=10, spread=0.5, with_ref=False)
    hyper = replace(BASE, policy_loss="ppo_clip", clip_eps=0.15, clip_eps_high=0.25)
    _, _, stats = run_objective(seqs, hyper)
    cut = sum(
        int(ppo_clipped(np.subtract(lp, old), np.asarray(adv), 0.15, 0.25).sum())
        for lp, old, adv, _ in seqs
    )
    assert cut == stats.clipped


# ---------------------------------------------------------------- the lr schedule


def reference_lr(step, base, schedule, warmup, max_steps):
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / (max_steps - warmup)
    return {
        "constant": base,
        "linear": base * (1 - p),
        "cosine": base * (1 + math.cos(math.pi * p)) / 2,
    }[schedule]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_lr_schedule_matches_its_formula(schedule, warmup):
    rng = random.Random(warmup)
    for _ in range(20):
        max_steps = rng.randint(warmup + 1, 200)
        base = rng.uniform(1e-6, 1e-2)
        for step in range(max_steps):
            got = lr_at(step, base, schedule, warmup, max_steps)
            assert got == pytest.approx(reference_lr(step, base, schedule, warmup, max_steps))
            assert 0 < got <= base * (1 + 1e-12)


def test_lr_schedule_shape():
    assert [lr_at(s, 1.0, "linear", 2, 6) for s in range(6)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    )
    assert lr_at(4, 1.0, "cosine", 0, 8) == pytest.approx(0.5)
    assert lr_at(99, 3e-5, "constant", 0, 100) == 3e-5
    with pytest.raises(ValueError):
        lr_at(0, 1.0, "step", 0, 10)


# ---------------------------------------------------------------- config and capabilities


def test_defaults_are_the_previous_objective():
    from retrain.build import train_hyper

    hyper = train_hyper(config_from_dict({}))
    assert (hyper.policy_loss, hyper.loss_agg, hyper.kl_coef) == ("is", "token_mean", 0.0)
    assert (hyper.adv_clip_max, hyper.clip_ratio_c) == (0.0, 0.0)
    t = config_from_dict({}).training
    assert (t.lr_schedule, t.warmup_steps) == ("constant", 0)


def test_keys_reach_the_train_hyper():
    from retrain.build import train_hyper

    config = config_from_dict(
        {
            "training": {
                "policy_loss": "ppo_clip",
                "clip_eps": 0.1,
                "clip_ratio_c": 3.0,
                "adv_clip_max": 2.0,
                "loss_agg": "seq_mean_token_sum",
                "kl_coef": 0.01,
                "kl_estimator": "k2",
            }
        }
    )
    hyper = train_hyper(config)
    assert hyper.clip_eps == hyper.clip_eps_high == 0.1  # 0 = clip_eps
    assert (hyper.clip_ratio_c, hyper.adv_clip_max, hyper.kl_estimator) == (3.0, 2.0, "k2")
    assert [o for _, o in loss_options_used(config)] == [
        "ppo_clip",
        "dual_clip",
        "adv_clip",
        "seq_mean_token_sum",
        "kl",
    ]
    high = train_hyper(
        config_from_dict({"training": {"policy_loss": "ppo_clip", "clip_eps_high": 0.28}})
    )
    assert (high.clip_eps, high.clip_eps_high) == (0.2, 0.28)


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        ({"clip_ratio_c": 0.5, "policy_loss": "ppo_clip"}, "[training] clip_ratio_c"),
        ({"clip_ratio_c": 3.0}, 'only used with policy_loss = "ppo_clip"'),
        ({"clip_eps_high": 0.3, "policy_loss": "is"}, "[training] clip_eps_high"),
        ({"loss_agg": "sum"}, "[training] loss_agg"),
        ({"kl_estimator": "k4"}, "[training] kl_estimator"),
        ({"lr_schedule": "step"}, "[training] lr_schedule"),
        ({"warmup_steps": 5, "max_steps": 5}, "[training] warmup_steps"),
        ({"clip_eps": 1.5, "policy_loss": "ppo_clip"}, "[training] clip_eps"),
    ],
)
def test_bad_loss_settings_are_config_errors(training, expected):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": training})
    assert expected in str(info.value)


def test_the_original_clip_eps_turns_ppo_on_as_it_did_there():
    """The later original's clip_eps > 0 meant PPO clipping (0 = off): read so wherever
    the original's keys are (retrain.compat installed, as the CLI always has it)."""
    from retrain.compat import config_from_dict

    assert config_from_dict({"training": {"clip_eps": 0.2}}).training.policy_loss == "ppo_clip"
    off = config_from_dict({"training": {"clip_eps": 0.0}}).training
    assert (off.policy_loss, off.clip_eps) == ("is", 0.2)
    flags = config_from_dict(
        {}, ["--clip-eps", "0.3", "--clip-ratio-c", "3", "--adv-clip-max", "4"]
    )
    assert (flags.training.policy_loss, flags.training.clip_eps) == ("ppo_clip", 0.3)
    assert (flags.training.clip_ratio_c, flags.training.adv_clip_max) == (3.0, 4.0)
    explicit = config_from_dict({"training": {"policy_loss": "is", "clip_eps": 0.3}})
    assert explicit.training.policy_loss == "is"


def test_local_supports_every_option_and_tinker_what_its_service_computes():
    local = BACKENDS.entry("local").capabilities.loss_options
    tinker = BACKENDS.entry("tinker").capabilities.loss_options
    assert set(local) == {
        "ppo_clip",
        "gspo",
        "cispo",
        "sapo",
        "vespo",
        "clip_cov",
        "kl_cov",
        "gpg",
        "gmpo",
        "dppo",
        "dual_clip",
        "sequence_ratio",
        "adv_clip",
        "seq_mean_token_sum",
        "seq_mean_token_mean",
        "seq_mean_token_sum_norm",
        "bnpo",
        "kl",
        "tis",
        "mis",
        "sequence_is",
        "user_objective",  # a dotted-path policy_loss
    }
    # the service's ppo and cispo losses; every aggregation is a rescaling of A
    assert set(tinker) == {
        "ppo_clip",
        "cispo",
        "adv_clip",
        "seq_mean_token_sum",
        "seq_mean_token_mean",
        "seq_mean_token_sum_norm",
        "bnpo",
    }
    assert BACKENDS.entry("prime_rl").capabilities.loss_options == ()


def test_a_backend_without_the_option_is_refused_generically():
    config = config_from_dict(
        {
            "training": {"policy_loss": "ppo_clip", "kl_coef": 0.1},
            "algorithm": {"transform_mode": "none"},
        }
    )
    plain = flow_problems(config, BackendCapabilities(), token_varying=False)
    assert [k for k, _ in plain] == ["[training] policy_loss", "[training] kl_coef"]
    assert "does not implement the loss option 'kl'" in plain[1][1]
    some = BackendCapabilities(loss_options=("ppo_clip",))
    assert [k for k, _ in flow_problems(config, some, token_varying=False)] == [
        "[training] kl_coef"
    ]
    assert flow_problems(config_from_dict({}), BackendCapabilities(), token_varying=False) == []


def test_the_new_keys_reach_the_train_hyper_and_name_their_options():
    from retrain.build import train_hyper

    raw = {
        "training": {
            "policy_loss": "sapo",
            "ratio_level": "sequence",
            "sapo_tau_pos": 2.0,
            "sapo_tau_neg": 3.0,
            "loss_agg": "bnpo",
            "bnpo_batch_size": 4,
            "max_tokens": 64,
            "is_correction": "mask",
            "is_level": "geometric",
            "is_low": 0.9,
            "is_high": 1.1,
        }
    }
    config = config_from_dict(raw)
    hyper = train_hyper(config)
    assert (hyper.policy_loss, hyper.ratio_level) == ("sapo", "sequence")
    assert (hyper.sapo_tau_pos, hyper.sapo_tau_neg) == (2.0, 3.0)
    assert (hyper.loss_agg, hyper.bnpo_batch_size, hyper.max_tokens) == ("bnpo", 4, 64)
    assert (hyper.is_correction, hyper.is_level, hyper.is_low, hyper.is_high) == (
        "mask",
        "geometric",
        0.9,
        1.1,
    )
    assert loss_options_used(config) == [
        ("[training] policy_loss", "sapo"),
        ("[training] ratio_level", "sequence_ratio"),
        ("[training] loss_agg", "bnpo"),
        ("[training] is_correction", "mis"),
        ("[training] is_level", "sequence_is"),
    ]
    for policy_loss, keys in {
        "vespo": dict(vespo_k_pos=1.0, vespo_lambda_pos=2.0, vespo_k_neg=0.5, vespo_lambda_neg=4.0),
        "clip_cov": dict(clip_cov_fraction=0.01, clip_cov_lb=0.5, clip_cov_ub=2.0),
        "kl_cov": dict(kl_cov_fraction=0.002, kl_cov_beta=0.3),
        "dppo": dict(clip_eps=0.1, clip_eps_high=0.3, dppo_kl_coef=0.001),
        "gmpo": dict(clip_eps=0.4, clip_eps_high=0.5),
    }.items():
        hyper = train_hyper(config_from_dict({"training": {"policy_loss": policy_loss, **keys}}))
        assert {k: getattr(hyper, k) for k in keys} == keys
    gspo = config_from_dict({"training": {"policy_loss": "gspo", "clip_ratio_c": 3.0}})
    assert loss_options_used(gspo) == [
        ("[training] policy_loss", "gspo"),
        ("[training] clip_ratio_c", "dual_clip"),
    ]
    tis = config_from_dict({"training": {"is_correction": "truncate", "is_high": 3.0}})
    assert loss_options_used(tis) == [("[training] is_correction", "tis")]


def test_tis_cap_stays_the_spelling_of_token_truncation():
    """An old config with tis_cap loads as before; the new keys spell the same loss."""
    from retrain.build import train_hyper

    old = train_hyper(config_from_dict({"training": {"tis_cap": 2.0}}))
    new = train_hyper(config_from_dict({"training": {"is_correction": "truncate", "is_high": 2.0}}))
    seqs = random_batch(random.Random(4), spread=0.8)
    a, b = (
        run_objective(seqs, replace(BASE, **_loss_keys(old))),
        run_objective(seqs, replace(BASE, **_loss_keys(new))),
    )
    assert a[0] == pytest.approx(b[0], rel=1e-12) and a[0] != run_objective(seqs, BASE)[0]
    assert a[2].metrics() == pytest.approx(b[2].metrics())
    assert a[2].metrics()["tis_truncated_fraction"] > 0


def _loss_keys(hyper):
    return {k: getattr(hyper, k) for k in ("tis_cap", "is_correction", "is_level", "is_high")}


@pytest.mark.parametrize(
    ("training", "key", "says"),
    [
        (
            {"policy_loss": "ppo_clip", "ratio_level": "sequence"},
            "ratio_level",
            'policy_loss = "gspo"',
        ),
        (
            {"policy_loss": "is", "sapo_tau_pos": 2.0},
            "sapo_tau_pos",
            'only used with policy_loss = "sapo"',
        ),
        ({"policy_loss": "sapo", "clip_eps_high": 0.3}, "clip_eps_high", "only used with"),
        ({"policy_loss": "cispo", "clip_ratio_c": 2.0}, "clip_ratio_c", '"ppo_clip" / "gspo"'),
        ({"policy_loss": "gspo", "kl_cov_beta": 0.5}, "kl_cov_beta", '"kl_cov"'),
        ({"policy_loss": "vespo", "clip_cov_lb": 0.0}, "clip_cov_lb", '"clip_cov"'),
        ({"policy_loss": "clip_cov", "clip_cov_lb": 5.0}, "clip_cov_lb", "below clip_cov_ub"),
        ({"bnpo_batch_size": 4}, "bnpo_batch_size", 'only used with loss_agg = "bnpo"'),
        ({"is_level": "sequence"}, "is_level", 'only used with is_correction = "truncate"'),
        ({"is_high": 3.0}, "is_high", "only used with is_correction"),
        ({"tis_cap": 2.0, "is_correction": "mask"}, "tis_cap", "short spelling"),
        (
            {"policy_loss": "gspo", "is_correction": "truncate", "is_level": "sequence"},
            "is_level",
            "already weighs by a sequence ratio",
        ),
        ({"is_correction": "mask", "is_low": 1.0}, "is_low", "must be below 1"),
        ({"is_correction": "mask", "is_high": 1.0}, "is_high", "[training] is_high"),
        ({"is_correction": "clip"}, "is_correction", "[training] is_correction"),
        ({"ratio_level": "word"}, "ratio_level", "[training] ratio_level"),
        ({"loss_agg": "bnpo_global"}, "loss_agg", "[training] loss_agg"),
        ({"policy_loss": "gpg", "clip_eps_high": 0.3}, "clip_eps_high", '"gmpo" / "dppo"'),
        ({"policy_loss": "gmpo", "dppo_kl_coef": 0.001}, "dppo_kl_coef", 'policy_loss = "dppo"'),
        ({"policy_loss": "dppo", "dppo_kl_coef": -1.0}, "dppo_kl_coef", "[training] dppo_kl_coef"),
        (
            {"policy_loss": "gpg", "is_correction": "truncate"},
            "is_correction",
            '"gpg" (-A logp) has no ratio to replace',
        ),
        (
            {"policy_loss": "gmpo", "is_correction": "truncate", "is_level": "geometric"},
            "is_level",
            "already weighs by a sequence ratio",
        ),
    ],
)
def test_misused_new_loss_keys_are_config_errors(training, key, says):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": training})
    problem = next(p for p in info.value.problems if p.startswith(f"[training] {key}"))
    assert says in problem


def test_the_new_loss_keys_load_with_their_own_objectives():
    for training in (
        {"policy_loss": "gspo", "clip_eps": 0.0003, "clip_eps_high": 0.0004, "clip_ratio_c": 3.0},
        {"policy_loss": "cispo", "clip_eps": 1.0, "clip_eps_high": 4.0, "ratio_level": "sequence"},
        {"policy_loss": "sapo", "sapo_tau_neg": 2.0, "loss_agg": "seq_mean_token_mean"},
        {"policy_loss": "clip_cov", "clip_cov_fraction": 0.001, "clip_eps_high": 0.28},
        {"loss_agg": "seq_mean_token_sum_norm", "max_tokens": 512},
        {"is_correction": "truncate", "is_level": "sequence", "is_low": 0.5, "is_high": 4.0},
        {"policy_loss": "gspo", "is_correction": "mask", "is_level": "geometric"},
        {"policy_loss": "my_losses.fn", "sapo_tau_pos": 3.0, "ratio_level": "sequence"},
        {"policy_loss": "gpg", "is_correction": "mask", "is_level": "geometric"},
        {"policy_loss": "gmpo", "clip_eps": 0.4, "clip_eps_high": 0.4},
        {"policy_loss": "dppo", "clip_eps_high": 0.3, "dppo_kl_coef": 0.001},
        {"policy_loss": "dppo", "is_correction": "truncate", "is_high": 20.0},
    ):
        config_from_dict({"training": training})


@pytest.mark.parametrize(
    ("training", "option"),
    [
        ({"policy_loss": "gspo"}, "gspo"),
        ({"policy_loss": "sapo"}, "sapo"),
        ({"policy_loss": "vespo"}, "vespo"),
        ({"policy_loss": "clip_cov"}, "clip_cov"),
        ({"policy_loss": "kl_cov"}, "kl_cov"),
        ({"policy_loss": "gpg"}, "gpg"),
        ({"policy_loss": "gmpo"}, "gmpo"),
        ({"policy_loss": "dppo"}, "dppo"),
        ({"policy_loss": "cispo", "ratio_level": "sequence"}, "sequence_ratio"),
        ({"tis_cap": 2.0}, "tis"),
        ({"is_correction": "truncate"}, "tis"),
        ({"is_correction": "mask"}, "mis"),
    ],
)
def test_tinker_refuses_what_its_service_lacks_when_the_config_loads(training, option):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"backend": {"backend": "tinker"}, "training": training})
    assert f"does not implement the loss option {option!r}" in str(info.value)
    with pytest.raises(ConfigError, match=f"loss option {option!r}"):
        config_from_dict({"backend": {"backend": "prime_rl"}, "training": training})


def test_tinker_takes_cispo_and_every_aggregation():
    for training in (
        {"policy_loss": "cispo", "clip_eps": 1.0, "clip_eps_high": 4.0},
        {"loss_agg": "seq_mean_token_sum_norm"},
        {"loss_agg": "bnpo", "bnpo_batch_size": 8},
    ):
        config_from_dict({"backend": {"backend": "tinker"}, "training": training})


def test_explain_names_the_objective_and_the_correction():
    from retrain.cli.summaries import objective_summary

    line = objective_summary(
        config_from_dict(
            {
                "training": {
                    "policy_loss": "gspo",
                    "clip_eps": 0.0003,
                    "clip_eps_high": 0.0004,
                    "loss_agg": "bnpo",
                    "bnpo_batch_size": 4,
                    "is_correction": "mask",
                    "is_level": "geometric",
                    "is_low": 0.99,
                    "is_high": 1.01,
                }
            }
        )
    )
    assert line.startswith("gspo (sequence ratio clipped to [0.9997, 1.0004])")
    assert "agg bnpo (local batches of 4 completions)" in line
    assert "IS weight mask to [0.99, 1.01] (geometric)" in line
    tis = objective_summary(config_from_dict({"training": {"tis_cap": 2.0}}))
    assert "IS weight truncated at 2 (token)" in tis
    for name in ("cispo", "sapo", "vespo", "clip_cov", "kl_cov", "gpg", "gmpo", "dppo"):
        line = objective_summary(config_from_dict({"training": {"policy_loss": name}}))
        assert line.startswith(f"{name} (")
    prime = {"policy_loss": "dppo", "dppo_kl_coef": 0.001}
    assert objective_summary(config_from_dict({"training": prime})).startswith(
        "dppo (tokens whose probability moved beyond -0.2 / +0.2 dropped, 0.001 (log r)^2)"
    )
    gmpo = {"policy_loss": "gmpo", "clip_eps": 0.4, "clip_eps_high": 0.4}
    assert objective_summary(config_from_dict({"training": gmpo})).startswith(
        "gmpo (geometric mean of the ratios, log r clipped to [-0.4, 0.4])"
    )


def test_tinker_refuses_kl_and_dual_clip_when_the_config_loads():
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "backend": {"backend": "tinker"},
                "training": {"policy_loss": "ppo_clip", "clip_ratio_c": 3.0, "kl_coef": 0.1},
            }
        )
    text = str(info.value)
    assert "[training] clip_ratio_c" in text and "'dual_clip'" in text
    assert "[training] kl_coef" in text and "'kl'" in text
    config_from_dict(
        {
            "backend": {"backend": "tinker"},
            "training": {
                "policy_loss": "ppo_clip",
                "loss_agg": "seq_mean_token_mean",
                "adv_clip_max": 2.0,
            },
        }
    )


# ---------------------------------------------------------------- Tinker's service losses


class _FakeTinker:
    class ModelInput:
        @staticmethod
        def from_ints(tokens):
            return list(tokens)

    class TensorData:
        def __init__(self, data, dtype, shape):
            self.data = data

    class Datum:
        def __init__(self, model_input, loss_fn_inputs):
            self.model_input = model_input
            self.loss_fn_inputs = loss_fn_inputs


def _service_loss(loss_fn, config, inputs, train_logprobs):
    """The Tinker service's documented losses (a sum over every target position)."""
    adv = np.asarray(inputs["advantages"].data, dtype=np.float64)
    sampler = np.asarray(inputs["logprobs"].data, dtype=np.float64)
    r = np.exp(train_logprobs - sampler)
    if loss_fn == "importance_sampling":
        return float(-(r * adv).sum())
    bounded = np.clip(r, config["clip_low_threshold"], config["clip_high_threshold"])
    if loss_fn == "cispo":  # sg(clip(r)) * target_logprobs * A, negated and summed
        return float(-(bounded * train_logprobs * adv).sum())
    assert loss_fn == "ppo"
    return float(-np.minimum(r * adv, bounded * adv).sum())


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(adv_clip_max=0.7),
        dict(policy_loss="ppo_clip", clip_eps=0.15, clip_eps_high=0.3),
        dict(policy_loss="cispo", clip_eps=0.15, clip_eps_high=0.3),
        dict(policy_loss="cispo", clip_eps=1.0, clip_eps_high=0.2, adv_clip_max=0.9),
    ],
)
def test_tinker_service_losses_equal_the_local_objective(options, loss_agg):
    from retrain.backends.tinker import advantage_scales, build_tinker_datum, loss_request
    from retrain.types import Datum

    hyper = replace(BASE, loss_agg=loss_agg, **options)
    f32 = lambda xs: [float(np.float32(x)) for x in xs]  # noqa: E731  (what a Datum holds)
    seqs = [
        (lp, f32(old), f32(adv), None)
        for lp, old, adv, _ in random_batch(random.Random(17), n=6, spread=0.4, with_ref=False)
    ]
    datums = [Datum([1, 2, 3], list(range(4, 4 + len(lp))), old, adv) for lp, old, adv, _ in seqs]
    scales = advantage_scales(datums, hyper)
    loss_fn, config = loss_request(hyper)
    service = 0.0
    for d, s, (lp, *_rest) in zip(datums, scales, seqs, strict=True):
        td = build_tinker_datum(_FakeTinker, d, float(s), hyper.adv_clip_max)
        train = np.concatenate([np.zeros(2), np.asarray(lp)])  # prompt positions: 0 = sampler
        service += _service_loss(loss_fn, config, td.loss_fn_inputs, train)
    local, _, _ = run_objective(seqs, hyper)
    assert service == pytest.approx(local, rel=1e-6)
    if hyper.policy_loss == "is":
        assert (loss_fn, config) == ("importance_sampling", None)
    else:
        assert loss_fn == {"ppo_clip": "ppo", "cispo": "cispo"}[hyper.policy_loss]
        assert config == {
            "clip_low_threshold": pytest.approx(1 - hyper.clip_eps),
            "clip_high_threshold": pytest.approx(1 + hyper.clip_eps_high),
        }


@pytest.mark.parametrize(
    "options",
    [
        dict(kl_coef=0.1),
        dict(clip_ratio_c=2.0, policy_loss="ppo_clip"),
        dict(tis_cap=2.0),
        dict(is_correction="mask"),
        dict(policy_loss="cispo", ratio_level="sequence"),
        dict(policy_loss="gspo"),
        dict(policy_loss="sapo"),
    ],
)
def test_tinker_refuses_what_its_service_cannot_compute(options):
    """A hyper built past config validation (a caller driving the backend directly)
    still gets no silent substitute."""
    from retrain.backends.tinker import loss_request
    from retrain.errors import BackendError

    with pytest.raises(BackendError, match="the Tinker service has no loss for"):
        loss_request(replace(BASE, **options))


def test_tinker_train_step_sends_the_ppo_loss_and_reports_clip_fraction():
    pytest.importorskip("tinker")
    import test_tinker_backend as fake

    class PpoTraining(fake.FakeTraining):
        def forward_backward(self, data, loss_fn, loss_fn_config=None):
            future = super().forward_backward(data, loss_fn)
            self.calls[-1] = ("forward_backward", loss_fn, loss_fn_config, len(data))
            return future

    backend, training, _, _ = fake.make_backend(PpoTraining())
    datums = [
        fake.Datum([1, 2], [3, fake.EOS], [-1.0, -2.0], [1.0, 1.0]),
        fake.Datum([1, 2], [4, 5, fake.EOS], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]),
    ]
    hyper = replace(
        BASE,
        policy_loss="ppo_clip",
        clip_eps=0.2,
        clip_eps_high=0.005,
        loss_agg="seq_mean_token_sum",
    )
    result = backend.train_step(datums, hyper)
    assert training.calls[0] == (
        "forward_backward",
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.005},
        2,
    )
    # seq_mean_token_sum: each completion's advantages divided by G = 2
    sent = [d.loss_fn_inputs["advantages"].tolist()[1:] for d in training.last_data]
    assert sent == [pytest.approx([0.5, 0.5]), pytest.approx([-0.5, -0.5, -0.5])]
    # the fake trainer's logprobs are the sampler's + 0.01: r = 1.01 > 1.005 clips the
    # positive-advantage tokens (2 of 5)
    assert result.extra["clip_fraction"] == pytest.approx(2 / 5)
    plain = backend.train_step(datums, BASE)
    assert training.calls[-2][:2] == ("forward_backward", "importance_sampling")
    assert plain.extra["clip_fraction"] == 0.0
