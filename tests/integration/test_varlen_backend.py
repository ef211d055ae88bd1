"""The local backend training through `attention = "varlen"` (retrain/kernels/varlen.py),
on the tiny random model on this CPU. The option is CUDA's (the config refuses it here),
so the backend is built with the choice made for it: its packed rows then go through the
variable-length layout and `varlen.reference` (the kernel's rule, one SDPA call per
sequence), and its step must be the dense mask's step, on a model with a sliding layer
too. tests/integration/test_gpu.py
runs the kernel itself."""

from __future__ import annotations

import pytest
import torch
from grad_recorder import step_gradients
from test_memory_sizing import HYPER, datums_of, make_backend
from tiny_model import make_tiny_model

from retrain.kernels import flex


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    """A tiny Qwen2 with layer 1 sliding over 4 positions (every prompt outgrows it): its
    masks come per layer type, each with its window."""
    return make_tiny_model(tmp_path_factory.mktemp("sliding") / "model", sliding_window=4)


@pytest.mark.parametrize("sliding", [False, True])
def test_a_step_through_the_varlen_layout_is_the_dense_masks_step(
    tiny_raw, tiny_model_dir, sliding_dir, monkeypatch, sliding
):
    model_dir = sliding_dir if sliding else tiny_model_dir
    tiny_raw["model"]["model"] = str(model_dir)
    tiny_model_dir = model_dir
    dense = make_backend(tiny_raw, tiny_model_dir)
    assert (dense._windows.sliding == 4) == sliding
    assert not dense._varlen
    datums = datums_of(dense)
    want_result, want = step_gradients(dense, datums, HYPER, 512)
    checked = []
    monkeypatch.setattr(flex, "varlen_chosen", lambda option, *rest: True)
    from retrain.kernels import varlen

    real_check = varlen.check
    monkeypatch.setattr(varlen, "check", lambda *a: checked.append(a) or real_check(*a))
    said: list[str] = []
    through = make_backend(tiny_raw, tiny_model_dir, said)
    assert through._varlen and len(checked) == 1  # the start's check ran, and passed
    assert any(f"attention={flex.VARLEN_LABEL}" in line for line in said)
    attended = []
    real_attend = varlen.attend
    monkeypatch.setattr(varlen, "attend", lambda *a: attended.append(1) or real_attend(*a))
    result, got = step_gradients(through, datums, HYPER, 512)
    assert attended  # every layer's attention went through the layout
    assert result.loss == pytest.approx(want_result.loss, rel=1e-5, abs=1e-7)
    assert len(got) == len(want) > 0 and any(g.abs().max() > 0 for g in want)
    for grad, expected in zip(got, want, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-4)


def test_varlen_is_refused_before_the_model_loads_off_cuda(tiny_raw):
    from retrain.config import config_from_dict
    from retrain.errors import ConfigError

    tiny_raw["backend"]["options"]["attention"] = "varlen"
    with pytest.raises(ConfigError, match=r"attention.*CUDA"):
        config_from_dict(tiny_raw)
