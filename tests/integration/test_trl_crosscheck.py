"""Opt-in (marker `trl`, `pytest -m trl`; needs TRL 1.16, the `bench` extra): retrain's
loss against TRL's own GRPOTrainer loss, row by row of the map retrain/loss/peers.py.

For every TRL row (each loss_type at importance_sampling_level token and sequence, delta,
beta), the same per-token logprobs, old logprobs, reference logprobs, advantages and masks
go to TRL's `_compute_loss` (its model forward stubbed to return those logprobs, as the
trainer's `_get_per_token_logps_and_entropies` would) and to retrain's LossFn under the
row's `[training]` settings (read through the config and build.train_hyper). One step is
two local batches of three completions (TRL: two gradient-accumulation calls, retrain: one
step in any micro-batch split); the losses and d loss / d logp of every token must be
equal. Where TRL differs from its paper, the row's notes say so and which one retrain
follows."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from retrain.build import train_hyper
from retrain.config import config_from_dict
from retrain.loss import LossInputs, LossStats, resolve_objective, step_weights
from retrain.loss.peers import PEER_LOSSES, TRL, TRL_BATCH, TRL_CHECK, TRL_MAX_COMPLETION

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl", minversion="1.16")

ROWS = [row for row in PEER_LOSSES if row.checked_by == TRL_CHECK]
B = TRL_BATCH["per_device_train_batch_size"]
GA = TRL_BATCH["gradient_accumulation_steps"]
G = B * GA


class _OneProcess:
    """The accelerator calls _compute_loss makes, for a single process."""

    num_processes = 1

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss_of(args, logps: torch.Tensor):
    """A GRPOTrainer without a model whose forward returns `logps`: the attributes its
    __init__ derives from `args` and _compute_loss reads, set the same way."""
    from trl import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.args = args
    trainer.loss_type = args.loss_type
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.beta = args.beta
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.max_completion_length = args.max_completion_length
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.use_vllm = False
    trainer.vllm_importance_sampling_correction = False
    trainer._entropy_bonus_enabled = False
    trainer.aux_loss_enabled = False
    trainer.accelerator = _OneProcess()
    trainer.model = SimpleNamespace(training=True)
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        logps,
        torch.zeros_like(logps),
        None,
    )
    return trainer


def random_step(seed: int, width: int = 8):
    """(logp, old, ref, advantages (G,), mask) of one step, right-padded to `width`."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, G)
    mask = np.arange(width)[None, :] < lengths[:, None]
    logp = rng.uniform(-4.0, -0.05, (G, width))
    # ratios mostly near 1, one token in ten far off (r ~ e^+-2: past cispo's cap of 5)
    far = rng.choice([0.0, 2.0, -2.0], (G, width), p=[0.8, 0.1, 0.1])
    old = logp + rng.normal(0, 0.3, (G, width)) + far
    ref = logp + rng.normal(0, 0.3, (G, width))
    adv = rng.normal(0, 1.0, G)
    for x in (logp, old, ref):
        x[~mask] = 0.0
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    return t(logp), t(old), t(ref), t(adv), torch.tensor(mask)


def trl_step(row, step) -> tuple[float, torch.Tensor]:
    """TRL's loss of the step, summed over its accumulation calls, and its gradients."""
    from trl import GRPOConfig

    logp, old, ref, adv, mask = step
    args = GRPOConfig(
        output_dir="/tmp/retrain-trl-crosscheck",
        report_to=[],
        use_cpu=True,
        num_generations=B,
        max_completion_length=TRL_MAX_COMPLETION,
        **TRL_BATCH,
        **row.peer_settings,
    )
    total, grads = 0.0, torch.zeros_like(logp)
    for b in range(GA):
        rows = slice(b * B, (b + 1) * B)
        mine = logp[rows].clone().requires_grad_(True)
        n = mask.shape[1]
        inputs = {
            "prompt_ids": torch.ones((B, 2), dtype=torch.long),
            "prompt_mask": torch.ones((B, 2), dtype=torch.long),
            "completion_ids": torch.ones((B, n), dtype=torch.long),
            "completion_mask": mask[rows].int(),
            "advantages": adv[rows],
            "old_per_token_logps": old[rows],
            "num_items_in_batch": mask.sum(),  # the generation batch's tokens
        }
        if args.beta != 0.0:
            inputs["ref_per_token_logps"] = ref[rows]
        # float64 throughout: TRL builds some constants (sapo's temperatures) from Python
        # floats, in the default dtype
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            loss = trl_loss_of(args, mine)._compute_loss(None, inputs)
        finally:
            torch.set_default_dtype(default)
        loss.backward()
        total += float(loss.detach())
        grads[rows] = mine.grad
    return total, grads


def retrain_step(row, step, chunks) -> tuple[float, torch.Tensor, LossStats]:
    """retrain's loss of the step under the row's settings, in micro-batches `chunks`."""
    logp, old, ref, adv, mask = step
    hyper = train_hyper(config_from_dict({"training": dict(row.settings)}))
    hyper = replace(hyper, temperature=1.0)
    loss_fn = resolve_objective(hyper.policy_loss)
    weights, denominator = step_weights(mask.sum(1).tolist(), hyper)
    total, grads, stats, start = 0.0, torch.zeros_like(logp), LossStats(), 0
    for size in chunks:
        rows = slice(start, start + size)
        mine = logp[rows].clone().requires_grad_(True)
        seq_w = None
        if hyper.loss_agg != "token_mean":
            seq_w = torch.from_numpy(weights[rows])
        tokens_adv = adv[rows, None].expand_as(mine).clone() * mask[rows]
        inputs = LossInputs(
            mine,
            old[rows],
            tokens_adv,
            mask[rows],
            denominator,
            seq_w,
            ref[rows] if hyper.kl_coef > 0 else None,
        )
        out = loss_fn(inputs, hyper)
        out.loss.backward()
        total += float(out.loss.detach())
        grads[rows] = mine.grad
        stats.add(out.stats)
        start += size
    return total, grads, stats


def test_every_trl_loss_type_and_level_has_a_checked_row():
    from trl import GRPOConfig

    names = {
        (r.peer_settings["loss_type"], r.peer_settings.get("importance_sampling_level"))
        for r in ROWS
    }
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"):
        assert f"'{loss_type}'" in help_text  # TRL 1.16 has it
        for level in ("token", "sequence"):
            assert (loss_type, level) in names
    assert all(r.peer == TRL for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name.replace(" ", ""))
def test_retrain_equals_trl(row):
    for seed in range(3):
        step = random_step(seed)
        want, want_grads = trl_step(row, step)
        mask = step[4]
        for chunks in ([G], [2, 4], [1] * G):
            loss, grads, stats = retrain_step(row, step, chunks)
            assert loss == pytest.approx(want, rel=1e-9, abs=1e-12), (row.name, chunks)
            assert torch.allclose(grads[mask], want_grads[mask], rtol=1e-9, atol=1e-12), row.name
            assert not grads[~mask].any() and not want_grads[~mask].any()
        assert want != 0.0 and want_grads[mask].abs().max() > 0


def test_the_rows_clip_what_they_claim_to():
    """The random steps make the clipped rows clip (else equality would prove little):
    PPO-style rows clip some tokens, cispo clamps some weights."""
    for row in ROWS:
        if row.settings.get("policy_loss") not in ("ppo_clip", "gspo", "cispo"):
            continue
        fractions = [
            retrain_step(row, random_step(s), [G])[2].metrics()["clip_fraction"] for s in range(3)
        ]
        assert max(fractions) > 0, row.name
