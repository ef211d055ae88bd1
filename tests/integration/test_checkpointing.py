"""`[backend.options] checkpointing`: recomputing each block in the backward pass gives the
step's gradient of the plain backward (same weights, same datums), and a run trains."""

from __future__ import annotations

import copy

import pytest
import torch
from grad_recorder import step_gradients

from retrain.build import build_backend
from retrain.config import config_from_dict
from retrain.types import Datum, TrainHyper

HYPER = TrainHyper(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, temperature=1.0)


def _backend(tiny_raw, checkpointing: bool, said: list[str] | None = None):
    from transformers import AutoTokenizer

    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["options"]["checkpointing"] = checkpointing
    tok = AutoTokenizer.from_pretrained(raw["model"]["model"])
    b = build_backend(config_from_dict(raw), tok, (said if said is not None else []).append)
    with torch.no_grad():  # a non-trivial adapter: the gradient reaches every LoRA matrix
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.linspace(-0.2, 0.2, p.numel()).view_as(p))
    return b


def test_checkpointing_gives_the_plain_gradient(tiny_raw):
    said: list[str] = []
    plain, ckpt = _backend(tiny_raw, False), _backend(tiny_raw, True, said)
    (ready,) = [s for s in said if s.startswith("Local backend ready")]
    assert "micro_batch_tokens=512, activation checkpointing, attention=" in ready

    def on(b) -> bool:
        m = b.model
        return getattr(m, "is_activation_checkpointing", None) or m.is_gradient_checkpointing

    assert not on(plain) and on(ckpt)
    prompts = [[5, 6, 7, 8], [9, 10]]
    datums = [
        Datum(p, [11 + i, 12, 13 + i], [-1.0, -0.5, -2.0], [0.5 - i, 0.5 - i, 0.5 - i])
        for p in prompts
        for i in range(2)
    ]
    a, grads_a = step_gradients(plain, datums, HYPER, 10_000)
    b, grads_b = step_gradients(ckpt, datums, HYPER, 10_000)
    assert a.loss == pytest.approx(b.loss, abs=1e-7)
    assert any(g.abs().max() > 1e-4 for g in grads_a)
    for x, y in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-7)
