"""The local backend on a model with sliding-window layers (a tiny Qwen2: layer 0 full,
layer 1 sliding over 4 positions, so every prompt outgrows the window): the trainer's
packed logprobs equal the sampler's, with either decoder, and a run's metrics say so.
Before the window was in retrain's 4-D masks, training ignored it (the run below then
records a largest log ratio of 0.08 and 0.10 instead of < 1e-4) and the static decoder
stopped with a shape error."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from run_helpers import QuietConsole
from test_precision import agreement
from tiny_model import build_tokenizer, make_tiny_model

from retrain.build import build_backend
from retrain.config import config_from_dict
from retrain.errors import BackendError
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

WINDOW = 4


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sliding") / "model", sliding_window=WINDOW)


def _raw(tiny_raw, model_dir, decode: str) -> dict:
    raw = copy.deepcopy(tiny_raw)
    raw["model"]["model"] = str(model_dir)
    raw["backend"]["options"]["decode"] = decode
    return raw


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_trainer_and_sampler_agree_past_the_window(tiny_raw, sliding_dir, decode):
    from transformers import AutoTokenizer

    b = build_backend(
        config_from_dict(_raw(tiny_raw, sliding_dir, decode)),
        AutoTokenizer.from_pretrained(sliding_dir),
        say=lambda s: None,
    )
    assert b._windows.sliding == WINDOW
    with torch.no_grad():  # a trained adapter: B is not zero
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    diff, groups = agreement(b, 4, 12, 1.0)
    assert max(len(s.token_ids) for g in groups for s in g) > WINDOW
    assert np.abs(diff).max() < 1e-4


def test_a_run_records_no_drift_between_sampler_and_trainer(tiny_raw, sliding_dir):
    raw = _raw(tiny_raw, sliding_dir, "dynamic")  # transformers windows the sampler
    # the whole distribution: under top_p the sampler records the nucleus's renormalised
    # logprobs (the behaviour policy), which differ from the model's by design
    raw["training"].update(max_steps=2, top_p=1.0)
    assert train(config_from_dict(raw), console=QuietConsole()) == 0
    rows, _ = read_jsonl(f"{raw['logging']['log_dir']}/metrics.jsonl")
    assert len(rows) == 2
    assert all(r["log_ratio_max_abs"] < 1e-4 for r in rows), [r["log_ratio_max_abs"] for r in rows]


def test_a_model_that_cannot_be_packed_is_refused_before_training(tiny_raw, tmp_path):
    """A real Bloom checkpoint (ALiBi, built from a 2-D mask): the backend stops at load
    with the model's name and why, not at the first training step."""
    from transformers import BloomConfig, BloomForCausalLM

    tok = build_tokenizer()
    directory = tmp_path / "bloom"
    config = BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=len(tok))
    BloomForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    raw = _raw(tiny_raw, directory, "dynamic")
    with pytest.raises(BackendError, match="cannot be trained by the local backend"):
        build_backend(config_from_dict(raw), tok, say=lambda s: None)
