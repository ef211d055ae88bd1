"""Opt-in tests on a CUDA GPU (`python -m pytest -m gpu`; skipped without one):

- the CUDA-graph decoder draws what the eager static decoder draws (the same tokens from
  the same uniforms; bf16 logprobs within rounding) and replays its captured step;
- with bf16 mode's sampler (the trainer's bf16 blocks, the LoRA adapter beside them in
  the sampling copy's buffers), a replayed step reads the adapter refreshed after an
  update (an optimizer step); so does the compiled step (`decode = "compiled"`: triton
  kernels captured in the graph);
- packed rows through FlexAttention (compiled) give the dense mask's logprobs and
  gradients (a CPU checks the forward pass only: torch has no FlexAttention backward
  there); so do they through flash attention's variable-length kernel in bf16, which
  passes the run start's check at SmolLM2's and Qwen3-4B's head shapes;
- the GPU's whole-bf16 sampler (bf16 adapter beside the shared weights, grouped decode
  attention, fused norms, float32 logits from the bf16 head) replays its captured step,
  and its compiled captured step, to the bit of the same step run uncaptured, before and
  after an adapter update;
- after a capture spoilt by a host sync, `empty_cache` still gives cached memory back;
- a captured graph's pool holds memory no new tensor takes, and the free memory the row
  and micro-batch budgets read leaves it out;
- a checkpoint saved on the GPU resumes there (adapter, optimizer, RNG states);
- after a step of CUDA's fused AdamW the sampler's and the trainer's bf16 copies of the
  adapter are the adapter just trained;
- torch's fused RMS norm passes the sampler's probe (retrain/kernels/norms.py);
- the rotary turn in fewer operators is transformers' to the bit (kernels/rotary.py);
- a training micro-batch is queued without one synchronising CUDA call (torch's sync
  debug mode);
- q/k/v and gate/up trained as one give the layers' own gradients on the tensor cores;
- activation checkpointing on the whole-bf16 model gives the plain gradient, and
  `checkpointing = "auto"` turns it on at a completion that runs out of memory;
- bf16 matmuls into float32 on the tensor cores (the trainer's and the sampler's logits)
  are the float32 products of the same values;
- the quickstart trains on `gpu:0`: held-out correct rate up by >= 0.3 in 15 steps;
- the original's headline shape (a random-weight model with Qwen3-4B's shapes, 8 x 16
  completions of 256 tokens, LoRA r32) runs 3 steps: every completion at 256 tokens, a
  finite loss, the peak GPU memory under the device's, the sampler close to the trainer.

Timings are printed, never asserted (benchmarks/gpu.py measures them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_cuda_graph_decoder_draws_what_the_eager_one_draws():
    from transformers import AutoConfig, AutoModelForCausalLM

    from retrain.engines.draw import uniforms
    from retrain.engines.static_decode import StaticDecoder
    from retrain.types import SamplingParams

    cfg = AutoConfig.for_model(
        "qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    device = torch.device("cuda", 0)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]] * 3
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=3)
    u = uniforms(len(prompts), 40, torch.Generator(device=device).manual_seed(3))
    eager = StaticDecoder(eos_ids=[2], pad_id=0, device=device)
    graphs = StaticDecoder(eos_ids=[2], pad_id=0, device=device, graphs=True)
    with torch.inference_mode():
        a = eager.decode(model, prompts, params, u)
        b = graphs.decode(model, prompts, params, u)
        c = graphs.decode(model, prompts, params, u)  # a replay of the captured step
    assert graphs.graph_failures == 0 and len(graphs._captured) == 1
    for out in (b, c):
        assert torch.equal(a.lengths, out.lengths)
        for r in range(len(prompts)):
            n = int(a.lengths[r])
            assert torch.equal(a.tokens[r, :n], out.tokens[r, :n])
            assert torch.allclose(a.logprobs[r, :n], out.logprobs[r, :n], atol=2e-2)


def test_a_captured_step_reads_the_adapter_refreshed_after_an_update():
    from decode_cases import adapter_update_case

    adapter_update_case(torch.device("cuda", 0), graphs=True)


def test_a_compiled_captured_step_reads_the_adapter_refreshed_after_an_update():
    from decode_cases import adapter_update_case

    adapter_update_case(torch.device("cuda", 0), graphs=True, compiled=True)


def test_the_whole_bf16_sampler_replays_its_captured_step_exactly():
    from decode_cases import whole_bf16_capture_case

    whole_bf16_capture_case(torch.device("cuda", 0))


def test_the_whole_bf16_sampler_replays_its_compiled_captured_step_exactly():
    from decode_cases import whole_bf16_capture_case

    whole_bf16_capture_case(torch.device("cuda", 0), compiled=True)


def test_after_a_spoilt_capture_the_cache_is_given_back():
    """A capture spoilt by a call it cannot hold (here a host sync), as a model's decode
    step may be: the decoder then decodes eagerly, and `end_pool_routing` ends the
    allocator's routing into the graphs' pool if torch left it on (torch 2.11 raises at
    the capture's end before ending it). Afterwards `empty_cache` gives cached memory
    back, as the out-of-memory back-off needs."""
    from retrain.engines.static_decode import end_pool_routing

    device = torch.device("cuda", 0)
    pool, graph, side = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph(), torch.cuda.Stream()
    current = torch.cuda.current_stream(device)
    x = torch.ones(1024, device=device)
    side.wait_stream(current)
    spoilt = torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local")
    with pytest.raises(Exception), spoilt:  # noqa: B017 (torch's error varies by version)
        (x * 2).sum().item()
    torch.cuda.set_stream(current)
    print("routing left on by torch:", end_pool_routing(device, pool))
    torch.cuda.synchronize(device)
    big = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    del big  # cached by the allocator
    held = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(device) <= held - (1 << 28)


def test_a_captured_graphs_unused_pool_memory_is_not_counted_free():
    """A product freed inside a capture leaves its block unused in the graph's pool (kept
    for the replays), where a new tensor cannot go: `cuda_free_bytes` leaves it out, as
    the decoder's kept graphs are beside the trainer's micro-batches."""
    from retrain.hardware import cuda_free_bytes, private_idle_bytes

    device = torch.device("cuda", 0)
    x = torch.ones(1 << 26, device=device)  # 256 MiB
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.graph(graph, pool=pool, stream=side):
        y = x * 2 + 1  # x * 2 is freed inside the capture
    torch.cuda.synchronize(device)
    idle = private_idle_bytes(torch.cuda.memory_snapshot(pool, include_traces=False), 0)
    assert idle >= x.nbytes
    z = torch.empty_like(x)  # not into the graph's unused block: the default pool's
    (home,) = [
        s["segment_pool_id"]
        for s in torch.cuda.memory_snapshot(include_traces=False)
        if s["device"] == 0 and s["address"] <= z.data_ptr() < s["address"] + s["total_size"]
    ]
    assert tuple(home) == (0, 0)
    del z
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert cuda_free_bytes(device, [pool]) <= free + cached - x.nbytes
    graph.replay()
    assert y[0].item() == 3.0


def test_a_checkpoint_saved_on_the_gpu_resumes_there(tiny_raw, tmp_path):
    """Its adapter, optimizer state and RNG states load back on CUDA (torch takes RNG
    states as CPU tensors only: the checkpoint's are loaded onto the device first)."""
    import copy

    from test_memory_sizing import HYPER, datums_of, make_backend

    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["devices"] = "gpu:0"
    backend = make_backend(raw, raw["model"]["model"])
    backend.train_step(datums_of(backend), HYPER)
    info = backend.save_checkpoint(tmp_path / "checkpoint")
    want = torch.rand(4, device="cuda")
    saved = {n: p.detach().clone() for n, p in backend.model.named_parameters() if "lora_" in n}
    backend.train_step(datums_of(backend), HYPER)  # moves the adapter and the RNG on
    backend.load_checkpoint(info)
    assert torch.equal(torch.rand(4, device="cuda"), want)
    for name, p in backend.model.named_parameters():
        if name in saved:
            assert torch.equal(p, saved[name]), name


def test_after_a_fused_adamw_step_the_sampler_and_the_staged_operands_hold_the_adapter(
    tiny_raw,
):
    """CUDA's AdamW is fused (`adamw_options`) and advances no version counter; after a
    step the backend advances them, so the sampling copy's bf16 A's and B's and the
    trainer's staged ones are bf16 of the factors just trained, not of the first step's."""
    import copy

    from test_memory_sizing import HYPER, datums_of, make_backend, trained_adapter

    from retrain.kernels.lora_layers import lora_a, lora_b

    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["devices"] = "gpu:0"
    backend = trained_adapter(make_backend(raw, raw["model"]["model"]))
    assert backend.optimizer.param_groups[0]["fused"]
    for _ in range(2):
        backend.train_step(datums_of(backend), HYPER)  # samples (refresh), then trains
    backend.engine.copy.refresh()
    checked = 0
    for layer, inner in backend.engine.copy.pairs:
        if not hasattr(inner, "a"):  # merged into a float32 weight: not this mode's
            continue
        for got, want in ((inner.a, lora_a(layer).weight), (inner.b, lora_b(layer).weight)):
            assert torch.equal(got, want.to(got.dtype)), layer
            checked += 1
    assert checked
    if backend._staged is not None:
        for unit in backend._staged.units:
            a, b = unit.operands(torch.bfloat16)
            for layer, a_rows, b_block in unit.slots:
                assert torch.equal(a_rows, lora_a(layer).weight.bfloat16())
                assert torch.equal(b_block, lora_b(layer).weight.bfloat16())


def _packed_styles(styles, dtype):
    """{style: (logprobs, [each parameter's gradient])} of a tiny Qwen3 in `dtype` on
    retrain's attention, the same packed rows through each mask style: rows longer than
    a 128-position block (FlexAttention skips whole blocks), a completion fed nothing."""
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from retrain.kernels import flex
    from retrain.kernels.packing import completion_logprobs

    cfg = AutoConfig.for_model(
        "qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).cuda().to(dtype)
    flex.use_flex(model)
    rng = np.random.default_rng(0)
    groups = [
        (rng.integers(0, 512, 40).tolist(), [rng.integers(0, 512, k) for k in (90, 1, 130, 57)]),
        (rng.integers(0, 512, 7).tolist(), [rng.integers(0, 512, k) for k in (200, 3)]),
    ]
    weights = torch.from_numpy(rng.normal(size=(6, 200))).float().cuda()
    out = {}
    for style in styles:
        model.zero_grad()
        logp = completion_logprobs(model, groups, 1.0, style, torch.device("cuda", 0), None)
        (logp * weights[:, : logp.shape[1]]).sum().backward()
        out[style] = (logp.detach(), [p.grad.clone() for p in model.parameters()])
    return out


def test_flex_attention_gives_the_dense_masks_gradients():
    grads = _packed_styles(("flex", "bool"), torch.float32)
    (a, ga), (b, gb) = grads["flex"], grads["bool"]
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3)


def test_varlen_attention_gives_the_dense_masks_logprobs_and_gradients():
    """Flash attention's variable-length kernel on a bf16 model: the dense mask's
    logprobs and gradients (through SDPA in bf16) within bf16 rounding, and the start's
    check passes at the quickstart's and the headline's head shapes."""
    from retrain.kernels import varlen

    for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):  # SmolLM2-135M, Qwen3-4B
        varlen.check(torch.device("cuda", 0), heads, kv_heads, dim, torch.bfloat16)
    results = _packed_styles(("varlen", "bool"), torch.bfloat16)
    (a, ga), (b, gb) = results["varlen"], results["bool"]
    ga, gb = (torch.cat([g.float().flatten() for g in grads]) for grads in (ga, gb))
    assert (a - b).norm() < 2.0**-6 * b.norm()
    rel = (ga - gb).norm() / gb.norm()
    assert gb.norm() > 0 and rel < 2.0**-5, rel


