"""An update moves the policy the right way: one optimizer step on completions with known
advantages raises the trainer's logprob of the positive-advantage completions and lowers
it for the negative ones. Run on the tiny random model through the local backend's own
loss, and through the loss the Tinker service computes on the datums the Tinker backend
builds (Tinker's `importance_sampling`: loss = -sum(advantages * exp(logp - logp_sampler))
over each datum's positions), evaluated here on the same model.

A flipped sign anywhere (the loss, the advantages, the Tinker scale) fails these tests."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from retrain.backends.local import LocalBackend
from retrain.build import build_backend
from retrain.config import config_from_dict
from retrain.types import Datum, SamplingParams, TrainHyper

PROMPT = [5, 6, 7, 8, 9]
GROUP = 8
LR = 2e-2  # Adam's first step moves each LoRA weight by about lr
HYPER = TrainHyper(lr=LR, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.fixture
def backend(tiny_raw, tiny_model_dir):
    from transformers import AutoTokenizer

    raw = copy.deepcopy(tiny_raw)
    raw["training"]["temperature"] = 1.0
    config = config_from_dict(raw)
    return build_backend(config, AutoTokenizer.from_pretrained(tiny_model_dir), say=lambda s: None)


def sampled_datums(backend: LocalBackend, signs: list[float]) -> list[Datum]:
    """`len(signs)` completions of one prompt, each with a constant advantage."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=21)
    group = backend.sample([PROMPT], len(signs), params)[0]
    return [
        Datum(PROMPT, s.token_ids, s.logprobs, np.full(len(s.token_ids), sign))
        for s, sign in zip(group, signs, strict=True)
    ]


def sequence_logprobs(backend: LocalBackend, datums: list[Datum]) -> np.ndarray:
    """The trainer's log-probability of each whole completion."""
    with torch.no_grad():
        logp = backend.completion_logprobs(PROMPT, [d.completion_ids for d in datums], 1.0)
    return np.array([float(logp[i, : len(d.completion_ids)].sum()) for i, d in enumerate(datums)])


def assert_moved_the_right_way(before: np.ndarray, after: np.ndarray, signs: list[float]):
    delta = after - before
    pos = [d for d, s in zip(delta, signs, strict=True) if s > 0]
    neg = [d for d, s in zip(delta, signs, strict=True) if s < 0]
    assert np.mean(pos) > 1e-3, f"positive-advantage logprobs moved by {pos}"
    assert np.mean(neg) < -1e-3, f"negative-advantage logprobs moved by {neg}"
    assert sum(d > 0 for d in pos) > len(pos) / 2  # most of them, not one outlier
    assert sum(d < 0 for d in neg) > len(neg) / 2


