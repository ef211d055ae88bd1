"""[backpressure] settings under which the USL is never fitted are refused when the config
loads (retrain/config/validate.py `_backpressure`), each naming its key with a fix."""

from __future__ import annotations

import pytest

from retrain.backpressure import BackPressureController, batch_ladder, usl_throughput
from retrain.config import ConfigError, config_from_dict, load_config


def problems(**bp) -> list[str]:
    try:
        config_from_dict({"backpressure": bp})
    except ConfigError as err:
        return [p for p in err.problems if "[backpressure]" in p]
    return []


def fits_ever(**kw) -> bool:
    """Whether the controller ever adopts a model on a noise-free USL curve."""
    ctrl = BackPressureController(**kw)
    b = ctrl.batch_size
    for _ in range(60):
        d = ctrl.observe(b, usl_throughput(b, 10.0, 0.05, 0.002))
        b = d.batch_size
        if d.p_star is not None:
            return True
    return False


@pytest.mark.parametrize(
    ("bp", "key", "fix"),
    [
        ({"warmup_steps": 0}, "warmup_steps", "only 1 batch size is run"),
        ({"warmup_steps": 1}, "warmup_steps", "sees 2 batch sizes"),
        ({"min_batch_size": 5, "max_batch_size": 7}, "max_batch_size", "ladder [5, 7]"),
        ({"min_batch_size": 32, "max_batch_size": 64}, "max_batch_size", "min_batch_size = 16"),
        (
            {"min_batch_size": 8, "max_batch_size": 8},
            "max_batch_size",
            "ladder [8] has 1 batch size and",
        ),
        ({"min_batch_size": 1, "max_batch_size": 2}, "max_batch_size", "max_batch_size = 4"),
    ],
)
def test_settings_that_never_fit_are_refused(bp, key, fix):
    found = problems(enabled=True, **bp)
    assert len(found) == 1, found
    assert found[0].startswith(f"[backpressure] {key}")
    assert fix in found[0] and "Fix: " in found[0] and "enabled = false" in found[0]
    assert not fits_ever(**bp)  # ...and the controller indeed never fits with them


def test_both_problems_reported_together():
    found = problems(enabled=True, warmup_steps=1, min_batch_size=32, max_batch_size=64)
    assert [p.split(" (")[0].split(":")[0] for p in found] == [
        "[backpressure] warmup_steps",
        "[backpressure] max_batch_size",
    ]


@pytest.mark.parametrize(
    "bp",
    [
        {},  # defaults: warmup 10, ladder 1..64
        {"warmup_steps": 2},
        {"min_batch_size": 5, "max_batch_size": 11},  # ladder [5, 10, 11]
        {"min_batch_size": 16, "max_batch_size": 64},
    ],
)
def test_settings_that_fit_are_accepted(bp):
    assert problems(enabled=True, **bp) == []
    assert fits_ever(**bp)


def test_the_rung_count_is_the_controllers():
    # the check counts the controller's own ladder: 3 rungs exactly when max > 2 x min
    for lo in range(1, 9):
        for hi in range(lo, 4 * lo + 2):
            assert (len(batch_ladder(lo, hi)) >= 3) == (hi > 2 * lo)
            refused = problems(enabled=True, min_batch_size=lo, max_batch_size=hi)
            assert bool(refused) == (hi <= 2 * lo), (lo, hi, refused)


def test_disabled_back_pressure_is_not_checked():
    assert problems(enabled=False, warmup_steps=0, min_batch_size=8, max_batch_size=8) == []
    # min > max is refused whether or not it is enabled (and only that is said)
    found = problems(min_batch_size=8, max_batch_size=4)
    assert len(found) == 1 and found[0].startswith("[backpressure] min_batch_size")
    found = problems(enabled=True, min_batch_size=8, max_batch_size=4)
    assert len(found) == 1 and found[0].startswith("[backpressure] min_batch_size")
    # reported with the others, not instead of them (no ladder check: there is no ladder)
    found = problems(enabled=True, warmup_steps=1, min_batch_size=10, max_batch_size=4)
    assert [p.split(" (")[0].split(":")[0] for p in found] == [
        "[backpressure] min_batch_size",
        "[backpressure] warmup_steps",
    ]


def test_the_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "bp.toml"
    path.write_text("[backpressure]\nenabled = true\nwarmup_steps = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}:3" in str(info.value)