def test_masked_passes_run_sdpas_efficient_kernel_and_survive_cudnns_nan_case():
    """retrain's masked attention of many query positions (retrain/kernels/
    masked_attention.py) is SDPA held to its memory-efficient kernel: its output to the
    bit, its gradients within rounding (bf16, grouped heads, a packed mask); and on pytorch/pytorch#196678's
    case (704 positions, every logit ~ -120, an all-allowed mask), where cuDNN's backward
    has given NaN grad_q on an H100, its gradients are finite."""
    import math

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import repeat_kv

    from retrain.kernels.masked_attention import attend
    from retrain.kernels.packing import additive, pack

    groups = [([1] * 37, [torch.arange(k).numpy() for k in (90, 1, 130)]), ([2] * 5, [torch.arange(60).numpy()])]  # fmt: skip
    mask = additive(pack(groups, "bool").mask.cuda(), torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16().requires_grad_()

    length = mask.shape[-1]
    q, k, v = leaf(2, 8, length, 64), leaf(2, 2, length, 64), leaf(2, 2, length, 64)
    probe = torch.randn(2, length, 8, 64, generator=g, device="cuda").bfloat16()
    results = []
    for run in ("mine", "sdpa"):
        for t in (q, k, v):
            t.grad = None
        if run == "mine":
            out = attend(q, k, v, mask, 0.125)
        else:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, repeat_kv(k, 4), repeat_kv(v, 4), mask, scale=0.125
                ).transpose(1, 2)
        (out.float() * probe).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    (out, *grads), (ref, *ref_grads) = results
    assert torch.equal(out, ref)
    # the kernel's backward may add a query's gradient across key blocks atomically, in
    # any order: within rounding, not to the bit
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a.float() - b.float()).norm() <= 2.0**-7 * b.float().norm()

    n, d = 704, 64
    q, k, v = leaf(1, 1, n, d), leaf(1, 1, n, d), leaf(1, 1, n, d)
    with torch.no_grad():
        q.mul_(0.1)[..., 0] = 1.0
        k.mul_(0.1)[..., 0] = -120 * math.sqrt(d)
    allowed = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None, None]
    out = attend(q, k, v, additive(allowed, torch.bfloat16), None)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_bf16_matmuls_into_float32_are_the_float32_products():
    from retrain.engines.sampling_copy import Float32Head
    from retrain.kernels.precision import linear_f32, mm_f32

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, 2560, generator=gen).bfloat16()
    b = torch.randn(2560, 1000, generator=gen).bfloat16()
    got = mm_f32(a.cuda(), b.cuda())
    assert got.dtype == torch.float32
    want = a.double() @ b.double()  # bf16 products are exact; only float32 sums differ
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=2e-3)
    # the sampler's head reads the shared bf16 weight (no float32 copy) with the same result
    layer = torch.nn.Linear(2560, 1000, bias=False, dtype=torch.bfloat16, device="cuda")
    head = Float32Head(layer)
    assert head.weight.data_ptr() == layer.weight.data_ptr()
    x = a.cuda()
    want = linear_f32(x.cpu(), layer.weight.cpu())
    torch.testing.assert_close(head(x).cpu(), want, rtol=1e-5, atol=2e-3)


