"""The SEPA lambda scheduler: schedules, gate, state round trip, validation."""

from __future__ import annotations

import json
import math

import pytest

from retrain.sepa import SEPAScheduler


def run(s, steps, rate=1.0, var=1.0):
    return [s.update(t, rate, var) for t in steps]


def test_defaults_match_the_config_reference():
    s = SEPAScheduler()
    assert (s.steps, s.schedule, s.delay_steps, s.correct_rate_gate) == (500, "linear", 50, 0.1)
    assert s.lam == 0.0 and not s.gate_open


def test_linear_hand_worked():
    s = SEPAScheduler(steps=500, delay_steps=50, correct_rate_gate=0.0)
    assert run(s, [0, 50, 51, 300, 550, 551, 10_000]) == [0.0, 0.0, 1 / 500, 0.5, 1.0, 1.0, 1.0]


def test_linear_without_delay_and_zero_steps():
    s = SEPAScheduler(steps=10, delay_steps=0, correct_rate_gate=0.0)
    assert run(s, [0, 5, 10]) == [0.0, 0.5, 1.0]
    jump = SEPAScheduler(steps=0, delay_steps=3, correct_rate_gate=0.0)
    assert run(jump, [0, 2, 3, 4]) == [0.0, 0.0, 1.0, 1.0]


def test_gate_keeps_lambda_zero_until_correct_rate_reaches_it_and_is_sticky():
    s = SEPAScheduler(steps=10, delay_steps=0, correct_rate_gate=0.25)
    assert s.update(5, 0.2, 1.0) == 0.0 and not s.gate_open
    assert s.update(6, 0.25, 1.0) == 0.6 and s.gate_open
    assert s.update(7, 0.0, 1.0) == 0.7 and s.gate_open  # sticky
    assert s.metrics() == {"sepa_lambda": 0.7, "sepa_gate_open": 1.0}


def test_gate_zero_disables_gate():
    s = SEPAScheduler(steps=10, delay_steps=0, correct_rate_gate=0.0)
    assert s.gate_open
    assert s.update(5, 0.0, 1.0) == 0.5


def test_missing_or_nan_correct_rate_does_not_open_gate():
    s = SEPAScheduler(steps=10, delay_steps=0)
    assert s.update(5, None, 1.0) == 0.0
    assert s.update(6, float("nan"), 1.0) == 0.0
    assert not s.gate_open


def test_auto_warmup_fixes_var0_then_formula():
    s = SEPAScheduler(
        steps=1000,
        delay_steps=1000,
        schedule="auto",
        correct_rate_gate=0.0,
        ema_decay=0.5,
        var_threshold=0.5,
        warmup=2,
    )
    assert s.update(0, 1.0, 4.0) == 0.0 and s.var_0 is None  # ema = 4
    assert s.update(1, 1.0, 2.0) == 0.0  # ema = 3 -> var_0 = 3, ratio 3/3/0.5 = 2 -> 0
    assert s.var_0 == 3.0
    lam = s.update(2, 1.0, 0.0)  # ema = 1.5 -> 1 - min(1.5/3/0.5, 1) = 0
    assert lam == 0.0 and s.var_ema == 1.5
    lam = s.update(3, 1.0, 0.0)  # ema = 0.75 -> 1 - 0.75/3/0.5 = 0.5
    assert lam == pytest.approx(0.5)
    lam = s.update(4, 1.0, 0.0)  # ema = 0.375 -> 0.75
    assert lam == pytest.approx(0.75)
    assert s.auto_lambda() == pytest.approx(0.75)


def test_auto_takes_the_max_with_linear():
    s = SEPAScheduler(steps=10, delay_steps=0, schedule="auto", correct_rate_gate=0.0, warmup=1)
    # variance never decays: auto_lambda stays 0, the linear ramp drives lambda
    assert run(s, [0, 5, 10], var=2.0) == [0.0, 0.5, 1.0]


