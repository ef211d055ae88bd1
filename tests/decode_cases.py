"""A decoding case shared by the CPU tests and the opt-in GPU tests: bf16 mode's sampling
copy (the trainer's bf16 blocks, the LoRA adapter beside them) under the static decoder,
before and after an in-place adapter update."""

from __future__ import annotations

import torch


def adapter_update_case(device, graphs: bool, tokens: int = 40, compiled: bool = False) -> None:
    """bf16 mode's sampling copy decoded by the static decoder (`graphs`: captured;
    `compiled`: the step compiled): the copy computes the trained PEFT model's logits,
    the decoder draws what the eager one draws, and after an in-place adapter update and
    the copy's refresh, the same captured (compiled) step draws what the eager decoder
    draws from the updated copy: it reads the adapter, not a snapshot of it.
    tests/unit/test_static_decode.py runs it on a CPU (graphs=False, eager and compiled),
    tests/integration/test_gpu.py on CUDA with graphs (eager and compiled)."""
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from retrain.engines.draw import uniforms
    from retrain.engines.sampling_copy import LoraBeside, SamplingCopy
    from retrain.engines.static_decode import StaticDecoder
    from retrain.kernels.precision import bf16_linears
    from retrain.types import SamplingParams

    cfg = _qwen3_config()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg)
    bf16_linears(base)  # what the local backend does in bf16 mode, before the adapter
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base.to(device), lora).eval()
    copy = SamplingCopy.build(model, None)
    assert all(type(side) is LoraBeside for _, side in copy.pairs)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]] * 3
    params = SamplingParams(max_tokens=tokens, temperature=1.0, top_p=1.0, seed=3)
    u = uniforms(len(prompts), tokens, torch.Generator(device=device).manual_seed(3))
    eager = StaticDecoder(eos_ids=[2], pad_id=0, device=device)
    tested = StaticDecoder(eos_ids=[2], pad_id=0, device=device, graphs=graphs, compiled=compiled)
    drawn, compiles = [], []
    for _ in _before_and_after_an_update(model, copy, device):
        with torch.inference_mode():
            a = eager.decode(copy.model, prompts, params, u)
            b = tested.decode(copy.model, prompts, params, u)
            ids = torch.tensor([prompts[0] + a.tokens[0].tolist()], device=device)
            got, want = copy.model(input_ids=ids).logits, model(input_ids=ids).logits
        # the trained model's logits, up to the order of float32 sums (the siblings'
        # stacked adapter; on CUDA also addmm's fused add), which the next layer's bf16
        # input can amplify
        torch.testing.assert_close(got, want, atol=3e-3 if device.type == "cpu" else 5e-2, rtol=0)
        assert torch.equal(a.lengths, b.lengths)
        for r in range(len(prompts)):
            n = int(a.lengths[r])
            assert torch.equal(a.tokens[r, :n], b.tokens[r, :n])
            assert torch.allclose(a.logprobs[r, :n], b.logprobs[r, :n], atol=2e-2)
        drawn.append(a)
        compiles.append(counters["stats"]["unique_graphs"])
    if graphs:  # one capture, replayed after the update
        assert tested.graph_failures == 0 and len(tested._captured) == 1
    if compiled:  # compiled for the first decode, not again for the update
        assert tested.compile_failures == 0 and tested._compiled_step is not None
        assert compiles[0] == compiles[1]
    assert not torch.equal(drawn[0].logprobs, drawn[1].logprobs)  # the update was sampled


def whole_bf16_capture_case(device, compiled: bool = False, tokens: int = 40) -> None:
    """A GPU's bf16 mode as the local backend builds it: the whole model in bf16, the
    adapter computing in bf16, decode attention through retrain's grouped SDPA, and its
    sampling copy (the adapter beside the shared bf16 weights, one kernel per RMS norm,
    float32 logits from the shared bf16 head). With the step captured (`compiled`: and
    compiled), each replay, before and after an in-place adapter update, draws what the
    decoder's step run uncaptured draws at the same shapes (same buckets, cache length
    and buffers), to the bit: the graph replays the step, nothing else, and reads the
    refreshed adapter, and each of the step's key spans (a graph each) reads what the
    uncaptured step of that span reads. CUDA only (tests/integration/test_gpu.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from retrain.engines.draw import uniforms
    from retrain.engines.sampling_copy import Float32Head, LoraBeside, SamplingCopy
    from retrain.engines.static_decode import StaticDecoder
    from retrain.kernels import flex
    from retrain.kernels.lora_layers import adapter_in_input_dtype, lean_lora_forward
    from retrain.kernels.precision import bf16_weights
    from retrain.kernels.recompute import recompute_elementwise
    from retrain.types import SamplingParams

    cfg = _qwen3_config(attn_implementation="sdpa")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg)
    bf16_weights(base)  # local.py's order: the whole model bf16, moved, then the adapter
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base.to(device), lora)
    lean_lora_forward(model)
    adapter_in_input_dtype(model)
    recompute_elementwise(model)
    flex.use_flex(model.get_base_model())
    model.eval()
    copy = SamplingCopy.build(model, None)
    assert all(type(side) is LoraBeside for _, side in copy.pairs)
    assert isinstance(copy.model.get_output_embeddings(), Float32Head)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]] * 3
    params = SamplingParams(max_tokens=tokens, temperature=1.0, top_p=0.9, seed=3)
    u = uniforms(len(prompts), tokens, torch.Generator(device=device).manual_seed(3))
    decoder = StaticDecoder(eos_ids=[2], pad_id=0, device=device, graphs=True, compiled=compiled)
    decoder.length_step = 16  # a 48-position cache read by spans of 16, 32, 48: three graphs
    drawn = []
    for _ in _before_and_after_an_update(model, copy, device):
        with torch.inference_mode():
            # the same decoder (the same compiled code), shapes and buffers, its step run
            # as it is, then from the graph (captured at the first pass, replayed after)
            decoder._graphs = lambda *a, **k: None
            a = decoder.decode(copy.model, prompts, params, u)
            del decoder._graphs
            b = decoder.decode(copy.model, prompts, params, u)
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.logprobs, b.logprobs)
        drawn.append(b)
    assert decoder.graph_failures == 0 and sorted(k[2] for k in decoder._captured) == [16, 32, 48]
    if compiled:
        assert decoder.compile_failures == 0 and decoder._compiled_step is not None
    assert not torch.equal(drawn[0].logprobs, drawn[1].logprobs)  # the update was sampled


def _qwen3_config(**more):
    """A 2-layer Qwen3 with grouped-query heads (4 query, 2 key/value) and eos 2."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, eos_token_id=2, **more,
    )  # fmt: skip


def _before_and_after_an_update(model, copy, device):
    """Yields twice, the sampling copy refreshed each time: with the adapter as it is,
    then after what an optimizer step does to it (every B changed in place)."""
    for update in range(2):
        if update:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.5, generator=torch.Generator(device=device).manual_seed(1))
        copy.refresh()
        yield
