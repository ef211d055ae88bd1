"""The local backend's bf16 mode (`[backend.options] dtype`) and the sampler's early-stop
bookkeeping, on the tiny random model:

* bf16 mode turns the transformer blocks' frozen linears into bf16 matmuls while the
  adapter, embeddings, norms and logits stay float32; sampler and trainer then agree to
  within bf16 rounding, and an update still moves the policy the right way;
* rows that reach end-of-sequence leave the decoding batch, and every other row's
  recorded logprobs still equal the trainer's (float32)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from retrain.backends.local import LocalBackend
from retrain.build import build_backend
from retrain.config import config_from_dict
from retrain.engines.sampling_copy import Float32Head, LoraBeside
from retrain.kernels.lora_layers import InputDtypeLinear, plain_lora_layers
from retrain.kernels.precision import Bf16Linear, use_bf16
from retrain.kernels.recompute import GatedMlp, RecomputedRmsNorm
from retrain.types import Datum, SamplingParams, TrainHyper

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def make_backend(tiny_raw, tiny_model_dir, dtype: str) -> LocalBackend:
    from transformers import AutoTokenizer

    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["options"]["dtype"] = dtype
    b = build_backend(
        config_from_dict(raw), AutoTokenizer.from_pretrained(tiny_model_dir), say=lambda s: None
    )
    with torch.no_grad():  # a trained adapter: B is not zero
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return b


def agreement(b: LocalBackend, n: int, max_tokens: int, temperature: float) -> np.ndarray:
    """Trainer minus sampler logprob of every sampled token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=5)
    groups = b.sample(PROMPTS, n, params)
    diffs = []
    for prompt, group in zip(PROMPTS, groups, strict=True):
        with torch.no_grad():
            logp = b.completion_logprobs(prompt, [s.token_ids for s in group], temperature)
        for i, s in enumerate(group):
            diffs.append(logp[i, : len(s.token_ids)].double().numpy() - s.logprobs)
    return np.concatenate(diffs), groups


