"""The `custom` reward: user functions that are sync, async, raise, or misbehave."""

from __future__ import annotations

import asyncio
import logging
import sys
import textwrap

import pytest
from builders import reward

from retrain.errors import RewardError
from retrain.rewards.custom import CustomReward
from retrain.types import Example

MODULE = textwrap.dedent(
    """
    import asyncio
    import math

    calls = []

    def score(response, reference):
        return 1.0 if reference in response else 0.0

    def flaky(response, reference):
        if "boom" in response:
            raise ValueError("custom failure " + response)
        return 0.5

    running = {"now": 0, "max": 0}  # how many async_score calls overlap

    async def async_score(response, reference):
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        await asyncio.sleep(0.05)
        running["now"] -= 1
        return float(len(response) == len(reference))

    async def async_flaky(response, reference):
        await asyncio.sleep(0)
        if "boom" in response:
            raise KeyError("async failure")
        return 1.0

    async def sleepy(response, reference):
        await asyncio.sleep(5)
        return 1.0

    def returns_nan(response, reference):
        return math.nan

    def returns_text(response, reference):
        return "1.0"

    def returns_bool(response, reference):
        return response == reference
    """
)


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / "my_rewards_mod.py").write_text(MODULE)
    return tmp_path


def _ex(ref):
    return Example(prompt="q", reference=ref)


def test_module_name_on_search_paths(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="score",
        search_paths=[str(plugin_dir)],
    )
    out = r.score_batch(["the answer is 42", "nope"], [_ex("42"), _ex("42")])
    assert out.rewards == [1.0, 0.0]
    assert out.errors == 0
    r.close()


def test_module_name_in_the_working_directory(tmp_path, monkeypatch):
    """As for every plugin: a module beside the TOML, run from there, is found by name even
    under the `retrain` script (neither '' nor the working directory on sys.path)."""
    (tmp_path / "cwd_rewards_mod.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    cwd = str(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", cwd, ".")])
    r = reward("custom", custom_module="cwd_rewards_mod")
    assert r.score("the answer is 42", "42") == 1.0 and sys.path[-1] == cwd
    r.close()
    with pytest.raises(RewardError, match=r"searched sys.path and the working directory"):
        reward("custom", custom_module="no_such_rewards_mod")


def test_file_path_relative_to_search_path_and_absolute(plugin_dir):
    r = reward("custom", custom_module="my_rewards_mod.py", search_paths=[str(plugin_dir)])
    assert r.score("x 7", "7") == 1.0
    r2 = reward("custom", custom_module=str(plugin_dir / "my_rewards_mod.py"))
    assert r2.score("x 8", "7") == 0.0


def test_exception_scores_zero_counts_and_logs_once(plugin_dir, caplog):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="flaky",
        search_paths=[str(plugin_dir)],
    )
    with caplog.at_level(logging.WARNING, logger="retrain.rewards"):
        out = r.score_batch(["ok", "boom 1", "boom 2"], [_ex("x")] * 3)
        out2 = r.score_batch(["boom 3"], [_ex("x")])
    assert out.rewards == [0.5, 0.0, 0.0]
    assert out.errors == 2
    assert out2.errors == 1
    warnings = [rec for rec in caplog.records if rec.name == "retrain.rewards"]
    assert len(warnings) == 1  # first traceback only, once per reward object
    assert "Traceback" in warnings[0].getMessage()
    assert "custom failure boom 1" in warnings[0].getMessage()


def test_async_function_is_awaited_concurrently(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="async_score",
        search_paths=[str(plugin_dir)],
    )
    out = r.score_batch(["abc"] * 10 + ["abcd"], [_ex("xyz")] * 11)
    assert out.rewards == [1.0] * 10 + [0.0]
    # Awaited together, not one after the other: the calls were in flight at once.
    assert sys.modules["my_rewards_mod"].running["max"] > 1
    r.close()


def test_async_exception_is_counted(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="async_flaky",
        search_paths=[str(plugin_dir)],
    )
    out = r.score_batch(["fine", "boom"], [_ex("x")] * 2)
    assert out.rewards == [1.0, 0.0] and out.errors == 1


def test_async_timeout_is_counted(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="sleepy",
        search_paths=[str(plugin_dir)],
        timeout=0.2,
    )
    out = r.score_batch(["a"], [_ex("x")])
    assert out.rewards == [0.0] and out.timeouts == 1 and out.errors == 0


def test_async_scoring_from_inside_a_running_loop(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="async_score",
        search_paths=[str(plugin_dir)],
    )

    async def caller():
        return r.score_batch(["abc"], [_ex("xyz")])

    assert asyncio.run(caller()).rewards == [1.0]


def test_nan_is_an_error_naming_the_function(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="returns_nan",
        search_paths=[str(plugin_dir)],
    )
    with pytest.raises(RewardError, match=r"my_rewards_mod\.returns_nan.*nan"):
        r.score("a", "b")


def test_non_numeric_is_an_error_naming_the_function(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="returns_text",
        search_paths=[str(plugin_dir)],
    )
    with pytest.raises(RewardError, match=r"returns_text returned str"):
        r.score("a", "b")


def test_bool_counts_as_a_number(plugin_dir):
    r = reward(
        "custom",
        custom_module="my_rewards_mod",
        custom_function="returns_bool",
        search_paths=[str(plugin_dir)],
    )
    assert r.score_batch(["a", "b"], [_ex("a"), _ex("a")]).rewards == [1.0, 0.0]


def test_missing_module_and_function(plugin_dir):
    with pytest.raises(RewardError, match="custom_module is required"):
        reward("custom")
    with pytest.raises(RewardError, match="cannot import 'no_such_reward_mod'"):
        reward("custom", custom_module="no_such_reward_mod")
    with pytest.raises(RewardError, match="not found"):
        reward("custom", custom_module="missing/file.py")
    with pytest.raises(RewardError, match="no function 'nope'.*flaky"):
        reward(
            "custom",
            custom_module="my_rewards_mod",
            custom_function="nope",
            search_paths=[str(plugin_dir)],
        )


def test_direct_callable():
    r = CustomReward(fn=lambda resp, ref: float(resp == ref))
    assert r.score("x", "x") == 1.0
