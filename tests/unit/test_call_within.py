"""`threads.call_within`, the one bounded call of the Tinker SDK's blocking calls and the
environment probe: a result, the call's own error, or Overran when it does not return
(not to be mistaken for a TimeoutError the call itself raised)."""

from __future__ import annotations

import threading

import pytest

from retrain.threads import Overran, call_within


def test_the_result_and_the_calls_own_errors_come_back():
    assert call_within(lambda: 42, 5.0, "t") == 42
    with pytest.raises(ValueError, match="bad"):
        call_within(lambda: (_ for _ in ()).throw(ValueError("bad")), 5.0, "t")

    def times_out():
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError) as got:
        call_within(times_out, 5.0, "t")
    assert not isinstance(got.value, Overran)


def test_a_call_that_does_not_return_is_left_behind():
    release = threading.Event()
    try:
        with pytest.raises(Overran, match="no answer within 0.01 s"):
            call_within(release.wait, 0.01, "t")
    finally:
        release.set()  # the left-behind thread ends


def test_the_environment_probe_names_an_environments_own_timeout(monkeypatch):
    """A TimeoutError the environment raises while loading is its failure, not the
    probe's time limit."""
    import retrain.data as data
    from retrain.config import config_from_dict
    from retrain.data.env_probe import probe_environment
    from retrain.errors import DataError

    def build(*args, **kwargs):
        raise TimeoutError("its server timed out")

    monkeypatch.setattr(data, "build_data_source", build)
    config = config_from_dict({"environment": {"provider": "verifiers", "id": "x"}})
    with pytest.raises(DataError) as got:
        probe_environment(config)
    assert str(got.value) == "loading the environment failed: TimeoutError: its server timed out"