def test_auto_is_gated_too():
    s = SEPAScheduler(
        steps=1000,
        delay_steps=1000,
        schedule="auto",
        correct_rate_gate=0.5,
        ema_decay=0.0,
        warmup=1,
    )
    s.update(0, 0.0, 10.0)
    assert s.update(1, 0.0, 0.0) == 0.0  # auto would give 1, gate shut
    assert s.auto_lambda() == 1.0
    assert s.update(2, 0.9, 0.0) == 1.0


def test_auto_zero_baseline_does_not_produce_nan():
    s = SEPAScheduler(schedule="auto", correct_rate_gate=0.0, warmup=1, delay_steps=0, steps=100)
    lam = s.update(10, 1.0, 0.0)
    assert s.var_0 == 0.0 and lam == 0.1 and not math.isnan(lam)


def test_nan_or_missing_exec_var_is_ignored():
    s = SEPAScheduler(schedule="auto", warmup=2, ema_decay=0.5)
    s.update(0, 1.0, 2.0)
    s.update(1, 1.0, float("nan"))
    s.update(2, 1.0, None)
    assert s.var_ema == 2.0 and s.observations == 1 and s.var_0 is None
    s.update(3, 1.0, 4.0)
    assert s.var_ema == 3.0 and s.var_0 == 3.0


def test_negative_exec_var_is_rejected():
    with pytest.raises(ValueError, match="exec_var"):
        SEPAScheduler().update(0, 1.0, -1.0)


def test_state_dict_round_trip_is_exact_and_json():
    a = SEPAScheduler(schedule="auto", warmup=3, ema_decay=0.9, delay_steps=2, steps=20)
    for t, (rate, var) in enumerate(
        [(0.0, 3.1), (0.05, 2.9), (0.2, float("nan")), (0.0, 1.7), (0.1, 0.3), (0.3, 0.11)]
    ):
        a.update(t, rate, var)
    state = a.state_dict()
    text = json.dumps(state, allow_nan=False)
    b = SEPAScheduler(schedule="auto", warmup=3, ema_decay=0.9, delay_steps=2, steps=20)
    b.load_state_dict(json.loads(text))
    assert b.state_dict() == state
    assert (b.var_ema, b.var_0, b.observations, b.gate_open, b.lam) == (
        a.var_ema,
        a.var_0,
        a.observations,
        a.gate_open,
        a.lam,
    )
    for t in range(6, 30):
        assert a.update(t, 0.0, 0.05 * t) == b.update(t, 0.0, 0.05 * t)


def test_fresh_state_is_json_without_nan():
    json.dumps(SEPAScheduler().state_dict(), allow_nan=False)


def test_load_state_rejects_garbage():
    with pytest.raises(ValueError):
        SEPAScheduler().load_state_dict({"var_ema": 1.0})
    with pytest.raises(ValueError):
        SEPAScheduler().load_state_dict({**SEPAScheduler().state_dict(), "version": 99})


def test_lambda_at_has_no_side_effects():
    s = SEPAScheduler(steps=10, delay_steps=0, correct_rate_gate=0.0)
    before = s.state_dict()
    assert s.lambda_at(5) == 0.5
    assert s.state_dict() == before


def test_reset():
    s = SEPAScheduler(schedule="auto", warmup=1)
    s.update(100, 1.0, 1.0)
    s.reset()
    assert s.state_dict() == SEPAScheduler(schedule="auto", warmup=1).state_dict()


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"steps": -1}, "steps"),
        ({"steps": 1.5}, "steps"),
        ({"schedule": "cosine"}, "schedule"),
        ({"delay_steps": -3}, "delay_steps"),
        ({"correct_rate_gate": 1.5}, "correct_rate_gate"),
        ({"correct_rate_gate": "0.1"}, "correct_rate_gate"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"var_threshold": 0.0}, "var_threshold"),
        ({"warmup": 0}, "warmup"),
        ({"steps": True}, "steps"),
    ],
)
def test_constructor_validation(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SEPAScheduler(**kwargs)
