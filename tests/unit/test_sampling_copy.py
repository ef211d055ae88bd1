"""The pytorch engine's sampling copy against the PEFT model it stands in for: the same
logits (float32 merged; bf16 blocks with the adapter beside them), refreshed after the
adapter changes, an update too small for a bf16 weight still reaching the sampler, the
same samples from the same seed, and logprobs that are the copy's own (the behaviour
policy)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.engines.pytorch import PyTorchEngine  # noqa: E402
from retrain.engines.sampling_copy import LoraBeside, SamplingCopy, Sibling  # noqa: E402
from retrain.kernels.precision import sibling_sets  # noqa: E402
from retrain.types import SamplingParams  # noqa: E402


def tiny_peft(seed: int = 0, *, bf16_blocks: bool = False, b_std: float = 0.2, **lora_kw):
    """A tiny Llama with LoRA on every projection, B ~ N(0, b_std) (a trained adapter).
    `bf16_blocks`: what the local backend trains in bf16 mode (bf16 block linears, turned
    before the adapter is added; float32 residual stream and adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from retrain.kernels.precision import bf16_linears

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
    base = LlamaForCausalLM(config)
    if bf16_blocks:
        bf16_linears(base)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", **lora_kw
    )
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_std) if b_std else p.zero_()
    return model.eval()


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_copy_matches_the_adapter_and_shares_frozen_weights():
    model = tiny_peft()
    sc = SamplingCopy.build(model, None)
    sc.refresh()
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits_of(sc.model, ids), logits_of(model, ids), atol=1e-5, rtol=0)
    base = model.get_base_model()
    assert sc.model.model.embed_tokens.weight is base.model.embed_tokens.weight
    assert len(sc.pairs) == 2 * 7  # every projection of both layers


def test_refresh_follows_in_place_updates_and_only_then():
    model = tiny_peft()
    sc = SamplingCopy.build(model, None)
    sc.refresh()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    before = logits_of(sc.model, ids)
    sc.refresh()  # nothing changed: the same weights
    torch.testing.assert_close(logits_of(sc.model, ids), before, atol=0, rtol=0)
    with torch.no_grad():  # what an optimizer step does
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.1)
    assert not torch.allclose(logits_of(model, ids), before)
    sc.refresh()
    torch.testing.assert_close(logits_of(sc.model, ids), logits_of(model, ids), atol=1e-5, rtol=0)


def test_the_trained_model_is_untouched_by_building_a_bf16_copy():
    model = tiny_peft()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    before = logits_of(model, ids)
    sc = SamplingCopy.build(model, torch.bfloat16)
    sc.refresh()
    assert next(sc.model.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(logits_of(model, ids), before, atol=0, rtol=0)


def test_a_bf16_copy_runs_the_tiled_bf16_layer_and_follows_the_adapter():
    """The wholly bf16 copy's block linears are the tiled Bf16Linear (fixed matmul row
    counts on a CPU), the adapted ones included; the output layer stays a plain linear. Its
    logits are those of the same copy with plain bf16 linears, and follow an update."""
    from retrain.kernels.precision import Bf16Linear

    model = tiny_peft()
    sc = SamplingCopy.build(model, torch.bfloat16)
    sc.refresh()
    linears = [m for m in sc.model.modules() if isinstance(m, torch.nn.Linear)]
    head = sc.model.get_output_embeddings()
    assert [type(m) is Bf16Linear for m in linears] == [m is not head for m in linears]
    # the adapter stays float32 beside the bf16 weights
    assert all(type(side) is LoraBeside for _, side in sc.pairs)
    assert all(type(side.base) is Bf16Linear for _, side in sc.pairs)
    assert all(side.a.dtype == side.b.dtype == torch.float32 for _, side in sc.pairs)
    ids = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(4))  # 120 rows
    before = logits_of(sc.model, ids).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.1)
    sc.refresh()
    tiled = logits_of(sc.model, ids).float()
    assert (tiled - before).abs().max() > 0.2  # the update reached the copy
    for m in linears:  # the same weights through plain bf16 linears
        if m is not head:
            m.__class__ = torch.nn.Linear
    plain = logits_of(sc.model, ids).float()
    # the same bf16 products; only the order of a few sums may differ between row counts
    torch.testing.assert_close(tiled, plain, atol=3e-2, rtol=0)


def test_bf16_mode_copy_shares_the_bf16_weights_and_computes_the_trainers_logits():
    from retrain.kernels.precision import Bf16Linear

    model = tiny_peft(bf16_blocks=True, b_std=0.05)
    sc = SamplingCopy.build(model, None)
    sc.refresh()
    assert len(sc.pairs) == 2 * 7
    for layer, side in sc.pairs:
        assert type(side) is LoraBeside and type(side.base) is Bf16Linear
        assert side.base.weight is layer.base_layer.weight  # shared: no new weight memory
    # every weight of the copy lies in the trainer's memory (the siblings' stacked
    # weights are views of the trainer's, rearranged in place)
    trained = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(p.untyped_storage().data_ptr() in trained for p in sc.model.parameters())
    ids = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(6))
    # the same bf16 matmuls on the same rows, and the adapter's float32 product beside them
    torch.testing.assert_close(logits_of(sc.model, ids), logits_of(model, ids), atol=1e-5, rtol=0)


