"""The local step's memory bounds and explain's peak estimate (retrain/memory.py): rows
decoded at once worked by hand, the estimate's parts on SmolLM2's shape by hand, and the
estimate never growing with the group size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.memory import ACTIVATION_FLOATS, LOGIT_ROWS, SLACK, peak_memory, sampling_rows

# SmolLM2-135M as explain's model_shape reads its config.json
SMOLLM2 = {
    "params": 134_515_008,
    "block_params": 106_203_456,
    "hidden": 576,
    "layers": 30,
    "vocab": 49152,
    "kv_width": 192,
    "linear_in_out": 30 * (2 * 576 + 2 * (576 + 192) + 3 * (576 + 1536)),
}


def estimate(group: int, **kw) -> dict[str, float]:
    args = dict(
        batch_size=4,
        group_size=group,
        max_tokens=24,
        prompt_tokens=256,
        micro_batch_tokens=512,
        prompt_batch=0,
        block_bytes=2,
        lora_rank=16,
    )
    args.update(kw)
    return peak_memory(SMOLLM2, **args)


def test_rows_decoded_at_once_worked_by_hand():
    assert sampling_rows(4, 8, 0) == 32  # the whole step fits in 64
    assert sampling_rows(4, 24, 0) == 48  # two whole prompts
    assert sampling_rows(4, 64, 0) == 64
    assert sampling_rows(4, 200, 0) == 64  # a large group in parts
    assert sampling_rows(4, 200, 3) == 600  # an explicit prompt_batch: whole prompts


def test_parts_worked_by_hand():
    parts = estimate(16)
    blocks = SMOLLM2["block_params"]
    assert parts["weights"] == (SMOLLM2["params"] - blocks) * 4 + 2 * blocks * 2
    assert parts["adapter"] == 16 * SMOLLM2["linear_in_out"] * 16
    # 64 rows of 256 + 24 positions: K and V per layer, float32; logits of the rows
    assert parts["sampling"] == 2 * 30 * 192 * 4 * 64 * 280 + 64 * 49152 * 12
    # a full micro-batch of 512 positions, and one chunk of logits
    assert parts["training"] == 512 * 576 * 30 * 4 * ACTIVATION_FLOATS + LOGIT_ROWS * 49152 * 8
    live = parts["weights"] + parts["adapter"] + parts["training"]
    assert parts["total"] == pytest.approx(live * SLACK + parts["runtime"])
    # the SmolLM2 quickstart peaked at 2.6-2.9 GiB on a CPU in bf16 mode
    assert 2.3 < parts["total"] / 2**30 < 3.2


@given(st.integers(1, 4096))
def test_the_estimate_never_grows_with_the_group(group):
    total = estimate(group)["total"]
    assert total <= estimate(64)["total"]
    if group >= 64:  # sampling and training both at their bounds
        assert total == pytest.approx(estimate(4096)["total"])