def test_bf16_mode_keeps_the_adapter_norms_and_logits_in_float32(tiny_raw, tiny_model_dir):
    b = make_backend(tiny_raw, tiny_model_dir, "bf16")
    base = b.model.get_base_model()
    blocks = [m for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    lora = [m for m in blocks if "lora_" in type(m).__name__ or m.weight.requires_grad]
    frozen = [m for m in blocks if m not in lora]
    assert frozen and all(type(m) is Bf16Linear for m in frozen)
    assert all(m.weight.dtype == torch.bfloat16 for m in frozen)
    assert all(p.dtype == torch.float32 for p in b.params)  # the adapter
    head = base.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    norms = [p for n, p in base.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    out = b.model(input_ids=torch.tensor([PROMPTS[0]]))
    assert out.logits.dtype == torch.float32
    # the sampler's copy runs the trainer's own bf16 weights, the adapter beside them
    assert b.engine.copy is not None
    for layer, side in b.engine.copy.pairs:
        assert type(side.base) is Bf16Linear and side.base.weight is layer.base_layer.weight


def test_bf16_sampler_and_trainer_agree_to_bf16_rounding(tiny_raw, tiny_model_dir):
    exact, _ = agreement(make_backend(tiny_raw, tiny_model_dir, "fp32"), 4, 10, 0.7)
    assert np.abs(exact).max() < 1e-4
    diff, _ = agreement(make_backend(tiny_raw, tiny_model_dir, "bf16"), 4, 10, 0.7)
    # bf16 rounds each matmul's output to 8 significant bits; the sampler runs one token
    # at a time and the trainer a packed row, so the roundings differ a little
    assert np.abs(diff).mean() < 0.02 and np.abs(diff).max() < 0.25
    assert np.abs(diff).max() > 0  # really a bf16 computation


def signed_update(tiny_raw, tiny_model_dir) -> tuple[LocalBackend, list[Datum]]:
    """A bf16 backend after one step that rewards the even completions of a group and
    penalises the odd ones; asserts their logprobs moved that way."""
    b = make_backend(tiny_raw, tiny_model_dir, "bf16")
    prompt, signs = PROMPTS[0], [1.0, -1.0] * 4
    group = b.sample([prompt], len(signs), SamplingParams(max_tokens=6, temperature=1.0, seed=21))
    datums = [
        Datum(prompt, s.token_ids, s.logprobs, np.full(len(s.token_ids), sign))
        for s, sign in zip(group[0], signs, strict=True)
    ]

    def seq_logp():
        with torch.no_grad():
            logp = b.completion_logprobs(prompt, [d.completion_ids for d in datums], 1.0)
        return np.array(
            [float(logp[i, : len(d.completion_ids)].sum()) for i, d in enumerate(datums)]
        )

    before = seq_logp()
    b.train_step(datums, TrainHyper(lr=2e-2, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8))
    delta = seq_logp() - before
    assert np.mean(delta[0::2]) > 1e-3 and np.mean(delta[1::2]) < -1e-3
    return b, datums


def test_bf16_update_moves_the_policy_the_right_way(tiny_raw, tiny_model_dir):
    b, datums = signed_update(tiny_raw, tiny_model_dir)
    prompt = datums[0].prompt_ids
    # the sampler follows the update: after the backend's own optimizer step its copy
    # computes the trained model's logits (the same bf16 matmuls, the adapter beside)
    ids = torch.tensor([prompt + datums[0].completion_ids.tolist()])
    b.engine.copy.refresh()
    with torch.no_grad():
        got, want = b.engine.copy.model(input_ids=ids).logits, b.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_auto_picks_bf16_only_where_matmuls_are_native(monkeypatch):
    import retrain.hardware as hardware

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    # on CUDA torch's capability of the GPU itself, not nvidia-smi's (which may number
    # GPUs of different models otherwise: hardware.gpu_order_unknown)
    asked = []
    monkeypatch.setattr(hardware, "compute_capability", lambda *a, **kw: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: asked.append(d) or (7, 5))
    assert not use_bf16("auto", gpu) and asked == [gpu] and use_bf16("bf16", gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (8, 0))
    assert not use_bf16("auto", cpu) and use_bf16("auto", gpu) and use_bf16("bf16", cpu)
    assert not use_bf16("auto", torch.device("mps"))
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert use_bf16("auto", cpu) and not use_bf16("fp32", cpu) and not use_bf16("fp32", gpu)


def test_finished_rows_leave_the_batch_and_the_rest_stay_exact(tiny_raw, tiny_model_dir):
    b = make_backend(tiny_raw, tiny_model_dir, "fp32")
    # a tenth of the vocabulary ends a completion, so rows stop at many different steps
    b.engine.eos_ids = list(range(20, 30))
    diff, groups = agreement(b, 6, 12, 1.0)
    lengths = {len(s.token_ids) for g in groups for s in g}
    stops = {s.stop_reason for g in groups for s in g}
    assert len(lengths) >= 4 and stops == {"eos", "length"}
    for g in groups:
        for s in g:
            assert (s.stop_reason == "eos") == (int(s.token_ids[-1]) in range(20, 30))
            assert not np.isin(s.token_ids[:-1], range(20, 30)).any()  # stopped at the first
    assert np.abs(diff).max() < 1e-4


def test_a_group_larger_than_a_decoding_batch_is_sampled_in_exact_parts(
    tiny_raw, tiny_model_dir, monkeypatch
):
    import retrain.memory

    b = make_backend(tiny_raw, tiny_model_dir, "fp32")
    monkeypatch.setattr(retrain.memory, "SAMPLE_ROWS", 4)  # a group of 6 is decoded as 4 + 2
    rows = []
    inner = b.engine._sample_chunk

    def recording(model, prompts, n, params, generator):
        rows.append(len(prompts) * n)
        return inner(model, prompts, n, params, generator)

    monkeypatch.setattr(b.engine, "_sample_chunk", recording)
    diff, groups = agreement(b, 6, 8, 1.0)
    assert rows == [4, 2, 4, 2]  # each prompt in two parts, never over 4 rows
    assert [len(g) for g in groups] == [6, 6]
    assert np.abs(diff).max() < 1e-4  # every part's logprobs are the trainer's


# ---------------------------------------------------------------- the GPU's layout


@pytest.fixture
def whole_bf16(monkeypatch):
    """bf16 mode as a GPU runs it (the whole model in bf16), on this CPU."""
    import retrain.hardware as hardware

    monkeypatch.setattr(hardware, "WHOLE_BF16", frozenset({"cpu", "cuda"}))


def test_on_a_gpu_bf16_mode_holds_the_whole_model_in_bf16(whole_bf16, tiny_raw, tiny_model_dir):
    b = make_backend(tiny_raw, tiny_model_dir, "bf16")
    base = b.model.get_base_model()
    frozen = [p for p in base.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)  # norms, embeddings too
    assert all(p.dtype == torch.float32 for p in b.params)  # the adapter
    rotary = [buf for name, buf in base.named_buffers() if "inv_freq" in name]
    assert rotary and all(buf.dtype == torch.float32 for buf in rotary)
    assert not any(isinstance(m, Bf16Linear) for m in base.modules())
    # the adapter computes in bf16 from the bf16 stream (float32 A and B cast per call),
    # added to the base output in float32 and rounded once; the sampler's copy beside the
    # shared weights does the same, with bf16 copies of A and B (the trainer reads B in
    # bf16 for that product too)
    factors = [m for m in base.modules() if isinstance(m, InputDtypeLinear)]
    assert factors and all(f.weight.dtype == torch.float32 for f in factors)
    assert {type(m).__name__ for _, m in plain_lora_layers(b.model)} == {"LeanLoraLinear"}
    sides = [m for m in b.engine.copy.model.modules() if isinstance(m, LoraBeside)]
    assert sides and all(m.a.dtype == m.b.dtype == torch.bfloat16 and m.once for m in sides)
    # the trainer's norms and gated MLPs keep only their inputs for the backward
    layers = base.config.num_hidden_layers
    assert sum(isinstance(m, GatedMlp) for m in base.modules()) == layers
    assert sum(isinstance(m, RecomputedRmsNorm) for m in base.modules()) == 2 * layers + 1
    # its q/k/v and gate/up run as one each, as the sampler's copy runs them
    assert sorted(len(g.layers) for g in b._siblings) == [2] * layers + [3] * layers
    # the sampler's copy computes float32 logits from its bf16 hidden states and the
    # shared bf16 output weight, as the trainer's split head does
    copy_ = b.engine.copy.model
    head = copy_.get_output_embeddings()
    assert isinstance(head, Float32Head)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        hidden = copy_.get_decoder()(input_ids=ids).last_hidden_state
        assert hidden.dtype == torch.bfloat16
        logits = copy_(input_ids=ids).logits
        want = torch.nn.functional.linear(
            hidden.float(), base.get_output_embeddings().weight.float()
        )
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, atol=0, rtol=0)
    with torch.no_grad():
        logp = b.completion_logprobs(PROMPTS[0], [np.array([3, 4, 5])], 1.0)
    assert logp.dtype == torch.float32


def test_whole_bf16_sampler_and_trainer_agree_to_bf16_rounding(
    whole_bf16, tiny_raw, tiny_model_dir
):
    diff, _ = agreement(make_backend(tiny_raw, tiny_model_dir, "bf16"), 4, 10, 0.7)
    # the residual stream is rounded to bf16 at every layer, one token at a time in the
    # sampler and in a packed row in the trainer, and so is each adapted layer's output,
    # its adapter added in float32 (here B ~ N(0, 0.2), an update as large as the
    # weights: mean 3e-4, largest 2e-3; 5e-4 and 2e-3 added to the rounded base output);
    # the logits are float32 in both
    assert np.abs(diff).mean() < 5e-3 and np.abs(diff).max() < 0.05
    assert np.abs(diff).max() > 0


def test_whole_bf16_update_moves_the_policy_the_right_way(whole_bf16, tiny_raw, tiny_model_dir):
    b, _ = signed_update(tiny_raw, tiny_model_dir)
    # the sampler follows: its copy now draws from the updated policy (float32 logits of
    # the same bf16 network; only the order of bf16 sums differs from the trainer's)
    diff, _ = agreement(b, 4, 10, 1.0)
    assert np.abs(diff).mean() < 0.05
