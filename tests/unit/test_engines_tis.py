"""Truncated importance sampling (`[training] tis_cap`) on hand-worked numbers: a token
whose ratio r = exp(logp - logp_sampler) exceeds the cap contributes -A * cap (gradient
-A * cap * dlogp), the others are untouched."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from retrain.loss import LossInputs, resolve_objective  # noqa: E402
from retrain.types import TrainHyper  # noqa: E402


def _hyper(**kw) -> TrainHyper:
    return TrainHyper(lr=1e-4, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8, **kw)


def _run(tis_cap: float, policy_loss: str = "is"):
    # r = 3 (truncated at cap 2), r = 0.5 and r = 1 (kept); advantages 1, 1, -2
    logp = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]], requires_grad=True)
    sampler = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    hyper = _hyper(tis_cap=tis_cap, policy_loss=policy_loss)
    out = resolve_objective(policy_loss)(LossInputs(logp, sampler, adv, mask, 3.0), hyper)
    out.loss.backward()
    return float(out.loss.detach()), logp.grad[0].tolist(), out.stats.metrics()


def test_tis_caps_the_ratio_of_one_token():
    loss, grad, metrics = _run(2.0)
    # -(1*min(3,2) + 1*0.5 + (-2)*1) / 3 = -(2 + 0.5 - 2) / 3
    assert loss == pytest.approx(-0.5 / 3)
    assert grad == pytest.approx([-2.0 / 3, -0.5 / 3, 2.0 / 3])
    assert metrics["tis_truncated_fraction"] == pytest.approx(1 / 3)


def test_tis_off_is_the_plain_importance_sampling_loss():
    loss, grad, metrics = _run(0.0)
    assert loss == pytest.approx(-(3.0 + 0.5 - 2.0) / 3)
    assert grad == pytest.approx([-3.0 / 3, -0.5 / 3, 2.0 / 3])
    assert "tis_truncated_fraction" not in metrics


def test_a_cap_above_every_ratio_changes_nothing():
    capped, plain = _run(10.0), _run(0.0)
    assert capped[0] == pytest.approx(plain[0]) and capped[1] == pytest.approx(plain[1])
    assert capped[2]["tis_truncated_fraction"] == 0.0


def test_tis_cap_must_be_off_or_above_one(tmp_path):
    from retrain.config import load_config
    from retrain.errors import ConfigError

    path = tmp_path / "c.toml"
    path.write_text("[training]\ntis_cap = 0.5\n")
    with pytest.raises(ConfigError, match=r"\[training\] tis_cap"):
        load_config(str(path), [])
