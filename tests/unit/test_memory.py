"""The local step's memory (retrain/memory.py): model shapes read from config.json worked
by hand (SmolLM2-135M, Qwen3-4B), the dtype each part is counted at, rows decoded at once,
the peak estimate's parts, the micro-batch and decoder sizes chosen from a device's free
memory, and the estimate against a device."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.errors import BackendError
from retrain.memory import (
    AUTO_MOST,
    CPU_MICRO_BATCH,
    GIB,
    HEADROOM,
    LOGIT_ROWS,
    MEMORY_MODELS,
    MICRO_BATCH_MAX,
    MICRO_BATCH_STEP,
    SAMPLE_ROWS,
    ModelShape,
    Sizing,
    StepSizes,
    adapter_bytes,
    auto_micro_batch_tokens,
    copy_adapter_bytes,
    decode_row_budget,
    decoding_batches,
    fit_problem,
    kv_value_bytes,
    largest_micro_batch,
    memory_model,
    params_in_name,
    peak_memory,
    sampler_copy_bytes,
    sampling_rows,
    shape_from_config,
    training_memory,
    weight_bytes,
)

# SmolLM2-135M-Instruct's config.json (the sizes; the file has more keys)
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
# Qwen3-4B's config.json (the sizes)
QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
SMOLLM2 = shape_from_config(SMOLLM2_CONFIG)
QWEN3_4B = shape_from_config(QWEN3_4B_CONFIG)


def at(dtype="bf16", device_kind="cpu", lora_rank=0, target_modules=(), **kw) -> Sizing:
    """A `Sizing` (the trainer's dtype on a device kind, the adapter, the sampler)."""
    return Sizing(device_kind, dtype, lora_rank, tuple(target_modules), **kw)


# ----------------------------------------------------------------------------- shapes


def test_smollm2_shape_counts_the_checkpoints_parameters():
    assert ModelShape(576, 30, 9, 3, 64, 1536, 49152, tied_embeddings=True) == SMOLLM2
    # per block: q 576x576, k and v 576x192, o 576x576, gate/up/down 576x1536
    per_block = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    assert SMOLLM2.block_params == 30 * per_block == 106_168_320
    # + 61 norms of 576 + one tied 49152 x 576 embedding: the safetensors file's count
    assert SMOLLM2.params == 106_168_320 + 61 * 576 + 49152 * 576 == 134_515_008
    assert SMOLLM2.kv_width == 192
    assert SMOLLM2.kv_bytes_per_token() == 2 * 30 * 192 * 4


def test_qwen3_4b_shape_by_hand():
    s = QWEN3_4B
    # head_dim 128 is given (32 x 128 = 4096 != hidden 2560); 8 kv heads (GQA)
    assert (s.heads * s.head_dim, s.kv_width) == (4096, 1024)
    assert s.projections() == {
        "q_proj": (2560, 4096),
        "k_proj": (2560, 1024),
        "v_proj": (2560, 1024),
        "o_proj": (4096, 2560),
        "gate_proj": (2560, 9728),
        "up_proj": (2560, 9728),
        "down_proj": (9728, 2560),
    }
    attention = 2560 * 4096 * 2 + 2560 * 1024 * 2  # 26,214,400
    mlp = 3 * 2560 * 9728  # 74,711,040
    assert s.block_params == 36 * (attention + mlp) == 3_633_315_840
    embed = 151936 * 2560  # tied: counted once
    assert s.params == 3_633_315_840 + 73 * 2560 + embed == 4_022_458_880  # "4.0B"
    assert s.kv_bytes_per_token() == 2 * 36 * 1024 * 4


def test_config_variants():
    # head_dim absent: hidden / heads; kv heads absent: the heads (no GQA)
    bare = {
        k: v for k, v in QWEN3_4B_CONFIG.items() if k not in ("head_dim", "num_key_value_heads")
    }
    s = shape_from_config(bare)
    assert (s.head_dim, s.kv_heads) == (80, 32)
    # untied (or unsaid): the output layer counts on its own
    untied = shape_from_config({**SMOLLM2_CONFIG, "tie_word_embeddings": False})
    assert untied.params - SMOLLM2.params == 49152 * 576
    unsaid = {k: v for k, v in SMOLLM2_CONFIG.items() if k != "tie_word_embeddings"}
    assert shape_from_config(unsaid) == untied
    # Llama's biases
    biased = shape_from_config({**SMOLLM2_CONFIG, "attention_bias": True, "mlp_bias": True})
    assert biased.params - SMOLLM2.params == 30 * ((576 + 192 * 2 + 576) + (1536 * 2 + 576))
    # a multimodal config nests the language model's sizes in text_config
    nested = {"architectures": ["X"], "tie_word_embeddings": True, "text_config": QWEN3_4B_CONFIG}
    assert shape_from_config(nested) == QWEN3_4B
    # a transformers config's to_dict() has null head_dim for some models
    assert shape_from_config({**QWEN3_4B_CONFIG, "head_dim": None}).head_dim == 80


@pytest.mark.parametrize(
    "missing",
    ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"],
)
def test_a_config_without_a_needed_size_has_no_shape(missing):
    assert shape_from_config({k: v for k, v in QWEN3_4B_CONFIG.items() if k != missing}) is None
    assert shape_from_config({**QWEN3_4B_CONFIG, missing: 0}) is None


def test_params_in_name():
    assert params_in_name("Qwen/Qwen3-4B-Instruct-2507") == 4_000_000_000
    assert params_in_name("HuggingFaceTB/SmolLM2-135M-Instruct") == 135_000_000
    assert params_in_name("Qwen/Qwen2.5-0.5B") == 500_000_000
    assert params_in_name("my-model") is None


# ----------------------------------------------------------------------------- dtypes


def test_weights_at_the_dtype_the_device_holds(monkeypatch):
    import retrain.memory as memory

    s = QWEN3_4B
    other = s.params - s.block_params  # embeddings, norms: float32 on a CPU
    # bf16 mode on a CPU: blocks at 2 bytes, shared by the sampler (its adapter beside them)
    assert weight_bytes(s, at("bf16")) == other * 4 + s.block_params * 2
    # on a GPU the whole model is bf16, the sampler's float32 logits read the shared
    # output layer (torch >= 2.8); before, it added a float32 copy of it
    monkeypatch.setattr(memory, "f32_out_matmul", lambda kind: kind == "cuda")
    assert weight_bytes(s, at("bf16", "cuda")) == s.params * 2
    monkeypatch.setattr(memory, "f32_out_matmul", lambda kind: False)
    assert weight_bytes(s, at("bf16", "cuda")) == s.params * 2 + s.vocab * s.hidden * 4
    assert weight_bytes(s, at("fp32", "cuda")) == weight_bytes(s, at("fp32"))
    # its KV cache is bf16 too: half the sampling part of the same step
    step = StepSizes(8, 16, 256, 256, 0)
    gpu = peak_memory(s, at("bf16", "cuda", 32), step, 512)
    cpu = peak_memory(s, at("bf16", "cpu", 32), step, 512)
    rows = sampling_rows(8, 16, 0)
    assert gpu.sampling == rows * (s.kv_bytes_per_token(2) * 512 + s.logit_bytes_per_row())
    assert cpu.sampling == rows * (s.kv_bytes_per_token(4) * 512 + s.logit_bytes_per_row())
    # float32: the sampler's copy holds W + BA for each adapted (here every) linear
    assert weight_bytes(s, at("fp32")) == other * 4 + (s.block_params * 2) * 4
    # ~7.5 GB of bf16 blocks + 1.56 GB of float32 embeddings (Qwen3-4B's 8 GB in bf16)
    assert 8.0 < weight_bytes(s, at("bf16")) / GIB < 8.5
    # LoRA on two projections: only those are merged again, and only in float32
    qv = 36 * (2560 * 4096 + 2560 * 1024)
    assert (
        weight_bytes(s, at("fp32", "cpu", 0, ("q_proj", "v_proj")))
        == other * 4 + (s.block_params + qv) * 4
    )
    assert weight_bytes(s, at("bf16", "cpu", 0, ("q_proj", "v_proj"))) == weight_bytes(
        s, at("bf16")
    )


def test_the_sampling_copys_own_adapter_is_counted_in_bf16():
    s = QWEN3_4B
    # a GPU: A and B bf16 (rounded once or twice); q/k/v one set (outs 4096 + 1024 +
    # 1024 by 3 ranks), gate/up another (2 x 9728 by 2 ranks), o and down alone; per
    # layer 32 x (3 x 8704 x 2 + 2 x 22016 x 2 + 6656 x 2 + 12288 x 2) = 5,701,632 bytes,
    # 0.19 GiB over 36 layers
    per_layer = 32 * (3 * 8704 * 2 + 2 * 22_016 * 2 + 6656 * 2 + 12_288 * 2)
    assert per_layer == 5_701_632
    assert copy_adapter_bytes(s, at("bf16", "cuda", 32)) == 36 * per_layer
    want = weight_bytes(s, at("bf16", "cuda")) + 36 * per_layer
    assert weight_bytes(s, at("bf16", "cuda", 32)) == want
    # a CPU's bf16 mode (float32 stream): A and B float32
    assert copy_adapter_bytes(s, at("bf16", "cpu", 32)) == 36 * per_layer * 2
    # a set with a member left unadapted runs apart: q and v alone, no block-diagonal B
    alone = 32 * ((2560 + 4096) + (2560 + 1024)) * 4
    assert copy_adapter_bytes(s, at("bf16", "cpu", 32, ("q_proj", "v_proj"))) == 36 * alone
    # float32 merges the adapter into the copy's weights instead; no rank, nothing beside
    assert copy_adapter_bytes(s, at("fp32", "cpu", 32)) == 0
    assert weight_bytes(s, at("fp32", "cpu", 32)) == weight_bytes(s, at("fp32"))
    assert weight_bytes(s, at("bf16", "cpu", 0)) == weight_bytes(s, at("bf16"))


def test_a_bf16_sampling_copy_of_its_own_on_a_float32_trainer(monkeypatch):
    import dataclasses

    import retrain.memory as memory

    s = QWEN3_4B  # tied embeddings
    per_layer = 32 * (3 * 8704 + 2 * 22_016 + 6656 + 12_288) * 4  # A and B float32
    head = s.vocab * s.hidden * 4
    trainer = s.params * 4
    # on a CPU: the whole model in bf16, its tied output layer copied to float32 besides
    got = weight_bytes(s, at("fp32", "cpu", 32, sampler="bf16"))
    assert got == trainer + s.params * 2 + head + 36 * per_layer
    # no merged float32 copies then: the bf16 copy is the sampler's
    assert got < weight_bytes(s, at("fp32", "cpu", 32)) + s.params * 2 + head + 36 * per_layer
    # untied: the output layer is float32 instead of bf16 (2 bytes more a value)
    untied = dataclasses.replace(s, tied_embeddings=False)
    got = sampler_copy_bytes(untied, at("fp32", "cpu", 32, sampler="bf16"))
    assert got == untied.params * 2 + head // 2 + 36 * per_layer
    # on a GPU whose bf16 matmuls give float32 logits, no float32 output layer at all
    monkeypatch.setattr(memory, "f32_out_matmul", lambda kind: kind == "cuda")
    got = sampler_copy_bytes(s, at("fp32", "cuda", 32, sampler="bf16"))
    assert got == s.params * 2 + 36 * per_layer
    # its KV cache is bf16; a bf16 trainer samples through its own matmuls, unchanged
    assert kv_value_bytes(at("fp32", "cpu", sampler="bf16")) == 2
    assert kv_value_bytes(at("bf16", "cpu", sampler="bf16")) == 4
    assert sampler_copy_bytes(s, at("bf16", "cpu", 32, sampler="bf16")) == sampler_copy_bytes(
        s, at("bf16", "cpu", 32)
    )


def test_adapter_is_float32_with_gradient_and_two_moments():
    in_out = 36 * ((2560 + 4096) * 2 + (2560 + 1024) * 2 + (2560 + 9728) * 3)
    assert adapter_bytes(QWEN3_4B, at(lora_rank=32)) == 32 * in_out * 4 * 4
    assert adapter_bytes(QWEN3_4B, at(lora_rank=32, target_modules=("q_proj",))) == (
        32 * 36 * (2560 + 4096) * 16
    )
    # a GPU's wholly bf16 trainer keeps bf16 copies of A and B for its products, laid
    # out as the sampler's copy (q/k/v and gate/up each a set): 0.19 GiB more
    staged = 36 * 32 * (3 * 8704 * 2 + 2 * 22_016 * 2 + 6656 * 2 + 12_288 * 2)
    assert adapter_bytes(QWEN3_4B, at("bf16", "cuda", 32)) == 32 * in_out * 16 + staged
    assert adapter_bytes(QWEN3_4B, at("fp32", "cuda", 32)) == 32 * in_out * 16


def test_memory_models_one_table_the_measured_ones_marked_calibrated():
    assert memory_model("cpu", "bf16").calibrated and memory_model("cpu", "fp32").calibrated
    assert "H100" in memory_model("cuda", "bf16").calibrated
    for key, model in MEMORY_MODELS.items():
        if key[0] == "mps" or key == ("cuda", "fp32"):
            assert model.calibrated == ""  # not measured there yet
    with pytest.raises(ValueError, match="xla"):
        memory_model("xla", "bf16")


# ----------------------------------------------------------------------------- a step


def test_rows_decoded_at_once_worked_by_hand():
    assert sampling_rows(4, 8, 0) == 32  # the whole step fits in 64
    assert sampling_rows(4, 24, 0) == 48  # two whole prompts
    assert sampling_rows(4, 64, 0) == 64
    assert sampling_rows(4, 200, 0) == 64  # a large group in parts
    assert sampling_rows(4, 200, 3) == 600  # an explicit prompt_batch: whole prompts
    # a per-device row budget
    assert sampling_rows(4, 200, 0, max_rows=256) == 200
    assert sampling_rows(8, 16, 0, max_rows=256) == 128
    assert decoding_batches(2, 6, 0, max_rows=4) == [(0, 1, 4), (0, 1, 2), (1, 1, 4), (1, 1, 2)]


def step(group: int, **kw) -> StepSizes:
    args = dict(batch_size=4, group_size=group, max_tokens=24, prompt_tokens=256, prompt_batch=0)
    return StepSizes(**{**args, **kw})


def estimate(group: int, micro_batch_tokens: int = 512, sizing: Sizing | None = None, **kw):
    return peak_memory(SMOLLM2, sizing or at(lora_rank=16), step(group, **kw), micro_batch_tokens)


def test_parts_worked_by_hand():
    parts = estimate(16)
    cpu = memory_model("cpu", "bf16")
    s = SMOLLM2
    # shared by the sampler, which keeps its own float32 A and B (r16) beside them: q/k/v
    # and gate/up each one stacked A and one block-diagonal B
    beside = 16 * 30 * 4 * (3 * (576 + 960) + 2 * (576 + 3072) + (576 + 576) + (1536 + 576))
    assert parts.weights == (s.params - s.block_params) * 4 + s.block_params * 2 + beside
    assert parts.adapter == 16 * 30 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536)) * 16
    # 64 rows of 256 + 24 positions: K and V per layer, float32; logits of the rows
    assert parts.sampling == 2 * 30 * 192 * 4 * 64 * 280 + 64 * 49152 * 12
    # a full micro-batch of 512 positions, and one chunk of logits
    assert parts.training == 512 * 576 * 30 * cpu.activation_bytes + LOGIT_ROWS * 49152 * 8
    live = parts.weights + parts.adapter + parts.training
    assert parts.total == pytest.approx(live * cpu.slack + cpu.runtime_bytes)
    # the SmolLM2 quickstart peaked at 2.4 GiB RSS on a CPU in bf16 mode (vs_trl.py,
    # 2026-11-24; 2.6-2.9 GiB while the sampler held a merged copy)
    assert 2.1 < parts.total / GIB < 2.8


