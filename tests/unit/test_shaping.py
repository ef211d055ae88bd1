"""Batch shaping (retrain/shaping.py): the overlong penalty worked by hand and under
hypothesis, the truncation mask in build_datums, and dynamic sampling's rounds on a fake
rollout over the real example stream (the real run: tests/integration/test_shaping_run.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.data.base import ExampleStream
from retrain.logs.timer import PhaseTimer
from retrain.rollout import build_datums
from retrain.shaping import (
    Shaping,
    completion_length,
    informative,
    is_truncated,
    merge_counters,
    overlong_penalty,
    round_seed,
    sample_step,
)
from retrain.types import Example, GroupRollout, Sample, SamplingParams

# ---------------------------------------------------------------- overlong penalty


def test_overlong_penalty_by_hand():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token (x 0.5), -0.5 at 10
    got = overlong_penalty([0, 6, 7, 8, 10, 11], max_tokens=10, buffer=4, factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_overlong_penalty_needs_a_buffer():
    with pytest.raises(ValueError, match="buffer must be > 0"):
        overlong_penalty([3], max_tokens=10, buffer=0, factor=1.0)


@given(
    max_tokens=st.integers(2, 4096),
    data=st.data(),
    factor=st.floats(0.01, 10.0),
)
def test_overlong_penalty_invariants(max_tokens, data, factor):
    buffer = data.draw(st.integers(1, max_tokens - 1))
    lengths = np.arange(0, max_tokens + 3)
    pen = overlong_penalty(lengths, max_tokens, buffer, factor)
    start = max_tokens - buffer
    assert np.all(pen <= 0) and np.all(pen >= -factor - 1e-12)
    assert np.all(np.diff(pen) <= 1e-12)  # never rewards a longer completion
    assert np.all(pen[: start + 1] == 0)  # free up to L_max - L_cache
    assert pen[max_tokens] == pytest.approx(-factor)  # the full penalty at max_tokens ...
    assert np.all(pen[max_tokens:] == pen[max_tokens])  # ... and beyond
    inside = lengths[start + 1 : max_tokens + 1]  # linear, one factor/buffer per token
    assert np.allclose(np.diff(pen[start : max_tokens + 1]), -factor / buffer)
    assert np.allclose(pen[inside], (start - inside) / buffer * factor)


def test_completion_length_counts_every_token_or_the_longest_model_turn():
    one = Sample([5, 6, 2], [0.0] * 3, "eos")  # 2 = end of sequence: it counts
    assert completion_length(one) == 3
    turns = Sample(
        list(range(9)), [0.0] * 9, "eos", loss_mask=[1, 1, 0, 0, 1, 1, 1, 0, 1]
    )  # model turns of 2, 3 and 1 tokens between environment replies
    assert completion_length(turns) == 3
    assert completion_length(Sample([1], [0.0], "eos", loss_mask=[0])) == 0


# ---------------------------------------------------------------- truncation mask


def group(rewards, reasons, lengths=None, reference="r") -> GroupRollout:
    lengths = lengths or [3] * len(rewards)
    samples = [
        Sample(list(range(n)), [-0.1] * n, why) for n, why in zip(lengths, reasons, strict=True)
    ]
    return GroupRollout(
        Example("p", reference),
        [1, 2],
        samples,
        ["t"] * len(rewards),
        list(rewards),
        [None] * len(rewards),
        [r > 0.5 for r in rewards],
    )


def test_mask_truncated_gives_truncated_completions_no_datum():
    g = group([1.0, 0.0, 0.0], ["eos", "length", "eos"])
    adv = [[np.full(3, a) for a in (0.67, -0.33, -0.33)]]
    assert len(build_datums([g], adv)) == 3
    kept = build_datums([g], adv, mask_truncated=True)
    assert [d.advantages[0] for d in kept] == [0.67, -0.33]  # the "length" one is out
    assert is_truncated(g.samples[1]) and not is_truncated(g.samples[0])


# ---------------------------------------------------------------- small pieces


def test_informative_is_the_pipelines_skip_rule():
    assert informative([0.0, 1.0]) and not informative([1.0, 1.0]) and not informative([])


def test_round_seeds():
    assert round_seed(None, 3) is None
    assert round_seed(42, 0) == 42  # round 0 samples as a run without dynamic sampling
    assert len({round_seed(42, r) for r in range(4)}) == 4


def test_merge_counters_weights_rates_by_completions_and_sums_counts():
    merged = merge_counters(
        [
            ({"reward_errors": 1.0, "no_answer_rate": 0.5, "turns_max": 2.0}, 4),
            ({"reward_errors": 2.0, "no_answer_rate": 0.0, "turns_max": 5.0}, 12),
        ]
    )
    assert merged == {"reward_errors": 3.0, "no_answer_rate": 0.125, "turns_max": 5.0}


# ---------------------------------------------------------------- dynamic sampling


class FakeRollout:
    """A group's rewards come from its example's reference: "flat" -> all 1.0 (no
    signal), "mixed" -> 0 and 1. Completion lengths come from `lengths`."""

    def __init__(self, lengths=(2, 2)):
        self.calls: list[tuple[list[str], int | None]] = []
        self.lengths = list(lengths)

    def __call__(self, examples, group_size, params, timer):
        self.calls.append(([e.prompt for e in examples], params.seed))
        groups = []
        for e in examples:
            rewards = [1.0, 1.0] if e.reference == "flat" else [0.0, 1.0]
            groups.append(group(rewards, ["eos", "eos"], self.lengths, e.reference))
            groups[-1].example = e
        return groups, {"reward_errors": 1.0, "no_answer_rate": 0.5}


def stream(kinds: str) -> ExampleStream:
    """One example per letter: f = flat (all-equal rewards), m = mixed."""
    ref = {"f": "flat", "m": "mixed"}
    return ExampleStream([Example(f"{k}{i}", ref[k]) for i, k in enumerate(kinds)], shuffle=False)


def run(shaping, kinds, batch_size=3, seed=7, lengths=(2, 2)):
    data, rollout = stream(kinds), FakeRollout(lengths)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=seed)
    out = sample_step(shaping, data.next_batch, rollout, (batch_size, 2), params, PhaseTimer())
    return out, rollout, data


def test_off_is_one_round_of_batch_size_prompts():
    out, rollout, data = run(Shaping(), "ffmmmm")
    assert [len(p) for p, _ in rollout.calls] == [3] and data.position == 3
    assert out.report.metrics == {} and out.report.warning == ""
    assert out.reward_counters == {"reward_errors": 1.0, "no_answer_rate": 0.5}


def test_dynamic_sampling_draws_the_missing_groups_until_the_batch_is_informative():
    out, rollout, data = run(Shaping(dynamic_sampling=True), "fmfmfmmm")
    # round 0: f0 m1 f2 (1 informative, 2 missing) -> round 1: m3 f4 (1 missing) -> m5
    assert [p for p, _ in rollout.calls] == [["f0", "m1", "f2"], ["m3", "f4"], ["m5"]]
    seeds = [s for _, s in rollout.calls]
    assert seeds == [7, round_seed(7, 1), round_seed(7, 2)]
    assert data.position == 6  # every prompt drawn belongs to the step
    assert sum(informative(g.rewards) for g in out.groups) == 3
    assert len(out.groups) == 6  # the all-equal ones stay, as sampled (not trained)
    assert out.report.metrics == {"groups_dropped": 3, "sampling_rounds": 3}
    assert out.report.warning == ""
    assert out.reward_counters == {"reward_errors": 3.0, "no_answer_rate": 0.5}


def test_the_bound_stops_the_rounds_and_warns():
    out, rollout, _ = run(Shaping(dynamic_sampling=True, max_rounds=2), "fmffffffff")
    assert len(rollout.calls) == 3  # one round + 2 extra rounds at most
    assert out.report.metrics == {"groups_dropped": 6, "sampling_rounds": 3}
    text = out.report.warning
    assert "found 1 of 3 informative groups in 3 sampling rounds" in text
    assert "trains on those 1" in text and "dynamic_sampling_max_rounds = 2" in text
    assert "Fix: raise dynamic_sampling_max_rounds" in text


def test_no_informative_group_says_the_step_trains_on_nothing():
    out, _, _ = run(Shaping(dynamic_sampling=True, max_rounds=1), "ffffff")
    assert out.report.metrics == {"groups_dropped": 6, "sampling_rounds": 2}
    assert "found no informative group in 2 sampling rounds" in out.report.warning
    assert "this step trains on nothing" in out.report.warning


def test_the_overlong_penalty_is_added_before_the_filter():
    # lengths 2 and 9 of max_tokens 10, buffer 4: the second pays (6 - 9) / 4 * 2 = -1.5,
    # so a flat group (rewards 1, 1) becomes informative and no round is added
    shaping = Shaping(dynamic_sampling=True, overlong_buffer=4, overlong_penalty=2.0, max_tokens=10)
    out, rollout, _ = run(shaping, "ffffff", lengths=(2, 9))
    assert len(rollout.calls) == 1
    assert out.groups[0].rewards == [1.0, -0.5]
    assert out.groups[0].correct == [True, True]  # correctness is the reward's own
    assert out.report.metrics == {
        "overlong_penalty_mean": -0.75,
        "groups_dropped": 0,
        "sampling_rounds": 1,
    }