def test_torchs_fused_rms_norm_passes_the_probe_on_cuda():
    from transformers import AutoConfig, AutoModelForCausalLM

    from retrain.kernels.norms import fuse_rms_norms
    from retrain.kernels.precision import bf16_weights

    cfg = AutoConfig.for_model(
        "qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    bf16_weights(model)
    model.cuda().eval()
    ids = torch.arange(1, 40, device="cuda")[None]
    with torch.no_grad():
        before = model(input_ids=ids).logits.float()
        assert fuse_rms_norms(model) == 9  # two per block, q and k per block, the final one
        after = model(input_ids=ids).logits.float()
    torch.testing.assert_close(after, before, rtol=0, atol=0.1)  # bf16 logits, summed otherwise


def test_the_rotary_turn_is_transformers_to_the_bit_on_cuda():
    """retrain/kernels/rotary.py on CUDA's element-wise kernels: queries, keys and their
    gradients equal transformers' own turn, in bf16 and float32, both head layouts."""
    import transformers.models.llama.modeling_llama as llama

    from retrain.kernels.rotary import rotate

    original = getattr(llama.apply_rotary_pos_emb, "original", llama.apply_rotary_pos_emb)
    ours = rotate(original)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for dim, shape in ((1, (4, 32, 300, 128)), (2, (4, 300, 8, 128))):
            q, k, gq, gk = (torch.randn(shape, device="cuda", generator=gen) for _ in range(4))
            cos, sin = (torch.randn(4, 300, 128, device="cuda", generator=gen) for _ in range(2))
            got = []
            for fn in (original, ours):
                qs, ks = (t.to(dtype).requires_grad_() for t in (q, k))
                outs = fn(qs, ks, cos.to(dtype), sin.to(dtype), dim)
                torch.autograd.backward(outs, (gq.to(dtype), gk.to(dtype)))
                got.append([*outs, qs.grad, ks.grad])
            assert all(torch.equal(a, b) for a, b in zip(*got, strict=True)), (dtype, dim)


def test_fused_norms_and_gated_products_give_the_models_gradients_on_cuda():
    """On CUDA the norm is torch's fused rms_norm with the weight (one kernel forward,
    one backward, nothing recomputed) and the gated product is recomputed, so the
    gradients match the model's own to bf16 rounding, not to the bit as on a CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from retrain.kernels.norms import RmsNorm
    from retrain.kernels.precision import bf16_weights
    from retrain.kernels.recompute import recompute_elementwise

    cfg = AutoConfig.for_model(
        "qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    ids = torch.arange(1, 60, device="cuda")[None]
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        bf16_weights(model)
        model.cuda()
        for name, p in model.named_parameters():  # the MLPs and norms trained, for the test
            p.requires_grad_("mlp" in name or "norm" in name)
        if recompute:
            assert recompute_elementwise(model) == (9, 2)
            assert [type(m) for m in model.modules() if isinstance(m, RmsNorm)] == [RmsNorm] * 9
        out = model.model(input_ids=ids).last_hidden_state.float()
        (out * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        grads.append(
            torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
        )
    rel = (grads[1] - grads[0]).norm() / grads[0].norm()
    assert grads[0].norm() > 0 and rel < 0.02, rel


def test_fused_sibling_loras_give_each_layers_gradients_on_cuda():
    """q/k/v and gate/up trained as one (stacked weights, stacked A's, block-diagonal
    B's: retrain/kernels/lora_layers.py `fuse_sibling_loras`) on the tensor cores: the
    logits and every LoRA factor's gradient as the layers alone give them, to bf16
    rounding (cuBLAS may pick other kernels for the wider matmuls)."""
    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from tiny_qwen3 import VOCAB, qwen3_lora

    from retrain.kernels.lora_layers import fuse_sibling_loras

    ids = torch.arange(1, 60, device="cuda")[None] % VOCAB
    results = []
    for fuse in (False, True):
        model = qwen3_lora(bf16=True, switch=True, recompute=True, lean=True).cuda()
        groups = fuse_sibling_loras(model) if fuse else []
        assert len(groups) == (4 if fuse else 0)
        logits = model(input_ids=ids).logits.float()
        (logits * torch.linspace(-1, 1, logits.shape[-1], device="cuda")).sum().backward()
        grads = [p.grad.float().flatten() for p in model.parameters() if p.requires_grad]
        results.append((logits.detach(), torch.cat(grads)))
    (logits, grads), (fused_logits, fused_grads) = results
    assert (fused_logits - logits).norm() < 2.0**-7 * logits.norm()
    rel = (fused_grads - grads).norm() / grads.norm()
    assert grads.norm() > 0 and rel < 2.0**-6, rel


@pytest.mark.parametrize("attention", ["flex", "varlen"])
def test_a_training_micro_batch_never_waits_for_the_gpu(tiny_raw, tmp_path, attention):
    """What tests/integration/test_queued_training.py checks on a CPU, under torch's sync
    debug mode (which also sees copies from pageable host memory): every micro-batch's
    uploads, forward (FlexAttention's block mask or the variable-length kernel's layout
    included), loss with its statistics and the KL term, and backward are queued without
    one synchronising CUDA call."""
    import copy
    from dataclasses import replace

    from test_memory_sizing import HYPER, datums_of, make_backend
    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", hidden=64)  # 16-wide heads for FlexAttention
    raw = copy.deepcopy(tiny_raw)
    raw["model"]["model"] = str(model)
    raw["backend"]["devices"] = "gpu:0"
    raw["backend"]["options"] = {"attention": attention, "micro_batch_tokens": 24}
    backend = make_backend(raw, model)
    datums = datums_of(backend)
    hyper = replace(HYPER, policy_loss="ppo_clip", tis_cap=1.5, kl_coef=0.1)
    backend.train_step(datums, hyper)  # FlexAttention compiles; pinned buffers are made
    inner, passes = backend._backward, []

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            passes.append(1)

    backend._backward = strict
    result = backend.train_step(datums, hyper)
    assert len(passes) >= 3 and result.loss == result.loss


def test_checkpointing_on_cuda_gives_the_plain_gradient_and_auto_turns_it_on(tiny_raw, tmp_path):
    """Activation checkpointing on the GPU's whole-bf16 model (fused norms and recomputed
    gated products inside the recomputed blocks) gives the plain backward's gradient, to bf16
    rounding; and checkpointing = "auto" turns it on at a completion that runs out of
    memory (injected while it is off) and trains that step."""
    import copy

    from grad_recorder import step_gradients
    from test_memory_sizing import HYPER, datums_of, make_backend

    def backend(checkpointing):
        raw = copy.deepcopy(tiny_raw)
        raw["backend"]["devices"] = "gpu:0"
        raw["backend"]["options"] = {"checkpointing": checkpointing}
        return make_backend(raw, raw["model"]["model"])

    plain, ckpt, auto = backend(False), backend(True), backend("auto")
    datums = datums_of(plain)
    _, want = step_gradients(plain, datums, HYPER, 10_000)
    _, got = step_gradients(ckpt, datums, HYPER, 10_000)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0.02, atol=1e-4)
    assert auto.options.checkpointing is False  # a tiny model: every completion fits
    inner = auto._logprobs

    def forward(groups, temperature):
        if not auto.options.checkpointing:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return inner(groups, temperature)

    auto._logprobs = forward
    result, got = step_gradients(auto, datums, HYPER, 1)  # one completion a micro-batch
    assert result.extra["checkpointing"] == 1.0 and auto.options.checkpointing is True
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0.02, atol=1e-4)


def test_compiled_blocks_train_as_the_eager_blocks_on_cuda(tiny_raw):
    """`compile = true` through inductor and triton, FlexAttention inside the compiled
    blocks (the headline's path; the quickstart's dense mask is the lease's quickstart
    variant): against the same step in float32, a step's loss and gradients are as close
    as the eager bf16 blocks' (inductor rounds a fused chain once, so it is no farther;
    on this project's CPU 2.6% against eager's 3.0%), a second step compiles nothing new,
    and the sampling copy stays eager."""
    import copy

    from grad_recorder import step_gradients
    from test_memory_sizing import HYPER, datums_of, make_backend
    from torch._dynamo.utils import counters

    from retrain.kernels.blocks import transformer_blocks as blocks
    from retrain.kernels.compiled_blocks import compiled

    def backend(compile_, dtype="auto"):
        raw = copy.deepcopy(tiny_raw)
        raw["backend"]["devices"] = "gpu:0"
        raw["backend"]["options"] = {"compile": compile_, "attention": "flex", "dtype": dtype}
        return make_backend(raw, raw["model"]["model"])

    eager, ours, exact = backend(False), backend(True), backend(False, "fp32")
    with torch.no_grad():  # one trained-looking adapter for all three
        drawn = {}
        for name, p in eager.model.named_parameters():
            if p.requires_grad:
                drawn[name] = p.normal_(0, 0.1)
        for other in (ours, exact):
            for name, p in other.model.named_parameters():
                if name in drawn:
                    p.copy_(drawn[name])
    assert all(compiled(m) for m in blocks(ours.model))
    assert not any(compiled(m) for m in ours.engine.copy.model.modules())
    datums = datums_of(eager)
    steps = [step_gradients(b, datums, HYPER, 10_000) for b in (eager, ours, exact)]
    (want_result, want), (result, got), (exact_result, ref) = steps

    def error(grads):
        flat = torch.cat([g.flatten().float() for g in grads])
        truth = torch.cat([g.flatten().float() for g in ref])
        return ((flat - truth).norm() / truth.norm()).item()

    assert error(got) < 1.2 * error(want) + 0.005, (error(got), error(want))
    assert result.loss == pytest.approx(exact_result.loss, rel=0.05, abs=1e-3)
    counters.clear()
    ours.train_step(datums_of(ours), HYPER)
    assert counters["stats"]["unique_graphs"] == 0  # the graphs were reused


def _run(tmp_path: Path, flags: list[str]) -> tuple[list[dict], list[dict]]:
    from retrain.cli.init import templates
    from retrain.config import load_config
    from retrain.trainer import train

    path = tmp_path / "retrain.toml"
    path.write_text(templates()["quickstart"])
    logs = tmp_path / "logs"
    flags += ["--devices", "gpu:0", "--log-dir", str(logs)]
    flags += ["--adapter-path", str(tmp_path / "adapter"), "--save-every", "0"]
    assert train(load_config(path, flags), str(path)) == 0
    evals = _rows(logs / "eval.jsonl") if (logs / "eval.jsonl").is_file() else []
    return _rows(logs / "metrics.jsonl"), evals


def test_the_quickstart_learns_on_the_gpu(tmp_path):
    rows, evals = _run(tmp_path, ["--max-steps", "15", "--eval-every", "5"])

    def median(key: str) -> float:
        values = sorted(r[key] for r in rows[1:])
        return values[len(values) // 2]

    print(
        f"quickstart on {torch.cuda.get_device_name()}: median {median('step_time_s'):.2f} "
        f"s/step (sampling {median('time_sampling_s'):.2f}, training "
        f"{median('time_training_s'):.2f}; the first step left out)"
    )
    assert [e["step"] for e in evals] == [0, 5, 10, 15]
    assert evals[-1]["eval_correct_rate"] - evals[0]["eval_correct_rate"] >= 0.3, evals
    assert all(r["engine_cuda_graphs"] == 1 for r in rows)  # no step fell back to eager


def test_the_headline_shape_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import PARITY, QWEN3_4B, random_model

    # RETRAIN_RAND4B: a folder that holds (or will hold) the model, kept between runs
    model = random_model(
        Path(os.environ.get("RETRAIN_RAND4B", tmp_path / "rand4b")), QWEN3_4B, "cuda"
    )
    (tmp_path / "parity_reward.py").write_text(PARITY)
    flags = ["--model", str(model), "--lora-rank", "32", "--batch-size", "8"]
    flags += ["--group-size", "16", "--max-tokens", "256", "--max-steps", "3", "--eval-every", "0"]
    flags += ["--reward-type", "custom", "--custom-function", "parity"]
    flags += ["--custom-module", str(tmp_path / "parity_reward.py"), "--lr", "1e-5"]
    rows, _ = _run(tmp_path, flags)
    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    for r in rows:
        print(
            f"step {r['step']}: {r['step_time_s']:.1f} s (sampling {r['time_sampling_s']:.1f}, "
            f"training {r['time_training_s']:.1f}), peak {r.get('gpu_peak_memory_gb')} GB, "
            f"log ratio mean {r.get('log_ratio_mean')} max {r.get('log_ratio_max_abs')}"
        )
        assert r["tokens_generated"] == 8 * 16 * 256  # random weights never stop early
        assert r["loss"] == r["loss"]  # finite (the run stops on a non-finite one)
        assert 0 < r["gpu_peak_memory_gb"] < total
        assert r["engine_cuda_graphs"] == 1  # sampled through the captured step
        assert r["sampling_oom_retries"] == 0  # the row budget's estimate held
        if r["num_datums"]:
            assert abs(r["log_ratio_mean"]) < 0.05  # the sampler samples what the trainer scores
