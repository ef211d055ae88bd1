"""The pytorch engine's merged-LoRA sampler against the plain PEFT model it replaces: same
logits (float32), re-merged after the adapter changes, the same samples from the same
seed, and in bf16 logprobs that are exactly the bf16 copy's own (the behaviour policy)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.engines.merged import MergedSampler  # noqa: E402
from retrain.engines.pytorch import PyTorchEngine  # noqa: E402
from retrain.types import SamplingParams  # noqa: E402


def tiny_peft(seed: int = 0, **lora_kw):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", **lora_kw
    )
    model = get_peft_model(LlamaForCausalLM(config), lora)
    with torch.no_grad():  # a trained adapter: B is not zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.eval()


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_copy_matches_the_adapter_and_shares_frozen_weights():
    model = tiny_peft()
    merged = MergedSampler.build(model, None)
    merged.refresh()
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        logits_of(merged.model, ids), logits_of(model, ids), atol=1e-5, rtol=0
    )
    base = model.get_base_model()
    assert merged.model.model.embed_tokens.weight is base.model.embed_tokens.weight
    assert len(merged.pairs) == 2 * 7  # every projection of both layers


def test_refresh_follows_in_place_updates_and_only_then():
    model = tiny_peft()
    merged = MergedSampler.build(model, None)
    merged.refresh()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    before = logits_of(merged.model, ids)
    merged.refresh()  # nothing changed: the same weights
    torch.testing.assert_close(logits_of(merged.model, ids), before, atol=0, rtol=0)
    with torch.no_grad():  # what an optimizer step does
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.1)
    assert not torch.allclose(logits_of(model, ids), before)
    merged.refresh()
    torch.testing.assert_close(
        logits_of(merged.model, ids), logits_of(model, ids), atol=1e-5, rtol=0
    )


def test_the_trained_model_is_untouched_by_building_a_bf16_copy():
    model = tiny_peft()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    before = logits_of(model, ids)
    merged = MergedSampler.build(model, torch.bfloat16)
    merged.refresh()
    assert next(merged.model.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(logits_of(model, ids), before, atol=0, rtol=0)


def test_a_bf16_copy_runs_the_tiled_bf16_layer_and_follows_the_adapter():
    """The wholly bf16 copy's block linears are the tiled Bf16Linear (fixed matmul row
    counts on a CPU), merged ones included; the output layer stays a plain linear. Its
    logits are those of the same copy with plain bf16 linears, and follow an update."""
    from retrain.kernels.precision import Bf16Linear

    model = tiny_peft()
    merged = MergedSampler.build(model, torch.bfloat16)
    merged.refresh()
    linears = [m for m in merged.model.modules() if isinstance(m, torch.nn.Linear)]
    head = merged.model.get_output_embeddings()
    assert [type(m) is Bf16Linear for m in linears] == [m is not head for m in linears]
    assert all(type(plain) is Bf16Linear for _, plain in merged.pairs)
    ids = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(4))  # 120 rows
    before = logits_of(merged.model, ids).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.1)
    merged.refresh()
    tiled = logits_of(merged.model, ids).float()
    assert (tiled - before).abs().max() > 0.2  # the update reached the copy
    for m in linears:  # the same weights through plain bf16 linears
        if m is not head:
            m.__class__ = torch.nn.Linear
    plain = logits_of(merged.model, ids).float()
    # the same bf16 products; only the order of a few sums may differ between row counts
    torch.testing.assert_close(tiled, plain, atol=3e-2, rtol=0)


def test_unsupported_models_fall_back_to_sampling_the_model_as_is():
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    assert MergedSampler.build(plain, None) is None
    assert MergedSampler.build(tiny_peft(use_dora=True), None) is None


def sample(engine, seed=5, n=4):
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=12, seed=seed)
    return engine.sample([[1, 5, 9, 3], [7, 2]], n, params)


def test_merged_engine_samples_what_the_adapter_samples():
    model = tiny_peft()
    fast = PyTorchEngine(model, {0}, 0, torch.device("cpu"))
    slow = PyTorchEngine(model, {0}, 0, torch.device("cpu"), merge_lora=False)
    assert fast.merged is not None and slow.merged is None
    for g_fast, g_slow in zip(sample(fast), sample(slow)):
        for a, b in zip(g_fast, g_slow):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            assert abs(a.logprobs - b.logprobs).max() < 1e-5


def test_bf16_logprobs_are_the_bf16_models_own():
    """The recorded logprob of each token is log_softmax of the bf16 copy's logits: the
    distribution the token was drawn from (what the importance ratio needs)."""
    model = tiny_peft()
    engine = PyTorchEngine(model, {0}, 0, torch.device("cpu"), dtype="bf16")
    prompt = [1, 5, 9, 3]
    (group,) = engine.sample([prompt], 3, SamplingParams(max_tokens=10, temperature=1.0, seed=7))
    for s in group:
        ids = torch.tensor([prompt + s.token_ids.tolist()])
        logits = logits_of(engine.merged.model, ids)[0, len(prompt) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert abs(s.logprobs - want.double().numpy()).max() < 2e-2  # bf16 kernel order
        fp32 = torch.log_softmax(logits_of(model, ids)[0, len(prompt) - 1 : -1], -1)
        fp32 = fp32.gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert abs(s.logprobs - fp32.double().numpy()).max() < 0.2  # bf16 vs fp32, bounded
