"""retrain.threads: the thread count follows the free cores (deterministic: a fake meter
stands in for /proc/stat), a fixed count is never measured, and the meter reads sane
numbers on this machine."""

from __future__ import annotations

import pytest

from retrain.threads import CpuMeter, ThreadPolicy, allowed_cpus, choose_threads


@pytest.mark.parametrize(
    ("cpus", "others", "want"),
    [
        (2, 0.0, 2),  # idle box: every core
        (2, 0.3, 2),  # a little background work: still both
        (2, 0.8, 1),  # one core taken: one thread, no barrier waits on a busy core
        (2, 4.0, 1),  # heavily loaded: never fewer than one
        (8, 2.6, 5),
        (4, None, 4),  # unknown load (no /proc): all allowed cores
    ],
)
def test_choose_threads(cpus, others, want):
    assert choose_threads(cpus, others) == want


class FakeMeter:
    def __init__(self, readings):
        self.readings = list(readings)

    def others(self):
        return self.readings.pop(0)


def test_policy_follows_the_load_phase_by_phase():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        policy = ThreadPolicy(meter=FakeMeter([0.0, 1.5, 0.1]))
        policy.cpus = 2
        assert policy.apply("start") == 2
        assert policy.apply("sampling") == 1
        assert torch.get_num_threads() == 1
        assert policy.apply("training") == 2
        assert [d[0] for d in policy.decisions] == ["start", "sampling", "training"]
    finally:
        torch.set_num_threads(before)


def test_fixed_threads_are_never_measured():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        policy = ThreadPolicy(1)
        assert policy.meter is None
        assert policy.apply("sampling") == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_meter_reads_a_plausible_value():
    others = CpuMeter().others(min_interval=0.05)
    if others is None:
        pytest.skip("no /proc/stat here")
    assert 0.0 <= others <= allowed_cpus() + 0.5


def test_startup_line_names_the_count_and_the_wait_policy(monkeypatch):
    policy = ThreadPolicy(meter=FakeMeter([0.4]))
    policy.cpus = 2
    policy.decisions.append(("start", 0.4, 2))
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    line = policy.describe(2)
    assert "2 of 2 cores" in line and "0.4" in line and "OMP_WAIT_POLICY=PASSIVE" in line
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert "OMP_WAIT_POLICY" not in ThreadPolicy(3).describe(3)


def test_metrics_report_the_last_phases():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        policy = ThreadPolicy(meter=FakeMeter([0.0, 1.2, 0.2]))
        policy.cpus = 2
        for phase in ("start", "sampling", "training"):
            policy.apply(phase)
        assert policy.metrics() == {
            "threads_sampling": 1,
            "cpu_busy_others_sampling": 1.2,
            "threads_training": 2,
            "cpu_busy_others_training": 0.2,
        }
    finally:
        torch.set_num_threads(before)


def test_a_reading_sooner_than_its_interval_gives_the_last_figure_without_waiting(monkeypatch):
    """The first reading waits for its interval; a later one that comes sooner (a phase
    shorter than 0.2 s, as a GPU quickstart's are) returns the last figure at once and
    reads nothing, so the next reading spans the whole time since the last one. It used
    to sleep out the interval before every phase, stretching each to 0.2 s."""
    from types import SimpleNamespace

    from retrain import threads

    clock, slept, busy = {"t": 100.0}, [], {"s": 0.0}

    def sleep(seconds):
        slept.append(seconds)
        clock["t"] += seconds

    monkeypatch.setattr(threads, "time", SimpleNamespace(monotonic=lambda: clock["t"], sleep=sleep))
    monkeypatch.setattr(threads, "_busy_seconds", lambda cpus: busy["s"])
    monkeypatch.setattr(threads, "_own_seconds", lambda: 0.0)
    meter = threads.CpuMeter()
    busy["s"] = 0.2  # another process kept one core busy over the first 0.2 s
    assert meter.others() == pytest.approx(1.0) and slept == [pytest.approx(0.2)]
    clock["t"] += 0.05  # a short phase later: the last figure, no wait, nothing read
    busy["s"] = 9.0
    assert meter.others() == pytest.approx(1.0) and len(slept) == 1
    clock["t"] += 0.25  # 0.3 s after the last reading: read anew, over all of it
    busy["s"] = 0.2 + 0.15
    assert meter.others() == pytest.approx(0.5) and len(slept) == 1