def test_training_memory_leaves_sampling_out():
    peak = training_memory(SMOLLM2, at(lora_rank=16), 512)
    full = estimate(16)
    assert peak.sampling == 0 and peak.training == full.training
    assert peak.total == pytest.approx(
        (full.weights + full.adapter + full.training) * full.slack + full.runtime
    )


def test_a_micro_batch_is_never_larger_than_the_step():
    small = step(2, batch_size=1, max_tokens=10, prompt_tokens=20)  # 40 positions in all
    a = peak_memory(SMOLLM2, at(lora_rank=16), small, 512)
    b = peak_memory(SMOLLM2, at(lora_rank=16), small, 40)
    assert a == b


@given(st.integers(1, 4096))
def test_the_estimate_never_grows_with_the_group(group):
    total = estimate(group).total
    assert total <= estimate(64).total
    if group >= 64:  # sampling and training both at their bounds
        assert total == pytest.approx(estimate(4096).total)


# ----------------------------------------------------------------------------- sizes from
# free memory

SIZING = Sizing("cuda", "bf16", 32)


def test_auto_is_512_on_a_cpu_whatever_its_memory():
    for free in (None, 1 * GIB, 1000 * GIB):
        assert auto_micro_batch_tokens(QWEN3_4B, at("bf16", "cpu", 32), free) == 512
    assert auto_micro_batch_tokens(None, at("fp32", "mps", 8), None) == CPU_MICRO_BATCH


