"""The resumable batch stream every data source shares."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.data import DataSource, ExampleStream
from retrain.errors import DataError
from retrain.types import Example


def _examples(n):
    return [Example(prompt=f"q{i}", reference=str(i)) for i in range(n)]


def _refs(batch):
    return [int(e.reference) for e in batch]


def test_each_epoch_visits_every_example_once():
    s = ExampleStream(_examples(7), shuffle=True, shuffle_seed=5)
    first = _refs(s.next_batch(7))
    second = _refs(s.next_batch(7))
    assert sorted(first) == list(range(7)) == sorted(second)
    assert first != second  # reshuffled per epoch
    assert s.position == 14 and s.epoch == 2


def test_unshuffled_order_is_the_list_order_and_wraps():
    s = ExampleStream(_examples(3), shuffle=False)
    assert _refs(s.next_batch(5)) == [0, 1, 2, 0, 1]
    assert s.epoch == 1


def test_order_depends_only_on_seed_and_epoch():
    a = ExampleStream(_examples(20), shuffle_seed=1)
    b = ExampleStream(_examples(20), shuffle_seed=1)
    c = ExampleStream(_examples(20), shuffle_seed=2)
    # Cut into different batch sizes, the sequence is the same.
    seq_a = _refs(a.next_batch(7) + a.next_batch(13) + a.next_batch(20))
    seq_b = sum((_refs(b.next_batch(4)) for _ in range(10)), [])
    assert seq_a == seq_b
    assert _refs(c.next_batch(20)) != seq_a[:20]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 30),
    before=st.lists(st.integers(1, 17), max_size=5),
    after=st.lists(st.integers(1, 17), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
    shuffle=st.booleans(),
)
def test_resume_gives_the_same_next_batches(n, before, after, seed, shuffle):
    original = DataSource(_examples(n), shuffle=shuffle, shuffle_seed=seed)
    for k in before:
        original.next_batch(k)
    state = original.state_dict()
    assert state["position"] == sum(before)
    resumed = DataSource(_examples(n), shuffle=shuffle, shuffle_seed=seed)
    resumed.load_state_dict(state)
    for k in after:
        assert _refs(resumed.next_batch(k)) == _refs(original.next_batch(k))
    assert resumed.position == original.position


def test_shuffle_seed_defaults_to_seed():
    a = DataSource(_examples(10), seed=3)
    b = DataSource(_examples(10), shuffle_seed=3, seed=99)
    assert _refs(a.next_batch(10)) == _refs(b.next_batch(10))


def test_max_examples_caps_the_list():
    src = DataSource(_examples(10), max_examples=4)
    assert len(src) == 4 and [e.reference for e in src] == ["0", "1", "2", "3"]


def test_state_dict_contents_and_mismatch_warning(caplog):
    src = DataSource(_examples(5), name="toy", shuffle_seed=1)
    src.next_batch(3)
    state = src.state_dict()
    assert state == {
        "position": 3,
        "epoch": 0,
        "num_examples": 5,
        "shuffle": True,
        "shuffle_seed": 1,
        "source": "toy",
    }
    other = DataSource(_examples(6), shuffle_seed=1)
    with caplog.at_level(logging.WARNING, logger="retrain.data"):
        other.load_state_dict(state)
    assert "5 examples" in caplog.text
    assert other.position == 3


def test_bad_states_and_sizes():
    src = DataSource(_examples(2))
    with pytest.raises(DataError, match="position"):
        src.load_state_dict({})
    with pytest.raises(DataError, match=">= 0"):
        src.load_state_dict({"position": -1})
    with pytest.raises(ValueError):
        src.next_batch(0)
    with pytest.raises(DataError, match="no examples"):
        DataSource([])
