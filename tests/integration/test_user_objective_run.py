"""A user-written objective (`[training] policy_loss = "module.fn"`, a file in a
`[plugins] search_paths` folder) through the real local backend on the tiny random model:
it is resolved once, called on every micro-batch, and its loss is the one trained."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from grad_recorder import step_gradients
from run_helpers import QuietConsole
from test_loss_options_run import run, with_training

from retrain.config import config_from_dict

USER_LOSSES = '''
from retrain.loss import TokenLoss
from retrain.loss.objectives import importance_sampling

CALLS = []


def recording_is(inputs, hyper):
    """`is`, recording what it was called with."""
    CALLS.append((tuple(inputs.logp.shape), inputs.logp.dtype, inputs.logp.requires_grad))
    return importance_sampling(inputs, hyper)


def flipped_is(inputs, hyper):
    """-1 times `is`: gradient ascent on the policy-gradient objective."""
    return TokenLoss(-importance_sampling(inputs, hyper).per_token)
'''


def write_losses(tmp_path, module: str) -> None:
    """The objectives as `module` in tmp_path (tiny_raw's [plugins] search_paths); a new
    name per test, since an imported module stays in sys.modules."""
    (tmp_path / f"{module}.py").write_text(USER_LOSSES)


def test_a_flipped_objective_flips_the_gradient(tiny_raw, tiny_model_dir, tmp_path):
    """The backend built with a dotted policy_loss trains with it: its gradient is
    exactly -1 times the `is` gradient of the same step at the same weights."""
    from transformers import AutoTokenizer

    from retrain.build import build_backend, train_hyper
    from retrain.types import Datum, SamplingParams

    write_losses(tmp_path, "flip_losses")
    tiny_raw["training"]["policy_loss"] = "flip_losses.flipped_is"
    config = config_from_dict(tiny_raw)
    b = build_backend(config, AutoTokenizer.from_pretrained(tiny_model_dir), lambda s: None)
    assert b.loss_fn.name == "flip_losses.flipped_is"
    assert b.loss_fn.objective is sys.modules["flip_losses"].flipped_is
    with torch.no_grad():  # a non-trivial adapter, so the gradient reaches every LoRA matrix
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    groups = b.sample(prompts, 3, SamplingParams(max_tokens=6, temperature=1.0, seed=4))
    datums = [
        Datum(prompt, s.token_ids, s.logprobs, [1.5 - i] * len(s.token_ids))
        for prompt, g in zip(prompts, groups, strict=True)
        for i, s in enumerate(g)
    ]
    hyper = train_hyper(config)
    mine, g_mine = step_gradients(b, datums, hyper, 10_000)
    theirs, g_theirs = step_gradients(b, datums, replace(hyper, policy_loss="is"), 10_000)
    assert b.loss_fn.name == "is"  # a hyper naming another loss re-resolves it
    assert mine.loss == -theirs.loss != 0.0
    assert any(g.abs().max() > 1e-4 for g in g_theirs)
    for x, y in zip(g_mine, g_theirs, strict=True):
        assert torch.equal(x, -y)


def test_a_run_trains_with_the_user_objective_resolved_once(tiny_raw, tmp_path, monkeypatch):
    """A 2-step `retrain` run with a recording copy of `is` logs exactly the losses of
    the built-in `is` run (same seed), its objective called on every micro-batch with
    float32 logprobs that carry a gradient, and resolved twice, never per micro-batch:
    by the startup checks (before any model loads) and as the backend is built."""
    import retrain.loss as loss

    write_losses(tmp_path, "run_losses")
    resolved = []
    original = loss.resolve_objective
    monkeypatch.setattr(
        loss,
        "resolve_objective",
        lambda name, paths=(): resolved.append(name) or original(name, paths),
    )
    options = dict(max_steps=2, save_every=0)
    mine = with_training(
        tiny_raw, tmp_path, "mine", policy_loss="run_losses.recording_is", **options
    )
    code, rows = run(mine)
    assert code == 0 and [r["step"] for r in rows] == [0, 1]
    assert resolved == ["run_losses.recording_is"] * 2
    calls = sys.modules["run_losses"].CALLS
    assert len(calls) >= 2 and all(c[1] == torch.float32 and c[2] for c in calls)
    resolved.clear()
    code, base = run(with_training(tiny_raw, tmp_path, "is", **options))
    assert code == 0 and resolved == ["is"]
    assert [r["loss"] for r in rows] == [r["loss"] for r in base]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in base]


def test_a_missing_objective_fails_when_the_run_starts(tiny_raw, tmp_path):
    from retrain.errors import ConfigError
    from retrain.trainer import train

    raw = with_training(tiny_raw, tmp_path, "missing", policy_loss="nowhere_losses.fn")
    said = r"\[training\] policy_loss: cannot import module 'nowhere_losses'"
    with pytest.raises(ConfigError, match=said):
        train(config_from_dict(raw), console=QuietConsole())
