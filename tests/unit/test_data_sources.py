"""The built-in data sources on local files: jsonl, math (hub-shaped copies), reasoning_gym,
plus build_data_source's plugin handling."""

from __future__ import annotations

import json
import time

import pytest
from builders import data_source

from retrain.data import DataSource
from retrain.data.jsonl import JsonlSource
from retrain.data.math import DATASET_ID, SUBJECTS, MathSource
from retrain.errors import DataError
from retrain.types import Example

# -- jsonl ----------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_reads_fields_and_numbers(tmp_path):
    p = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"q": "1+1?", "a": 2}, "", {"q": "half?", "a": "\\frac{1}{2}", "extra": 1}],
    )
    src = data_source("jsonl", path=str(p), prompt_field="q", answer_field="a")
    assert isinstance(src, JsonlSource) and src.name == "jsonl"
    assert [(e.prompt, e.reference) for e in src.examples] == [
        ("1+1?", "2"),
        ("half?", "\\frac{1}{2}"),
    ]
    assert src.examples[1].meta["line"] == 3  # blank line 2 skipped, numbering kept
    assert src.examples[1].meta["record"]["extra"] == 1


def test_jsonl_default_fields(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    assert data_source("jsonl", path=str(p)).examples == [Example("q", "a")]


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    p = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": 1}, '{"question": "x",'])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        data_source("jsonl", path=str(p))


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    p = _write_jsonl(
        tmp_path / "m.jsonl",
        [{"question": "q", "answer": 1}, {"question": "q"}],
    )
    with pytest.raises(DataError, match=r"m\.jsonl:2: missing field 'answer'.*answer_field"):
        data_source("jsonl", path=str(p))
    with pytest.raises(DataError, match=r"m\.jsonl:1: missing field 'problem'.*prompt_field"):
        data_source("jsonl", path=str(p), prompt_field="problem")


def test_jsonl_other_errors(tmp_path):
    with pytest.raises(DataError, match="path is required"):
        data_source("jsonl")
    with pytest.raises(DataError, match="not found"):
        data_source("jsonl", path=str(tmp_path / "nope.jsonl"))
    p = _write_jsonl(tmp_path / "arr.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"arr\.jsonl:1: expected a JSON object"):
        data_source("jsonl", path=str(p))
    p = _write_jsonl(tmp_path / "nested.jsonl", [{"question": "q", "answer": {"x": 1}}])
    with pytest.raises(DataError, match=r"nested\.jsonl:1: field 'answer' must be a string"):
        data_source("jsonl", path=str(p))


# -- math -----------------------------------------------------------------------------


def _math_row(i, subject, boxed=True):
    ans = f"\\frac{{{i}}}{{2}}"
    sol = f"Work... so it is $\\boxed{{{ans}}}$." if boxed else "No box here."
    typ = subject.replace("_", " ").title().replace("And", "&")
    return {"problem": f"{subject} problem {i}", "solution": sol, "level": "Level 2", "type": typ}


def _write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_math_hub_layout_parquet(tmp_path):
    # <root>/<subject>/{train,test}-00000-of-00001.parquet, plus a subject we do not use.
    for s in SUBJECTS:
        _write_parquet(
            tmp_path / s / "train-00000-of-00001.parquet",
            [_math_row(i, s) for i in range(3)] + [_math_row(9, s, boxed=False)],
        )
        _write_parquet(tmp_path / s / "test-00000-of-00001.parquet", [_math_row(100, s)])
    _write_parquet(tmp_path / "algebra" / "train-00000-of-00001.parquet", [_math_row(0, "algebra")])
    src = data_source("math", path=str(tmp_path), shuffle=False)
    assert isinstance(src, MathSource)
    assert len(src) == 5 * 3  # no test rows, no unboxed rows, no algebra
    first = src.examples[0]
    assert first.prompt == "intermediate_algebra problem 0"
    assert first.reference == "\\frac{0}{2}"  # the boxed answer of the solution, nested kept
    assert first.meta["subject"] == "intermediate_algebra" and first.meta["level"] == "Level 2"
    assert {e.meta["subject"] for e in src.examples} == set(SUBJECTS)
    capped = data_source("math", path=str(tmp_path), max_examples=4, shuffle=False)
    assert [e.prompt for e in capped.examples] == [e.prompt for e in src.examples[:4]]


def test_math_test_split(tmp_path):
    for s in SUBJECTS:
        _write_parquet(tmp_path / s / "train-00000-of-00001.parquet", [_math_row(1, s)])
        _write_parquet(tmp_path / s / "test-00000-of-00001.parquet", [_math_row(2, s)])
    src = data_source("math", path=str(tmp_path), split="test")
    assert {e.reference for e in src.examples} == {"\\frac{2}{2}"}


def test_math_flat_jsonl_filters_subjects_by_type(tmp_path):
    rows = [_math_row(1, "geometry"), _math_row(2, "algebra"), _math_row(3, "number_theory")]
    rows.append({"problem": "untyped", "solution": "\\boxed{5}"})
    p = _write_jsonl(tmp_path / "math_train.jsonl", rows)
    src = MathSource(path=str(p), shuffle=False)
    assert [e.prompt for e in src.examples] == [
        "geometry problem 1",
        "number_theory problem 3",
        "untyped",
    ]
    assert src.examples[1].meta["subject"] == "number_theory"


def test_math_original_release_layout(tmp_path):
    # MATH/train/<subject>/<n>.json, one problem per file
    for s in SUBJECTS[:2]:
        d = tmp_path / "train" / s
        d.mkdir(parents=True)
        for i in range(2):
            (d / f"{i}.json").write_text(json.dumps(_math_row(i, s)))
    src = MathSource(path=str(tmp_path))
    assert len(src) == 4


def test_math_bad_local_copies(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        MathSource(path=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .parquet/.jsonl/.json files"):
        MathSource(path=str(tmp_path / "empty"))
    p = _write_jsonl(tmp_path / "x.jsonl", [{"problem": "p", "solution": "\\boxed{1}"}, "{oops"])
    with pytest.raises(DataError, match=r"x\.jsonl:2"):
        MathSource(path=str(p))
    p = _write_jsonl(tmp_path / "y.jsonl", [{"question": "p", "answer": "1"}])
    with pytest.raises(DataError, match="problem"):
        MathSource(path=str(p))


def test_math_offline_fails_fast_with_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets")
    t0 = time.monotonic()
    with pytest.raises(DataError) as info:
        data_source("math")
    assert time.monotonic() - t0 < 60
    msg = str(info.value)
    assert DATASET_ID in msg
    assert "reasoning_gym" in msg and "jsonl" in msg and "[data] path" in msg


def test_math_unreachable_hub_fails_fast(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    pytest.importorskip("datasets")  # import first: a cold import is not what is timed
    t0 = time.monotonic()
    with pytest.raises(DataError, match="cannot reach the Hugging Face hub") as info:
        data_source("math")
    assert time.monotonic() - t0 < 30  # no retry loop against a refused port
    assert DATASET_ID in str(info.value) and "reasoning_gym" in str(info.value)


# -- reasoning_gym --------------------------------------------------------------------


def test_reasoning_gym_options_and_determinism():
    pytest.importorskip("reasoning_gym")
    kw = dict(task="chain_sum", args={"min_terms": 2, "max_terms": 2}, size=12)
    a = data_source("reasoning_gym", seed=7, **kw)
    b = data_source("reasoning_gym", seed=7, **kw)
    c = data_source("reasoning_gym", seed=8, **kw)
    assert a.name == "reasoning_gym:chain_sum" and a.reward_hint == "gym"
    assert len(a) == 12
    assert [(e.prompt, e.reference) for e in a.examples] == [
        (e.prompt, e.reference) for e in b.examples
    ]
    assert [e.prompt for e in a.examples] != [e.prompt for e in c.examples]
    assert [e.prompt for e in a.next_batch(12)] == [e.prompt for e in b.next_batch(12)]
    meta = a.examples[0].meta
    assert meta["source"] == "reasoning_gym" and meta["task"] == "chain_sum"
    assert meta["entry"]["metadata"]["num_terms"] == 2  # the option reached the task
    assert meta["args"] == {"min_terms": 2, "max_terms": 2}


def test_reasoning_gym_errors():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(DataError, match="task is required"):
        data_source("reasoning_gym")
    with pytest.raises(DataError, match="did you mean 'chain_sum'"):
        data_source("reasoning_gym", task="chain_sun")
    with pytest.raises(DataError, match=r"\[data.args\].*bogus"):
        data_source("reasoning_gym", task="chain_sum", args={"bogus": 1})


def test_reasoning_gym_task_names_are_cached_per_installed_copy(tmp_path, monkeypatch):
    """explain's task check reads the names, and what a task's defaults give, from the
    retrain cache after the first call (importing reasoning-gym takes about 1 s); a
    damaged file is read past, a cache that cannot be written is only slower."""
    pytest.importorskip("reasoning_gym")
    import retrain.data.reasoning_gym as rg

    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "cache"))
    names = rg.task_names()
    assert "basic_arithmetic" in names and names == sorted(names)
    (cached,) = (tmp_path / "cache" / "reasoning_gym").glob("catalog-*.json")
    assert json.loads(cached.read_text()) == {"tasks": names, "defaults": {}}
    # 'composite' mixes the tasks its [data.args] datasets name: with none it refuses
    refused = "rejected by reasoning-gym task 'composite': Must specify at least one dataset"
    assert rg.defaults_problem("composite") == refused
    assert rg.defaults_problem("chain_sum") is None
    catalog = {"tasks": names, "defaults": {"composite": refused, "chain_sum": ""}}
    assert json.loads(cached.read_text()) == catalog

    def no_import():
        raise AssertionError("imported reasoning-gym again")

    monkeypatch.setattr(rg, "_import_reasoning_gym", no_import)
    assert rg.task_names() == names  # read from the cache
    assert rg.defaults_problem("composite") == refused
    cached.write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "cache"))
    assert rg.task_names() == names  # rewritten, the defaults to be found again
    assert json.loads(cached.read_text()) == {"tasks": names, "defaults": {}}
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("RETRAIN_CACHE", str(blocked))  # no directory can be made under it
    assert rg.task_names() == names and rg.defaults_problem("composite") == refused


# -- build_data_source ----------------------------------------------------------------


def test_unknown_source_lists_valid_ones():
    with pytest.raises(DataError, match="valid: math, reasoning_gym, jsonl"):
        data_source("jsnol")


def test_plugin_source_returning_examples(tmp_path):
    (tmp_path / "my_data_plugin.py").write_text(
        "from retrain.types import Example\n"
        "def load(size, seed):\n"
        "    return [Example(prompt=f'p{i}', reference=str(i + seed)) for i in range(size)]\n"
    )
    src = data_source(
        "my_data_plugin.load", size=3, seed=10, search_paths=[str(tmp_path)], shuffle=False
    )
    assert isinstance(src, DataSource)
    assert [e.reference for e in src.next_batch(4)] == ["10", "11", "12", "10"]


def test_plugin_source_returning_garbage(tmp_path):
    (tmp_path / "bad_data_plugin.py").write_text("def load():\n    return 42\n")
    with pytest.raises(DataError, match="expected a DataSource"):
        data_source("bad_data_plugin.load", search_paths=[str(tmp_path)])


def test_environment_provider_must_be_known():
    with pytest.raises(DataError, match="provider"):
        data_source("math", environment={"provider": "gymnasium", "id": "x"})
