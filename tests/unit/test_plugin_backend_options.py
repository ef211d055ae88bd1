"""A plugin backend's option schema (its `retrain_backend_option_schema` hook) is applied
as a built-in's is: unknown options and bad values are refused at the run's start (and
by explain, before any model loads), and the backend gets the schema's defaults."""

from __future__ import annotations

import json

from retrain.build import build_backend
from retrain.cli.main import main
from retrain.config import load_config
from retrain.startup import plugin_option_problems

PLUGIN = """\
class Hooked:
    retrain_backend_option_schema = {
        "foo": {"type": "int", "default": 3, "choices": [1, 2, 3]},
        "bar": {"type": "str", "default": "x"},
    }

    def __init__(self, config, tokenizer, say=None):
        self.options = dict(config.backend.options)
"""


def config_file(tmp_path, options: str = "{}"):
    (tmp_path / "hooked_backend.py").write_text(PLUGIN)
    path = tmp_path / "c.toml"
    path.write_text(
        f'[backend]\nbackend = "hooked_backend.Hooked"\noptions = {options}\n'
        f"[plugins]\nsearch_paths = [{str(tmp_path)!r}]\n[algorithm]\n"
        'transform_mode = "none"\n[training]\nseed = 1\n'
    )
    return path


def test_bad_options_are_refused_naming_them(tmp_path):
    config = load_config(config_file(tmp_path, "{ foo = 5, baz = 1 }"))
    problems = dict(plugin_option_problems(config))
    assert problems["[backend.options] foo"] == "must be one of [1, 2, 3], got 5"
    assert problems["[backend.options] baz"].startswith(
        "unknown option 'baz' for backend 'hooked_backend.Hooked'"
    )
    assert plugin_option_problems(load_config(config_file(tmp_path, "{ foo = 2 }"))) == []


def test_explain_reports_them_before_any_model_loads(tmp_path, capsys):
    path = config_file(tmp_path, "{ baz = 1 }")
    code = main(["explain", str(path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 2
    assert any("unknown option 'baz' for backend" in e for e in report["errors"]), report["errors"]


def test_the_backend_gets_the_schemas_defaults(tmp_path):
    backend = build_backend(load_config(config_file(tmp_path)), None, say=print)
    assert backend.options == {"foo": 3, "bar": "x"}
    backend = build_backend(load_config(config_file(tmp_path, "{ foo = 1 }")), None, say=print)
    assert backend.options == {"foo": 1, "bar": "x"}