def test_a_bf16_stream_takes_the_float32_adapter_into_its_float32_copy(monkeypatch):
    """Beside a bf16 layer, the float32 adapter's product is added to a float32 copy of
    the layer's output and the sum rounded once, PEFT's order; into that copy itself: an
    addmm into a new tensor first copies its input there (aten's addmm_out), one more
    pass over the output per adapted layer and decoded token."""
    from retrain.engines.sampling_copy import add_beside

    gen = torch.Generator().manual_seed(8)
    flat = torch.randn(6, 10, generator=gen).bfloat16()
    x = torch.randn(6, 12, generator=gen).bfloat16()
    a, b = torch.randn(4, 12, generator=gen), torch.randn(10, 4, generator=gen)
    want = (flat.double() + 2.0 * (x.double() @ a.double().t()) @ b.double().t()).bfloat16()
    out_of_place = []
    real = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: out_of_place.append(1) or real(*a, **k))
    add_beside(flat, x, a, b, 2.0)
    assert not out_of_place
    assert (flat.double() - want.double()).abs().max() <= want.double().abs().max() * 2**-7


def test_an_update_below_a_bf16_step_reaches_the_bf16_sampler():
    """A young adapter's update is far below half a bf16 step of the weights it adapts:
    folded into bf16 weights it rounds away and the sampler keeps the old policy. Beside
    the weights it moves the sampler's logits exactly as it moves the trainer's."""
    model = tiny_peft(bf16_blocks=True, b_std=0.0)  # a fresh adapter
    sc = SamplingCopy.build(model, None)
    sc.refresh()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(7))
    before = logits_of(model, ids)
    with torch.no_grad():  # B from zero to a first optimizer step's size
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-5)
    kept = lost = 0
    for layer, _ in sc.pairs:  # what folding the update into the bf16 weights would give
        w = layer.base_layer.weight
        delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        folded = (w.float() + delta * layer.scaling["default"]).to(torch.bfloat16)
        lost += int((folded == w).sum())
        kept += folded.numel()
    assert lost > 0.95 * kept  # nearly all of it rounds back to the old weights
    after = logits_of(model, ids)
    moved = (after - before).abs().max().item()
    assert moved > 1e-4  # the trainer sees the update
    sc.refresh()
    got = logits_of(sc.model, ids)
    assert (got - after).abs().max().item() < moved / 50  # so does the sampler


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
    assert SamplingCopy.build(plain, None) is None
    assert SamplingCopy.build(tiny_peft(use_dora=True), None) is None


def sample(engine, seed=5, n=4):
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=12, seed=seed)
    return engine.sample([[1, 5, 9, 3], [7, 2]], n, params)


def test_merged_engine_samples_what_the_adapter_samples():
    model = tiny_peft()
    fast = PyTorchEngine(model, {0}, 0, torch.device("cpu"))
    slow = PyTorchEngine(model, {0}, 0, torch.device("cpu"), sampling_copy=False)
    assert fast.copy is not None and slow.copy is None
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
        logits = logits_of(engine.copy.model, ids)[0, len(prompt) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert abs(s.logprobs - want.double().numpy()).max() < 2e-2  # bf16 kernel order
        fp32 = torch.log_softmax(logits_of(model, ids)[0, len(prompt) - 1 : -1], -1)
        fp32 = fp32.gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert abs(s.logprobs - fp32.double().numpy()).max() < 0.2  # bf16 vs fp32, bounded


def test_a_bf16_copy_of_its_own_keeps_the_rotary_frequencies_float32():
    """`[inference] dtype = "bf16"` on a float32 model: its parameters in bf16, its
    buffers as the trainer's (float32 rotary frequencies, as transformers loads a bf16
    model), so the sampler's rotary angles are the trainer's."""
    model = tiny_peft()
    copy_ = PyTorchEngine(model, {0}, 0, torch.device("cpu"), dtype="bf16").copy.model
    frozen = [p for p in copy_.parameters() if p.is_floating_point()]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    ours = dict(copy_.named_buffers())
    theirs = {n.removeprefix("base_model.model."): b for n, b in model.named_buffers()}
    rotary = [n for n in ours if "inv_freq" in n]
    assert rotary
    for name in rotary:
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], theirs[name])


# ---------------------------------------------------------------- sibling projections