def test_auto_on_a_gpu_is_the_largest_that_fits_up_to_auto_most():
    def peak(positions):
        return training_memory(QWEN3_4B, SIZING, positions).total

    # 16 GiB free: fewer than AUTO_MOST positions fit, and auto is the largest that does
    free = 16 * GIB
    n = auto_micro_batch_tokens(QWEN3_4B, SIZING, free)
    assert n % MICRO_BATCH_STEP == 0 and MICRO_BATCH_STEP <= n < AUTO_MOST
    assert n == largest_micro_batch(QWEN3_4B, SIZING, free)
    assert peak(n) <= HEADROOM * free < peak(n + MICRO_BATCH_STEP)
    # an 80 GiB GPU: the largest that fits is more (the H100 lease of 2026-11-27 at these
    # shapes, LoRA r32, with the random model's smaller vocabulary: a peak of 39.5 GiB at
    # 8,332 positions, so ~16k fill it), and auto stops at AUTO_MOST, where that lease's
    # headline trained as fast as with more
    largest = largest_micro_batch(QWEN3_4B, SIZING, 79 * GIB)
    assert AUTO_MOST < largest < 16384
    assert auto_micro_batch_tokens(QWEN3_4B, SIZING, 79 * GIB) == AUTO_MOST
    # so does any model with room for more; none gets more than AUTO_MOST
    tiny = shape_from_config({**SMOLLM2_CONFIG, "hidden_size": 64, "num_hidden_layers": 2})
    assert largest_micro_batch(tiny, SIZING, 79 * GIB) == MICRO_BATCH_MAX
    assert auto_micro_batch_tokens(tiny, SIZING, 79 * GIB) == AUTO_MOST
    assert auto_micro_batch_tokens(SMOLLM2, SIZING, 1000 * GIB) == AUTO_MOST


