"""A step's FLOPs and bytes for back pressure's roofline hint (retrain/roofline.py), on a
hand-counted model."""

from __future__ import annotations

from retrain.backpressure import BackPressureController
from retrain.memory import ModelShape
from retrain.roofline import step_work

# One block: q, k, v, o 4x4 (64), gate and up 4x8 and down 8x4 (96); norms 3 x 4; tied
# embeddings 10 x 4: 212 parameters. A token's K and V: 2 x 1 layer x 4 x value bytes.
SHAPE = ModelShape(
    hidden=4, layers=1, heads=1, kv_heads=1, head_dim=4, intermediate=8, vocab=10,
    tied_embeddings=True,
)  # fmt: skip


def test_the_counts_by_hand():
    assert SHAPE.params == 212
    work = step_work(SHAPE, 2, [(3, 2), (1, 4)])
    # 6 x 212 x (5 + 5) positions
    assert work.flops == 12_720
    # weights 424 bytes x (4 decoding steps + 3 training reads); KV: row 1 reads 3 then 4
    # positions, row 2 reads 1, 2, 3, 4: 17 positions x 16 bytes
    assert work.bytes_moved == 424 * 7 + 17 * 16


def test_no_rows_is_no_flops():
    work = step_work(SHAPE, 4, [])
    assert work.flops == 0 and work.bytes_moved == 212 * 4 * 3


def test_the_hint_turns_with_the_ridge_point():
    work = step_work(SHAPE, 2, [(3, 2), (1, 4)])  # 12,720 / 3,240 = 3.9 FLOP per byte
    for peak_gflops, regime in ((1.0, "compute_bound"), (100.0, "memory_bound")):
        bp = BackPressureController(group_size=2, peak_gflops=peak_gflops, peak_bw_gb_s=10.0)
        assert bp.roofline_hint(work.flops, work.bytes_moved) == regime