def _unfused(sc) -> None:
    """Each sibling projection of the copy back as its own layer."""
    for parent in sc.model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, Sibling):
                setattr(parent, name, child.part)


@pytest.mark.parametrize("bf16_blocks", [False, True])
def test_siblings_run_as_one_and_compute_the_unfused_layers(bf16_blocks):
    model = tiny_peft(bf16_blocks=bf16_blocks, b_std=0.05)
    sc = SamplingCopy.build(model, None)
    sc.refresh()
    fused = [(p, n) for p, n in sibling_sets(sc.model)]
    assert len(fused) == 2 * 2  # q/k/v and gate/up of both layers
    for parent, names in fused:
        members = [getattr(parent, n) for n in names]
        assert all(isinstance(m, Sibling) for m in members)
        assert len({id(m.group) for m in members}) == 1
    ids = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(8))
    got = logits_of(sc.model, ids)
    want = logits_of(model, ids)
    # float32 sums in another order (bf16 blocks: then rounded to a bf16 input downstream)
    torch.testing.assert_close(got, want, atol=2e-3 if bf16_blocks else 1e-5, rtol=0)
    _unfused(sc)  # each projection alone again: the members kept their (viewed) A and B
    torch.testing.assert_close(logits_of(sc.model, ids), want, atol=1e-5, rtol=0)


def test_an_update_reaches_the_siblings_stacked_adapter():
    model = tiny_peft(bf16_blocks=True, b_std=0.0)
    sc = SamplingCopy.build(model, None)
    sc.refresh()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(9))
    before = logits_of(sc.model, ids)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and ("q_proj" in name or "up_proj" in name):
                p.normal_(0, 0.3)
    sc.refresh()
    after = logits_of(sc.model, ids)
    assert (after - before).abs().max() > 0.05
    torch.testing.assert_close(after, logits_of(model, ids), atol=2e-3, rtol=0)


def test_a_sibling_called_with_another_input_gets_its_own_output():
    model = tiny_peft(b_std=0.05)
    sc = SamplingCopy.build(model, None)
    sc.refresh()
    attn = sc.model.model.layers[0].self_attn
    x, other = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    trained = model.base_model.model.model.layers[0].self_attn
    with torch.no_grad():
        q = attn.q_proj(x)  # computes q, k and v for x
        k = attn.k_proj(other)  # not x: recomputed for `other`
        v = attn.v_proj(x)
        torch.testing.assert_close(q, trained.q_proj(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(k, trained.k_proj(other), atol=1e-5, rtol=0)
        torch.testing.assert_close(v, trained.v_proj(x), atol=1e-5, rtol=0)


def test_sibling_storage_is_rearranged_in_place_with_the_same_values():
    from retrain.kernels.precision import share_sibling_storage, stacked

    model = tiny_peft()
    attn = model.get_base_model().model.layers[1].self_attn
    layers = [attn.q_proj.base_layer, attn.k_proj.base_layer, attn.v_proj.base_layer]
    params = [m.weight for m in layers]
    values = [w.detach().clone() for w in params]
    assert stacked(params) is None  # loaded one tensor per weight
    assert share_sibling_storage(model.get_base_model()) == 2 * 2
    assert [m.weight for m in layers] == params  # the same Parameters, new layout
    whole = stacked(params)
    assert whole is not None and whole.shape == (32 + 16 + 16, 32)
    assert torch.equal(whole, torch.cat(values))
    assert all(torch.equal(w, v) for w, v in zip(params, values))


def test_the_trainers_modes_are_switched_only_when_it_samples_itself(monkeypatch):
    """Switching a model's mode walks every module (~2.5k at Qwen3-4B's 36 layers with an
    adapter). With a copy the trained model is left in training mode, untouched; without
    one it samples in eval mode (its LoRA dropout off) and goes back to training mode."""
    model = tiny_peft(lora_dropout=0.5).train()
    walks = []
    real = torch.nn.Module.train

    def counted(module, mode=True):
        if module is model:
            walks.append(mode)
        return real(module, mode)

    monkeypatch.setattr(torch.nn.Module, "train", counted)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    seen = []
    hooks = [d.register_forward_hook(lambda m, i, o: seen.append(m.training)) for d in dropouts]
    fast = PyTorchEngine(model, {0}, 0, torch.device("cpu"))
    sample(fast)
    assert walks == [] and model.training and not seen  # the copy has no dropout layers
    slow = PyTorchEngine(model, {0}, 0, torch.device("cpu"), sampling_copy=False)
    sample(slow)
    assert walks == [False, True]  # eval to sample, then training again
    assert seen and not any(seen)  # every dropout ran in eval mode while sampling
    assert all(m.training for m in model.modules())
    model.eval()
    walks.clear()
    sample(slow)
    assert walks == []  # already in eval mode: left there, no walk
    assert not any(m.training for m in model.modules())
    for hook in hooks:
        hook.remove()