@given(st.floats(1, 200), st.floats(1, 200))
def test_auto_is_monotone_in_free_memory(a, b):
    lo, hi = sorted((a, b))
    small = largest_micro_batch(QWEN3_4B, SIZING, lo * GIB)
    large = largest_micro_batch(QWEN3_4B, SIZING, hi * GIB)
    assert small <= large


def test_auto_refuses_when_not_even_the_smallest_micro_batch_fits():
    # bf16 blocks, float32 embeddings and the adapter with its optimizer: ~10 GiB
    assert largest_micro_batch(QWEN3_4B, SIZING, 10 * GIB) == 0
    assert largest_micro_batch(QWEN3_4B, SIZING, 16 * GIB) > 0
    with pytest.raises(BackendError, match=r"\[backend.options\] micro_batch_tokens.*256"):
        auto_micro_batch_tokens(QWEN3_4B, SIZING, 10 * GIB)
    with pytest.raises(BackendError, match="config.json"):
        auto_micro_batch_tokens(None, SIZING, 80 * GIB)


def test_decode_row_budget():
    kv, logits = QWEN3_4B.kv_bytes_per_token(), QWEN3_4B.logit_bytes_per_row()
    args = dict(kv_bytes_per_token=kv, logit_bytes_per_row=logits, max_len=512)
    assert decode_row_budget(device_kind="cpu", free_bytes=1000 * GIB, **args) == SAMPLE_ROWS
    # 0.9 x 40 GiB / (294,912 x 512 + 1,823,232) bytes per row
    rows = decode_row_budget(device_kind="cuda", free_bytes=40 * GIB, **args)
    assert rows == int(0.9 * 40 * GIB // (294_912 * 512 + 1_823_232)) == 252
    assert decode_row_budget(device_kind="cuda", free_bytes=1, **args) == 1
    more = decode_row_budget(device_kind="cuda", free_bytes=60 * GIB, **args)
    assert more > rows


# ----------------------------------------------------------------------------- the
# estimate against a device


def qwen_peak(micro_batch_tokens, **kw):
    sizes = step(16, batch_size=8, max_tokens=256, **kw)
    return peak_memory(QWEN3_4B, SIZING, sizes, micro_batch_tokens)


def test_fit_problem_names_the_setting_and_the_largest_value_that_fits():
    free, total = 79 * GIB, 80 * GIB
    largest = largest_micro_batch(QWEN3_4B, SIZING, free)
    where = dict(free_bytes=free, total_bytes=total, where="gpu:0", largest=largest)
    assert fit_problem(qwen_peak(largest), micro_batch_tokens=largest, **where) is None
    over = fit_problem(qwen_peak(20480), micro_batch_tokens=20480, calibrated=False, **where)
    assert over.level == "error"
    assert over.message.startswith("[backend.options] micro_batch_tokens = 20480: the step needs ~")
    assert "over the 79.0 GiB free on gpu:0 (of 80.0 GiB)" in over.message
    assert f"the largest that fits is {largest}" in over.message
    assert "not calibrated" in over.message
    # between HEADROOM and all of it: a warning
    near = next(
        n
        for n in range(largest, MICRO_BATCH_MAX, 64)
        if HEADROOM * free < qwen_peak(n).total <= free
    )
    warning = fit_problem(qwen_peak(near), micro_batch_tokens=near, **where)
    assert warning.level == "warning" and "close to running out" in warning.message


def test_fit_problem_blames_sampling_or_the_device_when_they_make_the_peak():
    free = 79 * GIB
    where = dict(free_bytes=free, total_bytes=None, where="gpu:0")
    peak = qwen_peak(512, max_rows=10_000, group_size=512)  # every completion at once
    assert peak.sampling > peak.training
    problem = fit_problem(peak, micro_batch_tokens=512, largest=3840, **where)
    assert problem.level == "error" and problem.message.startswith(
        "[training] max_tokens: sampling"
    )
    tiny = fit_problem(
        qwen_peak(512), micro_batch_tokens=512, largest=0, **{**where, "free_bytes": 10 * GIB}
    )
    assert tiny.message.startswith("[backend] devices:") and "[model] model" in tiny.message


def test_checkpointing_keeps_one_input_per_block():
    """With activation checkpointing a position keeps its block inputs (2 bytes per hidden
    unit and layer on a GPU's bf16 model, 4 on a CPU's float32 residual stream) plus one
    block's activations being recomputed; the micro-batch that fits grows accordingly."""
    model = memory_model("cuda", "bf16")
    recomputing = replace(SIZING, checkpointing=True)
    plain = training_memory(QWEN3_4B, SIZING, 1024)
    ckpt = training_memory(QWEN3_4B, recomputing, 1024)
    logits = LOGIT_ROWS * QWEN3_4B.vocab * 4 * 2
    h, layers = QWEN3_4B.hidden, QWEN3_4B.layers
    assert plain.training == 1024 * h * layers * model.activation_bytes + logits
    assert ckpt.training == 1024 * h * (layers * 2 + model.activation_bytes) + logits
    on_cpu = training_memory(QWEN3_4B, replace(recomputing, device_kind="cpu"), 1024)
    cpu_model = memory_model("cpu", "bf16")
    assert on_cpu.training == 1024 * h * (layers * 4 + cpu_model.activation_bytes) + logits
    free = 79 * GIB
    assert largest_micro_batch(QWEN3_4B, recomputing, free) > (
        largest_micro_batch(QWEN3_4B, SIZING, free)
    )
    sizes = StepSizes(8, 16, 256, 256, 0)
    assert peak_memory(QWEN3_4B, recomputing, sizes, 1024).training == ckpt.training


def test_a_sharded_base_is_divided_over_the_ranks_while_training_only():
    """`[backend.options] shard = true` on 4 ranks: training holds a quarter of the blocks
    plus the one it gathered; sampling gathers them whole, and there is no merged copy."""
    sharded = estimate(16, shards=4)
    s, block = SMOLLM2, SMOLLM2.block_params * 2
    rest = (s.params - s.block_params) * 4
    assert sharded.weights == rest + block  # no merged sampling copy
    assert sharded.training_weights == rest + block / 4 + block / s.layers
    live = max(sharded.weights + sharded.sampling, sharded.training_weights + sharded.training)
    assert sharded.total == (live + sharded.adapter) * sharded.slack + sharded.runtime
    # long micro-batches: the training phase sets the peak, and sharding lowers it
    long = dict(micro_batch_tokens=8192)
    assert estimate(2, **long, shards=4).total < estimate(2, **long).total
