"""benchmarks/gpu_layout_learning.py's table: a row per run with its held-out rates at each
evaluation ("-" where it has none), its largest log ratio and median s/step, then each
layout's mean over seeds, read from the JSON's string keys as from the child's int ones."""

from __future__ import annotations

from benchmark_module import load

learning = load("gpu_layout_learning")


def run(layout, seed, held, ratios=(0.1, None), steps=(2.0, 4.0, 3.0)):
    return {
        "layout": layout,
        "seed": seed,
        "held_out": held,
        "log_ratio_max_abs": list(ratios),
        "step_s": list(steps),
    }


def test_rows_then_each_layouts_mean_per_evaluation():
    runs = [
        run("cpu", 0, {"0": 0.25, "5": 0.5}),
        run("gpu", 0, {0: 0.25, 5: 0.75}, ratios=(None, 0.4)),
        run("cpu", 1, {"0": 0.5, "5": 1.0}),
        run("gpu", 1, {"0": 0.5}, ratios=(None,)),  # its second evaluation missing
    ]
    lines = learning.table(runs).splitlines()
    assert lines[0] == (
        "| layout | seed | held-out @0 | held-out @5 | largest log ratio | s/step |"
    )
    assert lines[2] == "| cpu | 0 | 25.0% | 50.0% | 0.100 | 3.00 |"
    assert lines[3] == "| gpu | 0 | 25.0% | 75.0% | 0.400 | 3.00 |"
    assert lines[5] == "| gpu | 1 | 50.0% | - | - | 3.00 |"
    assert lines[6] == "| cpu | mean | 37.5% | 75.0% | | |"
    assert lines[7] == "| gpu | mean | 37.5% | 75.0% | | |"
