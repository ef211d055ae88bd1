"""A step's work for back pressure's roofline hint (`[backpressure] peak_gflops` and
`peak_bw_gb_s`): its floating-point operations and the bytes it moves to and from device
memory, from the model's shape and the step's token counts. A first-order count, as a
roofline is: the hint compares their ratio with the hardware's ridge point, it never
sizes a batch.

For N parameters of `value_bytes` each (W = N x value_bytes) and completions of c_i
tokens after prompts of p_i:

- FLOPs: 6 N per position, sum_i (p_i + c_i): 2 N to sample it (the prompt prefilled,
  each completion token decoded) and 4 N to train it (the forward pass, and the backward
  pass's gradients of the activations; the frozen weights get none, the adapter's are
  negligible). Attention's own FLOPs are left out (a few per cent at these lengths).
- Bytes: W per decoding step (each reads every weight once, however many rows it
  decodes; max_i c_i steps when all rows decode together, as the GPU sampler aims to),
  3 W to train (forward, backward, and the log-probabilities' pass), and each decoding
  step's read of its rows' KV caches, sum_i (p_i c_i + c_i (c_i - 1) / 2) positions of
  `kv_bytes_per_token`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retrain.memory import ModelShape

TRAINING_WEIGHT_READS = 3  # forward, backward, the log-probabilities' pass


@dataclass(frozen=True)
class StepWork:
    flops: float
    bytes_moved: float


def step_work(shape: ModelShape, value_bytes: int, rows: Sequence[tuple[int, int]]) -> StepWork:
    """The work of a step that sampled and trained `rows`, (prompt tokens, completion
    tokens) per completion (module docstring)."""
    params = shape.params
    positions = sum(p + c for p, c in rows)
    longest = max((c for _, c in rows), default=0)
    kv_positions = sum(p * c + c * (c - 1) // 2 for p, c in rows)
    weights = params * value_bytes
    return StepWork(
        flops=6.0 * params * positions,
        bytes_moved=float(
            weights * (longest + TRAINING_WEIGHT_READS)
            + kv_positions * shape.kv_bytes_per_token(value_bytes)
        ),
    )
