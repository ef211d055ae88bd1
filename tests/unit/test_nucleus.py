"""Nucleus (top-p) sampling in the pytorch engine: the truncated distribution against a
plain per-row reference, and the recorded logprob is that of the distribution sampled."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from retrain.engines.draw import nucleus  # noqa: E402


def reference_nucleus(probs: list[float], top_p: float) -> list[float]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_nucleus_matches_a_plain_reference(top_p):
    rng = np.random.default_rng(int(top_p * 1000))
    logits = torch.tensor(rng.normal(size=(6, 40)) * 3, dtype=torch.float64)
    got = nucleus(torch.log_softmax(logits, dim=-1), top_p).exp()
    for row, probs in zip(got.tolist(), torch.softmax(logits, dim=-1).tolist()):
        assert row == pytest.approx(reference_nucleus(probs, top_p), abs=1e-12)
        assert math.isclose(sum(row), 1.0, abs_tol=1e-12)


def test_top_token_always_kept_and_full_mass_keeps_everything():
    logp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0]]), dim=-1)
    only_top = nucleus(logp, 1e-6).exp()[0].tolist()
    assert only_top == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert torch.allclose(nucleus(logp, 1.0), logp)
