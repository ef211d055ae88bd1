"""The local backend's memory bounds, and the peak-memory estimate `explain` prints.

A step's memory does not grow with the group size: sampling decodes at most SAMPLE_ROWS
completions at once (with `[backend.options] prompt_batch = 0`), training runs packed
micro-batches of at most `micro_batch_tokens` positions, padding included, and the
trainer computes the logits LOGIT_ROWS positions at a time. No torch here, so `explain`
works on a bare install.
"""

from __future__ import annotations

from typing import Any

# Completions decoded at once with `prompt_batch = 0` (retrain/engines/pytorch.py).
SAMPLE_ROWS = 64
# Positions per output-layer matmul in training (retrain/kernels/logprobs.py): 128 x
# 49152 float32 logits are 25 MB.
LOGIT_ROWS = 128
# float32 values a trained position keeps per hidden unit and layer until the backward
# pass, with LoRA on all seven projections; measured on SmolLM2-135M (~1.1 GB of heap for
# a micro-batch of 512 positions, 576 hidden units, 30 layers).
ACTIVATION_FLOATS = 32
# Resident memory of Python, torch, transformers and their libraries, measured on a CPU.
RUNTIME_BYTES = 0.6 * 2**30
# Allocator slack: freed memory the heap keeps, measured at 5-15% over the live peak.
SLACK = 1.15


def decoding_batches(
    prompts: int, group_size: int, prompt_batch: int
) -> list[tuple[int, int, int]]:
    """(first prompt, prompts, completions each) of each batch the pytorch engine decodes:
    with `prompt_batch` that many whole prompts; with 0, at most SAMPLE_ROWS completions,
    as whole prompts or, for a larger group, one prompt's completions in parts."""
    if prompt_batch or group_size <= SAMPLE_ROWS:
        per = prompt_batch or SAMPLE_ROWS // group_size
        return [(i, min(per, prompts - i), group_size) for i in range(0, prompts, per)]
    return [
        (i, 1, min(SAMPLE_ROWS, group_size - done))
        for i in range(prompts)
        for done in range(0, group_size, SAMPLE_ROWS)
    ]


def sampling_rows(batch_size: int, group_size: int, prompt_batch: int) -> int:
    """Completions the pytorch engine decodes at once: the largest of its batches."""
    batches = decoding_batches(batch_size, group_size, prompt_batch)
    return max((prompts * rows for _, prompts, rows in batches), default=0)


def peak_memory(
    shape: dict[str, Any],
    *,
    batch_size: int,
    group_size: int,
    max_tokens: int,
    prompt_tokens: int,
    micro_batch_tokens: int,
    prompt_batch: int,
    block_bytes: int,
    lora_rank: int,
) -> dict[str, float]:
    """Bytes of each part of a local step's peak, and `total`. The weights: embeddings in
    float32, the transformer blocks' linears at `block_bytes` (2 in bf16-matmul mode) twice
    (the sampler's merged-LoRA copy). The adapter with its gradient and two Adam moments.
    Then the larger of sampling (KV cache and logits of the rows decoded at once) and
    training (one micro-batch's activations and logit chunk), the allocator's slack, and
    the runtime. `shape` is explain's `model_shape` of a config.json."""
    h, layers, vocab = shape["hidden"], shape["layers"], shape["vocab"]
    rows = sampling_rows(batch_size, group_size, prompt_batch)
    per_step = batch_size * (prompt_tokens + group_size * max_tokens)
    positions = min(micro_batch_tokens, per_step)
    blocks = shape["block_params"]
    parts = {
        "weights": (shape["params"] - blocks) * 4 + 2 * blocks * block_bytes,
        "adapter": lora_rank * shape["linear_in_out"] * 4 * 4,
        "sampling": 2 * layers * shape["kv_width"] * 4 * rows * (prompt_tokens + max_tokens)
        + rows * vocab * 4 * 3,
        "training": positions * h * layers * 4 * ACTIVATION_FLOATS
        + min(positions, LOGIT_ROWS) * vocab * 4 * 2,
        "runtime": RUNTIME_BYTES,
    }
    live = parts["weights"] + parts["adapter"] + max(parts["sampling"], parts["training"])
    parts["total"] = live * SLACK + parts["runtime"]
    return parts
