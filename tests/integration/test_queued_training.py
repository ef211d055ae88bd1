"""A training micro-batch is queued whole: its forward, loss, statistics and backward never
make the host wait for the device (tests/device_waits.py records, on this CPU, every
operator that would on CUDA), and on CUDA the step reads its numbers once, after its last
backward (off CUDA as each micro-batch ends: the same numbers). A non-finite micro-batch
loss still stops the step before the optimizer does, naming that micro-batch, with the
weights untouched."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from device_waits import DeviceWaits
from test_memory_sizing import HYPER, datums_of, make_backend

from retrain.errors import TrainingError
from retrain.types import Datum

SETTINGS = {
    "is": {},
    # clipped tokens, token truncation, the KL penalty and per-completion weights
    "ppo_clip_tis_kl_weighted": dict(
        policy_loss="ppo_clip", tis_cap=1.5, kl_coef=0.1, loss_agg="seq_mean_token_mean"
    ),
    "mask_sequence": dict(is_correction="mask", is_level="sequence", is_high=1.2),
    # a step-wide selection: its picks go up with each micro-batch
    "clip_cov": dict(policy_loss="clip_cov", clip_cov_fraction=0.2, clip_cov_lb=-5.0),
}


@pytest.fixture
def backend(tiny_raw, tiny_model_dir):
    b = make_backend(tiny_raw, tiny_model_dir)
    with torch.no_grad():  # a non-trivial adapter
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return b


def _recording(backend, monkeypatch) -> DeviceWaits:
    """Record the device waits inside every micro-batch's forward and backward."""
    waits, inner = DeviceWaits(), backend._backward

    def recorded(*args, **kwargs):
        with waits:
            return inner(*args, **kwargs)

    monkeypatch.setattr(backend, "_backward", recorded)
    return waits


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("split_head", [True, False])
def test_a_micro_batch_never_waits_for_the_device(backend, monkeypatch, name, split_head):
    if not split_head:  # the plain path: the logits of the kept positions
        monkeypatch.setattr(backend, "head", None)
    datums = datums_of(backend)
    hyper = replace(HYPER, **SETTINGS[name])
    monkeypatch.setattr(backend, "options", replace(backend.options, micro_batch_tokens=24))
    waits = _recording(backend, monkeypatch)
    result = backend.train_step(datums, hyper)
    assert waits.seen == {}, f"operators that wait for the device: {dict(waits.seen)}"
    assert result.loss == result.loss and result.extra["micro_batch_tokens"] == 24
    if name == "ppo_clip_tis_kl_weighted":
        assert result.extra["kl_mean"] > 0  # the KL term ran (the adapter moved the policy)


def test_reading_once_a_step_gives_what_reading_each_micro_batch_gives(backend, monkeypatch):
    """The CUDA way (the step's sums read once, after the last backward; nothing in the
    whole loop waits) against this CPU's (each micro-batch's read as it ends): the same
    loss, metrics and update; and the largest and mean log ratio of one micro-batch for all.
    The sampler's logprobs are moved off the trainer's, so the ratios are not rounding."""
    hyper = replace(HYPER, **SETTINGS["ppo_clip_tis_kl_weighted"])
    monkeypatch.setattr(backend, "options", replace(backend.options, micro_batch_tokens=24))
    sampled = datums_of(backend)
    smallest = {id(d) for d in backend._micro_batches(sampled)[-1][1]}  # it runs last
    datums = [  # the sampler 0.1 below the trainer, 0.3 in the micro-batch that runs last
        Datum(
            d.prompt_ids,
            d.completion_ids,
            d.sampler_logprobs - (0.3 if id(d) in smallest else 0.1),
            d.advantages,
        )
        for d in sampled
    ]
    model0 = copy.deepcopy(backend.model.state_dict())
    optimizer0 = copy.deepcopy(backend.optimizer.state_dict())
    inner, results = backend._accumulate, {}
    for queued in (False, True):
        backend.model.load_state_dict(model0)
        backend.optimizer.load_state_dict(optimizer0)
        monkeypatch.setattr(backend, "_reads_each_micro_batch", lambda q=queued: not q)
        waits = DeviceWaits()

        def recorded(*args, waits=waits, **kwargs):
            with waits:
                return inner(*args, **kwargs)

        monkeypatch.setattr(backend, "_accumulate", recorded)
        result = backend.train_step(datums, hyper)
        trained = [p.detach().clone() for p in backend.model.parameters() if p.requires_grad]
        results[queued] = (result, trained, dict(waits.seen))
    (each, trained_each, _), (once, trained_once, waited) = results[False], results[True]
    assert waited == {}, waited
    assert once.loss == pytest.approx(each.loss, rel=1e-6)
    assert once.extra == pytest.approx(each.extra, rel=1e-6)
    assert once.log_ratio_max_abs == pytest.approx(each.log_ratio_max_abs, rel=1e-6)
    assert once.log_ratio_mean == pytest.approx(each.log_ratio_mean, rel=1e-6, abs=1e-12)
    for a, b in zip(trained_each, trained_once, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    backend.model.load_state_dict(model0)
    backend.optimizer.load_state_dict(optimizer0)
    monkeypatch.setattr(backend, "options", replace(backend.options, micro_batch_tokens=10_000))
    whole = backend.train_step(datums, hyper)
    assert once.log_ratio_max_abs == pytest.approx(whole.log_ratio_max_abs, rel=1e-5)
    assert once.log_ratio_mean == pytest.approx(whole.log_ratio_mean, rel=1e-5)
    assert 0.1 < whole.log_ratio_mean < whole.log_ratio_max_abs < 0.31


def test_the_recorder_sees_a_read_back_and_a_bool_index():
    """The recorder itself: a value read back and a bool-mask index are waits, an index
    by position is not."""
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    with DeviceWaits() as waits:
        x.index_select(0, torch.tensor([0, 2]))
        torch.where(mask, x, 0.0).sum()
    assert waits.seen == {}
    with DeviceWaits() as waits:
        float(x.sum())
        x[mask] = 0.0
        x[mask].sum()
    assert sorted(name for name, _ in waits.seen) == ["_local_scalar_dense", "index", "index_put_"]


def test_a_non_finite_micro_batch_stops_the_step_and_keeps_the_weights(backend, monkeypatch):
    """The loss is read after the last backward now: the second micro-batch's NaN still
    stops the step before the optimizer, names that micro-batch's size, and leaves the
    weights and their optimizer state as they were."""
    datums = datums_of(backend)
    monkeypatch.setattr(backend, "options", replace(backend.options, micro_batch_tokens=24))
    sizes = [len(chunk) for _, chunk in backend._micro_batches(datums)]
    assert len(sizes) >= 3
    inner, calls = backend._logprobs, []

    def poisoned(groups, temperature):
        calls.append(1)
        out = inner(groups, temperature)
        return out * float("nan") if len(calls) == 2 else out

    monkeypatch.setattr(backend, "_logprobs", poisoned)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    state = copy.deepcopy(backend.optimizer.state_dict())
    with pytest.raises(TrainingError) as err:
        backend.train_step(datums, HYPER)
    assert f"loss is nan (non-finite) in a micro-batch of {sizes[1]} completions" in str(err.value)
    assert "the weights were not updated" in str(err.value)
    assert len(calls) == len(sizes)  # the step ran through; nothing was read before its end
    for n, p in backend.model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None or not p.grad.any()
    assert backend.optimizer.state_dict()["state"].keys() == state["state"].keys()
