"""The TOML writer: resolved configs load back to the same Config, secrets are redacted,
and `set_keys` edits a hand-written TOML text keeping its comments and order."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.config import TABLES, config_from_dict, load_config, schema
from retrain.config.toml_writer import REMOVE, config_to_toml, set_keys, value_to_toml

REPO = Path(__file__).resolve().parents[2]


def _reload(text: str):
    return config_from_dict(tomllib.loads(text))


def test_round_trip_default_and_templates():
    for raw in [{}, {"campaign": {}, "squeeze": {"adapter_path": "a"}}]:
        c = config_from_dict(raw)
        assert _reload(config_to_toml(c)) == c
    templates = sorted((REPO / "retrain/config/templates").glob("*.toml"))
    assert templates
    for path in templates:
        c = load_config(path)
        assert _reload(config_to_toml(c)) == c, path


def test_round_trip_redacts_secrets():
    c = config_from_dict({"reward": {"type": "judge", "judge_api_key": "sk-secret"}})
    text = config_to_toml(c)
    assert "sk-secret" not in text
    assert 'judge_api_key = ""  # redacted' in text
    back = _reload(text)
    assert back.reward.judge_api_key == ""
    assert dataclasses.replace(back, reward=c.reward) == c
    # An empty secret is simply empty, with no comment.
    assert "redacted" not in config_to_toml(config_from_dict({}))


def test_header_comments_and_schema_order():
    c = config_from_dict({"campaign": {}})
    text = config_to_toml(c, header="Resolved config.\n\nSecond paragraph.")
    head = [line.rstrip() for line in text.splitlines()[:5]]  # older tomlkit writes "# "
    assert head == ["# Resolved config.", "#", "# Second paragraph.", "", "[backend]"]
    assert text.endswith("\n") and not text.endswith("\n\n")
    heads = [line[1:-1] for line in text.splitlines() if line.startswith("[")]
    assert heads == [t for t in TABLES if t != "squeeze"]  # unset optional tables are left out
    training = text.split("[training]\n", 1)[1].split("\n\n", 1)[0]
    keys = [line.split(" = ")[0] for line in training.splitlines()]
    assert keys == [f.name for f in dataclasses.fields(schema.TrainingConfig)]


def test_dicts_and_lists_stay_inline_in_their_table():
    c = config_from_dict(
        {
            "data": {
                "args": {"min terms": 2, "nested": {"x": [1, 2]}},
                "few_shot": [{"user": "2+2?", "assistant": "\\boxed{4}"}],
            },
            "campaign": {"conditions": [{"advantage_mode": "grpo", "transform_mode": "none"}]},
        }
    )
    text = config_to_toml(c)
    assert 'args = {"min terms" = 2, nested = {x = [1, 2]}}' in text
    assert "[data." not in text and "[[" not in text  # no sub-tables splitting [data]
    assert _reload(text) == c


def test_value_to_toml():
    cases = [
        ("local", '"local"'),
        ('say "hi"\n', '"say \\"hi\\"\\n"'),
        ("\x7f", '"\\u007f"'),
        (4e-5, "4e-05"),
        (1.0, "1.0"),
        (float("inf"), "inf"),
        (-1, "-1"),
        (True, "true"),
    ]
    for value, text in cases:
        assert value_to_toml(value) == text
    assert value_to_toml([]) == "[]" and value_to_toml({}) == "{}"
    assert value_to_toml([1, 2]) == "[1, 2]"
    assert value_to_toml({"a": 1, "b c": "d"}) == '{a = 1, "b c" = "d"}'
    assert math.isnan(tomllib.loads("x = " + value_to_toml(float("nan")))["x"])
    with pytest.raises(TypeError, match="NoneType"):
        value_to_toml(None)


def test_every_character_round_trips():
    text = "".join(chr(c) for c in range(0x800)) + "\U0001f600\ufeff"
    assert tomllib.loads("x = " + value_to_toml(text))["x"] == text
    assert tomllib.loads(f"x = {value_to_toml({text: [text]})}")["x"] == {text: [text]}


def test_schema_does_not_import_the_writer():
    # The circle schema <-> toml_writer is gone: the writer depends on the schema only.
    tree = ast.parse(inspect.getsource(schema))
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not any("toml_writer" in (name or "") for name in imported)
    assert not hasattr(schema.Config, "to_toml")


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
_scalar = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    _text,
    st.booleans(),
    st.floats(allow_nan=False),
)
_nested = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=50, deadline=None)
@given(
    lr=st.floats(min_value=1e-9, max_value=10, allow_nan=False),
    seed=st.integers(min_value=-1, max_value=2**31),
    prompt=_text,
    args=st.dictionaries(st.text(min_size=1, max_size=8), _nested, max_size=3),
    shots=st.lists(st.fixed_dictionaries({"user": _text, "assistant": _text}), max_size=2),
    seeds=st.lists(st.integers(min_value=0, max_value=10**6), unique=True, min_size=1, max_size=4),
)
def test_round_trip_property(lr, seed, prompt, args, shots, seeds):
    c = config_from_dict(
        {
            "training": {"lr": lr, "seed": seed},
            "data": {"system_prompt": prompt, "args": args, "few_shot": shots},
            "campaign": {"seeds": seeds},
        }
    )
    assert _reload(config_to_toml(c)) == c


HAND_WRITTEN = """\
# My experiment.
[training]
lr = 1e-4  # tuned by hand
batch_size = 4

# Sampling
group_size = 8

[data]
source = "jsonl"  # local file
args = { a = 1 }
"""


def test_set_keys_keeps_comments_and_order():
    out = set_keys(
        HAND_WRITTEN,
        {
            ("training", "lr"): 3e-5,
            ("training", "batch_size"): REMOVE,
            ("training", "max_steps"): 10,
            ("data", "source"): "math",
            ("data.args", "b"): "x",
            ("reward", "type"): "judge",
            ("", "missing"): REMOVE,
            ("squeeze", "missing"): REMOVE,
        },
    )
    assert out.startswith("# My experiment.\n[training]\nlr = 3e-05  # tuned by hand\n")
    assert "# Sampling\ngroup_size = 8\n" in out
    assert 'source = "math"  # local file' in out
    assert "batch_size" not in out and "[squeeze]" not in out
    assert out.index("group_size") < out.index("max_steps") < out.index("[data]")
    assert out.rstrip().endswith('[reward]\ntype = "judge"')
    assert tomllib.loads(out) == {
        "training": {"lr": 3e-5, "group_size": 8, "max_steps": 10},
        "data": {"source": "math", "args": {"a": 1, "b": "x"}},
        "reward": {"type": "judge"},
    }
    assert set_keys(HAND_WRITTEN, {}) == HAND_WRITTEN


def test_set_keys_refuses_a_non_table():
    with pytest.raises(ValueError, match=r"\[training.lr\] is not a table"):
        set_keys(HAND_WRITTEN, {("training.lr", "x"): 1})