SIGNS = [1.0, -1.0] * (GROUP // 2)


def test_local_update_raises_positive_and_lowers_negative_completions(backend):
    datums = sampled_datums(backend, SIGNS)
    before = sequence_logprobs(backend, datums)
    # on-policy: the trainer agrees with the sampler before the update
    assert before == pytest.approx([d.sampler_logprobs.sum() for d in datums], abs=1e-3)
    result = backend.train_step(datums, HYPER)
    n = sum(len(d.completion_ids) for d in datums)
    # at ratio 1 the loss is -(1/N) * sum of the token advantages
    assert result.loss == pytest.approx(-sum(d.advantages.sum() for d in datums) / n, abs=1e-4)
    assert result.grad_norm > 0
    assert_moved_the_right_way(before, sequence_logprobs(backend, datums), SIGNS)


def test_flipping_the_advantages_flips_the_direction(backend):
    """The control: the same batch with the opposite signs moves the other way, so the
    test above measures the update and not some drift common to every step."""
    flipped = [-s for s in SIGNS]
    datums = sampled_datums(backend, flipped)
    before = sequence_logprobs(backend, datums)
    backend.train_step(datums, HYPER)
    assert_moved_the_right_way(before, sequence_logprobs(backend, datums), flipped)


def tinker_importance_sampling_loss(model, tinker_datum) -> tuple[torch.Tensor, torch.Tensor]:
    """Tinker's documented `importance_sampling` loss of one datum, on `model`: position i
    of model_input predicts target_tokens[i]; per position -adv * exp(logp - logp_sampler),
    summed. Returns (elementwise loss, trainer logprobs)."""
    fn = tinker_datum.loss_fn_inputs
    inputs = torch.tensor([tinker_datum.model_input.to_ints()])
    targets = torch.tensor(fn["target_tokens"].tolist(), dtype=torch.long)
    sampler = torch.tensor(fn["logprobs"].tolist(), dtype=torch.float32)
    adv = torch.tensor(fn["advantages"].tolist(), dtype=torch.float32)
    logits = model(input_ids=inputs).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return -(adv * torch.exp(logp - sampler)), logp


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value


class TinyTinkerService:
    """A Tinker training service computed on the tiny model: forward_backward evaluates
    Tinker's importance_sampling loss on the datums it is sent and accumulates the
    gradient; optim_step applies Adam with the AdamParams it is sent."""

    def __init__(self, tinker, model, params):
        self.tinker, self.model, self.params = tinker, model, params
        self.optimizer = torch.optim.Adam(params, lr=0.0)
        self.sent = []
        self.grads = []

    def create_lora_training_client(self, base_model, rank, seed=None):
        return self

    def forward_backward(self, data, loss_fn):
        assert loss_fn == "importance_sampling"
        self.sent = list(data)
        self.model.train()
        outputs, total = [], 0.0
        for datum in data:
            elementwise, logp = tinker_importance_sampling_loss(self.model, datum)
            elementwise.sum().backward()
            total += float(elementwise.detach().sum())
            outputs.append(
                {
                    "elementwise_loss": self.tinker.TensorData.from_torch(elementwise.detach()),
                    "logprobs": self.tinker.TensorData.from_torch(logp.detach()),
                }
            )
        self.grads = [p.grad.detach().clone() for p in self.params]
        return _Done(
            self.tinker.types.ForwardBackwardOutput(
                loss_fn_output_type="scalar", loss_fn_outputs=outputs, metrics={"loss:sum": total}
            )
        )

    def optim_step(self, adam):
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return _Done(self.tinker.types.OptimStepResponse(metrics={}))


def test_the_tinker_backends_datums_under_tinkers_loss_move_the_policy_the_same_way(
    backend, tiny_model_dir
):
    tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed")
    from types import SimpleNamespace

    from retrain.backends.tinker import TinkerBackend
    from retrain.build import tinker_settings

    datums = sampled_datums(backend, SIGNS)
    n = sum(len(d.completion_ids) for d in datums)
    snapshot = [p.detach().clone() for p in backend.params]

    # the local backend's gradient on this batch
    local_grads = []
    step = backend.optimizer.step

    def recording_step(*args, **kwargs):
        local_grads.extend(p.grad.detach().clone() for p in backend.params)
        return step(*args, **kwargs)

    backend.optimizer.step = recording_step
    try:
        local = backend.train_step(datums, HYPER)
    finally:
        backend.optimizer.step = step
    with torch.no_grad():  # back to the weights that sampled
        for p, s in zip(backend.params, snapshot, strict=True):
            p.copy_(s)
    before = sequence_logprobs(backend, datums)

    # the same batch through the Tinker backend, its service computing Tinker's loss
    service = TinyTinkerService(tinker, backend.model, backend.params)
    config = config_from_dict(
        {
            "backend": {"backend": "tinker", "options": {"keepalive_s": 0.0}},
            "model": {"model": str(tiny_model_dir), "lora_rank": 4},
            "training": {"seed": 3, "temperature": 1.0},
        }
    )
    remote = TinkerBackend(
        tinker_settings(config),
        SimpleNamespace(eos_token_id=2),
        say=lambda s: None,
        service_client=service,
    )
    try:
        result = remote.train_step(datums, HYPER)
    finally:
        remote.close()

    # what it sent: each completion position carries its Datum's advantage over N
    for d, t in zip(datums, service.sent, strict=True):
        adv = np.asarray(t.loss_fn_inputs["advantages"].tolist())
        assert np.all(adv[: len(PROMPT) - 1] == 0)
        assert adv[len(PROMPT) - 1 :] == pytest.approx(d.advantages / n, rel=1e-6)
    # Tinker's loss on those datums is the local backend's loss: same value, same gradient
    assert result.loss == pytest.approx(local.loss, abs=1e-5)
    assert any(float(g.abs().max()) > 0 for g in local_grads)
    for g_tinker, g_local in zip(service.grads, local_grads, strict=True):
        assert torch.allclose(g_tinker, g_local, atol=1e-7, rtol=1e-3)
    # and the service's optimizer step moves the policy the right way
    assert_moved_the_right_way(before, sequence_logprobs(backend, datums), SIGNS)
