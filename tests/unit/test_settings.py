"""Typed settings (retrain/settings.py) built by the composition root (retrain/build.py):
each options record has exactly its backend's option schema, every built-in backend has
a settings builder, and the settings carry what the config says."""

from __future__ import annotations

from dataclasses import fields

import pytest

from retrain import build, registry
from retrain.config import config_from_dict
from retrain.settings import LocalOptions, PrimeRLOptions, TinkerOptions


@pytest.mark.parametrize(
    ("backend", "record"),
    [("local", LocalOptions), ("tinker", TinkerOptions), ("prime_rl", PrimeRLOptions)],
)
def test_each_options_record_has_exactly_its_schema(backend, record):
    schema = registry.BACKENDS.entry(backend).options
    assert [f.name for f in fields(record)] == list(schema)
    defaults = record.from_mapping({})
    assert {k: getattr(defaults, k) for k in schema} == {k: s.default for k, s in schema.items()}


def test_every_built_in_backend_has_a_settings_builder():
    assert set(build.BACKEND_SETTINGS) == set(registry.BACKENDS.names())


def test_local_settings_carry_the_config():
    config = config_from_dict(
        {
            "backend": {"devices": "cpu,cpu", "options": {"micro_batch_tokens": 64}},
            "model": {"model": "some/model", "lora_rank": 8},
            "lora": {"alpha": 0, "target_modules": ["q_proj"]},
            "training": {"lr": 3e-4, "seed": 7, "temperature": 0.6},
            "optimizer": {"beta2": 0.99},
        }
    )
    s = build.local_settings(config)
    assert (s.model, s.devices, s.seed) == ("some/model", "cpu,cpu", 7)
    assert (
        s.lora.rank == 8 and s.lora.effective_alpha == 16 and s.lora.target_modules == ("q_proj",)
    )
    assert s.optimizer.lr == 3e-4 and s.optimizer.beta2 == 0.99
    assert s.options.micro_batch_tokens == 64 and s.options.prompt_batch == 0
    assert build.train_hyper(config).temperature == 0.6  # the trainer scores at it


def test_engine_settings_take_the_backends_prompt_batch_and_the_model():
    config = config_from_dict(
        {
            "backend": {"options": {"prompt_batch": 3}},
            "model": {"model": "m", "lora_rank": 4},
            "inference": {"engine": "vllm", "url": "http://h:1", "timeout": 9.0},
        }
    )
    s = build.engine_settings(config)
    assert (s.engine, s.url, s.timeout, s.prompt_batch) == ("vllm", "http://h:1", 9.0, 3)
    assert (s.model, s.lora_rank) == ("m", 4)


def test_remote_backends_say_which_settings_they_ignore():
    config = config_from_dict(
        {
            "backend": {"backend": "tinker", "devices": "cpu"},
            "lora": {"dropout": 0.1},
            "training": {"temperature": 0.5},
        }
    )
    s = build.tinker_settings(config)
    assert s.temperature == 0.5
    assert "[backend] devices" in s.ignored and "[lora] dropout" in s.ignored


def test_a_plugin_backend_is_built_from_the_config(tmp_path, monkeypatch):
    (tmp_path / "my_backend_mod.py").write_text(
        "class B:\n"
        "    def __init__(self, config, tokenizer, say=print):\n"
        "        self.config, self.tokenizer = config, tokenizer\n"
    )
    config = config_from_dict(
        {"backend": {"backend": "my_backend_mod.B"}, "plugins": {"search_paths": [str(tmp_path)]}}
    )
    backend = build.build_backend(config, "tok", lambda s: None)
    assert backend.config is config and backend.tokenizer == "tok"


def test_the_pytorch_engine_factory_waits_for_the_model():
    pytest.importorskip("torch")
    from retrain.engines.pytorch import UnboundPyTorchEngine

    config = config_from_dict({"inference": {"dtype": "bf16", "prefix_caching": False}})
    engine = build.build_engine(build.engine_settings(config), tokenizer=None, say=print)
    assert isinstance(engine, UnboundPyTorchEngine) and engine.traits.in_process
    assert engine.settings.dtype == "bf16" and engine.settings.prefix_caching is False
